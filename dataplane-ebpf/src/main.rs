//! The dataplane's kernel programs, one per hook.
//!
//! | program       | hook                | minimum kernel |
//! |---------------|---------------------|----------------|
//! | `dp_connect4` | `cgroup/connect4`   | 5.7 (netns cookie in sock_addr) |
//! | `dp_sockops`  | `sockops`           | 4.20 (socket cookie in sock_ops) |
//!
//! Every program returns "allow" on any unexpected input: a redirector that
//! fails must never take a pod's networking down with it, and errors are
//! counted in `REDIRECT_STATS` instead.
#![no_std]
#![no_main]

mod connect;
mod maps;
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
