//! `cargo xtask demo [--keep]`: set up, build, then run the two-node mesh
//! demo (`dp-demo` in the tests crate, which owns the topology harness).

use std::process::{Command, ExitCode};

use anyhow::{Context as _, Result};

use crate::{build, run, setup};

/// Runs the demo; its exit code says whether every flow behaved.
pub fn demo(keep: bool) -> Result<ExitCode> {
    setup::setup(None)?;
    build::build_bins(false)?;
    let binary = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/debug/dp-demo");
    let mut cmd = Command::new(&binary);
    if keep {
        cmd.arg("--keep");
    }
    // Ctrl-C reaches the demo, which tears its mesh down before exiting.
    let status = run::run_forwarding_sigterm(&mut cmd)
        .with_context(|| format!("running {} failed", binary.display()))?;
    Ok(match status.code() {
        Some(0) => ExitCode::SUCCESS,
        Some(code) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
        None => ExitCode::FAILURE,
    })
}
