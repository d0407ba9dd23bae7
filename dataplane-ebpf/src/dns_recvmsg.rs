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
    dns_capture::recorded_server,
    peer_rewrite::{rewrite4, rewrite6},
};

/// The server recorded for this socket, if it talks to the resolver port.
#[inline(always)]
fn server(ctx: &SockAddrContext, port: u16) -> Option<(IpAddr16, u16)> {
    recorded_server(ctx, port).map(|s| (s.addr, s.port))
}

#[cgroup_sock_addr(recvmsg4)]
pub fn dp_dns_recvmsg4(ctx: SockAddrContext) -> i32 {
    rewrite4(&ctx, server, Counter::DnsReplyRewritten)
}

#[cgroup_sock_addr(recvmsg6)]
pub fn dp_dns_recvmsg6(ctx: SockAddrContext) -> i32 {
    rewrite6(&ctx, server, Counter::DnsReplyRewritten)
}
