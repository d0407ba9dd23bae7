//! `cgroup/connect4`, in the probe object: tells the agent the cookie of a
//! network namespace on kernels without `SO_NETNS_COOKIE` (before 5.14),
//! where only BPF can read it (minimum kernel 5.7, for
//! `bpf_get_netns_cookie` in sock_addr programs).
//!
//! The agent attaches it to its own cgroup (through an unpinned link that
//! goes away with the agent). A helper thread inside the namespace
//! `connect()`s a UDP socket to `127.0.0.1:9`; this program records
//! `socket cookie -> netns cookie` for that one destination, and the agent
//! reads and deletes the entry. Every other `connect()` is left alone, and
//! every call is allowed: the probe must never change what a socket does.

use aya_ebpf::{
    helpers::{bpf_get_netns_cookie, bpf_get_socket_cookie},
    macros::{cgroup_sock_addr, map},
    maps::LruHashMap,
    programs::SockAddrContext,
};
use dataplane_common::maps::{
    NETNS_COOKIE_PROBE_ADDR, NETNS_COOKIE_PROBE_PORT, NETNS_COOKIES_CAPACITY,
};

/// Return value that lets `connect()` go on.
const ALLOW: i32 = 1;

/// `socket cookie -> netns cookie` of the probe connections (the agent
/// deletes each entry once read; LRU evicts any it never reads).
#[map]
static NETNS_COOKIES: LruHashMap<u64, u64> =
    LruHashMap::with_max_entries(NETNS_COOKIES_CAPACITY, 0);

#[cgroup_sock_addr(connect4)]
pub fn dp_netns_cookie(ctx: SockAddrContext) -> i32 {
    let sa = ctx.sock_addr;
    // SAFETY: context field reads, checked by the verifier.
    let (dst_be, port_be) = unsafe { ((*sa).user_ip4, (*sa).user_port) };
    // `user_port` holds the network-order port in its low 16 bits.
    if dst_be != NETNS_COOKIE_PROBE_ADDR.to_be()
        || u16::from_be(port_be as u16) != NETNS_COOKIE_PROBE_PORT
    {
        return ALLOW;
    }
    // SAFETY: helpers valid for sock_addr programs (4.20 and 5.7).
    let (socket, netns) = unsafe {
        (
            bpf_get_socket_cookie(sa.cast()),
            bpf_get_netns_cookie(sa.cast()),
        )
    };
    // A failed insert leaves the entry absent, which the agent reports.
    let _ = NETNS_COOKIES.insert(socket, netns, 0);
    ALLOW
}
