//! Types of the same-node fast path: connections between two pods this
//! agent serves on one node go from the client's socket straight to the
//! server's, with no proxy on either side, once the agent has decided the
//! pair once and cached the verdict in the kernel.
//!
//! The agent writes [`FastKey`] -> [`FastVerdict`]; `connect4/6` read it
//! and leave such a connection alone (recording a [`FastConn`] under the
//! socket cookie); `sockops` re-keys the record by tuple when the SYN
//! leaves, so the destination pod's `sk_lookup` lets exactly that
//! connection through; at close `sockops` emits a [`FastClose`] into a ring
//! buffer for telemetry.

use crate::{IpAddr16, SockTuple};

/// A client pod (by network namespace) and the destination it dials: key of
/// the verdict cache.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FastKey {
    /// Cookie of the client pod's network namespace.
    pub netns_cookie: u64,
    /// Destination address as `connect()` gave it.
    pub dst_addr: IpAddr16,
    /// Destination port, host byte order.
    pub dst_port: u16,
    /// Explicit padding; always zero.
    pub _pad: [u8; 6],
}

/// An allowed (client pod, destination) pair.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FastVerdict {
    /// Cookie of the destination pod's network namespace: the kernel takes
    /// the fast path only while the destination address still belongs to
    /// that pod (an address reused by another pod never inherits it).
    pub dst_netns_cookie: u64,
    /// The verdict generation it was made in; verdicts of an older
    /// generation than [`crate::maps::FAST_GENERATION`]'s are void.
    pub generation: u64,
}

/// One fast-path connection: value of the by-cookie and by-tuple records.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FastConn {
    /// Cookie of the client pod's network namespace.
    pub src_netns_cookie: u64,
    /// Cookie of the server pod's network namespace.
    pub dst_netns_cookie: u64,
    /// `bpf_ktime_get_ns()` when the client sent its SYN (0 before).
    pub start_ns: u64,
}

/// A fast-path connection that closed, as the client's socket saw it:
/// one ring-buffer record.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FastClose {
    /// Cookie of the client pod's network namespace.
    pub src_netns_cookie: u64,
    /// Cookie of the server pod's network namespace.
    pub dst_netns_cookie: u64,
    /// Bytes the client sent that the server acknowledged.
    pub bytes_sent: u64,
    /// Bytes the client received.
    pub bytes_received: u64,
    /// From the SYN to the close, in nanoseconds.
    pub duration_ns: u64,
    /// The connection, client side first.
    pub tuple: SockTuple,
    /// Explicit padding; always zero.
    pub _pad: [u8; 4],
}

/// Most endpoints a [`FastService`] holds; a service with more stays on
/// the proxy.
pub const FAST_SERVICE_MAX_ENDPOINTS: usize = 8;

/// One endpoint of a [`FastService`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FastEndpoint {
    /// The endpoint's address, in the VIP's family (IPv4-mapped for IPv4).
    pub addr: IpAddr16,
    /// Cookie of the endpoint pod's network namespace: the endpoint is
    /// taken only while its address still belongs to that pod.
    pub dst_netns_cookie: u64,
    /// The endpoint's (target) port, host byte order.
    pub port: u16,
    /// Explicit padding; always zero.
    pub _pad: [u8; 6],
}

/// An allowed (client pod, service VIP and port) pair: `endpoints` are
/// the service's endpoints on this node that the client may reach on the
/// fast path; the service may have others, which only the proxy reaches.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FastService {
    /// The verdict generation it was made in (as [`FastVerdict`]'s).
    pub generation: u64,
    /// How many of `endpoints` are valid (1 to
    /// [`FAST_SERVICE_MAX_ENDPOINTS`]).
    pub count: u32,
    /// How many endpoints the service has in all (at least `count`): the
    /// kernel draws one of them uniformly; a draw past `count` is an
    /// endpoint elsewhere, and the connection goes to the proxy, which
    /// then chooses among the others only.
    pub choices: u32,
    /// The endpoints the kernel connects to directly.
    pub endpoints: [FastEndpoint; FAST_SERVICE_MAX_ENDPOINTS],
}

/// The VIP a fast-path client socket dialled, by socket cookie.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FastVip {
    /// The VIP as `connect()` gave it.
    pub addr: IpAddr16,
    /// The service port, host byte order.
    pub port: u16,
    /// Explicit padding; always zero.
    pub _pad: [u8; 2],
}

/// The close record of a fast-path connection to a service VIP: a
/// [`FastClose`] followed by the VIP (a reader that knows only
/// [`FastClose`] reads the prefix).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FastCloseVip {
    /// The connection as for any fast-path close.
    pub close: FastClose,
    /// The VIP and port the client dialled.
    pub vip: FastVip,
    /// Explicit padding; always zero.
    pub _pad: [u8; 4],
}

const _: () = {
    assert!(core::mem::size_of::<FastEndpoint>() == 32);
    assert!(core::mem::size_of::<FastService>() == 16 + 32 * FAST_SERVICE_MAX_ENDPOINTS);
    assert!(core::mem::size_of::<FastVip>() == 20);
    assert!(core::mem::size_of::<FastCloseVip>() == 104);
    assert!(core::mem::size_of::<FastKey>() == 32);
    assert!(core::mem::size_of::<FastVerdict>() == 16);
    assert!(core::mem::size_of::<FastConn>() == 24);
    assert!(core::mem::size_of::<FastClose>() == 80);
};

#[cfg(feature = "user")]
mod pod {
    // SAFETY: `repr(C)`, `Copy`, explicit padding only, any bit pattern
    // valid.
    unsafe impl aya::Pod for super::FastKey {}
    unsafe impl aya::Pod for super::FastVerdict {}
    unsafe impl aya::Pod for super::FastConn {}
    unsafe impl aya::Pod for super::FastClose {}
    unsafe impl aya::Pod for super::FastEndpoint {}
    unsafe impl aya::Pod for super::FastService {}
    unsafe impl aya::Pod for super::FastVip {}
    unsafe impl aya::Pod for super::FastCloseVip {}
}
