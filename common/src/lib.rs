//! Types the kernel programs and the agent exchange through BPF maps.
//!
//! Everything here is `#[repr(C)]` with every padding byte spelled out as a
//! named `_pad` field, because the kernel compares map keys byte for byte: an
//! uninitialised padding byte would make two equal keys differ. Sizes are
//! checked at compile time below so a field added on one side cannot silently
//! shift the layout the other side reads.
//!
//! Addresses are stored as 16 bytes in network byte order; IPv4 addresses use
//! the IPv4-mapped IPv6 form (`::ffff:a.b.c.d`) so that one key type serves v4,
//! v6 and dual-stack sockets alike. Ports are stored in host byte order.
//!
//! With the `user` feature the types implement [`aya::Pod`] so user space can
//! read and write them in maps.
#![no_std]

pub mod counters;
pub mod fast_path;
pub mod maps;

pub use counters::{COUNTER_SLOTS, Counter};
pub use fast_path::{
    FAST_SERVICE_MAX_ENDPOINTS, FastClose, FastCloseVip, FastConn, FastEndpoint, FastKey,
    FastService, FastVerdict, FastVip,
};

/// Port of the in-pod listener that receives captured outbound connections.
pub const OUTBOUND_PORT: u16 = 15001;
/// Port of the in-pod listener that receives captured inbound plaintext.
pub const INBOUND_PLAINTEXT_PORT: u16 = 15006;
/// Port of the in-pod HBONE (mutual TLS) listener.
pub const HBONE_PORT: u16 = 15008;
/// Socket mark the engine sets on its own sockets so the kernel programs let
/// them through (the same value Istio uses, 0x539).
pub const DEFAULT_PROXY_MARK: u32 = 0x539;

/// Default mark of the engine's sockets that connect to an app from the
/// client's address (IP_TRANSPARENT): next to the proxy mark, and distinct
/// from it so in-pod routing can send only their replies back to the engine.
pub const DEFAULT_TRANSPARENT_MARK: u32 = 0x53a;

/// In-pod port of the DNS proxy (Istio's node proxy uses the same).
pub const DNS_PROXY_PORT: u16 = 15053;

/// `AF_INET`, as the kernel reports a socket family.
pub const AF_INET: u16 = 2;
/// `AF_INET6`, as the kernel reports a socket family.
pub const AF_INET6: u16 = 10;

/// An IPv4 or IPv6 address as 16 bytes in network byte order, IPv4 in the
/// IPv4-mapped form.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct IpAddr16 {
    /// The address as four 32-bit words, each in network byte order, so that
    /// eBPF code can copy the kernel's `user_ip6[4]` words without swapping.
    pub words: [u32; 4],
}

impl IpAddr16 {
    /// The IPv4-mapped form of an IPv4 address given in network byte order
    /// (as the kernel stores `user_ip4` and `local_ip4`).
    pub const fn from_ipv4_be(addr_be: u32) -> Self {
        Self {
            words: [0, 0, u32::to_be(0x0000_ffff), addr_be],
        }
    }

    /// The address from the kernel's four network-order words.
    pub const fn from_ipv6_words(words: [u32; 4]) -> Self {
        Self { words }
    }

    /// The 16 address bytes in network order.
    pub fn octets(&self) -> [u8; 16] {
        let mut out = [0u8; 16];
        let mut i = 0;
        while i < 4 {
            // Each word already holds network-order bytes in memory order.
            let b = self.words[i].to_ne_bytes();
            out[i * 4] = b[0];
            out[i * 4 + 1] = b[1];
            out[i * 4 + 2] = b[2];
            out[i * 4 + 3] = b[3];
            i += 1;
        }
        out
    }

    /// The address from its 16 network-order bytes.
    pub fn from_octets(b: [u8; 16]) -> Self {
        let w = |i: usize| u32::from_ne_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        Self {
            words: [w(0), w(4), w(8), w(12)],
        }
    }

    /// Whether this is an IPv4-mapped address (`::ffff:0:0/96`).
    pub const fn is_ipv4_mapped(&self) -> bool {
        self.words[0] == 0 && self.words[1] == 0 && self.words[2] == u32::to_be(0x0000_ffff)
    }

