//! Builds the kernel crate for `bpfel-unknown-none` with aya-build and leaves
//! the object in `OUT_DIR`, where `src/redirect/object.rs` embeds it.
//!
//! Why a build script rather than an xtask step: a plain `cargo build` (and
//! `cargo test`, `cargo clippy`) then always embeds kernel programs that match
//! the user-space code beside them; nobody can ship an agent with a stale
//! object. The cost is that every build needs the nightly toolchain's
//! `rust-src` and `bpf-linker`, which `cargo xtask setup` installs.

use std::process::Command;

#[path = "build/source_commit.rs"]
mod source_commit;

use anyhow::{Context as _, anyhow, bail};
use aya_build::Toolchain;

const EBPF_PACKAGE: &str = "dataplane-ebpf";

fn main() -> anyhow::Result<()> {
    emit_dependency_versions();
    source_commit::emit();
    check_toolchain()?;
    let metadata = cargo_metadata::MetadataCommand::new()
        .no_deps()
        .exec()
        .context("cargo metadata failed while looking for the kernel crate")?;
    let package = metadata
        .packages
        .into_iter()
        .find(|p| p.name.as_str() == EBPF_PACKAGE)
        .ok_or_else(|| anyhow!("workspace has no `{EBPF_PACKAGE}` package"))?;
    let root_dir = package
        .manifest_path
        .parent()
        .ok_or_else(|| anyhow!("{} has no parent directory", package.manifest_path))?;
    // aya-build relays every line the nested cargo prints as a build-script
    // warning; keep only real diagnostics.
    // SAFETY: the build script is single-threaded at this point.
    unsafe { std::env::set_var("CARGO_TERM_QUIET", "true") };
    aya_build::build_ebpf(
        [aya_build::Package {
            name: EBPF_PACKAGE,
            root_dir: root_dir.as_str(),
            ..Default::default()
        }],
        Toolchain::Nightly,
    )
    .context("building the kernel programs failed; `cargo xtask setup` installs what they need")
}

/// Fails with a fix instead of aya-build's raw cargo error when the tools the
/// kernel crate needs are missing.
fn check_toolchain() -> anyhow::Result<()> {
    if which::which("bpf-linker").is_err() {
        bail!("bpf-linker is not on PATH: run `cargo xtask setup` to build it");
    }
    let sysroot = Command::new("rustup")
        .args(["run", "nightly", "rustc", "--print", "sysroot"])
        .output()
        .context("running `rustup run nightly rustc` failed: is rustup installed?")?;
    if !sysroot.status.success() {
        bail!("the nightly toolchain is missing: run `cargo xtask setup`");
    }
    let sysroot = String::from_utf8_lossy(&sysroot.stdout).trim().to_owned();
    let core_src = format!("{sysroot}/lib/rustlib/src/rust/library/core");
    if !std::path::Path::new(&core_src).exists() {
        bail!("nightly rust-src is missing ({core_src}): run `cargo xtask setup`");
    }
    Ok(())
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
