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
//!   client's own `sockops` recorded, and only toward that namespace;
//! - a service VIP's verdict lists its endpoints on this node with their
//!   pods' namespaces and how many endpoints it has in all; `connect4/6`
//!   draw one of all, and for one of this node's rewrite the destination
//!   to it (kube-proxy's translation of the VIP then never applies), and
//!   `getpeername` reports the VIP, as after kube-proxy's translation.

use aya_ebpf::{
    bindings::{BPF_RB_AVAIL_DATA, BPF_RB_FORCE_WAKEUP, bpf_sock_ops},
    helpers::{bpf_get_prandom_u32, bpf_get_socket_cookie, bpf_ktime_get_ns},
    programs::{SockAddrContext, SockOpsContext},
};
use dataplane_common::{
    Counter, FAST_SERVICE_MAX_ENDPOINTS, FastClose, FastCloseVip, FastConn, FastKey, FastVip,
    IpAddr16, POD_CAPTURE_INBOUND, SockTuple, maps::FAST_CLOSED_WAKE_BYTES,
};

use crate::maps::{
    FAST_BY_COOKIE, FAST_BY_TUPLE, FAST_CLOSED, FAST_GENERATION, FAST_SERVICES, FAST_VERDICTS,
    FAST_VIP_BY_COOKIE, POD_INBOUND, count,
};

const _: () = assert!(FAST_SERVICE_MAX_ENDPOINTS.is_power_of_two());

/// TCP states (`include/net/tcp_states.h`) a socket can close from.
const TCP_SYN_SENT: u32 = 2;
const TCP_FIN_WAIT2: u32 = 5;
const TCP_CLOSE_WAIT: u32 = 8;
const TCP_LAST_ACK: u32 = 9;
const TCP_CLOSING: u32 = 11;

/// What the fast path does with one `connect()`.
pub enum Admit {
    /// Nothing: the connection takes the proxy path.
    No,
    /// The connection goes to the address dialled, socket to socket.
    AsDialled,
    /// The connection goes to this endpoint (address, port in host order)
    /// of the service VIP dialled, socket to socket.
    Endpoint(IpAddr16, u16),
}

/// Whether the client socket of `ctx` (in namespace `netns`) may reach
/// `dst:port` directly, or one endpoint of the service there; when it may,
/// the socket is recorded as a fast-path client.
#[inline(always)]
pub fn admit_connect(ctx: &SockAddrContext, netns: u64, dst: IpAddr16, port: u16) -> Admit {
    let key = FastKey {
        netns_cookie: netns,
        dst_addr: dst,
        dst_port: port,
        _pad: [0; 6],
    };
    let generation = match FAST_GENERATION.get(0) {
        Some(generation) => *generation,
        None => return Admit::No,
    };
    let Some(verdict) = FAST_VERDICTS.get_ptr(key) else {
        return admit_service(ctx, &key, generation);
    };
    // SAFETY: a pointer from a successful lookup; the value is copied.
    let verdict = unsafe { *verdict };
    if verdict.generation != generation || !owned_by(dst, verdict.dst_netns_cookie) {
        return Admit::No;
    }
    // SAFETY: helper valid for sock_addr programs since 4.20.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.sock_addr.cast()) };
    if !record_client(cookie, netns, verdict.dst_netns_cookie) {
        return Admit::No;
    }
    count(Counter::FastPathOutbound);
    Admit::AsDialled
}

/// The service form of [`admit_connect`]: a uniform draw among all the
/// service's endpoints; one of the endpoints the agent allowed for the VIP
/// of `key` is taken, any other is left to the proxy.
#[inline(always)]
fn admit_service(ctx: &SockAddrContext, key: &FastKey, generation: u64) -> Admit {
    let Some(service) = FAST_SERVICES.get_ptr(key) else {
        return Admit::No;
    };
    // SAFETY: a pointer from a successful lookup; three fields are read.
    let (made_in, here, choices) =
        unsafe { ((*service).generation, (*service).count, (*service).choices) };
    if made_in != generation
        || here == 0
        || here as usize > FAST_SERVICE_MAX_ENDPOINTS
        || choices < here
    {
        return Admit::No;
    }
    // SAFETY: helper without arguments.
    let draw = unsafe { bpf_get_prandom_u32() };
    // `choices >= here > 0`; said again so that no panic path is left.
    let Some(pick) = draw.checked_rem(choices) else {
        return Admit::No;
    };
    if pick >= here {
        // An endpoint elsewhere: the proxy's share.
        count(Counter::FastPathServiceProxied);
        return Admit::No;
    }
    let pick = pick as usize;
    // The verifier does not bound a remainder, so the index is masked (a
    // no-op: pick < here <= the maximum, a power of two). The
    // compiler knows the mask is a no-op and would drop it; reading the
    // value back through a volatile load hides that from it.
    // SAFETY: a read of an initialised local.
    let pick = unsafe { core::ptr::read_volatile(&pick) } & (FAST_SERVICE_MAX_ENDPOINTS - 1);
    // SAFETY: a pointer from a successful lookup; one element is copied.
    let Some(endpoint) = (unsafe { (*service).endpoints.get(pick).copied() }) else {
        return Admit::No;
    };
    // A socket cannot change family: an endpoint of the other one (which
    // the agent never writes) stays on the proxy.
    if endpoint.addr.is_ipv4_mapped() != key.dst_addr.is_ipv4_mapped()
        || !owned_by(endpoint.addr, endpoint.dst_netns_cookie)
    {
        return Admit::No;
    }
    // SAFETY: helper valid for sock_addr programs since 4.20.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.sock_addr.cast()) };
    let vip = FastVip {
        addr: key.dst_addr,
        port: key.dst_port,
        _pad: [0; 2],
    };
    if FAST_VIP_BY_COOKIE.insert(cookie, vip, 0).is_err() {
        count(Counter::MapUpdateFailed);
        return Admit::No;
    }
    if !record_client(cookie, key.netns_cookie, endpoint.dst_netns_cookie) {
        let _ = FAST_VIP_BY_COOKIE.remove(cookie);
        return Admit::No;
    }
    count(Counter::FastPathOutbound);
    count(Counter::FastPathService);
    Admit::Endpoint(endpoint.addr, endpoint.port)
}

