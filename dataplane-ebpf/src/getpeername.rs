//! `cgroup/getpeername4` and `cgroup/getpeername6`: an application whose
//! connection was steered to the outbound listener sees the peer it dialled,
//! not `127.0.0.1:15001` (minimum kernel 5.8).
//!
//! Only sockets with a cookie-keyed original destination (recorded by
//! `connect4`/`connect6`) whose current peer is the loopback outbound
//! listener are rewritten; everything else is left alone. These hooks must
//! always return 1.

use aya_ebpf::{
    helpers::bpf_get_socket_cookie, macros::cgroup_sock_addr, programs::SockAddrContext,
};
use dataplane_common::{Counter, IpAddr16, OrigDst};

use crate::{
    ctx_words::{read_ip6, write_ip6},
    dns_capture::recorded_server,
    maps::{ORIG_DST_COOKIE, agent_config, count},
};

/// The only return value the kernel accepts from getpeername programs.
const DONE: i32 = 1;
/// 127.0.0.1 in network order.
const LOOPBACK_BE: u32 = u32::to_be(0x7f00_0001);

#[cgroup_sock_addr(getpeername4)]
pub fn dp_getpeername4(ctx: SockAddrContext) -> i32 {
    let sa = ctx.sock_addr;
    // SAFETY: context field reads, checked by the verifier.
    let (peer_be, port_be) = unsafe { ((*sa).user_ip4, (*sa).user_port) };
    if peer_be != LOOPBACK_BE {
        return DONE;
    }
    let Some(orig) = original_peer(&ctx, port_be) else {
        return DONE;
    };
    if !orig.addr.is_ipv4_mapped() {
        return DONE;
    }
    // SAFETY: user_ip4/user_port are writable in getpeername4 programs.
    unsafe {
        (*sa).user_ip4 = orig.addr.words[3];
        (*sa).user_port = u32::from(orig.port.to_be());
    }
    count(Counter::PeerRewritten);
    DONE
}

#[cgroup_sock_addr(getpeername6)]
pub fn dp_getpeername6(ctx: SockAddrContext) -> i32 {
    let sa = ctx.sock_addr;
    // SAFETY: context field reads at constant offsets, checked by the
    // verifier.
    let (words, port_be) = unsafe { (read_ip6(&raw const (*sa).user_ip6), (*sa).user_port) };
    let peer = IpAddr16::from_ipv6_words(words);
    if peer != IpAddr16::LOCALHOST_V6 && peer != IpAddr16::LOCALHOST_V4_MAPPED {
        return DONE;
    }
    let Some(orig) = original_peer(&ctx, port_be) else {
        return DONE;
    };
    // SAFETY: user_ip6/user_port are writable in getpeername6 programs,
    // with 32-bit stores.
    unsafe {
        write_ip6(&raw mut (*sa).user_ip6, orig.addr.words);
        (*sa).user_port = u32::from(orig.port.to_be());
    }
    count(Counter::PeerRewritten);
    DONE
}

/// The original destination of this socket if its current peer port
/// (`port_be`, as the context holds it) is the outbound listener's, or the
/// DNS server it asked if its peer is the in-pod resolver.
#[inline(always)]
fn original_peer(ctx: &SockAddrContext, port_be: u32) -> Option<OrigDst> {
    let cfg = agent_config()?;
    let port = u16::from_be(port_be as u16);
    if let Some(server) = recorded_server(ctx, port) {
        return Some(OrigDst {
            addr: server.addr,
            port: server.port,
            family: server.family,
        });
    }
    if port != cfg.outbound_port {
        return None;
    }
    // SAFETY: helper valid for sock_addr programs since 4.20.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.sock_addr.cast()) };
    let orig = ORIG_DST_COOKIE.get_ptr(cookie)?;
    // SAFETY: a pointer from a successful lookup; the value is copied.
    Some(unsafe { *orig })
}
