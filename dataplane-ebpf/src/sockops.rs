//! `sockops`: when a captured connection sends its SYN, re-keys its original
//! destination from the socket cookie to the client's namespace and the
//! connection tuple, which is what the engine can rebuild from the socket it
//! accepts (minimum kernel 4.20; 4.16 for the state callback). The namespace
//! comes from the cookie record: `bpf_get_netns_cookie` reaches sock_ops
//! programs only in 5.15.
//!
//! `BPF_SOCK_OPS_TCP_CONNECT_CB` fires after the source port is chosen and
//! before the SYN leaves, so the record exists before the listener can accept.
//! The cookie-keyed record stays for `getpeername` for as long as the socket
//! lives: the program asks for the socket's state callback and drops the
//! record when the socket reaches `TCP_CLOSE` (when `getpeername` fails with
//! `ENOTCONN` anyway), so dead sockets do not crowd live ones out of the LRU.
//!
//! It also carries the same-node fast path's socket events (see
//! `fast_path`): the tuple record at connect, the telemetry record at
//! close; and the tuples of the node's own connections to pods (see
//! `node_probe`).

use aya_ebpf::{
    bindings::{
        BPF_SOCK_OPS_STATE_CB, BPF_SOCK_OPS_STATE_CB_FLAG, BPF_SOCK_OPS_TCP_CONNECT_CB,
        bpf_sock_ops,
    },
    helpers::bpf_get_socket_cookie,
    macros::sock_ops,
    programs::SockOpsContext,
};
use dataplane_common::{AF_INET, AF_INET6, Counter, IpAddr16, OrigDstKey, SockTuple};

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
        let cookie = socket_cookie(&ctx);
        let Some(tuple) = tuple_of(&ctx) else {
            return 0;
        };
        if crate::node_probe::on_connect(cookie, tuple) {
            // A node socket's connection to a pod: its notes go at close.
            watch_state(&ctx);
        } else if crate::fast_path::on_connect(cookie, tuple) {
            watch_state(&ctx);
        } else {
            record_orig_dst(&ctx, cookie, tuple);
        }
    } else if op == BPF_SOCK_OPS_STATE_CB && ctx.arg(1) == TCP_CLOSE {
        let cookie = socket_cookie(&ctx);
        let tuple = tuple_of(&ctx);
        crate::fast_path::on_close(&ctx, cookie, tuple);
        crate::node_probe::on_close(cookie, tuple);
        let _ = ORIG_DST_COOKIE.remove(cookie);
    }
    0
}

#[inline(always)]
fn socket_cookie(ctx: &SockOpsContext) -> u64 {
    // SAFETY: helper valid for sock_ops programs since 4.20.
    unsafe { bpf_get_socket_cookie(ctx.ops.cast()) }
}

/// The connection tuple as this (client) socket sees it.
#[inline(always)]
fn tuple_of(ctx: &SockOpsContext) -> Option<SockTuple> {
    // sock_ops quirk: remote_port holds the network-order port in its upper
    // 16 bits; local_port is in host order.
    let src_port = ctx.local_port() as u16;
    let dst_port = u16::from_be((ctx.remote_port() >> 16) as u16);
    let family = ctx.family();
    let ops: *mut bpf_sock_ops = ctx.ops;
    if family == u32::from(AF_INET) {
        Some(SockTuple {
            src_addr: IpAddr16::from_ipv4_be(ctx.local_ip4()),
            dst_addr: IpAddr16::from_ipv4_be(ctx.remote_ip4()),
            src_port,
            dst_port,
        })
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
        Some(SockTuple {
            src_addr: IpAddr16::from_ipv6_words(local),
            dst_addr: IpAddr16::from_ipv6_words(remote),
            src_port,
            dst_port,
        })
    } else {
        None
    }
}

#[inline(always)]
fn record_orig_dst(ctx: &SockOpsContext, cookie: u64, tuple: SockTuple) {
    let Some(captured) = ORIG_DST_COOKIE.get_ptr(cookie) else {
        return;
    };
    // SAFETY: a pointer from a successful lookup; the value is copied out at
    // once.
    let captured = unsafe { *captured };
    let key = OrigDstKey {
        netns_cookie: captured.netns_cookie,
        tuple,
        _pad: [0; 4],
    };
    if ORIG_DST.insert(key, captured.orig, 0).is_ok() {
        count(Counter::OrigDstRecorded);
    } else {
        count(Counter::MapUpdateFailed);
    }
    watch_state(ctx);
}

/// Asks for state changes of this socket (keeping any flags another
/// program set), so its records go when it closes. Without the callback a
/// cookie record only ages out of the LRU, and a fast-path connection's
/// close goes unrecorded.
#[inline(always)]
fn watch_state(ctx: &SockOpsContext) {
    let _ = ctx.set_cb_flags((ctx.cb_flags() | BPF_SOCK_OPS_STATE_CB_FLAG) as i32);
}