    /// Whether a connection to or from this address never leaves the
    /// network namespace: `127.0.0.0/8` (IPv4-mapped), `::1`, and the
    /// unspecified addresses `0.0.0.0` and `::`, which `connect()` treats as
    /// the local host.
    pub const fn is_loopback(&self) -> bool {
        if self.is_ipv4_mapped() {
            let v4 = u32::from_be(self.words[3]);
            return v4 >> 24 == 127 || v4 == 0;
        }
        self.words[0] == 0
            && self.words[1] == 0
            && self.words[2] == 0
            && (self.words[3] == 0 || self.words[3] == u32::to_be(1))
    }

    /// `::1`.
    pub const LOCALHOST_V6: Self = Self {
        words: [0, 0, 0, u32::to_be(1)],
    };

    /// `::ffff:127.0.0.1`.
    pub const LOCALHOST_V4_MAPPED: Self = Self::from_ipv4_be(u32::to_be(0x7f00_0001));
}

/// The connection tuple of a client socket as the client sees it: its own
/// address and port, and the address and port it is connected to after any
/// rewrite. The engine rebuilds the same tuple from an accepted socket's peer
/// and local addresses.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SockTuple {
    /// Client (source) address.
    pub src_addr: IpAddr16,
    /// Address the client is connected to (the listener, after a rewrite).
    pub dst_addr: IpAddr16,
    /// Client port, host byte order.
    pub src_port: u16,
    /// Connected-to port, host byte order.
    pub dst_port: u16,
}

/// The destination a client asked for before the kernel rewrote it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct OrigDst {
    /// Original destination address.
    pub addr: IpAddr16,
    /// Original destination port, host byte order.
    pub port: u16,
    /// [`AF_INET`] or [`AF_INET6`]: the family the application used, so an
    /// IPv4 destination reached through an IPv4-mapped IPv6 socket can be
    /// reported in the form the application expects.
    pub family: u16,
}

/// Key of `ORIG_DST`: a captured connection's tuple within the client's
/// network namespace.
///
/// The tuple alone does not name a connection on a node: every pod's apps
/// connect from loopback to the same `127.0.0.1` listener address inside
/// their own namespace, and two namespaces' port choices for the same
/// tuple are drawn from the same kernel-wide sequence, so two pods dialling
/// at the same moment often get the same source port.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct OrigDstKey {
    /// Cookie of the client's (and its outbound listener's) network
    /// namespace; 0 for a pod with [`ENROLLED_ORIG_DST_BY_TUPLE`].
    pub netns_cookie: u64,
    /// The connection as the client sees it.
    pub tuple: SockTuple,
    /// Explicit padding; always zero.
    pub _pad: [u8; 4],
}

/// Value of `ORIG_DST_COOKIE`: where a captured socket was going, and the
/// namespace part of its [`OrigDstKey`] (which `sockops`, unable to ask the
/// kernel for the namespace before 5.15, copies from here).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct CapturedDst {
    /// Cookie of the socket's network namespace, or 0 for a pod whose
    /// records are keyed by tuple alone ([`ENROLLED_ORIG_DST_BY_TUPLE`]).
    pub netns_cookie: u64,
    /// The destination before the rewrite.
    pub orig: OrigDst,
    /// Explicit padding; always zero.
    pub _pad: [u8; 4],
}

/// Settings of one agent instance that every kernel program reads. Lives in
/// slot 0 of the `AGENT_CONFIG` array.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AgentConfig {
    /// Sockets carrying this mark belong to the engine and are never captured.
    pub proxy_mark: u32,
    /// In-pod port of the outbound capture listener.
    pub outbound_port: u16,
    /// In-pod port of the inbound plaintext capture listener.
    pub inbound_port: u16,
    /// In-pod port of the HBONE listener.
    pub hbone_port: u16,
    /// In-pod port of the DNS proxy; 0 = no DNS capture.
    pub dns_port: u16,
    /// Bit set of `AGENT_*` flags.
    pub flags: u32,
    /// Sockets carrying this mark belong to the engine too: its connections
    /// to an app from the client's own address. Never captured; 0 = none.
    /// A separate mark because the pod routes replies to such connections
    /// back into the engine by mark, which must not catch the engine's other
    /// connections.
    pub transparent_mark: u32,
}

/// [`AgentConfig::flags`] bit: when an enrolled pod's engine listener is
/// missing (agent down), let traffic through uncaptured (fail-open) instead
/// of refusing it (fail-closed, the default).
pub const AGENT_FAIL_OPEN: u32 = 1 << 0;

