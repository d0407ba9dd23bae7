//! Seeds for the fuzz targets (`dataplane-user/fuzz`), written by the unit
//! tests that exercise each parser: the inputs the tests already hold to
//! be valid (or interestingly invalid) are where the fuzzer starts.
//! `cargo xtask fuzz` runs the tests with `DATAPLANE_FUZZ_SEEDS` set; a
//! plain test run writes nothing.

use std::path::PathBuf;

/// Where seeds go, when a seed run asked for them.
fn seed_dir(target: &str) -> Option<PathBuf> {
    let root = std::env::var_os("DATAPLANE_FUZZ_SEEDS")?;
    Some(PathBuf::from(root).join(target))
}

/// Records `input` as a seed of fuzz target `target` under `name`.
/// Panics (failing the test) if the seed directory cannot be written: a
/// seed run that silently wrote nothing would fuzz from nothing.
pub(crate) fn seed(target: &str, name: &str, input: impl AsRef<[u8]>) {
    let Some(dir) = seed_dir(target) else {
        return;
    };
    let written =
        std::fs::create_dir_all(&dir).and_then(|()| std::fs::write(dir.join(name), input.as_ref()));
    if let Err(err) = written {
        panic!(
            "cannot write fuzz seed {target}/{name} under {}: {err}",
            dir.display()
        );
    }
}

/// The `hbone_head` target's input format: the request's method,
/// authority, `forwarded`, `baggage` and `traceparent`, one per line.
pub(crate) fn hbone_head_input(fields: [&str; 5]) -> String {
    fields.join("\n")
}
