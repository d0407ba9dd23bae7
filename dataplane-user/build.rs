//! What `dataplane version` reports about the build: the locked versions of
//! a few dependencies and the source commit. (The kernel programs are built
//! and embedded by `crates/kernel/build.rs`.)

#[path = "build/source_commit.rs"]
mod source_commit;

fn main() {
    emit_dependency_versions();
    source_commit::emit();
}

/// Exposes the locked versions of the crates `dataplane version` reports as
/// `DP_DEPENDENCY_VERSIONS` ("name version" pairs, comma separated).
fn emit_dependency_versions() {
    const REPORTED: [&str; 6] = ["aya", "aya-obj", "aya-ebpf", "tokio", "clap", "tracing"];
    let lock_path = concat!(env!("CARGO_MANIFEST_DIR"), "/../Cargo.lock");
    println!("cargo:rerun-if-changed={lock_path}");
    let lock = std::fs::read_to_string(lock_path).unwrap_or_default();
    let mut found = Vec::new();
    let mut name: Option<&str> = None;
    for line in lock.lines() {
        if let Some(n) = line.strip_prefix("name = ") {
            name = Some(n.trim_matches('"'));
        } else if let (Some(n), Some(v)) = (name, line.strip_prefix("version = ")) {
            if REPORTED.contains(&n) {
                found.push(format!("{n} {}", v.trim_matches('"')));
            }
            name = None;
        }
    }
    println!(
        "cargo:rustc-env=DP_DEPENDENCY_VERSIONS={}",
        found.join(", ")
    );
}
