//! The writer of seeds for the fuzz targets (`dataplane-user/fuzz`), shared
//! by every crate whose unit tests hold parser inputs worth starting from.
//!
//! Each crate keeps its own list of what it seeds (its tests call [`seed`]
//! with the inputs they already check); the file format lives here once so
//! that every crate names and places seeds the same way. `cargo xtask fuzz`
//! runs those tests with `DATAPLANE_FUZZ_SEEDS` set; a plain test run
//! writes nothing.
//!
//! Only built with the `test-util` feature, which crates enable from their
//! dev-dependencies: the agent itself never writes seeds.

use std::path::PathBuf;

/// The environment variable naming the directory seeds go under, one
/// subdirectory per fuzz target.
pub const SEEDS_ENV: &str = "DATAPLANE_FUZZ_SEEDS";

/// Where seeds go, when a seed run asked for them.
fn seed_dir(target: &str) -> Option<PathBuf> {
    let root = std::env::var_os(SEEDS_ENV)?;
    Some(PathBuf::from(root).join(target))
}

/// Records `input` as a seed of fuzz target `target`, named by its hash
/// (as libFuzzer names corpus files, so a seed written twice is one file).
///
/// # Panics
///
/// If the seed directory cannot be written, failing the test: a seed run
/// that silently wrote nothing would fuzz from nothing.
pub fn seed(target: &str, input: impl AsRef<[u8]>) {
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
