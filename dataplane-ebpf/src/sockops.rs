//! `sockops`: when a captured connection sends its SYN, re-keys its original
//! destination from the socket cookie to the connection tuple, which is what
//! the engine can rebuild from the socket it accepts (minimum kernel 4.20;
//! 4.16 for the state callback).
//!
//! `BPF_SOCK_OPS_TCP_CONNECT_CB` fires after the source port is chosen and
//! before the SYN leaves, so the record exists before the listener can accept.
//! The cookie-keyed record stays for `getpeername` for as long as the socket
//! lives: the program asks for the socket's state callback and drops the
//! record when the socket reaches `TCP_CLOSE` (when `getpeername` fails with
//! `ENOTCONN` anyway), so dead sockets do not crowd live ones out of the LRU.

use aya_ebpf::{
    bindings::{
        BPF_SOCK_OPS_STATE_CB, BPF_SOCK_OPS_STATE_CB_FLAG, BPF_SOCK_OPS_TCP_CONNECT_CB,
        bpf_sock_ops,
    },
    helpers::bpf_get_socket_cookie,
    macros::sock_ops,
    programs::SockOpsContext,
};
use dataplane_common::{AF_INET, AF_INET6, Counter, IpAddr16, SockTuple};

use crate::{
    ctx_words::read_ip6,
    maps::{ORIG_DST, ORIG_DST_COOKIE, count},
};

/// `TCP_CLOSE` in the kernel's TCP state numbering.
const TCP_CLOSE: u32 = 7;

#[sock_ops]
pub fn dp_sockops(ctx: SockOpsContext) -> u32 {
    let op = ctx.op();
    if op == BPF_SOCK_OPS_TCP_CONNECT_CB {
        record_orig_dst(&ctx);
    } else if op == BPF_SOCK_OPS_STATE_CB && ctx.arg(1) == TCP_CLOSE {
        forget_socket(&ctx);
    }
    0
}

#[inline(always)]
fn socket_cookie(ctx: &SockOpsContext) -> u64 {
    // SAFETY: helper valid for sock_ops programs since 4.20.
    unsafe { bpf_get_socket_cookie(ctx.ops.cast()) }
}

#[inline(always)]
fn record_orig_dst(ctx: &SockOpsContext) {
    let cookie = socket_cookie(ctx);
    let Some(orig) = ORIG_DST_COOKIE.get_ptr(cookie) else {
        return;
    };
    // SAFETY: a pointer from a successful lookup; the value is copied out at
    // once.
    let orig = unsafe { *orig };
    // sock_ops quirk: remote_port holds the network-order port in its upper
    // 16 bits; local_port is in host order.
    let src_port = ctx.local_port() as u16;
    let dst_port = u16::from_be((ctx.remote_port() >> 16) as u16);
    let family = ctx.family();
    let ops: *mut bpf_sock_ops = ctx.ops;
    let tuple = if family == u32::from(AF_INET) {
        SockTuple {
            src_addr: IpAddr16::from_ipv4_be(ctx.local_ip4()),
            dst_addr: IpAddr16::from_ipv4_be(ctx.remote_ip4()),
            src_port,
            dst_port,
        }
    } else if family == u32::from(AF_INET6) {
        // SAFETY: context field reads at constant offsets, checked by the
        // verifier. An IPv6 socket connected to an IPv4-mapped address
        // reports both ends in the mapped form, the key user space builds.
        let (local, remote) = unsafe {
            (
                read_ip6(&raw const (*ops).local_ip6),
                read_ip6(&raw const (*ops).remote_ip6),
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
    // Ask for state changes of this socket (keeping any flags another
    // program set) so its cookie record goes when the socket closes. Without
    // the callback the record only ages out of the LRU.
    let _ = ctx.set_cb_flags((ctx.cb_flags() | BPF_SOCK_OPS_STATE_CB_FLAG) as i32);
}

#[inline(always)]
fn forget_socket(ctx: &SockOpsContext) {
    let _ = ORIG_DST_COOKIE.remove(socket_cookie(ctx));
}
