//! Seeds for the fuzz targets `config` and `xds_response`
//! (`dataplane-user/fuzz`), written by this crate's unit tests that parse
//! them. `cargo xtask fuzz` runs the tests with `DATAPLANE_FUZZ_SEEDS` set; a
//! plain test run writes nothing. The same format as `dataplane-user`'s
//! seeds (one file per input, named by its hash), kept here because a test
//! helper of a higher crate is out of this crate's reach.

use std::path::PathBuf;

/// Where seeds go, when a seed run asked for them.
fn seed_dir(target: &str) -> Option<PathBuf> {
    let root = std::env::var_os("DATAPLANE_FUZZ_SEEDS")?;
    Some(PathBuf::from(root).join(target))
}

/// Records `input` as a seed of fuzz target `target`, named by its hash
/// (as libFuzzer names corpus files, so a seed written twice is one file).
/// Panics (failing the test) if the seed directory cannot be written: a
/// seed run that silently wrote nothing would fuzz from nothing.
pub(crate) fn seed(target: &str, input: impl AsRef<[u8]>) {
    use std::hash::{DefaultHasher, Hash, Hasher};
    let Some(dir) = seed_dir(target) else {
        return;
    };
    let input = input.as_ref();
    // `DefaultHasher::new()` has fixed keys: the same input, the same name.
    let mut hasher = DefaultHasher::new();
    input.hash(&mut hasher);
    let name = format!("seed-{:016x}", hasher.finish());
    let written =
        std::fs::create_dir_all(&dir).and_then(|()| std::fs::write(dir.join(&name), input));
    if let Err(err) = written {
        panic!(
            "cannot write fuzz seed {target}/{name} under {}: {err}",
            dir.display()
        );
    }
}
