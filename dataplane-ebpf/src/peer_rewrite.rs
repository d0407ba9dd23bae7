//! The rewrite `getpeername` and `recvmsg` programs share: when the address
//! a socket is about to report is loopback (the engine's listener or the
//! in-pod resolver the connection was steered to), report the address the
//! application asked for instead. The caller says where to find it; these
//! functions read and write the context the same way for both hooks, so
//! the two can never drift apart.

use aya_ebpf::programs::SockAddrContext;
use dataplane_common::{Counter, IpAddr16};

use crate::{
    ctx_words::{read_ip6, write_ip6},
    maps::count,
};

/// The only return value getpeername and recvmsg programs may give.
pub const DONE: i32 = 1;
/// 127.0.0.1 in network order.
const LOOPBACK_BE: u32 = u32::to_be(0x7f00_0001);

/// IPv4 form: `find` gets the context and the reported port (host order)
/// and returns the address (IPv4-mapped) and port to report instead.
#[inline(always)]
pub fn rewrite4(
    ctx: &SockAddrContext,
    find: impl FnOnce(&SockAddrContext, u16) -> Option<(IpAddr16, u16)>,
    counter: Counter,
) -> i32 {
    let sa = ctx.sock_addr;
    // SAFETY: context field reads, checked by the verifier.
    let (ip_be, port_be) = unsafe { ((*sa).user_ip4, (*sa).user_port) };
    if ip_be != LOOPBACK_BE {
        return DONE;
    }
    // `user_port` holds the network-order port in its low 16 bits.
    let Some((addr, port)) = find(ctx, u16::from_be(port_be as u16)) else {
        return DONE;
    };
    report4(ctx, addr, port, counter)
}

/// Reports `addr:port` (IPv4-mapped; anything else is left alone) to the
/// IPv4 caller of `ctx`.
#[inline(always)]
pub fn report4(ctx: &SockAddrContext, addr: IpAddr16, port: u16, counter: Counter) -> i32 {
    if !addr.is_ipv4_mapped() {
        return DONE;
    }
    let sa = ctx.sock_addr;
    // SAFETY: user_ip4/user_port are writable in these programs.
    unsafe {
        (*sa).user_ip4 = addr.words[3];
        (*sa).user_port = u32::from(port.to_be());
    }
    count(counter);
    DONE
}

/// IPv6 form (native and IPv4-mapped loopback), as [`rewrite4`].
#[inline(always)]
pub fn rewrite6(
    ctx: &SockAddrContext,
    find: impl FnOnce(&SockAddrContext, u16) -> Option<(IpAddr16, u16)>,
    counter: Counter,
) -> i32 {
    let sa = ctx.sock_addr;
    // SAFETY: context field reads at constant offsets, checked by the
    // verifier.
    let (words, port_be) = unsafe { (read_ip6(&raw const (*sa).user_ip6), (*sa).user_port) };
    let ip = IpAddr16::from_ipv6_words(words);
    if ip != IpAddr16::LOCALHOST_V6 && ip != IpAddr16::LOCALHOST_V4_MAPPED {
        return DONE;
    }
    let Some((addr, port)) = find(ctx, u16::from_be(port_be as u16)) else {
        return DONE;
    };
    report6(ctx, addr, port, counter)
}

/// Reports `addr:port` to the IPv6 caller of `ctx`.
#[inline(always)]
pub fn report6(ctx: &SockAddrContext, addr: IpAddr16, port: u16, counter: Counter) -> i32 {
    let sa = ctx.sock_addr;
    // SAFETY: user_ip6/user_port are writable in these programs, with
    // 32-bit stores.
    unsafe {
        write_ip6(&raw mut (*sa).user_ip6, addr.words);
        (*sa).user_port = u32::from(port.to_be());
    }
    count(counter);
    DONE
}
