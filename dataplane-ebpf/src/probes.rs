//! The probe object: kernel programs the agent loads only on kernels that
//! lack a feature, kept apart from the redirection object so that loading
//! one creates none of the other's maps.
//!
//! | program           | hook              | minimum kernel | used on |
//! |-------------------|-------------------|----------------|---------|
//! | `dp_netns_cookie` | `cgroup/connect4` | 5.7            | < 5.14 (no `SO_NETNS_COOKIE`) |
#![no_std]
#![no_main]

mod netns_cookie;

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    // No panic is reachable; this only satisfies `no_std` (see main.rs).
    loop {}
}

/// GPL-compatible licence: required for the helpers these programs call.
#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
