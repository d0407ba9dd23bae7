//! `cgroup/connect6`: the same as `connect4` for IPv6 TCP sockets (minimum
//! kernel 5.7).
//!
//! An IPv6 socket may dial an IPv4 peer through an IPv4-mapped address
//! (`::ffff:a.b.c.d`); the kernel then connects over IPv4 without running
//! `connect4`, so this program handles both forms: a native destination is
//! rewritten to `[::1]:<outbound port>`, a mapped one to
//! `[::ffff:127.0.0.1]:<outbound port>` (an IPv6 socket cannot switch to a
//! native IPv6 peer after choosing IPv4, nor the reverse). The recorded
//! family is `AF_INET6` either way: it is the family the application used.

use aya_ebpf::{macros::cgroup_sock_addr, programs::SockAddrContext};
use dataplane_common::{AF_INET6, IpAddr16};

use crate::{
    ctx_words::{read_ip6, write_ip6},
    dns_capture,
    outbound::{ALLOW, Outbound, REFUSE, decide},
};

#[cgroup_sock_addr(connect6)]
pub fn dp_connect6(ctx: SockAddrContext) -> i32 {
    let sa = ctx.sock_addr;
    // SAFETY: context field reads at constant offsets, checked by the
    // verifier.
    let (words, port_be) = unsafe { (read_ip6(&raw const (*sa).user_ip6), (*sa).user_port) };
    let dst = IpAddr16::from_ipv6_words(words);
    // `user_port` holds the network-order port in its low 16 bits.
    let port = u16::from_be(port_be as u16);
    let listener = if dst.is_ipv4_mapped() {
        IpAddr16::LOCALHOST_V4_MAPPED
    } else {
        IpAddr16::LOCALHOST_V6
    };
    // DNS of a pod with DNS capture goes to its resolver (same address
    // choice as for the outbound listener).
    if let Some(resolver) = dns_capture::steer(&ctx, dst, port, AF_INET6) {
        // SAFETY: user_ip6/user_port are writable in connect6 programs,
        // with 32-bit stores.
        unsafe {
            write_ip6(&raw mut (*sa).user_ip6, listener.words);
            (*sa).user_port = u32::from(resolver.to_be());
        }
        return ALLOW;
    }
    match decide(&ctx, dst, port, AF_INET6) {
        Outbound::Pass => ALLOW,
        Outbound::Refuse => REFUSE,
        Outbound::Redirect(listener_port) => {
            // SAFETY: user_ip6/user_port are writable in connect6 programs,
            // with 32-bit stores.
            unsafe {
                write_ip6(&raw mut (*sa).user_ip6, listener.words);
                (*sa).user_port = u32::from(listener_port.to_be());
            }
            ALLOW
        }
        Outbound::Endpoint(addr, port) => {
            // SAFETY: as above.
            unsafe {
                write_ip6(&raw mut (*sa).user_ip6, addr.words);
                (*sa).user_port = u32::from(port.to_be());
            }
            ALLOW
        }
    }
}
