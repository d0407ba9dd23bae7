//! `cgroup/sendmsg4` and `cgroup/sendmsg6`: an enrolled pod's unconnected
//! UDP query to port 53 goes to its in-pod resolver (minimum kernel 5.7,
//! for `bpf_get_netns_cookie` in sock_addr programs; the hooks exist since
//! 4.18). Connected UDP sockets are steered at `connect()` time instead: a
//! `send()` without an address does not run these hooks.
//!
//! These hooks must return 1 (0 fails the send with `EPERM`).

use aya_ebpf::{macros::cgroup_sock_addr, programs::SockAddrContext};
use dataplane_common::{AF_INET, AF_INET6, IpAddr16};

use crate::{
    ctx_words::{read_ip6, write_ip6},
    dns_capture::steer,
};

/// Return value that lets the send go on.
const SEND: i32 = 1;
/// 127.0.0.1 in network order.
const LOOPBACK_BE: u32 = u32::to_be(0x7f00_0001);

#[cgroup_sock_addr(sendmsg4)]
pub fn dp_dns_sendmsg4(ctx: SockAddrContext) -> i32 {
    let sa = ctx.sock_addr;
    // SAFETY: context field reads, checked by the verifier.
    let (dst_be, port_be) = unsafe { ((*sa).user_ip4, (*sa).user_port) };
    // `user_port` holds the network-order port in its low 16 bits.
    let port = u16::from_be(port_be as u16);
    if let Some(resolver) = steer(&ctx, IpAddr16::from_ipv4_be(dst_be), port, AF_INET) {
        // SAFETY: user_ip4/user_port are writable in sendmsg4 programs.
        unsafe {
            (*sa).user_ip4 = LOOPBACK_BE;
            (*sa).user_port = u32::from(resolver.to_be());
        }
    }
    SEND
}

#[cgroup_sock_addr(sendmsg6)]
pub fn dp_dns_sendmsg6(ctx: SockAddrContext) -> i32 {
    let sa = ctx.sock_addr;
    // SAFETY: context field reads at constant offsets, checked by the
    // verifier.
    let (words, port_be) = unsafe { (read_ip6(&raw const (*sa).user_ip6), (*sa).user_port) };
    let dst = IpAddr16::from_ipv6_words(words);
    let port = u16::from_be(port_be as u16);
    if let Some(resolver) = steer(&ctx, dst, port, AF_INET6) {
        // A mapped destination stays IPv4 (the socket may be bound to an
        // IPv4 address); a native one goes to [::1].
        let to = if dst.is_ipv4_mapped() {
            IpAddr16::LOCALHOST_V4_MAPPED
        } else {
            IpAddr16::LOCALHOST_V6
        };
        // SAFETY: user_ip6/user_port are writable in sendmsg6 programs,
        // with 32-bit stores.
        unsafe {
            write_ip6(&raw mut (*sa).user_ip6, to.words);
            (*sa).user_port = u32::from(resolver.to_be());
        }
    }
    SEND
}