/// What the agent knows about one enrolled network namespace. The value of
/// the `ENROLLED_NETNS` map, keyed by the namespace cookie.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EnrolledNetns {
    /// Bit set of `ENROLLED_*` flags.
    pub flags: u32,
    /// Explicit padding; always zero.
    pub _pad: [u8; 4],
}

/// [`EnrolledNetns::flags`] bit: capture outbound TCP.
pub const ENROLLED_CAPTURE_OUTBOUND: u32 = 1 << 0;
/// [`EnrolledNetns::flags`] bit: the engine's outbound listeners are up. The
/// agent clears it when it stops and re-sets it when it re-adopts the pod;
/// while clear, `connect4`/`connect6` apply the fail-open/fail-closed setting.
pub const ENROLLED_ENGINE_READY: u32 = 1 << 1;
/// [`EnrolledNetns::flags`] bit: capture the pod's DNS (UDP and TCP to port
/// 53) into the agent's in-pod resolver on [`AgentConfig::dns_port`].
pub const ENROLLED_CAPTURE_DNS: u32 = 1 << 2;
/// [`EnrolledNetns::flags`] bit: key the pod's `ORIG_DST` records by tuple
/// alone (namespace cookie 0). Set, on kernels before 5.15, for pods served
/// by an external proxy, which reads them through
/// `getsockopt(SO_ORIGINAL_DST)`: there a `cgroup/getsockopt` program
/// cannot ask for the socket's namespace.
pub const ENROLLED_ORIG_DST_BY_TUPLE: u32 = 1 << 3;

/// The addresses a captured outbound connection of a pod served by an
/// external proxy (Istio's ztunnel) leaves from: the value of `POD_SOURCE`,
/// keyed by the pod's namespace cookie.
///
/// `connect4`/`connect6` rewrite the destination to the loopback listener
/// before the kernel picks the source, which would then be loopback too; so
/// they bind the socket to the pod's address first. The proxy then sees the
/// pod as the client, as under istio-cni's iptables `REDIRECT` (which
/// rewrites the destination after the source was chosen). Our own engine
/// knows the client from its pod, so its pods have no entry.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PodSource {
    /// The pod's IPv4 address, IPv4-mapped; all zero when it has none.
    pub v4: IpAddr16,
    /// The pod's IPv6 address; all zero when it has none.
    pub v6: IpAddr16,
}

/// The DNS port the kernel programs capture.
pub const DNS_PORT: u16 = 53;

/// The DNS server a pod's socket asked before the kernel steered it to the
/// in-pod resolver: the value of `DNS_ORIG_COOKIE`, keyed by socket cookie.
/// `recvmsg` and `getpeername` show it in place of the resolver's address.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DnsOrigDst {
    /// The server address the application used.
    pub addr: IpAddr16,
    /// The server port (53), host byte order.
    pub port: u16,
    /// [`AF_INET`] or [`AF_INET6`]: the family of the socket that asked.
    pub family: u16,
    /// Explicit padding; always zero.
    pub _pad: [u8; 4],
}

/// A network namespace and a port: key of the per-pod excluded-port maps.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct NetnsPort {
    /// Network namespace cookie.
    pub netns_cookie: u64,
    /// Port, host byte order.
    pub port: u16,
    /// Explicit padding; always zero.
    pub _pad: [u8; 6],
}

/// Data part of an `OUT_EXCLUDED_CIDRS` LPM-trie key: the namespace cookie
/// (big-endian bytes, so the first 64 prefix bits match it exactly) followed
/// by the address. A CIDR `a/n` of namespace `c` is stored with prefix length
/// `64 + n` (IPv4: `64 + 96 + n`, addresses being IPv4-mapped).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct NetnsAddr {
    /// `netns_cookie.to_be_bytes()`.
    pub netns_cookie_be: [u8; 8],
    /// The address.
    pub addr: IpAddr16,
}

/// Prefix bits of [`NetnsAddr::netns_cookie_be`] in an LPM-trie key.
pub const NETNS_PREFIX_BITS: u32 = 64;

/// Prefix bits of a full [`NetnsAddr`]: the cookie and all 128 address bits
/// (the prefix length of a lookup key).
pub const NETNS_ADDR_BITS: u32 = NETNS_PREFIX_BITS + 128;

