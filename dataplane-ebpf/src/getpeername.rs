//! `cgroup/getpeername4` and `cgroup/getpeername6`: an application whose
//! connection was steered to the outbound listener sees the peer it dialled,
//! not `127.0.0.1:15001` (minimum kernel 5.8).
//!
//! Only sockets with a cookie-keyed original destination (recorded by
//! `connect4`/`connect6`) whose current peer is the loopback outbound
//! listener are rewritten, and fast-path sockets to a service VIP, whose
//! peer is the endpoint the kernel chose (they report the VIP, as a
//! connection kube-proxy translated does); everything else is left alone.
//! These hooks must always return 1.

use aya_ebpf::{
    helpers::bpf_get_socket_cookie, macros::cgroup_sock_addr, programs::SockAddrContext,
};
use dataplane_common::{Counter, IpAddr16};

use crate::{
    dns_capture::recorded_server,
    fast_path::dialled_vip,
    maps::{ORIG_DST_COOKIE, agent_config},
    peer_rewrite::{report4, report6, rewrite4, rewrite6},
};

#[cgroup_sock_addr(getpeername4)]
pub fn dp_getpeername4(ctx: SockAddrContext) -> i32 {
    if let Some((vip, port)) = dialled_vip(&ctx) {
        return report4(&ctx, vip, port, Counter::PeerRewritten);
    }
    rewrite4(&ctx, original_peer, Counter::PeerRewritten)
}

#[cgroup_sock_addr(getpeername6)]
pub fn dp_getpeername6(ctx: SockAddrContext) -> i32 {
    if let Some((vip, port)) = dialled_vip(&ctx) {
        return report6(&ctx, vip, port, Counter::PeerRewritten);
    }
    rewrite6(&ctx, original_peer, Counter::PeerRewritten)
}

/// The original destination of this socket if its current peer port
/// (host order) is the outbound listener's, or the DNS server it asked if
/// its peer is the in-pod resolver.
#[inline(always)]
fn original_peer(ctx: &SockAddrContext, port: u16) -> Option<(IpAddr16, u16)> {
    let cfg = agent_config()?;
    if let Some(server) = recorded_server(ctx, port) {
        return Some((server.addr, server.port));
    }
    if port != cfg.outbound_port {
        return None;
    }
    // SAFETY: helper valid for sock_addr programs since 4.20.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.sock_addr.cast()) };
    let orig = ORIG_DST_COOKIE.get_ptr(cookie)?;
    // SAFETY: a pointer from a successful lookup; the fields are copied.
    let (addr, port) = unsafe { ((*orig).orig.addr, (*orig).orig.port) };
    Some((addr, port))
}
