//! The same-node fast path's kernel half (minimum kernel 5.8 for the ring
//! buffer; the hooks it rides on need 5.9 anyway).
//!
//! The agent decides a (client pod, destination) pair once and writes the
//! verdict; from then on `connect4/6` leave such connections alone, so the
//! client's socket talks to the server's directly. What makes that safe is
//! decided here, at each step, from what the kernel itself knows:
//!
//! - the client is known by its socket's network namespace, not by the
//!   address it claims;
//! - the verdict names the destination pod's namespace, and holds only
//!   while the destination address still belongs to it;
//! - a verdict older than the agent's current generation is void, so one
//!   write of the generation revokes every cached verdict at once;
//! - the destination's `sk_lookup` lets through only the exact tuple the
//!   client's own `sockops` recorded, and only toward that namespace.

use aya_ebpf::{
    bindings::{BPF_RB_AVAIL_DATA, BPF_RB_FORCE_WAKEUP, BPF_RB_NO_WAKEUP, bpf_sock_ops},
    helpers::{bpf_get_socket_cookie, bpf_ktime_get_ns},
    programs::{SockAddrContext, SockOpsContext},
};
use dataplane_common::{
    Counter, FastClose, FastConn, FastKey, IpAddr16, POD_CAPTURE_INBOUND, SockTuple,
    maps::FAST_CLOSED_WAKE_BYTES,
};

use crate::maps::{
    FAST_BY_COOKIE, FAST_BY_TUPLE, FAST_CLOSED, FAST_GENERATION, FAST_VERDICTS, POD_INBOUND, count,
};

/// TCP states (`include/net/tcp_states.h`) a socket can close from.
const TCP_SYN_SENT: u32 = 2;
const TCP_FIN_WAIT2: u32 = 5;
const TCP_CLOSE_WAIT: u32 = 8;
const TCP_LAST_ACK: u32 = 9;
const TCP_CLOSING: u32 = 11;

/// Whether the client socket of `ctx` (in namespace `netns`) may reach
/// `dst:port` directly; when it may, the socket is recorded as a fast-path
/// client and `true` is returned.
#[inline(always)]
pub fn admit_connect(ctx: &SockAddrContext, netns: u64, dst: IpAddr16, port: u16) -> bool {
    let key = FastKey {
        netns_cookie: netns,
        dst_addr: dst,
        dst_port: port,
        _pad: [0; 6],
    };
    let Some(verdict) = FAST_VERDICTS.get_ptr(key) else {
        return false;
    };
    // SAFETY: a pointer from a successful lookup; the value is copied.
    let verdict = unsafe { *verdict };
    let generation = match FAST_GENERATION.get(0) {
        Some(generation) => *generation,
        None => return false,
    };
    if verdict.generation != generation {
        return false;
    }
    let Some(pod) = POD_INBOUND.get_ptr(dst) else {
        return false;
    };
    // SAFETY: as above.
    let (pod_netns, pod_flags) = unsafe { ((*pod).netns_cookie, (*pod).flags) };
    if pod_netns != verdict.dst_netns_cookie || pod_flags & POD_CAPTURE_INBOUND == 0 {
        return false;
    }
    let conn = FastConn {
        src_netns_cookie: netns,
        dst_netns_cookie: pod_netns,
        start_ns: 0,
    };
    // SAFETY: helper valid for sock_addr programs since 4.20.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.sock_addr.cast()) };
    if FAST_BY_COOKIE.insert(cookie, conn, 0).is_err() {
        // Without the record the destination would capture the SYN: take
        // the proxy path instead.
        count(Counter::MapUpdateFailed);
        return false;
    }
    count(Counter::FastPathOutbound);
    true
}

/// At `TCP_CONNECT_CB`: a fast-path client's record keyed by its tuple, so
/// the destination's `sk_lookup` knows this SYN. Returns whether the
/// socket is a fast-path client.
#[inline(always)]
pub fn on_connect(cookie: u64, tuple: SockTuple) -> bool {
    let Some(conn) = FAST_BY_COOKIE.get_ptr_mut(cookie) else {
        return false;
    };
    // SAFETY: a pointer from a successful lookup; this socket's own
    // callbacks are serialised by the socket lock.
    let conn = unsafe {
        (*conn).start_ns = bpf_ktime_get_ns();
        *conn
    };
    if FAST_BY_TUPLE.insert(tuple, conn, 0).is_err() {
        count(Counter::MapUpdateFailed);
    }
    true
}

/// At the client socket's close: the telemetry record, and the records of
/// the connection removed.
#[inline(always)]
pub fn on_close(ctx: &SockOpsContext, cookie: u64, tuple: Option<SockTuple>) {
    let Some(conn) = FAST_BY_COOKIE.get_ptr(cookie) else {
        return;
    };
    // SAFETY: as above.
    let conn = unsafe { *conn };
    let _ = FAST_BY_COOKIE.remove(cookie);
    let Some(tuple) = tuple else {
        return;
    };
    let _ = FAST_BY_TUPLE.remove(tuple);
    if conn.start_ns == 0 {
        // Closed before its SYN left: nothing was ever connected.
        return;
    }
    let ops: *mut bpf_sock_ops = ctx.ops;
    // SAFETY: context field reads, checked by the verifier (full sockets
    // only, which a state change is).
    let (acked, received) = unsafe { ((*ops).bytes_acked, (*ops).bytes_received) };
    // The kernel's counts are of sequence space: the SYN and a FIN each
    // take one. The state the socket closed from says which of them were
    // exchanged (from FIN_WAIT2 the peer's FIN is assumed, as after a
    // normal close; a FIN_WAIT2 timeout would under-count one byte).
    let (syn, our_fin, peer_fin) = match ctx.arg(0) {
        TCP_SYN_SENT => (0, 0, 0),
        TCP_FIN_WAIT2 | TCP_LAST_ACK | TCP_CLOSING => (1, 1, 1),
        TCP_CLOSE_WAIT => (1, 0, 1),
        _ => (1, 0, 0),
    };
    let record = FastClose {
        src_netns_cookie: conn.src_netns_cookie,
        dst_netns_cookie: conn.dst_netns_cookie,
        bytes_sent: acked.saturating_sub(syn + our_fin),
        bytes_received: received.saturating_sub(peer_fin),
        // SAFETY: helper without arguments.
        duration_ns: unsafe { bpf_ktime_get_ns() }.saturating_sub(conn.start_ns),
        tuple,
        _pad: [0; 4],
    };
    // The agent is woken by a batch, not by each record; it drains the
    // ring on a timer too, so a lone record waits at most that long.
    let wake = if FAST_CLOSED.query(BPF_RB_AVAIL_DATA.into()) >= FAST_CLOSED_WAKE_BYTES {
        BPF_RB_FORCE_WAKEUP
    } else {
        BPF_RB_NO_WAKEUP
    };
    match FAST_CLOSED.output::<FastClose>(&record, wake.into()) {
        Ok(()) => count(Counter::FastPathClosed),
        Err(_) => count(Counter::FastPathRecordLost),
    }
}

/// Whether the SYN of `tuple` toward the pod of namespace `pod_netns` is a
/// fast-path connection its client's `sockops` recorded.
#[inline(always)]
pub fn admit_syn(tuple: SockTuple, pod_netns: u64) -> bool {
    match FAST_BY_TUPLE.get_ptr(tuple) {
        // SAFETY: a pointer from a successful lookup; one field is read.
        Some(conn) => unsafe { (*conn).dst_netns_cookie == pod_netns },
        None => false,
    }
}