impl NetnsAddr {
    /// The key data for `addr` in the namespace `netns_cookie`.
    pub const fn new(netns_cookie: u64, addr: IpAddr16) -> Self {
        Self {
            netns_cookie_be: netns_cookie.to_be_bytes(),
            addr,
        }
    }
}

/// An enrolled pod as inbound capture sees it: the value of `POD_INBOUND`,
/// keyed by each of the pod's IP addresses.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PodInbound {
    /// Cookie of the pod's network namespace.
    pub netns_cookie: u64,
    /// The node-side address toward the pod (kubelet probes come from it).
    pub node_addr: IpAddr16,
    /// Bit set of `POD_*` flags.
    pub flags: u32,
    /// Explicit padding; always zero.
    pub _pad: [u8; 4],
}

/// [`PodInbound::flags`] bit: capture inbound TCP.
pub const POD_CAPTURE_INBOUND: u32 = 1 << 0;

/// Key of the `LISTENERS` sock hash: an engine listener of one pod, by pod
/// IP and role port ([`INBOUND_PLAINTEXT_PORT`] or [`HBONE_PORT`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ListenerKey {
    /// One of the pod's IPs.
    pub pod_addr: IpAddr16,
    /// The listener's role port.
    pub port: u16,
    /// Explicit padding; always zero.
    pub _pad: [u8; 2],
}

/// A pod IP and a port: key of the inbound excluded-port map.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct PodPort {
    /// One of the pod's IPs.
    pub pod_addr: IpAddr16,
    /// Port, host byte order.
    pub port: u16,
    /// Explicit padding; always zero.
    pub _pad: [u8; 2],
}

/// `SO_ORIGINAL_DST` (`<linux/netfilter_ipv4.h>`), also
/// `IP6T_SO_ORIGINAL_DST` at level `SOL_IPV6`.
pub const SO_ORIGINAL_DST: i32 = 80;
/// `SOL_IP`.
pub const SOL_IP: i32 = 0;
/// `SOL_IPV6`.
pub const SOL_IPV6: i32 = 41;

// Layouts are part of the kernel/user contract: fail the build if they move.
const _: () = {
    assert!(core::mem::size_of::<IpAddr16>() == 16);
    assert!(core::mem::size_of::<SockTuple>() == 36);
    assert!(core::mem::size_of::<OrigDst>() == 20);
    assert!(core::mem::size_of::<OrigDstKey>() == 48);
    assert!(core::mem::size_of::<CapturedDst>() == 32);
    assert!(core::mem::size_of::<AgentConfig>() == 20);
    assert!(core::mem::size_of::<EnrolledNetns>() == 8);
    assert!(core::mem::size_of::<NetnsPort>() == 16);
    assert!(core::mem::size_of::<NetnsAddr>() == 24);
    assert!(core::mem::size_of::<PodInbound>() == 32);
    assert!(core::mem::size_of::<ListenerKey>() == 20);
    assert!(core::mem::size_of::<PodPort>() == 20);
    assert!(core::mem::size_of::<DnsOrigDst>() == 24);
    assert!(core::mem::size_of::<PodSource>() == 32);
};

#[cfg(feature = "user")]
mod pod {
    // SAFETY: every type is `repr(C)`, `Copy`, has no padding bytes the
    // compiler could leave uninitialised (all padding is explicit), and any
    // bit pattern is a valid value.
    unsafe impl aya::Pod for super::IpAddr16 {}
    unsafe impl aya::Pod for super::SockTuple {}
    unsafe impl aya::Pod for super::OrigDst {}
    unsafe impl aya::Pod for super::OrigDstKey {}
    unsafe impl aya::Pod for super::CapturedDst {}
    unsafe impl aya::Pod for super::AgentConfig {}
    unsafe impl aya::Pod for super::EnrolledNetns {}
    unsafe impl aya::Pod for super::NetnsPort {}
    unsafe impl aya::Pod for super::NetnsAddr {}
    unsafe impl aya::Pod for super::PodInbound {}
    unsafe impl aya::Pod for super::ListenerKey {}
    unsafe impl aya::Pod for super::PodPort {}
    unsafe impl aya::Pod for super::DnsOrigDst {}
    unsafe impl aya::Pod for super::PodSource {}
}
