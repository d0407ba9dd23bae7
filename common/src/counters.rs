//! The kernel programs' per-decision counters: one slot each in the per-CPU
//! `REDIRECT_STATS` array.
//!
//! This list is the single source of truth. The kernel programs bump a slot
//! by [`Counter`] (its discriminant is the array index); the agent reads
//! [`Counter::ALL`] and names each value with [`Counter::name`], the name
//! `dataplane redirect stats` prints and the `event` label of
//! `dataplane_kernel_events_total`. All three come from one table (the
//! `counters!` invocation below), so a counter cannot be added on one side
//! only; compile-time checks below keep the indices dense and the names
//! unique, and `REDIRECT_STATS` large enough.

/// Declares [`Counter`], [`Counter::ALL`], [`Counter::name`] and
/// [`COUNTER_COUNT`] from one table of `Variant = index => "name"` rows.
macro_rules! counters {
    ($(
        $(#[doc = $doc:literal])*
        $variant:ident = $index:literal => $name:literal,
    )*) => {
        /// Indexes into the per-CPU `REDIRECT_STATS` counter array: one per
        /// decision the kernel programs take.
        #[repr(u32)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum Counter {
            $(
                $(#[doc = $doc])*
                $variant = $index,
            )*
        }

        /// Number of counters (the used slots of `REDIRECT_STATS`).
        pub const COUNTER_COUNT: usize = [$($name),*].len();

        impl Counter {
            /// Every counter, in index order.
            pub const ALL: [Counter; COUNTER_COUNT] = [$(Counter::$variant),*];

            /// Stable snake_case name, used by the CLI and metrics.
            pub const fn name(self) -> &'static str {
                match self {
                    $(Counter::$variant => $name,)*
                }
            }
        }
    };
}

