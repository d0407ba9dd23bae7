//! `cargo xtask lint`: formatting and clippy, for the user-space crates on
//! the host and for the kernel crate on its BPF target.
//!
//! Every check runs even after one fails, so a single run shows all
//! problems; the task fails if any check did.

use std::process::{Command, ExitCode};
use std::time::Instant;

use anyhow::{Result, bail};

use crate::{build, cmd};

/// `cargo xtask lint`.
pub fn lint() -> Result<ExitCode> {
    let started = Instant::now();
    let mut failed = Vec::new();
    for (name, mut check) in checks() {
        if let Err(err) = cmd::run(&mut check) {
            eprintln!("lint: {name} failed: {err:#}");
            failed.push(name);
        }
    }
    let elapsed = started.elapsed().as_secs_f64();
    if !failed.is_empty() {
        bail!("lint: {} failed ({elapsed:.1}s)", failed.join(", "));
    }
    println!("lint: clean ({elapsed:.1}s)");
    Ok(ExitCode::SUCCESS)
}

/// The checks, each with a short name for the summary.
fn checks() -> Vec<(&'static str, Command)> {
    // Stable rustfmt formats every crate, the no_std kernel crate included.
    let mut fmt = cmd::cargo();
    fmt.args(["fmt", "--all", "--check"]);

    // The fuzz targets are a workspace of their own (cargo-fuzz builds them
    // on nightly with sanitizers); formatting needs no build.
    let mut fuzz_fmt = cmd::cargo();
    fuzz_fmt.args([
        "fmt",
        "--check",
        "--manifest-path",
        "dataplane-user/fuzz/Cargo.toml",
    ]);

    let mut clippy = cmd::cargo();
    clippy.arg("clippy");
    build::user_workspace(&mut clippy).args(["--all-targets", "--", "-D", "warnings"]);

    // The kernel crate needs nightly (build-std for a tier-3 target). Clippy
    // does not link, so bpf-linker is not involved here.
    let mut ebpf_clippy = cmd::cargo();
    ebpf_clippy.args([
        "+nightly",
        "clippy",
        "--package",
        build::EBPF_PACKAGE,
        "--target",
        "bpfel-unknown-none",
        "-Z",
        "build-std=core",
        "--release",
        "--",
        "-D",
        "warnings",
    ]);

    vec![
        ("rustfmt", fmt),
        ("rustfmt (fuzz targets)", fuzz_fmt),
        ("clippy (user space)", clippy),
        ("clippy (kernel, bpfel-unknown-none)", ebpf_clippy),
    ]
}
