//! `sk_lookup`, attached to each enrolled pod's network namespace: inbound
//! TCP connections to the pod's IPs are handed to the engine's in-pod
//! listeners (minimum kernel 5.9).
//!
//! The kernel runs this program when a SYN finds no established socket,
//! before its own listener lookup. Assigning a listener from `LISTENERS`
//! (dual-stack `[::]` sockets, so IPv4 lookups reach them too) makes the
//! connection land there with its original destination as the accepted
//! socket's local address. `SK_DROP` ends the lookup with no match, so the
//! client gets a reset, not a silent timeout.
//!
//! Decision chain: not TCP or not an enrolled pod IP -> pass; the engine's
//! own connection to the app from a client's address (its tuple recorded
//! by the engine) -> pass; made by a socket of the node's own namespace
//! (kubelet's probes, `node_probe`) -> pass; from the node-side address or
//! a probe source -> pass; from loopback or from the pod
//! itself -> pass; to the HBONE port -> HBONE listener; to an engine capture
//! port -> drop (never loop); to an excluded port -> pass; anything else ->
//! inbound listener. A missing listener (agent down) passes or drops per the
//! agent's fail-open setting.

use aya_ebpf::{macros::sk_lookup, programs::SkLookupContext};
use dataplane_common::{
    AF_INET, AF_INET6, AGENT_FAIL_OPEN, AgentConfig, Counter, IpAddr16, ListenerKey,
    POD_CAPTURE_INBOUND, PodInbound, PodPort, SockTuple,
};

use crate::{
    ctx_words::read_ip6,
    maps::{
        IN_EXCL_PORTS, LISTENERS, POD_INBOUND, PROBE_SOURCES, TPROXY_TUPLES, agent_config, count,
    },
};

/// Let the lookup go on (with the assigned socket, if any).
const SK_PASS: u32 = 1;
/// End the lookup with no match.
const SK_DROP: u32 = 0;
const IPPROTO_TCP: u32 = 6;
/// `bpf_sk_assign` result when an earlier program already chose a socket.
const EEXIST: i32 = 17;

#[sk_lookup]
pub fn dp_sk_lookup(ctx: SkLookupContext) -> u32 {
    lookup(&ctx)
}

#[inline(always)]
fn lookup(ctx: &SkLookupContext) -> u32 {
    let Some(cfg) = agent_config() else {
        return SK_PASS;
    };
    let sl = ctx.lookup;
    // SAFETY: context field reads, checked by the verifier.
    let (family, protocol, local_port) =
        unsafe { ((*sl).family, (*sl).protocol, (*sl).local_port) };
    if protocol != IPPROTO_TCP {
        count(Counter::SkippedNotTcp);
        return SK_PASS;
    }
    let (dst, src) = if family == u32::from(AF_INET) {
        // SAFETY: as above; the v4 fields are in network order.
        let (local, remote) = unsafe { ((*sl).local_ip4, (*sl).remote_ip4) };
        (
            IpAddr16::from_ipv4_be(local),
            IpAddr16::from_ipv4_be(remote),
        )
    } else if family == u32::from(AF_INET6) {
        // SAFETY: context reads at constant offsets, word by word.
        let (local, remote) = unsafe {
            (
                read_ip6(&raw const (*sl).local_ip6),
                read_ip6(&raw const (*sl).remote_ip6),
            )
        };
        (
            IpAddr16::from_ipv6_words(local),
            IpAddr16::from_ipv6_words(remote),
        )
    } else {
        return SK_PASS;
    };
    let pod: PodInbound = match POD_INBOUND.get_ptr(dst) {
        // SAFETY: a pointer from a successful lookup; the value is copied.
        Some(pod) => unsafe { *pod },
        None => {
            count(Counter::SkippedNotEnrolled);
            return SK_PASS;
        }
    };
    if pod.flags & POD_CAPTURE_INBOUND == 0 {
        count(Counter::SkippedNotEnrolled);
        return SK_PASS;
    }
    // SAFETY: context field read; `remote_port` is network order.
    let remote_port = u16::from_be(unsafe { (*sl).remote_port });
    let tuple = SockTuple {
        src_addr: src,
        dst_addr: dst,
        src_port: remote_port,
        dst_port: local_port as u16,
    };
    if crate::fast_path::admit_syn(tuple, pod.netns_cookie) {
        count(Counter::FastPathInbound);
        return SK_PASS;
    }
    // Only with original source on (a transparent mark) can there be one.
    if cfg.transparent_mark != 0 && TPROXY_TUPLES.get_ptr(tuple).is_some() {
        // Consumed: a later SYN with the same tuple is a new connection.
        let _ = TPROXY_TUPLES.remove(tuple);
        count(Counter::TransparentPassed);
        return SK_PASS;
    }
    if crate::node_probe::admit_syn(tuple) {
        return SK_PASS;
    }
    if src == pod.node_addr || PROBE_SOURCES.get_ptr(src).is_some() {
        count(Counter::ExemptProbe);
        return SK_PASS;
    }
    if src.is_loopback() || same_pod(src, pod.netns_cookie) {
        count(Counter::ExemptLoopback);
        return SK_PASS;
    }
    let port = local_port as u16;
    if port == cfg.hbone_port {
        return assign(ctx, cfg, dst, cfg.hbone_port, Counter::InboundHbone);
    }
    if port == cfg.outbound_port || port == cfg.inbound_port {
        // The capture listeners are dual-stack wildcards: without this a
        // peer could reach them directly and make the engine loop.
        count(Counter::RefusedEnginePort);
        return SK_DROP;
    }
    let excluded = PodPort {
        pod_addr: dst,
        port,
        _pad: [0; 2],
    };
    if IN_EXCL_PORTS.get_ptr(excluded).is_some() {
        count(Counter::ExemptExcludedPort);
        return SK_PASS;
    }
    assign(ctx, cfg, dst, cfg.inbound_port, Counter::RedirectedInbound)
}

/// Whether `src` is one of the IPs of the pod with this netns cookie.
#[inline(always)]
fn same_pod(src: IpAddr16, netns_cookie: u64) -> bool {
    match POD_INBOUND.get_ptr(src) {
        // SAFETY: a pointer from a successful lookup; one field is copied.
        Some(other) => unsafe { (*other).netns_cookie == netns_cookie },
        None => false,
    }
}

/// Hands the connection to the pod's listener for `role_port`, counting
/// `counter`, or applies the fail-open setting when there is none.
#[inline(always)]
fn assign(
    ctx: &SkLookupContext,
    cfg: &AgentConfig,
    pod_addr: IpAddr16,
    role_port: u16,
    counter: Counter,
) -> u32 {
    let key = ListenerKey {
        pod_addr,
        port: role_port,
        _pad: [0; 2],
    };
    match LISTENERS.redirect_sk_lookup(ctx, key, 0) {
        Ok(()) => {
            count(counter);
            SK_PASS
        }
        // An earlier program in the chain (another generation of ours during
        // a make-before-break replacement) already assigned a socket.
        Err(err) if err == -EEXIST => SK_PASS,
        // No listener (the engine is down and its sockets are closed) or
        // one the kernel cannot use.
        Err(_) => {
            if cfg.flags & AGENT_FAIL_OPEN != 0 {
                count(Counter::EngineDownPassed);
                SK_PASS
            } else {
                count(Counter::EngineDownRefused);
                SK_DROP
            }
        }
    }
}