counters! {
    /// Outbound connection rewritten to the outbound listener.
    RedirectedOutbound = 0 => "redirected_outbound",
    /// Inbound connection assigned to the inbound plaintext listener.
    RedirectedInbound = 1 => "redirected_inbound",
    /// Inbound connection to port 15008 assigned to the HBONE listener.
    InboundHbone = 2 => "inbound_hbone",
    /// Socket not in an enrolled network namespace (or destination not an
    /// enrolled pod IP).
    SkippedNotEnrolled = 3 => "skipped_not_enrolled",
    /// Not a TCP socket.
    SkippedNotTcp = 4 => "skipped_not_tcp",
    /// Socket carries the proxy mark.
    ExemptProxyMark = 5 => "exempt_proxy_mark",
    /// Destination is a loopback address, or the pod is talking to itself.
    ExemptLoopback = 6 => "exempt_loopback",
    /// Port excluded for this pod.
    ExemptExcludedPort = 7 => "exempt_excluded_port",
    /// Destination inside a CIDR excluded for this pod.
    ExemptExcludedCidr = 8 => "exempt_excluded_cidr",
    /// Inbound from the node-side address or a configured probe address.
    ExemptProbe = 9 => "exempt_probe",
    /// Outbound to port 15008: already tunnel traffic.
    ExemptHbonePort = 10 => "exempt_hbone_port",
    /// Connection aimed at an engine capture port: refused, never looped.
    RefusedEnginePort = 11 => "refused_engine_port",
    /// Engine listener missing (agent down), fail-closed: refused.
    EngineDownRefused = 12 => "engine_down_refused",
    /// Engine listener missing (agent down), fail-open: let through.
    EngineDownPassed = 13 => "engine_down_passed",
    /// Original-destination record written at TCP connect time.
    OrigDstRecorded = 14 => "orig_dst_recorded",
    /// `getsockopt(SO_ORIGINAL_DST)` answered from the map.
    OrigDstAnswered = 15 => "orig_dst_answered",
    /// `getpeername()` answered with the original destination.
    PeerRewritten = 16 => "peer_rewritten",
    /// A map update failed (map full or kernel error).
    MapUpdateFailed = 17 => "map_update_failed",
    /// The engine's connection to an app from a client's address (its
    /// tuple recorded by the engine) reached the app uncaptured.
    TransparentPassed = 18 => "transparent_passed",
    /// A DNS query (UDP `sendmsg`/`connect` or TCP `connect` to port 53)
    /// steered to the pod's resolver.
    DnsRedirected = 19 => "dns_redirected",
    /// A DNS query of an enrolled pod left alone: the pod has no DNS
    /// capture, the socket is the engine's, or the server is on loopback.
    DnsPassed = 20 => "dns_passed",
    /// A reply of the pod's resolver shown as coming from the server the
    /// application asked (`recvmsg`).
    DnsReplyRewritten = 21 => "dns_reply_rewritten",
    /// A SYN an external in-pod proxy (marked with the proxy mark) sent over
    /// the pod's `lo` to one of the pod's IPs: its tuple recorded for
    /// `sk_lookup` and its mark changed to the transparent mark, so the
    /// app's replies are routed back to the proxy.
    ProxySynRemarked = 22 => "proxy_syn_remarked",
    /// A `connect()` between two pods of this node that the agent allowed
    /// onto the fast path: left alone, no proxy on either side.
    FastPathOutbound = 23 => "fast_path_outbound",
    /// A fast-path connection's SYN let through to the destination pod's
    /// app by `sk_lookup`.
    FastPathInbound = 24 => "fast_path_inbound",
    /// A fast-path connection's close recorded for telemetry.
    FastPathClosed = 25 => "fast_path_closed",
    /// A fast-path close record lost (the ring buffer was full).
    FastPathRecordLost = 26 => "fast_path_record_lost",
    /// A fast-path `connect()` to a service VIP: the kernel drew one of
    /// the service's endpoints on this node and rewrote the destination to
    /// it (also counted in `fast_path_outbound`).
    FastPathService = 27 => "fast_path_service",
    /// A `connect()` to a service VIP whose fast-path verdict covers some
    /// of its endpoints, where the kernel's draw fell on an endpoint
    /// elsewhere: left to the proxy, which chooses among those.
    FastPathServiceProxied = 28 => "fast_path_service_proxied",
    /// A `connect()` from the node's own network namespace to an enrolled
    /// pod's IP (kubelet's probes among them), noted so that the pod lets
    /// exactly that connection through.
    NodeConnect = 29 => "node_connect",
    /// Inbound connection made by a socket of the node's own namespace:
    /// let through to the app uncaptured.
    ExemptNodeSocket = 30 => "exempt_node_socket",
    /// A captured `connect()` of a pod served by an external proxy that
    /// could not be bound to the pod's own address (the application bound
    /// the socket itself, or the address is not usable in the pod): it
    /// reaches the proxy from loopback instead.
    SourceBindFailed = 31 => "source_bind_failed",
}

/// Number of slots in the `REDIRECT_STATS` array: room for counters added
/// later without changing the pinned map's definition (which a restarted
/// agent could not adopt).
pub const COUNTER_SLOTS: u32 = 32;

/// Whether two names are equal (`const` string comparison).
const fn same(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if a[i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
}

/// Whether `name` is non-empty snake_case (`[a-z0-9_]`, starting with a
/// letter): the form metric label values and the CLI use.
const fn is_snake_case(name: &str) -> bool {
    let bytes = name.as_bytes();
    if bytes.is_empty() || !bytes[0].is_ascii_lowercase() {
        return false;
    }
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if !(b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_') {
            return false;
        }
        i += 1;
    }
    true
}

// The table is the contract: fail the build when an index is skipped or
// repeated (user space would read the wrong slot), a name repeats, or the
// array has no slot for a counter.
const _: () = {
    assert!(COUNTER_COUNT as u32 <= COUNTER_SLOTS);
    let mut i = 0;
    while i < COUNTER_COUNT {
        assert!(
            Counter::ALL[i] as usize == i,
            "counter indices must be 0, 1, 2, ... in table order"
        );
        assert!(
            is_snake_case(Counter::ALL[i].name()),
            "counter names must be snake_case"
        );
        let mut j = i + 1;
        while j < COUNTER_COUNT {
            assert!(
                !same(Counter::ALL[i].name(), Counter::ALL[j].name()),
                "counter names must be unique"
            );
            j += 1;
        }
        i += 1;
    }
};
