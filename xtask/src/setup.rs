//! `cargo xtask setup`: install what a fresh machine lacks to build, test and
//! benchmark the project.
//!
//! Every step checks first and prints `ok: <thing> already present` or
//! `installing <thing>...`, so a second run only checks and takes seconds.

pub mod apt;
mod bpf_linker;
mod mounts;
mod qemu;
mod rust;

use std::path::Path;
use std::time::Instant;

use anyhow::{Result, bail};

/// What setup found and did, for the final summary.
#[derive(Debug, Default)]
pub struct Progress {
    /// Things this run installed or mounted.
    installed: Vec<String>,
}

impl Progress {
    /// Reports a thing that needs no work.
    pub fn present(&self, thing: &str) {
        println!("ok: {thing} already present");
    }

    /// Reports (before doing it) that a thing is being installed.
    pub fn installing(&mut self, thing: &str) {
        println!("installing {thing}...");
        self.installed.push(thing.to_owned());
    }
}

/// `cargo xtask setup`, also the first step of `run` and `test`.
/// `bpf_linker_root` redirects the bpf-linker check and install to
/// `<root>/bin` (for exercising the install path).
pub fn setup(bpf_linker_root: Option<&Path>) -> Result<()> {
    let started = Instant::now();
    let mut progress = Progress::default();

    rust::ensure_nightly(&progress)?;
    rust::ensure_rust_src(&mut progress)?;
    apt::ensure_packages(&mut progress)?;
    bpf_linker::ensure(&mut progress, bpf_linker_root)?;
    mounts::ensure_bpffs(&mut progress)?;
    mounts::ensure_cgroup2(&mut progress)?;

    let elapsed = started.elapsed().as_secs_f64();
    if progress.installed.is_empty() {
        println!("setup: nothing to do ({elapsed:.1}s)");
    } else {
        println!(
            "setup: installed {} ({elapsed:.1}s)",
            progress.installed.join(", ")
        );
    }
    Ok(())
}

/// Fails with `why` unless xtask runs as root (package installs and mounts
/// need it).
fn require_root(why: &str) -> Result<()> {
    // SAFETY: `geteuid` has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        bail!("{why} needs root: re-run `cargo xtask setup` as root (e.g. with sudo -E)");
    }
    Ok(())
}
