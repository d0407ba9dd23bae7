//! Debian packages the tests and benchmarks use, installed only when
//! missing (`apt-get update` runs at most once, and only if needed).

use std::process::Command;

use anyhow::{Context as _, Result, bail};

use super::Progress;
use crate::cmd;

/// Packages whose tools the tests and benchmarks call. Each entry lists
/// alternative names (first preferred), any one of which satisfies it.
const PACKAGES: &[&[&str]] = &[
    // ip, ss, tc
    &["iproute2"],
    // iptables, ip6tables
    &["iptables"],
    // bpftool: inspect loaded programs, maps and pins
    &["bpftool", "linux-bpftool"],
    // ps, sysctl, pgrep
    &["procps"],
    &["ethtool"],
    &["tcpdump"],
    // `vm-test`: the kernel matrix's guests (TCG), their shell and
    // mounts, module decompression, debug info off the packed binaries
    &["qemu-system-x86"],
    &["busybox-static"],
    &["xz-utils"],
    &["binutils"],
    // bridge, host-local, loopback: the reference CNI plugins the CNI
    // plugin's tests chain ours after (tests/tests/cni_plugin.rs)
    &["containernetworking-plugins"],
    // a virtualenv for the deploy checks' Python tools (Helm's engine,
    // Kubernetes schemas; tests/src/cni_deploy.rs)
    &["python3-venv"],
];

/// Installs the missing packages of [`PACKAGES`].
pub fn ensure_packages(progress: &mut Progress) -> Result<()> {
    let mut present = Vec::new();
    let mut missing = Vec::new();
    for alternatives in PACKAGES {
        match alternatives.iter().find(|name| is_installed(name)) {
            Some(name) => present.push(*name),
            None => missing.push(*alternatives),
        }
    }
    if !present.is_empty() {
        progress.present(&format!("Debian packages {}", present.join(" ")));
    }
    if missing.is_empty() {
        return Ok(());
    }

    super::require_root("installing Debian packages")?;
    cmd::run(apt("apt-get").args(["update", "-q"]))?;
    let names = missing
        .iter()
        .map(|alternatives| installable(alternatives))
        .collect::<Result<Vec<_>>>()?;
    progress.installing(&format!("Debian packages {}", names.join(" ")));
    cmd::run(
        apt("apt-get")
            .args(["install", "-y", "-q", "--no-install-recommends"])
            .args(&names),
    )
}

/// An apt command that never prompts.
fn apt(program: &str) -> Command {
    let mut cmd = Command::new(program);
    cmd.env("DEBIAN_FRONTEND", "noninteractive");
    cmd
}

/// Whether dpkg reports `name` as installed.
fn is_installed(name: &str) -> bool {
    cmd::probe(Command::new("dpkg-query").args(["-W", "-f=${Status}", name]))
        .is_some_and(|status| status_is_installed(&status))
}

/// Reads `dpkg-query -f '${Status}'` output.
fn status_is_installed(status: &str) -> bool {
    status.contains("install ok installed")
}

/// The first of `alternatives` apt can install (has a candidate version).
fn installable(alternatives: &[&str]) -> Result<String> {
    for name in alternatives {
        let policy = cmd::output(Command::new("apt-cache").args(["policy", name]))
            .context("apt-cache is required: is this a Debian-based system?")?;
        if has_candidate(&policy) {
            return Ok((*name).to_owned());
        }
    }
    bail!(
        "apt has no installable package among {}: install one by hand",
        alternatives.join(", ")
    )
}

/// Reads `apt-cache policy` output: true when it offers a candidate version.
fn has_candidate(policy: &str) -> bool {
    policy.lines().any(|line| {
        line.trim()
            .strip_prefix("Candidate:")
            .is_some_and(|candidate| candidate.trim() != "(none)")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_dpkg_status() {
        assert!(status_is_installed("install ok installed"));
        assert!(!status_is_installed("deinstall ok config-files"));
        assert!(!status_is_installed(""));
    }

    #[test]
    fn reads_apt_cache_candidate() {
        let available = "bpftool:\n  Installed: (none)\n  Candidate: 7.1.0+6.1.172-1\n";
        assert!(has_candidate(available));
        let unknown = "linux-bpftool:\n  Installed: (none)\n  Candidate: (none)\n";
        assert!(!has_candidate(unknown));
        assert!(!has_candidate(""));
    }
}
