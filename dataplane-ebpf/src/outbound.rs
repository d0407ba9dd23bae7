//! The outbound decision chain shared by `connect4` and `connect6`: which
//! `connect()` of an enrolled pod is steered to the pod's outbound listener,
//! which is left alone, and which is refused.
//!
//! The hooks differ only in how they read and rewrite the destination; the
//! decision, its counters and the original-destination record live here so
//! the two families can never drift apart.

use aya_ebpf::{
    bindings::sockaddr,
    helpers::{bpf_bind, bpf_get_netns_cookie, bpf_get_socket_cookie},
    maps::lpm_trie::Key,
    programs::SockAddrContext,
};
use dataplane_common::{
    AF_INET, AGENT_FAIL_OPEN, CapturedDst, Counter, ENROLLED_CAPTURE_OUTBOUND,
    ENROLLED_ENGINE_READY, ENROLLED_ORIG_DST_BY_TUPLE, IpAddr16, NETNS_ADDR_BITS, NetnsAddr,
    NetnsPort, OrigDst,
};

use crate::fast_path::Admit;
use crate::maps::{
    ENROLLED_NETNS, ORIG_DST_COOKIE, OUT_EXCL_CIDRS, OUT_EXCL_PORTS, POD_SOURCE, agent_config,
    count,
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
    /// this port (host order). The original destination is already recorded,
    /// and the source bound for pods of an external proxy.
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
    bind_pod_source(ctx, netns, dst, family);
    Outbound::Redirect(cfg.outbound_port)
}

/// `struct sockaddr_in`.
#[repr(C)]
struct SockaddrIn {
    family: u16,
    port_be: u16,
    addr_be: u32,
    zero: [u8; 8],
}

/// `struct sockaddr_in6`.
#[repr(C)]
struct SockaddrIn6 {
    family: u16,
    port_be: u16,
    flowinfo: u32,
    addr: [u32; 4],
    scope_id: u32,
}

/// Binds a socket about to be steered to the loopback listener to its
/// pod's own address, when the pod has a `POD_SOURCE` entry (pods served
/// by an external proxy such as ztunnel).
///
/// Why: the hook rewrites the destination before the kernel routes the
/// connection, so the kernel would pick a loopback source and the proxy
/// would see every client as `127.0.0.1`/`::1`. iptables `REDIRECT` (what
/// istio-cni uses) rewrites after routing, so ztunnel expects the pod's
/// address as the peer: it reports it in its access records and sends it
/// upstream in HBONE's `forwarded: for=`. A packet from the pod's address
/// to loopback stays on `lo`, exactly as under `REDIRECT`.
///
/// `bpf_bind` (kernel 4.17, cgroup connect hooks only) binds within the
/// socket's own namespace, the pod's, where the address is local; with
/// port 0 the kernel binds the address alone
/// (`BIND_FORCE_ADDRESS_NO_PORT`) and still picks the port at connect.
/// A failure (the application bound the socket itself, or the address is
/// not, or not yet, usable in the pod) leaves the loopback source: the
/// connection still goes through, counted in `source_bind_failed`.
#[inline(always)]
fn bind_pod_source(ctx: &SockAddrContext, netns: u64, dst: IpAddr16, family: u16) {
    let Some(source) = POD_SOURCE.get_ptr(netns) else {
        return;
    };
    // SAFETY: a pointer from a successful lookup; the value is copied.
    let source = unsafe { *source };
    let none = IpAddr16 { words: [0; 4] };
    let rc = if family == AF_INET {
        if source.v4 == none {
            return;
        }
        let mut sa = SockaddrIn {
            family: AF_INET,
            port_be: 0,
            addr_be: source.v4.words[3],
            zero: [0; 8],
        };
        // SAFETY: helper valid for connect4 programs; `sa` is a fully
        // initialised `sockaddr_in` on the stack, its size passed.
        unsafe {
            bpf_bind(
                ctx.sock_addr.cast(),
                (&raw mut sa).cast::<sockaddr>(),
                core::mem::size_of::<SockaddrIn>() as i32,
            )
        }
    } else {
        // An IPv6 socket dialling an IPv4-mapped address connects over
        // IPv4: its source must be the mapped IPv4 address.
        let addr = if dst.is_ipv4_mapped() {
            source.v4
        } else {
            source.v6
        };
        if addr == none {
            return;
        }
        let mut sa = SockaddrIn6 {
            family,
            port_be: 0,
            flowinfo: 0,
            addr: addr.words,
            scope_id: 0,
        };
        // SAFETY: helper valid for connect6 programs; `sa` is a fully
        // initialised `sockaddr_in6` on the stack, its size passed.
        unsafe {
            bpf_bind(
                ctx.sock_addr.cast(),
                (&raw mut sa).cast::<sockaddr>(),
                core::mem::size_of::<SockaddrIn6>() as i32,
            )
        }
    };
    if rc != 0 {
        count(Counter::SourceBindFailed);
    }
}
