//! What the mesh costs in memory, stage by stage, at the sizes of issue
//! 31's synthetic meshes (N workloads with one IP, N/10 services, N/100
//! namespace policies), counted by a global allocator that tracks the
//! bytes in use (what was asked for: the allocator's own overhead and
//! free pages are not counted, so RSS is higher; the `glibc chunks`
//! column is what glibc's allocator takes for the same blocks, its
//! 8-byte header and 16-byte rounding included, 32 bytes at least: the
//! agent's heap as `malloc_stats` reports it in use):
//!
//! - `resources`: istiod's resources as the xDS client holds them, each
//!   translated into the mesh model when it arrived (for the model, a
//!   resume's `initial_resource_versions` and diffing pushes);
//! - `model`: the mesh model's own tables (`XdsModel`: address claims,
//!   the entries by name, sharing the translations);
//! - `state`: the mesh state built from the entries (lookups by address,
//!   VIP, hostname, policy scope), sharing the entries' `Arc`s.
//!
//! Per workload includes the workload's share of services and policies;
//! per service and per policy are the growth when the mesh gets twice the
//! services (or policies) at the same N.
//!
//! `cargo bench -p dataplane-user --bench mesh_memory` (N = 10k and 50k; a
//! size list as the first free argument, e.g. `-- 1000,100000`). Without
//! `--bench` (cargo's test mode) it runs once at N = 1000.

use std::{
    alloc::{GlobalAlloc, Layout, System},
    sync::atomic::{AtomicUsize, Ordering},
};

use dataplane_user::{config::LocalConfig, sources::merged_state, xds::XdsModel};

#[path = "support/synthetic.rs"]
mod synthetic;

/// The system allocator, counting the bytes in use.
struct Counting;

static IN_USE: AtomicUsize = AtomicUsize::new(0);
/// The same blocks as glibc's allocator sizes them ([`chunk`]).
static CHUNKS: AtomicUsize = AtomicUsize::new(0);
/// Blocks in use.
static BLOCKS: AtomicUsize = AtomicUsize::new(0);

/// The size of glibc's chunk for a request of `size` bytes on 64-bit
/// targets (malloc.c `request2size`: the size word, rounded up to 16,
/// `MINSIZE` 32). Blocks past the mmap threshold are page-rounded
/// instead; the few there are do not change the figures.
fn chunk(size: usize) -> usize {
    ((size + 8 + 15) & !15).max(32)
}

fn count_alloc(size: usize) {
    IN_USE.fetch_add(size, Ordering::Relaxed);
    CHUNKS.fetch_add(chunk(size), Ordering::Relaxed);
    BLOCKS.fetch_add(1, Ordering::Relaxed);
}

fn count_dealloc(size: usize) {
    IN_USE.fetch_sub(size, Ordering::Relaxed);
    CHUNKS.fetch_sub(chunk(size), Ordering::Relaxed);
    BLOCKS.fetch_sub(1, Ordering::Relaxed);
}

// SAFETY: every call is forwarded to `System` with the caller's layout;
// the counter only observes sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract is `System::alloc`'s.
        let ptr = unsafe { System.alloc(layout) };
        if !ptr.is_null() {
            count_alloc(layout.size());
        }
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) };
        count_dealloc(layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: as above.
        let new = unsafe { System.realloc(ptr, layout, new_size) };
        if !new.is_null() {
            count_dealloc(layout.size());
            count_alloc(new_size);
        }
        new
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

fn in_use() -> usize {
    IN_USE.load(Ordering::Relaxed)
}

/// Glibc's chunk bytes and the blocks in use.
fn chunks_and_blocks() -> (usize, usize) {
    (
        CHUNKS.load(Ordering::Relaxed),
        BLOCKS.load(Ordering::Relaxed),
    )
}

/// Bytes in use by each stage for a mesh of `n` workloads, `services`
/// services and `policies` policies.
#[derive(Debug, Clone, Copy)]
struct Stages {
    resources: usize,
    model: usize,
    state: usize,
    /// The three stages' blocks as glibc's chunks.
    chunks: usize,
    /// The three stages' blocks.
    blocks: usize,
}

impl Stages {
    fn total(&self) -> usize {
        self.resources + self.model + self.state
    }
}

fn measure(n: usize, services: usize, policies: usize) -> Result<Stages, String> {
    let file = LocalConfig::default();
    let start = in_use();
    let (chunks_start, blocks_start) = chunks_and_blocks();
    let resources = synthetic::held(n, services, policies);
    let after_resources = in_use();
    let mut model = XdsModel::default();
    let entries = model.update(&resources).clone();
    let after_model = in_use();
    let state = merged_state(&file, Some(("xds://bench", &entries)))
        .map_err(|err| format!("the mesh state of {n} workloads: {err}"))?;
    let after_state = in_use();
    let (chunks_end, blocks_end) = chunks_and_blocks();
    let stages = Stages {
        resources: after_resources.saturating_sub(start),
        model: after_model.saturating_sub(after_resources),
        state: after_state.saturating_sub(after_model),
        chunks: chunks_end.saturating_sub(chunks_start),
        blocks: blocks_end.saturating_sub(blocks_start),
    };
    drop((state, entries, model, resources));
    Ok(stages)
}

fn main() -> Result<(), String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let timed = args.iter().any(|a| a == "--bench");
    let sizes: Vec<usize> = match args.iter().find(|a| !a.starts_with('-')) {
        Some(list) => list
            .split(',')
            .map(|s| s.trim().parse().map_err(|e| format!("size {s:?}: {e}")))
            .collect::<Result<_, _>>()?,
        None if timed => vec![10_000, 50_000],
        None => vec![1_000],
    };
    println!(
        "| workloads (services, policies) | resources | model | state | total | per workload | per service | per policy | glibc chunks | blocks |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for n in sizes {
        let (services, policies) = ((n / 10).max(1), (n / 100).max(1));
        let base = measure(n, services, policies)?;
        let more_services = measure(n, services * 2, policies)?;
        let more_policies = measure(n, services, policies * 2)?;
        let per =
            |grown: Stages, added: usize| grown.total().saturating_sub(base.total()) / added.max(1);
        let mb = |bytes: usize| format!("{:.1} MB", bytes as f64 / 1e6);
        println!(
            "| {n} ({services}, {policies}) | {} | {} | {} | {} | {} B | {} B | {} B | {} | {} |",
            mb(base.resources),
            mb(base.model),
            mb(base.state),
            mb(base.total()),
            base.total() / n.max(1),
            per(more_services, services),
            per(more_policies, policies),
            mb(base.chunks),
            base.blocks,
        );
    }
    Ok(())
}
