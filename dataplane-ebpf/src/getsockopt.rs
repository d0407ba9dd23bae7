//! `cgroup/getsockopt`: answers `getsockopt(SOL_IP, SO_ORIGINAL_DST)` and
//! `getsockopt(SOL_IPV6, IP6T_SO_ORIGINAL_DST)` on a socket a proxy
//! accepted from a pod's outbound listener, from the `ORIG_DST` record, so
//! unmodified proxies written for iptables `REDIRECT` work.
//!
//! Records are keyed by the client's namespace as well as the tuple, and
//! the accepted socket lives in that namespace (the outbound listener is
//! the pod's). Two programs, of which the agent attaches one:
//!
//! - `dp_getsockopt` asks for the socket's namespace (5.15:
//!   `bpf_get_netns_cookie` in sockopt programs);
//! - `dp_gsopt_tuple`, for older kernels (5.3), looks under namespace 0,
//!   where the pods of external proxies then have their records
//!   (`ENROLLED_ORIG_DST_BY_TUPLE`): there, two such pods that dial from
//!   the same source port at the same moment can still take each other's
//!   record.
//!
//! The kernel runs its own `getsockopt` first (which fails: no conntrack
//! entry exists for a socket-level redirect) and then this program with the
//! user's buffer. Every other option, and a socket without a record, passes
//! through untouched.

use aya_ebpf::{
    bindings::bpf_sock, helpers::bpf_get_netns_cookie, macros::cgroup_sockopt,
    programs::SockoptContext,
};
use dataplane_common::{
    AF_INET, AF_INET6, Counter, IpAddr16, OrigDst, OrigDstKey, SO_ORIGINAL_DST, SOL_IP, SOL_IPV6,
    SockTuple,
};

use crate::{
    ctx_words::read_ip6,
    maps::{ORIG_DST, count},
};

/// Return value that lets the call complete (with whatever the program left
/// in the context).
const PASS: i32 = 1;

#[cgroup_sockopt(getsockopt)]
pub fn dp_getsockopt(ctx: SockoptContext) -> i32 {
    // SAFETY: helper valid for cgroup sockopt programs since 5.15; it
    // returns the namespace of the context's socket.
    let netns_cookie = unsafe { bpf_get_netns_cookie(ctx.sockopt.cast()) };
    answer(&ctx, netns_cookie);
    PASS
}

#[cgroup_sockopt(getsockopt)]
pub fn dp_gsopt_tuple(ctx: SockoptContext) -> i32 {
    answer(&ctx, 0);
    PASS
}

/// Answers `SO_ORIGINAL_DST` from the record under `netns_cookie`.
#[inline(always)]
fn answer(ctx: &SockoptContext, netns_cookie: u64) {
    let so = ctx.sockopt;
    // SAFETY: context field reads, checked by the verifier.
    let (level, optname) = unsafe { ((*so).level, (*so).optname) };
    if optname != SO_ORIGINAL_DST || (level != SOL_IP && level != SOL_IPV6) {
        return;
    }
    // SAFETY: `sk` of a sockopt context is a full socket.
    let sk = unsafe { (*so).__bindgen_anon_1.sk };
    if sk.is_null() {
        return;
    }
    let Some(tuple) = accepted_tuple(sk) else {
        return;
    };
    let key = OrigDstKey {
        netns_cookie,
        tuple,
        _pad: [0; 4],
    };
    let Some(orig) = ORIG_DST.get_ptr(key) else {
        return;
    };
    // SAFETY: a pointer from a successful lookup; the value is copied.
    let orig: OrigDst = unsafe { *orig };
    let answered = if level == SOL_IP {
        // An IPv6 destination has no `sockaddr_in` form.
        orig.addr.is_ipv4_mapped() && write_answer(ctx, sockaddr_in(&orig))
    } else {
        write_answer(ctx, sockaddr_in6(&orig))
    };
    if answered {
        count(Counter::OrigDstAnswered);
    }
}

