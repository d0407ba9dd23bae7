//! Seeds for the fuzz targets `spiffe_id` and `certificate`
//! (`dataplane-user/fuzz`), written by this crate's unit tests that parse
//! them (`identity/spiffe.rs`, `identity/tests.rs`). `cargo xtask fuzz` runs
//! the tests with `DATAPLANE_FUZZ_SEEDS` set; a plain test run writes
//! nothing. The writer is `dataplane_core::fuzz_seed`, shared with
//! `dataplane-user`'s seeds so both name and place them the same way.

pub(crate) use dataplane_core::fuzz_seed::seed;
