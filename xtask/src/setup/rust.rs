//! The nightly toolchain and its `rust-src` component, which the kernel
//! crate's `-Z build-std=core` needs.

use std::process::Command;

use anyhow::{Context as _, Result, bail};

use super::Progress;
use crate::cmd;

/// Fails with instructions when the nightly toolchain is missing: setup
/// cannot fetch a toolchain where static.rust-lang.org is unreachable.
pub fn ensure_nightly(progress: &Progress) -> Result<()> {
    let toolchains = cmd::output(Command::new("rustup").args(["toolchain", "list"]))
        .context("rustup is required to manage the nightly toolchain")?;
    if !toolchains.lines().any(|line| line.starts_with("nightly")) {
        bail!(
            "the nightly toolchain is not installed and setup cannot fetch it: run \
             `rustup toolchain install nightly --profile minimal --component rust-src` \
             on a machine that reaches static.rust-lang.org"
        );
    }
    let version = cmd::output(Command::new("rustc").args(["+nightly", "--version"]))?;
    progress.present(&format!("nightly toolchain ({})", version.trim()));
    Ok(())
}

/// Adds the nightly `rust-src` component unless it is installed.
pub fn ensure_rust_src(progress: &mut Progress) -> Result<()> {
    let installed = cmd::output(Command::new("rustup").args([
        "component",
        "list",
        "--toolchain",
        "nightly",
        "--installed",
    ]))?;
    if installed.lines().any(|line| line.starts_with("rust-src")) {
        progress.present("nightly rust-src");
        return Ok(());
    }
    progress.installing("nightly rust-src");
    cmd::run(Command::new("rustup").args([
        "component",
        "add",
        "rust-src",
        "--toolchain",
        "nightly",
    ]))
    .context("installing rust-src needs access to static.rust-lang.org")
}
