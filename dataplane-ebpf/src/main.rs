//! The dataplane's kernel programs, one per hook.
//!
//! | program           | hook                   | minimum kernel |
//! |-------------------|------------------------|----------------|
//! | `dp_connect4`     | `cgroup/connect4`      | 5.7 (netns cookie in sock_addr) |
//! | `dp_connect6`     | `cgroup/connect6`      | 5.7 (netns cookie in sock_addr) |
//! | `dp_sockops`      | `sockops`              | 4.20 (socket cookie in sock_ops) |
//! | `dp_getsockopt`   | `cgroup/getsockopt`    | 5.15 (netns cookie in sockopt) |
//! | `dp_gsopt_tuple`  | `cgroup/getsockopt`, instead of `dp_getsockopt` before 5.15 | 5.3 |
//! | `dp_getpeername4` | `cgroup/getpeername4`  | 5.8 |
//! | `dp_getpeername6` | `cgroup/getpeername6`  | 5.8 |
//! | `dp_sk_lookup`    | `sk_lookup` (per netns) | 5.9 |
//! | `dp_dns_sendmsg4` | `cgroup/sendmsg4`      | 5.7 (netns cookie in sock_addr) |
//! | `dp_dns_sendmsg6` | `cgroup/sendmsg6`      | 5.7 (netns cookie in sock_addr) |
//! | `dp_dns_recvmsg4` | `cgroup/recvmsg4`      | 5.2 |
//! | `dp_dns_recvmsg6` | `cgroup/recvmsg6`      | 5.2 |
//! | `dp_proxy_syn`    | tc ingress of a pod's `lo` (external proxy) | 4.x (tc classifier writing `skb->mark`) |
//!
//! The cgroup programs attach once, at the agent's cgroup; `dp_sk_lookup`
//! attaches to each enrolled pod's network namespace, and `dp_proxy_syn` to
//! the `lo` of each pod served by an external in-pod proxy. Programs used only as
//! a fallback on older kernels live in a second object (`probes.rs`).
//!
//! Every program lets traffic through on any unexpected input: a redirector
//! that fails must never take a pod's networking down with it, and errors are
//! counted in `REDIRECT_STATS` instead. The only refusals are deliberate:
//! self-calls to the engine's capture ports, and fail-closed capture while
//! the engine is down.
#![no_std]
#![no_main]

mod connect4;
mod connect6;
mod ctx_words;
mod dns_capture;
mod dns_recvmsg;
mod dns_sendmsg;
mod fast_path;
mod getpeername;
mod getsockopt;
mod maps;
mod node_probe;
mod outbound;
mod peer_rewrite;
mod proxy_syn;
mod sk_lookup;
mod sockops;

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    // No panic is reachable (the verifier would reject the unbounded loop
    // otherwise emitted at a call site); this only satisfies `no_std`.
    loop {}
}

/// GPL-compatible licence: required for the helpers these programs call.
#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
