//! `cgroup/connect4`: steers an enrolled pod's outbound IPv4 TCP connection
//! to the pod's own outbound listener (minimum kernel 5.7, for
//! `bpf_get_netns_cookie` in sock_addr programs).
//!
//! The original destination is parked in `ORIG_DST_COOKIE` under the
//! socket's cookie; `sockops` re-keys it by connection tuple once the kernel
//! has chosen the source port.

use aya_ebpf::{
    helpers::{bpf_get_netns_cookie, bpf_get_socket_cookie},
    macros::cgroup_sock_addr,
    programs::SockAddrContext,
};
use dataplane_common::{AF_INET, Counter, IpAddr16, OrigDst};

use crate::maps::{ENROLLED_NETNS, ORIG_DST_COOKIE, agent_config, count};

/// Return value that lets the `connect()` proceed.
const ALLOW: i32 = 1;
const SOCK_STREAM: u32 = 1;
const IPPROTO_TCP: u32 = 6;
/// 127.0.0.1: the in-pod listeners bind loopback inside the pod's netns.
const LOOPBACK_BE: u32 = u32::to_be(0x7f00_0001);

#[cgroup_sock_addr(connect4)]
pub fn dp_connect4(ctx: SockAddrContext) -> i32 {
    connect4(&ctx);
    ALLOW
}

#[inline(always)]
fn connect4(ctx: &SockAddrContext) {
    let Some(cfg) = agent_config() else {
        return;
    };
    let sa = ctx.sock_addr;
    // SAFETY: `sa` is the context pointer the kernel passed in; the verifier
    // checks every field access against `bpf_sock_addr`.
    let (sock_type, protocol) = unsafe { ((*sa).type_, (*sa).protocol) };
    if sock_type != SOCK_STREAM || protocol != IPPROTO_TCP {
        count(Counter::SkippedNotTcp);
        return;
    }
    // SAFETY: helper valid for sock_addr programs since 5.7.
    let netns = unsafe { bpf_get_netns_cookie(sa.cast()) };
    // SAFETY: the value is only tested for presence, never read.
    if unsafe { ENROLLED_NETNS.get(netns) }.is_none() {
        count(Counter::SkippedNotEnrolled);
        return;
    }
    // SAFETY: `sk` of a sock_addr context is a non-null socket pointer.
    let mark = unsafe { (*(*sa).__bindgen_anon_1.sk).mark };
    if mark == cfg.proxy_mark {
        count(Counter::ExemptProxyMark);
        return;
    }
    // SAFETY: context field reads, checked by the verifier.
    let (dst_be, port_be) = unsafe { ((*sa).user_ip4, (*sa).user_port) };
    if u32::from_be(dst_be) >> 24 == 127 {
        count(Counter::ExemptLoopback);
        return;
    }
    let orig = OrigDst {
        addr: IpAddr16::from_ipv4_be(dst_be),
        port: u16::from_be(port_be as u16),
        family: AF_INET,
    };
    // SAFETY: helper valid for sock_addr programs since 4.20.
    let cookie = unsafe { bpf_get_socket_cookie(sa.cast()) };
    if ORIG_DST_COOKIE.insert(cookie, orig, 0).is_err() {
        // Without a record the engine could not tell where to go: leave the
        // connection uncaptured rather than break it.
        count(Counter::MapUpdateFailed);
        return;
    }
    // SAFETY: user_ip4/user_port are writable in connect4 programs.
    unsafe {
        (*sa).user_ip4 = LOOPBACK_BE;
        (*sa).user_port = u32::from(cfg.outbound_port.to_be());
    }
    count(Counter::RedirectedOutbound);
}
