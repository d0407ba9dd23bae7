//! Builds the eBPF crate (`dataplane-ebpf`) for `bpfel-unknown-none` with
//! aya-build and leaves its objects in `OUT_DIR`, where
//! `src/redirect/object.rs` (the programs) and `src/features/netns_cookie.rs`
//! (the probe object) embed them.
//!
//! Why a build script rather than an xtask step: a plain `cargo build` (and
//! `cargo test`, `cargo clippy`) then always embeds kernel programs that match
//! the user-space code beside them; nobody can ship an agent with a stale
//! object. The cost is that every build needs the nightly toolchain's
//! `rust-src` and `bpf-linker`, which `cargo xtask setup` installs.

use std::process::Command;

use anyhow::{Context as _, anyhow, bail};
use aya_build::Toolchain;

const EBPF_PACKAGE: &str = "dataplane-ebpf";

fn main() -> anyhow::Result<()> {
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
