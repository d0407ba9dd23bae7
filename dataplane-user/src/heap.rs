//! Handing the heap a large state change freed back to the kernel.
//!
//! istiod's first push to a node of a large mesh arrives as one message
//! (about 250 bytes per workload encoded) that is decoded, checked and
//! translated before the state is built; once it is in force those
//! buffers are free, but glibc's allocator keeps freed memory mapped for
//! reuse, so the agent's resident memory stayed at the push's peak (at 100k
//! workloads about 40 % above what the state holds). After a change of at
//! least [`TRIM_AFTER`] entries the agent asks the allocator to return
//! free pages ([`trim`]); a trim walks the heap once (milliseconds at
//! hundreds of megabytes), so smaller changes, istiod's steady churn, do
//! not pay for it.

/// Entries a change must count for a trim to follow it.
pub(crate) const TRIM_AFTER: usize = 1_000;

/// Returns the allocator's free memory to the kernel; says whether any
/// was. A no-op where the C library is not glibc.
pub(crate) fn trim() -> bool {
    #[cfg(target_env = "gnu")]
    {
        // SAFETY: `malloc_trim` only releases free memory the allocator
        // holds; it takes no pointer and is safe to call from any thread.
        unsafe { libc::malloc_trim(0) == 1 }
    }
    #[cfg(not(target_env = "gnu"))]
    {
        false
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_trim_returns_the_free_memory_between_live_blocks() {
        // Blocks below mmap's threshold, so on the heap proper; one in ten
        // kept, so the freed runs between them cannot merge into the
        // heap's top, which `free` itself would give back.
        let mut blocks: Vec<Vec<u8>> = (0..2_000).map(|i| vec![i as u8; 16 * 1024]).collect();
        let mut i = 0;
        blocks.retain(|_| {
            i += 1;
            i % 10 == 0
        });
        assert!(super::trim(), "glibc held no free memory to return");
        assert_eq!(blocks.len(), 200);
    }
}
