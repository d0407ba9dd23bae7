//! `cgroup/connect4`: steers an enrolled pod's outbound IPv4 TCP connection
//! to the pod's own outbound listener at `127.0.0.1:<outbound port>`
//! (minimum kernel 5.7, for `bpf_get_netns_cookie` in sock_addr programs).
//!
//! The decision chain is [`crate::outbound`]'s; the original destination is
//! parked in `ORIG_DST_COOKIE` under the socket's cookie, and `sockops`
//! re-keys it by namespace and connection tuple once the kernel has chosen
//! the source port.
//! DNS to port 53 (UDP or TCP) of a pod with DNS capture goes to the pod's
//! resolver instead ([`crate::dns_capture`]).

use aya_ebpf::{macros::cgroup_sock_addr, programs::SockAddrContext};
use dataplane_common::{AF_INET, IpAddr16};

use crate::{
    dns_capture,
    outbound::{ALLOW, Outbound, REFUSE, decide},
};

/// 127.0.0.1 in network order: the outbound listener inside the pod's netns.
const LOOPBACK_BE: u32 = u32::to_be(0x7f00_0001);

#[cgroup_sock_addr(connect4)]
pub fn dp_connect4(ctx: SockAddrContext) -> i32 {
    let sa = ctx.sock_addr;
    // SAFETY: context field reads, checked by the verifier.
    let (dst_be, port_be) = unsafe { ((*sa).user_ip4, (*sa).user_port) };
    // `user_port` holds the network-order port in its low 16 bits.
    let port = u16::from_be(port_be as u16);
    let dst = IpAddr16::from_ipv4_be(dst_be);
    // DNS (UDP or TCP to port 53) of a pod with DNS capture goes to its
    // resolver; everything else takes the outbound chain.
    if let Some(resolver) = dns_capture::steer(&ctx, dst, port, AF_INET) {
        // SAFETY: user_ip4/user_port are writable in connect4 programs.
        unsafe {
            (*sa).user_ip4 = LOOPBACK_BE;
            (*sa).user_port = u32::from(resolver.to_be());
        }
        return ALLOW;
    }
    match decide(&ctx, dst, port, AF_INET) {
        Outbound::Pass => ALLOW,
        Outbound::Refuse => REFUSE,
        Outbound::Redirect(listener_port) => {
            // SAFETY: user_ip4/user_port are writable in connect4 programs.
            unsafe {
                (*sa).user_ip4 = LOOPBACK_BE;
                (*sa).user_port = u32::from(listener_port.to_be());
            }
            ALLOW
        }
        // The fast path chose an endpoint of the family dialled
        // (IPv4-mapped here).
        Outbound::Endpoint(addr, port) => {
            // SAFETY: as above.
            unsafe {
                (*sa).user_ip4 = addr.words[3];
                (*sa).user_port = u32::from(port.to_be());
            }
            ALLOW
        }
    }
}
