//! Connections made by sockets of the node's own network namespace to an
//! enrolled pod (kubelet's health probes above all) reach the pod's apps
//! uncaptured, whatever the source address the node picks, and nothing
//! else that merely comes from the node's address does (traffic kube-proxy
//! forwards has no socket in the node's namespace). istio-cni gets the same
//! by SNATing such connections to 169.254.7.127 in the node's namespace and
//! letting that source through in the pod (`cni/pkg/iptables/iptables.go`).
//!
//! Three steps, one per hook: `connect4`/`connect6` note the socket
//! (`NODE_CONNECTS`, by socket cookie: the source port is not chosen yet),
//! `sockops`' connect callback turns the note into the connection's tuple
//! (`NODE_TUPLES`) before the SYN leaves, and the pod's `sk_lookup` lets
//! exactly that tuple through while the socket lives (its close, seen by
//! the state callback, drops both notes; the LRU bounds what a missed
//! close leaves). Minimum kernel 5.7 (the netns cookie
//! in sock_addr programs), as for the capture itself.

use aya_ebpf::{helpers::bpf_get_socket_cookie, programs::SockAddrContext};
use dataplane_common::{Counter, IpAddr16, SockTuple};

use crate::maps::{NODE_CONNECTS, NODE_NETNS, NODE_TUPLES, POD_INBOUND, count};

/// Notes a `connect()` of a socket in namespace `netns` to `dst` when the
/// socket is the node's and `dst` an enrolled pod's.
#[inline(always)]
pub fn note_connect(ctx: &SockAddrContext, netns: u64, dst: IpAddr16) {
    let Some(node) = NODE_NETNS.get(0) else {
        return;
    };
    if *node == 0 || *node != netns || POD_INBOUND.get_ptr(dst).is_none() {
        return;
    }
    // SAFETY: helper valid for sock_addr programs since 4.20.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.sock_addr.cast()) };
    if NODE_CONNECTS.insert(cookie, 1, 0).is_ok() {
        count(Counter::NodeConnect);
    } else {
        count(Counter::MapUpdateFailed);
    }
}

/// At the connect callback: a noted socket's tuple, for the pod's
/// `sk_lookup`, kept until the socket closes (`on_close`). Returns whether
/// the socket was noted.
#[inline(always)]
pub fn on_connect(cookie: u64, tuple: SockTuple) -> bool {
    if NODE_CONNECTS.get_ptr(cookie).is_none() {
        return false;
    }
    if NODE_TUPLES.insert(tuple, 1, 0).is_err() {
        count(Counter::MapUpdateFailed);
    }
    true
}

/// At a watched socket's close: a node socket's notes go, so a later
/// connection reusing the tuple is decided afresh.
#[inline(always)]
pub fn on_close(cookie: u64, tuple: Option<SockTuple>) {
    if NODE_CONNECTS.remove(cookie).is_ok()
        && let Some(tuple) = tuple
    {
        let _ = NODE_TUPLES.remove(tuple);
    }
}

/// Whether this SYN's tuple is a live node socket's connection. Not
/// consumed: a SYN the node retransmits (one a slow pod answered late)
/// gets the same answer as the first, instead of reaching the capture
/// listener beside the app's half-open connection.
#[inline(always)]
pub fn admit_syn(tuple: SockTuple) -> bool {
    if NODE_TUPLES.get_ptr(tuple).is_none() {
        return false;
    }
    count(Counter::ExemptNodeSocket);
    true
}
