//! Seeds for the fuzz targets `config` and `xds_response`
//! (`dataplane-user/fuzz`), written by this crate's unit tests that parse
//! them (`config`, `policy/tests.rs`, `xds/translate_tests.rs`). `cargo
//! xtask fuzz` runs the tests with `DATAPLANE_FUZZ_SEEDS` set; a plain test
//! run writes nothing. The writer is `dataplane_core::fuzz_seed`, shared
//! with the other crates' seeds so all name and place them the same way.

pub(crate) use dataplane_core::fuzz_seed::seed;