/// Whether `addr` is the address of an enrolled pod of namespace `netns`
/// that captures inbound traffic (an address reused by another pod never
/// inherits a verdict).
#[inline(always)]
fn owned_by(addr: IpAddr16, netns: u64) -> bool {
    let Some(pod) = POD_INBOUND.get_ptr(addr) else {
        return false;
    };
    // SAFETY: a pointer from a successful lookup; two fields are read.
    let (pod_netns, pod_flags) = unsafe { ((*pod).netns_cookie, (*pod).flags) };
    pod_netns == netns && pod_flags & POD_CAPTURE_INBOUND != 0
}

/// Records the socket of `cookie` as a fast-path client from namespace
/// `netns` to the pod of namespace `dst_netns`. A repeated `connect()` on a
/// socket whose SYN already left keeps the first record: the kernel
/// ignores the address then, and the record holds the SYN's time (which
/// its close record needs). A record without a SYN is stale (a connect
/// that failed before sending one) and is replaced.
#[inline(always)]
fn record_client(cookie: u64, netns: u64, dst_netns: u64) -> bool {
    if let Some(conn) = FAST_BY_COOKIE.get_ptr(cookie) {
        // SAFETY: a pointer from a successful lookup; one field is read.
        if unsafe { (*conn).start_ns } != 0 {
            return true;
        }
    }
    let conn = FastConn {
        src_netns_cookie: netns,
        dst_netns_cookie: dst_netns,
        start_ns: 0,
    };
    if FAST_BY_COOKIE.insert(cookie, conn, 0).is_err() {
        // Without the record the destination would capture the SYN: take
        // the proxy path instead.
        count(Counter::MapUpdateFailed);
        return false;
    }
    true
}

/// The VIP and port the fast-path client socket of `ctx` dialled, if it
/// dialled a service (`getpeername` reports it instead of the endpoint).
#[inline(always)]
pub fn dialled_vip(ctx: &SockAddrContext) -> Option<(IpAddr16, u16)> {
    // SAFETY: helper valid for sock_addr programs since 4.20.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.sock_addr.cast()) };
    let vip = FAST_VIP_BY_COOKIE.get_ptr(cookie)?;
    // SAFETY: a pointer from a successful lookup; the fields are copied.
    Some(unsafe { ((*vip).addr, (*vip).port) })
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
    let vip = FAST_VIP_BY_COOKIE.get_ptr(cookie).map(|vip| {
        // SAFETY: a pointer from a successful lookup; the value is copied.
        unsafe { *vip }
    });
    if vip.is_some() {
        let _ = FAST_VIP_BY_COOKIE.remove(cookie);
    }
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
    // A batch wakes the agent; below it, the ring's adaptive wake-up (no
    // flag) wakes it only when it had read every record before this one,
    // so an idle agent sleeps until a record comes and a busy one, which
    // reads a few and then pauses, is woken about once per pause.
    let wake = if FAST_CLOSED.query(BPF_RB_AVAIL_DATA.into()) >= FAST_CLOSED_WAKE_BYTES {
        BPF_RB_FORCE_WAKEUP
    } else {
        0
    };
    let written = match vip {
        Some(vip) => FAST_CLOSED.output::<FastCloseVip>(
            &FastCloseVip {
                close: record,
                vip,
                _pad: [0; 4],
            },
            wake.into(),
        ),
        None => FAST_CLOSED.output::<FastClose>(&record, wake.into()),
    };
    match written {
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
