//! Seeds for the fuzz target `hbone_head` (`dataplane-user/fuzz`), written
//! by this crate's unit tests that parse HBONE request heads
//! (`hbone/head_tests.rs`). `cargo xtask fuzz` runs the tests with
//! `DATAPLANE_FUZZ_SEEDS` set; a plain test run writes nothing. The writer
//! is `dataplane_core::fuzz_seed`, shared with the other crates' seeds.

pub(crate) use dataplane_core::fuzz_seed::seed;

/// The `hbone_head` target's input format: the request's method,
/// authority, `forwarded`, `baggage` and `traceparent`, one per line.
pub(crate) fn hbone_head_input(fields: [&str; 5]) -> String {
    fields.join("\n")
}