/// Copies a socket address (`N` words) into the user's buffer and makes it
/// the call's result. `false` (nothing written) when the buffer is too small.
#[inline(always)]
fn write_answer<const N: usize>(ctx: &SockoptContext, words: [u32; N]) -> bool {
    let so = ctx.sockopt;
    let size = N * 4;
    // SAFETY: context field reads, checked by the verifier.
    let (optval, optval_end, optlen) = unsafe {
        (
            (*so).__bindgen_anon_2.optval.cast::<u8>(),
            (*so).__bindgen_anon_3.optval_end.cast::<u8>(),
            (*so).optlen,
        )
    };
    // The user's buffer must hold the whole address (`optlen` is what the
    // caller passed, the kernel's own attempt having failed), and the
    // verifier needs the bound checked against `optval_end`.
    if optlen < size as i32 || optval.wrapping_add(size) > optval_end {
        return false;
    }
    let out = optval.cast::<u32>();
    for (i, word) in words.iter().enumerate() {
        // SAFETY: `size` bytes from `optval` are inside the buffer (checked
        // above) and `i < N`.
        unsafe { core::ptr::write_volatile(out.add(i), *word) };
    }
    // SAFETY: optlen and retval are writable in getsockopt programs; a
    // program may only set retval to 0.
    unsafe {
        (*so).optlen = size as i32;
        (*so).retval = 0;
    }
    true
}

/// The tuple the client side recorded, rebuilt from the accepted socket:
/// the client is the accepted socket's peer, and it connected to the
/// accepted socket's local address.
#[inline(always)]
fn accepted_tuple(sk: *mut bpf_sock) -> Option<SockTuple> {
    // SAFETY: reads of a socket pointer the verifier knows, at constant
    // offsets. `src_port` is in host order, `dst_port` in network order.
    let (family, local_port, peer_port_be) =
        unsafe { ((*sk).family, (*sk).src_port, (*sk).dst_port) };
    let (local, peer) = if family == u32::from(AF_INET) {
        // SAFETY: as above; the v4 fields are in network order.
        let (src, dst) = unsafe { ((*sk).src_ip4, (*sk).dst_ip4) };
        (IpAddr16::from_ipv4_be(src), IpAddr16::from_ipv4_be(dst))
    } else if family == u32::from(AF_INET6) {
        // SAFETY: as above, word by word.
        let (src, dst) = unsafe {
            (
                read_ip6(&raw const (*sk).src_ip6),
                read_ip6(&raw const (*sk).dst_ip6),
            )
        };
        (
            IpAddr16::from_ipv6_words(src),
            IpAddr16::from_ipv6_words(dst),
        )
    } else {
        return None;
    };
    Some(SockTuple {
        src_addr: peer,
        dst_addr: local,
        src_port: u16::from_be(peer_port_be),
        dst_port: local_port as u16,
    })
}

/// First two bytes of both socket address forms: the family in host order,
/// then the port in network order.
#[inline(always)]
fn family_and_port(family: u16, port: u16) -> u32 {
    let f = family.to_ne_bytes();
    let p = port.to_be_bytes();
    u32::from_ne_bytes([f[0], f[1], p[0], p[1]])
}

/// `struct sockaddr_in` of an IPv4(-mapped) destination, as four words.
#[inline(always)]
fn sockaddr_in(orig: &OrigDst) -> [u32; 4] {
    [
        family_and_port(AF_INET, orig.port),
        orig.addr.words[3],
        0,
        0,
    ]
}

/// `struct sockaddr_in6` (flow info and scope zero), as seven words.
#[inline(always)]
fn sockaddr_in6(orig: &OrigDst) -> [u32; 7] {
    let w = orig.addr.words;
    [
        family_and_port(AF_INET6, orig.port),
        0,
        w[0],
        w[1],
        w[2],
        w[3],
        0,
    ]
}
