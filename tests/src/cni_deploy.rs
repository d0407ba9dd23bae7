//! The Python tools that validate `deploy/` (see `deploy/tools/check_chart.py`):
//! helm-python-sdk, which renders and lints the chart with Helm 4's own Go
//! engine through a C binding shipped in its wheel, and kubernetes-validate,
//! which ships the official Kubernetes JSON schemas. Both come from PyPI
//! into a virtualenv created once per machine (first use: about a minute,
//! 75 MB download) under `$XDG_CACHE_HOME/dataplane` or `~/.cache/dataplane`,
//! or `$DATAPLANE_DEPLOY_TOOLS` when set. No `helm` binary exists in the
//! registries this project may use; this is how the chart is rendered.

use std::{fs::File, os::fd::AsRawFd as _, path::PathBuf, process::Command};

/// Pinned requirements; the directory name changes with them.
pub const REQUIREMENTS: &[&str] = &[
    "helm-python-sdk==0.2.2",
    "kubernetes-validate==1.37.0",
    "PyYAML==6.0.4",
];

fn cache_root() -> anyhow::Result<PathBuf> {
    if let Some(dir) = std::env::var_os("XDG_CACHE_HOME").filter(|d| !d.is_empty()) {
        return Ok(PathBuf::from(dir).join("dataplane"));
    }
    let home = std::env::var_os("HOME")
        .filter(|h| !h.is_empty())
        .ok_or_else(|| anyhow::anyhow!("HOME is not set"))?;
    Ok(PathBuf::from(home).join(".cache/dataplane"))
}

/// The virtualenv's `python`, creating the virtualenv when missing.
pub fn python() -> anyhow::Result<PathBuf> {
    let dir = match std::env::var_os("DATAPLANE_DEPLOY_TOOLS") {
        Some(dir) => PathBuf::from(dir),
        None => {
            let tag = REQUIREMENTS.iter().fold(0u32, |h, r| {
                r.bytes()
                    .fold(h, |h, b| h.wrapping_mul(31).wrapping_add(u32::from(b)))
            });
            cache_root()?.join(format!("deploy-tools-{tag:08x}"))
        }
    };
    let python = dir.join("bin/python");
    if python.exists() {
        return Ok(python);
    }
    std::fs::create_dir_all(dir.parent().unwrap_or(&dir))?;
    // One creator at a time across test processes.
    let lock = File::create(dir.with_extension("lock"))?;
    // SAFETY: flock on a descriptor we own; released when `lock` closes.
    if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) } != 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    if python.exists() {
        return Ok(python);
    }
    let staging = dir.with_extension("staging");
    let _ = std::fs::remove_dir_all(&staging);
    let interpreter = std::env::var("DATAPLANE_PYTHON").unwrap_or_else(|_| "python3".into());
    crate::run(&interpreter, &["-m", "venv", &staging.display().to_string()]).map_err(|e| {
        anyhow::anyhow!("{e}\nPython 3 with venv is needed (Debian: python3-venv; `cargo xtask setup` installs it)")
    })?;
    let out = Command::new(staging.join("bin/pip"))
        .args([
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--no-input",
        ])
        .args(REQUIREMENTS)
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "pip install {} failed: {}",
        REQUIREMENTS.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::rename(&staging, &dir)?;
    Ok(python)
}
