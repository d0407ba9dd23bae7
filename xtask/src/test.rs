//! `cargo xtask test`: every test the project has, on a machine that
//! `cargo xtask setup` prepares first (as the README's quick start promises).
//!
//! The integration tests spawn the built `target/<profile>/dataplane`
//! binary, which `cargo test` does not build for a different package, so the
//! binaries are built first.

use std::process::ExitCode;
use std::time::Instant;

use anyhow::Result;

use crate::{build, cmd, setup};

/// `cargo xtask test [--release] [-- EXTRA]`: sets up, builds the binaries,
/// then runs `cargo test` over the workspace without stopping at the first
/// failing test binary, and prints a one-line summary.
pub fn test(release: bool, extra: &[String]) -> Result<ExitCode> {
    let started = Instant::now();
    setup::setup(None)?;
    build::build_bins(release)?;

    let mut cargo = cmd::cargo();
    cargo.arg("test");
    build::user_workspace(&mut cargo).arg("--no-fail-fast");
    cargo.args(build::profile(release).0);
    if !extra.is_empty() {
        cargo.arg("--").args(extra);
    }
    let result = cmd::run(&mut cargo);
    let elapsed = started.elapsed().as_secs_f64();
    match result {
        Ok(()) => {
            println!("test: all tests passed ({elapsed:.1}s)");
            Ok(ExitCode::SUCCESS)
        }
        Err(err) => {
            eprintln!("test: FAILED ({elapsed:.1}s): {err:#}; the failing tests are listed above");
            Ok(ExitCode::FAILURE)
        }
    }
}
