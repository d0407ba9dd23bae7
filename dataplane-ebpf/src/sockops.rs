//! `sockops`: when a captured connection sends its SYN, re-keys its original
//! destination from the socket cookie to the connection tuple, which is what
//! the engine can rebuild from the socket it accepts (minimum kernel 4.20).
//!
//! `BPF_SOCK_OPS_TCP_CONNECT_CB` fires after the source port is chosen and
//! before the SYN leaves, so the record exists before the listener can accept.

use aya_ebpf::{
    bindings::BPF_SOCK_OPS_TCP_CONNECT_CB, helpers::bpf_get_socket_cookie, macros::sock_ops,
    programs::SockOpsContext,
};
use dataplane_common::{AF_INET, AF_INET6, Counter, IpAddr16, SockTuple};

use crate::maps::{ORIG_DST, ORIG_DST_COOKIE, count};

#[sock_ops]
pub fn dp_sockops(ctx: SockOpsContext) -> u32 {
    if ctx.op() == BPF_SOCK_OPS_TCP_CONNECT_CB {
        record_orig_dst(&ctx);
    }
    0
}

#[inline(always)]
fn record_orig_dst(ctx: &SockOpsContext) {
    // SAFETY: helper valid for sock_ops programs since 4.20.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.ops.cast()) };
    // SAFETY: the value is copied out at once; nothing else writes this key
    // while its socket is still connecting.
    let Some(orig) = (unsafe { ORIG_DST_COOKIE.get(cookie) }).copied() else {
        return;
    };
    let _ = ORIG_DST_COOKIE.remove(cookie);
    // sock_ops quirk: remote_port holds the network-order port in its upper
    // 16 bits; local_port is in host order.
    let src_port = ctx.local_port() as u16;
    let dst_port = u16::from_be((ctx.remote_port() >> 16) as u16);
    let family = ctx.family();
    let tuple = if family == u32::from(AF_INET) {
        SockTuple {
            src_addr: IpAddr16::from_ipv4_be(ctx.local_ip4()),
            dst_addr: IpAddr16::from_ipv4_be(ctx.remote_ip4()),
            src_port,
            dst_port,
        }
    } else if family == u32::from(AF_INET6) {
        // SAFETY: context field reads, checked by the verifier.
        let (local, remote) = unsafe {
            (
                ip6_words(&raw const (*ctx.ops).local_ip6),
                ip6_words(&raw const (*ctx.ops).remote_ip6),
            )
        };
        SockTuple {
            src_addr: IpAddr16::from_ipv6_words(local),
            dst_addr: IpAddr16::from_ipv6_words(remote),
            src_port,
            dst_port,
        }
    } else {
        return;
    };
    if ORIG_DST.insert(tuple, orig, 0).is_ok() {
        count(Counter::OrigDstRecorded);
    } else {
        count(Counter::MapUpdateFailed);
    }
}

/// Reads a context `__u32[4]` word by word. The verifier only accepts context
/// loads at a constant offset from the context pointer itself, and copying
/// the array whole makes the compiler derive a pointer first.
///
/// # Safety
/// `field` must point into the program's context.
#[inline(always)]
unsafe fn ip6_words(field: *const [u32; 4]) -> [u32; 4] {
    let base = field.cast::<u32>();
    // SAFETY: four in-bounds reads of the context array (caller's contract).
    unsafe {
        [
            core::ptr::read_volatile(base),
            core::ptr::read_volatile(base.add(1)),
            core::ptr::read_volatile(base.add(2)),
            core::ptr::read_volatile(base.add(3)),
        ]
    }
}
