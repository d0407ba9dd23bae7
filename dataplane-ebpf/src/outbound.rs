//! The outbound decision chain shared by `connect4` and `connect6`: which
//! `connect()` of an enrolled pod is steered to the pod's outbound listener,
//! which is left alone, and which is refused.
//!
//! The hooks differ only in how they read and rewrite the destination; the
//! decision, its counters and the original-destination record live here so
//! the two families can never drift apart.

use aya_ebpf::{
    helpers::{bpf_get_netns_cookie, bpf_get_socket_cookie},
    maps::lpm_trie::Key,
    programs::SockAddrContext,
};
use dataplane_common::{
    AGENT_FAIL_OPEN, CapturedDst, Counter, ENROLLED_CAPTURE_OUTBOUND, ENROLLED_ENGINE_READY,
    ENROLLED_ORIG_DST_BY_TUPLE, IpAddr16, NETNS_ADDR_BITS, NetnsAddr, NetnsPort, OrigDst,
};

use crate::fast_path::Admit;
use crate::maps::{
    ENROLLED_NETNS, ORIG_DST_COOKIE, OUT_EXCL_CIDRS, OUT_EXCL_PORTS, agent_config, count,
};

/// Return value of a `cgroup/connect*` program that lets `connect()` go on.
pub const ALLOW: i32 = 1;
/// Return value that fails `connect()` with `EPERM`.
pub const REFUSE: i32 = 0;

const SOCK_STREAM: u32 = 1;
const IPPROTO_TCP: u32 = 6;

/// What to do with one `connect()`.
pub enum Outbound {
    /// Leave the destination untouched.
    Pass,
    /// Fail the call with `EPERM` (a self-call to an engine capture port).
    Refuse,
    /// Rewrite the destination to the pod's loopback outbound listener on
    /// this port (host order). The original destination is already recorded.
    Redirect(u16),
    /// Rewrite the destination to this endpoint (address, port in host
    /// order) of the service dialled: the fast path chose it.
    Endpoint(IpAddr16, u16),
}

/// Runs the decision chain for a TCP `connect()` to `dst:port` (`port` in
/// host order) from a socket of address family `family` (`AF_INET` for
/// `connect4`, `AF_INET6` for `connect6`, IPv4-mapped destinations included).
#[inline(always)]
pub fn decide(ctx: &SockAddrContext, dst: IpAddr16, port: u16, family: u16) -> Outbound {
    let Some(cfg) = agent_config() else {
        return Outbound::Pass;
    };
    let sa = ctx.sock_addr;
    // SAFETY: `sa` is the context pointer the kernel passed in; the verifier
    // checks every field access against `bpf_sock_addr`.
    let (sock_type, protocol) = unsafe { ((*sa).type_, (*sa).protocol) };
    if sock_type != SOCK_STREAM || protocol != IPPROTO_TCP {
        count(Counter::SkippedNotTcp);
        return Outbound::Pass;
    }
    // SAFETY: helper valid for sock_addr programs since 5.7.
    let netns = unsafe { bpf_get_netns_cookie(sa.cast()) };
    let flags = match ENROLLED_NETNS.get_ptr(netns) {
        // SAFETY: a pointer from a successful lookup; the value is copied.
        Some(enrolled) => unsafe { (*enrolled).flags },
        None => 0,
    };
    if flags & ENROLLED_CAPTURE_OUTBOUND == 0 {
        // Kubelet's probes (any socket of the node's own namespace) to an
        // enrolled pod are let through by the pod's `sk_lookup`.
        crate::node_probe::note_connect(ctx, netns, dst);
        count(Counter::SkippedNotEnrolled);
        return Outbound::Pass;
    }
    // SAFETY: `sk` of a sock_addr context is a non-null full socket.
    let mark = unsafe { (*(*sa).__bindgen_anon_1.sk).mark };
    // A zero mark would exempt every unmarked socket: treat it as "no such
    // mark configured".
    if (cfg.proxy_mark != 0 && mark == cfg.proxy_mark)
        || (cfg.transparent_mark != 0 && mark == cfg.transparent_mark)
    {
        count(Counter::ExemptProxyMark);
        return Outbound::Pass;
    }
    if dst.is_loopback() {
        count(Counter::ExemptLoopback);
        return Outbound::Pass;
    }
    if port == cfg.outbound_port || port == cfg.inbound_port {
        // Redirecting would make the engine dial its own capture port: a
        // loop. Refuse instead.
        count(Counter::RefusedEnginePort);
        return Outbound::Refuse;
    }
    if port == cfg.hbone_port {
        count(Counter::ExemptHbonePort);
        return Outbound::Pass;
    }
    let excluded_port = NetnsPort {
        netns_cookie: netns,
        port,
        _pad: [0; 6],
    };
    if OUT_EXCL_PORTS.get_ptr(excluded_port).is_some() {
        count(Counter::ExemptExcludedPort);
        return Outbound::Pass;
    }
    if OUT_EXCL_CIDRS
        .get(Key::new(NETNS_ADDR_BITS, NetnsAddr::new(netns, dst)))
        .is_some()
    {
        count(Counter::ExemptExcludedCidr);
        return Outbound::Pass;
    }
    let engine_ready = flags & ENROLLED_ENGINE_READY != 0;
    // A pair the agent allowed onto the same-node fast path: no proxy.
    // Only while the engine is up, so fail-closed still holds when it is
    // down.
    if engine_ready {
        match crate::fast_path::admit_connect(ctx, netns, dst, port) {
            Admit::No => {}
            Admit::AsDialled => return Outbound::Pass,
            Admit::Endpoint(addr, port) => return Outbound::Endpoint(addr, port),
        }
    }
    if !engine_ready {
        if cfg.flags & AGENT_FAIL_OPEN != 0 {
            count(Counter::EngineDownPassed);
            return Outbound::Pass;
        }
        // Fail-closed: steer to the listener anyway. None is there, so the
        // kernel refuses the connection; nothing leaves uncaptured.
        count(Counter::EngineDownRefused);
    }
    let orig = CapturedDst {
        netns_cookie: if flags & ENROLLED_ORIG_DST_BY_TUPLE != 0 {
            0
        } else {
            netns
        },
        orig: OrigDst {
            addr: dst,
            port,
            family,
        },
        _pad: [0; 4],
    };
    // SAFETY: helper valid for sock_addr programs since 4.20.
    let cookie = unsafe { bpf_get_socket_cookie(sa.cast()) };
    if ORIG_DST_COOKIE.insert(cookie, orig, 0).is_err() {
        // Without a record the engine could not tell where to go: leave the
        // connection uncaptured rather than break it.
        count(Counter::MapUpdateFailed);
        return Outbound::Pass;
    }
    if engine_ready {
        count(Counter::RedirectedOutbound);
    }
    Outbound::Redirect(cfg.outbound_port)
}
