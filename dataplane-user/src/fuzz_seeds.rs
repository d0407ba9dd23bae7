//! Seeds for the fuzz targets (`dataplane-user/fuzz`), written by the unit
//! tests that exercise each parser: the inputs the tests already hold to
//! be valid (or interestingly invalid) are where the fuzzer starts.
//! `cargo xtask fuzz` runs the tests with `DATAPLANE_FUZZ_SEEDS` set; a
//! plain test run writes nothing. The seeds of `spiffe_id` and
//! `certificate` come from `dataplane-identity`'s tests, those of `config`
//! and `xds_response` from `dataplane-model`'s, those of `hbone_head` from
//! `dataplane-engine`'s, with the parsers; every crate writes through
//! `dataplane_core::fuzz_seed`.

pub(crate) use dataplane_core::fuzz_seed::seed;
