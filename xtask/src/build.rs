//! `cargo xtask build`: plain cargo over the workspace, minus the kernel
//! crate.
//!
//! The eBPF crate (`dataplane-ebpf`) only compiles for
//! `bpfel-unknown-none`; `crates/kernel/build.rs` builds it with aya-build
//! and `dataplane-kernel` embeds the object, so `--workspace` commands
//! exclude it.

use std::process::{Command, ExitCode};

use anyhow::Result;

use crate::cmd;

/// The kernel crate, which host-target cargo commands must leave out.
pub const EBPF_PACKAGE: &str = "dataplane-ebpf";

/// Adds `--workspace --exclude dataplane-ebpf` to a cargo command.
pub fn user_workspace(cmd: &mut Command) -> &mut Command {
    cmd.args(["--workspace", "--exclude", EBPF_PACKAGE])
}

/// Cargo's profile flag and the target subdirectory it builds into.
pub fn profile(release: bool) -> (Option<&'static str>, &'static str) {
    if release {
        (Some("--release"), "release")
    } else {
        (None, "debug")
    }
}

/// Builds every binary of the workspace (`dataplane` embeds the kernel
/// programs through its build script).
pub fn build_bins(release: bool) -> Result<()> {
    let mut cargo = cmd::cargo();
    cargo.arg("build");
    user_workspace(&mut cargo).arg("--bins");
    cargo.args(profile(release).0);
    cmd::run(&mut cargo)
}

/// `cargo xtask build [--release]`.
pub fn build(release: bool) -> Result<ExitCode> {
    build_bins(release)?;
    Ok(ExitCode::SUCCESS)
}
