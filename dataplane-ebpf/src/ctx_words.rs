//! Word-by-word access to the `__u32[4]` IPv6 address fields of kernel
//! contexts (`user_ip6`, `local_ip6`, `src_ip6`, ...).
//!
//! The verifier only accepts context loads and stores at a constant offset
//! from the context (or socket) pointer itself with a size it knows for the
//! field; copying the array whole lets the compiler derive an intermediate
//! pointer or merge accesses, which it rejects. Volatile accesses keep each
//! word a separate 32-bit load or store.

/// Reads a context `__u32[4]` word by word.
///
/// # Safety
/// `field` must point into the program's context (or a socket the verifier
/// knows), at a field readable with 32-bit loads.
#[inline(always)]
pub unsafe fn read_ip6(field: *const [u32; 4]) -> [u32; 4] {
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

/// Writes a context `__u32[4]` word by word.
///
/// # Safety
/// `field` must point into the program's context at a field the program
/// type may write with 32-bit stores (e.g. `user_ip6` of `connect6`).
#[inline(always)]
pub unsafe fn write_ip6(field: *mut [u32; 4], words: [u32; 4]) {
    let base = field.cast::<u32>();
    // SAFETY: four in-bounds writes of the context array (caller's contract).
    unsafe {
        core::ptr::write_volatile(base, words[0]);
        core::ptr::write_volatile(base.add(1), words[1]);
        core::ptr::write_volatile(base.add(2), words[2]);
        core::ptr::write_volatile(base.add(3), words[3]);
    }
}
