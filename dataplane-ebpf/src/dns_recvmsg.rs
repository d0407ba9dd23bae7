//! `cgroup/recvmsg4` and `cgroup/recvmsg6`: a reply of the in-pod resolver
//! shows the DNS server the application asked as its source, not
//! `127.0.0.1:<dns port>` (minimum kernel 5.2 for the hooks, 4.20 for the
//! socket cookie). Resolvers compare a reply's source with the server they
//! asked and drop a mismatch.
//!
//! Only datagrams from the resolver's loopback address and port, on sockets
//! with a recorded server, are rewritten. These hooks must return 1.

use aya_ebpf::{macros::cgroup_sock_addr, programs::SockAddrContext};
use dataplane_common::{Counter, IpAddr16};

use crate::{
    ctx_words::{read_ip6, write_ip6},
    dns_capture::recorded_server,
    maps::count,
};

/// The only return value the kernel accepts from recvmsg programs.
const DONE: i32 = 1;
/// 127.0.0.1 in network order.
const LOOPBACK_BE: u32 = u32::to_be(0x7f00_0001);

#[cgroup_sock_addr(recvmsg4)]
pub fn dp_dns_recvmsg4(ctx: SockAddrContext) -> i32 {
    let sa = ctx.sock_addr;
    // SAFETY: context field reads, checked by the verifier.
    let (src_be, port_be) = unsafe { ((*sa).user_ip4, (*sa).user_port) };
    if src_be != LOOPBACK_BE {
        return DONE;
    }
    let Some(server) = recorded_server(&ctx, u16::from_be(port_be as u16)) else {
        return DONE;
    };
    if !server.addr.is_ipv4_mapped() {
        return DONE;
    }
    // SAFETY: user_ip4/user_port are writable in recvmsg4 programs.
    unsafe {
        (*sa).user_ip4 = server.addr.words[3];
        (*sa).user_port = u32::from(server.port.to_be());
    }
    count(Counter::DnsReplyRewritten);
    DONE
}

#[cgroup_sock_addr(recvmsg6)]
pub fn dp_dns_recvmsg6(ctx: SockAddrContext) -> i32 {
    let sa = ctx.sock_addr;
    // SAFETY: context field reads at constant offsets, checked by the
    // verifier.
    let (words, port_be) = unsafe { (read_ip6(&raw const (*sa).user_ip6), (*sa).user_port) };
    let src = IpAddr16::from_ipv6_words(words);
    if src != IpAddr16::LOCALHOST_V6 && src != IpAddr16::LOCALHOST_V4_MAPPED {
        return DONE;
    }
    let Some(server) = recorded_server(&ctx, u16::from_be(port_be as u16)) else {
        return DONE;
    };
    // SAFETY: user_ip6/user_port are writable in recvmsg6 programs, with
    // 32-bit stores.
    unsafe {
        write_ip6(&raw mut (*sa).user_ip6, server.addr.words);
        (*sa).user_port = u32::from(server.port.to_be());
    }
    count(Counter::DnsReplyRewritten);
    DONE
}
