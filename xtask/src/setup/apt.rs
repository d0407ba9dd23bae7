//! Debian packages the tests and benchmarks use, installed only when
//! missing (`apt-get update` runs at most once, and only if needed).
//!
//! Setup never removes a package the machine already has: the install is
//! simulated first, and if apt would resolve a conflict by removing
//! something, setup leaves out the optional packages that cause it (saying
//! what then cannot run) or stops naming what apt wanted to remove. The
//! real install also runs with `--no-remove`, so apt itself refuses should
//! its answer change between the two runs.

use std::process::Command;

use anyhow::{Context as _, Result, bail};

use super::Progress;
use crate::cmd;

/// What a package is needed for: whether setup may go on without it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Need {
    /// Building, `cargo xtask test` and `bench`: setup fails without it.
    Tests,
    /// Only `cargo xtask vm-test` (the kernel matrix): setup may skip it
    /// when installing it would remove a package the machine has.
    VmTest,
}

/// A package the project's tools call: alternative names (first preferred),
/// any one of which satisfies it.
struct Package {
    names: &'static [&'static str],
    need: Need,
}

const fn tests(names: &'static [&'static str]) -> Package {
    Package {
        names,
        need: Need::Tests,
    }
}

const fn vm_test(names: &'static [&'static str]) -> Package {
    Package {
        names,
        need: Need::VmTest,
    }
}

/// Packages whose tools the tests and benchmarks call.
const PACKAGES: &[Package] = &[
    // protoc: crates/istio-api/build.rs compiles Istio's wire types
    // (crates/istio-api/proto) with it
    tests(&["protobuf-compiler"]),
    // ip, ss, tc
    tests(&["iproute2"]),
    // iptables, ip6tables
    tests(&["iptables"]),
    // bpftool: inspect loaded programs, maps and pins
    tests(&["bpftool", "linux-bpftool"]),
    // ps, sysctl, pgrep
    tests(&["procps"]),
    tests(&["ethtool"]),
    tests(&["tcpdump"]),
    // `vm-test`: the kernel matrix's guests (TCG) and their shell
    vm_test(&["qemu-system-x86"]),
    vm_test(&["busybox-static"]),
    // module decompression and debug info off the packed binaries (also
    // used outside the VMs)
    tests(&["xz-utils"]),
    tests(&["binutils"]),
    // bridge, host-local, loopback: the reference CNI plugins the CNI
    // plugin's tests chain ours after (tests/tests/cni_plugin.rs)
    tests(&["containernetworking-plugins"]),
    // a virtualenv for the deploy checks' Python tools (Helm's engine,
    // Kubernetes schemas; tests/src/cni_deploy.rs)
    tests(&["python3-venv"]),
    // a real Prometheus that scrapes two agents and answers the queries of
    // Istio's and Kiali's dashboards and of deploy/grafana/dataplane.json
    // (tests/tests/prometheus_queries.rs). The test runs its own process
    // (own config, storage and loopback port); the Debian service, where
    // the init system starts one, is not used.
    tests(&["prometheus"]),
];

/// Installs the missing packages of [`PACKAGES`] without removing any.
pub fn ensure_packages(progress: &mut Progress) -> Result<()> {
    let mut present = Vec::new();
    let mut missing = Vec::new();
    for package in PACKAGES {
        match package.names.iter().find(|name| is_installed(name)) {
            Some(name) => present.push(*name),
            None => missing.push(package),
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
    let wanted = missing
        .iter()
        .map(|package| Ok((installable(package.names)?, package.need)))
        .collect::<Result<Vec<_>>>()?;

    let Choice { install, skipped } = choose(wanted, removals)?;
    if !install.is_empty() {
        progress.installing(&format!("Debian packages {}", install.join(" ")));
        install_packages(&install)?;
    }
    if let Some(Skipped { packages, because }) = skipped {
        let mut left = Vec::new();
        for package in packages {
            if !super::qemu::install_matching(&package, progress)? {
                left.push(package);
            }
        }
        if !left.is_empty() {
            println!(
                "warning: not installing {}: apt would remove {}, which this machine has; \
                 `cargo xtask vm-test` needs them (install them by hand once the conflict \
                 is resolved); everything else works without them",
                left.join(" "),
                because.join(" ")
            );
        }
    }
    Ok(())
}

/// `apt-get install` of `names`, never prompting, without recommends, and
/// refusing (`--no-remove`) to remove any installed package to do it.
pub fn install_packages(names: &[impl AsRef<std::ffi::OsStr>]) -> Result<()> {
    cmd::run(
        apt("apt-get")
            .args([
                "install",
                "-y",
                "-q",
                "--no-install-recommends",
                "--no-remove",
            ])
            .args(names),
    )
}

/// What setup installs, and what it leaves out.
#[derive(Debug, PartialEq, Eq)]
struct Choice {
    /// Packages to install (apt removes nothing for them).
    install: Vec<String>,
    /// Optional packages left out because apt would remove installed ones.
    skipped: Option<Skipped>,
}

/// Optional packages left out, and what installing them would remove.
#[derive(Debug, PartialEq, Eq)]
struct Skipped {
    packages: Vec<String>,
    because: Vec<String>,
}

/// Decides what to install so that apt removes nothing: everything when the
/// simulation (`simulate`: names -> packages apt would remove) removes
/// nothing, else only what the tests need when that removes nothing, else
/// an error naming what apt would remove.
fn choose(
    wanted: Vec<(String, Need)>,
    simulate: impl Fn(&[String]) -> Result<Vec<String>>,
) -> Result<Choice> {
    let all = names(&wanted);
    let removed = simulate(&all)?;
    if removed.is_empty() {
        return Ok(Choice {
            install: all,
            skipped: None,
        });
    }
    let (required, optional): (Vec<_>, Vec<_>) = wanted
        .into_iter()
        .partition(|(_, need)| *need == Need::Tests);
    let mut install = names(&required);
    let still_removed = match (optional.is_empty(), install.is_empty()) {
        (true, _) => removed.clone(),
        (false, true) => Vec::new(),
        (false, false) => simulate(&install)?,
    };
    if !still_removed.is_empty() {
        bail!(
            "installing {} would make apt remove {}, which this machine has; setup \
             removes nothing: resolve the conflict by hand (e.g. upgrade the installed \
             packages first) and re-run `cargo xtask setup`",
            install.join(" "),
            still_removed.join(" ")
        );
    }
    // Each optional package on its own: one that conflicts must not keep
    // the others out.
    let mut skipped = Vec::new();
    let mut because = Vec::new();
    for (name, _) in optional {
        let mut with = install.clone();
        with.push(name.clone());
        let removed = simulate(&with)?;
        if removed.is_empty() {
            install = with;
        } else {
            skipped.push(name);
            for name in removed {
                if !because.contains(&name) {
                    because.push(name);
                }
            }
        }
    }
    Ok(Choice {
        install,
        skipped: (!skipped.is_empty()).then_some(Skipped {
            packages: skipped,
            because,
        }),
    })
}

fn names(wanted: &[(String, Need)]) -> Vec<String> {
    wanted.iter().map(|(name, _)| name.clone()).collect()
}

/// The installed packages apt would remove to install `names`, from a
/// simulated run (`apt-get -s`, which changes nothing).
pub(super) fn removals(names: &[String]) -> Result<Vec<String>> {
    let plan = cmd::output(
        apt("apt-get")
            .args(["install", "-s", "-q", "--no-install-recommends"])
            .args(names),
    )
    .context("cannot simulate the package install (apt-get -s)")?;
    Ok(simulated_removals(&plan))
}

/// Reads `apt-get -s` output: the packages on its `Remv` lines.
fn simulated_removals(plan: &str) -> Vec<String> {
    plan.lines()
        .filter_map(|line| line.strip_prefix("Remv "))
        .filter_map(|rest| rest.split_whitespace().next())
        .map(str::to_owned)
        .collect()
}

/// An apt command that never prompts.
pub(super) fn apt(program: &str) -> Command {
    let mut cmd = Command::new(program);
    cmd.env("DEBIAN_FRONTEND", "noninteractive");
    cmd
}

/// Whether dpkg reports `name` as installed.
pub(super) fn is_installed(name: &str) -> bool {
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

    #[test]
    fn reads_simulated_removals() {
        let plan = "Reading package lists...\nRemv qemu-utils [1:7.2+dfsg-7]\n\
                    Inst qemu-system-x86 (1:8.0 Debian:bookworm [amd64])\n\
                    Conf qemu-system-x86 (1:8.0 Debian:bookworm [amd64])\n";
        assert_eq!(simulated_removals(plan), ["qemu-utils"]);
        assert!(simulated_removals("0 upgraded, 0 newly installed, 0 to remove\n").is_empty());
    }

    fn wanted() -> Vec<(String, Need)> {
        vec![
            ("iproute2".to_owned(), Need::Tests),
            ("qemu-system-x86".to_owned(), Need::VmTest),
        ]
    }

    #[test]
    fn installs_everything_when_apt_removes_nothing() {
        let choice = choose(wanted(), |_| Ok(Vec::new())).expect("a choice");
        assert_eq!(choice.install, ["iproute2", "qemu-system-x86"]);
        assert_eq!(choice.skipped, None);
    }

    #[test]
    fn skips_the_vm_packages_that_would_remove_something() {
        let simulate = |names: &[String]| {
            Ok(if names.iter().any(|n| n == "qemu-system-x86") {
                vec!["qemu-utils".to_owned()]
            } else {
                Vec::new()
            })
        };
        let choice = choose(wanted(), simulate).expect("a choice");
        assert_eq!(choice.install, ["iproute2"]);
        let skipped = choice.skipped.expect("qemu skipped");
        assert_eq!(skipped.packages, ["qemu-system-x86"]);
        assert_eq!(skipped.because, ["qemu-utils"]);
        // One conflicting VM package does not keep the others out.
        let mut more = wanted();
        more.push(("busybox-static".to_owned(), Need::VmTest));
        let choice = choose(more, simulate).expect("a choice");
        assert_eq!(choice.install, ["iproute2", "busybox-static"]);
        assert_eq!(
            choice.skipped.expect("qemu skipped").packages,
            ["qemu-system-x86"]
        );
    }

    #[test]
    fn stops_when_a_required_package_would_remove_something() {
        let simulate = |_: &[String]| Ok(vec!["libfoo1".to_owned()]);
        let err = choose(wanted(), simulate).expect_err("refused").to_string();
        assert!(err.contains("iproute2") && err.contains("libfoo1"), "{err}");
        let only_required = vec![("iproute2".to_owned(), Need::Tests)];
        let err = choose(only_required, simulate)
            .expect_err("refused")
            .to_string();
        assert!(err.contains("libfoo1"), "{err}");
    }

    /// The parser against apt's real output: simulating the removal of an
    /// installed package (nothing changes) must name it. Setup installs
    /// procps, so it is there to simulate removing.
    #[test]
    fn reads_removals_from_real_apt() {
        let plan = cmd::output(apt("apt-get").args(["remove", "-s", "-q", "procps"]))
            .expect("apt-get -s remove runs");
        assert!(
            simulated_removals(&plan)
                .iter()
                .any(|name| name == "procps"),
            "apt's simulated removal of procps not recognized in:\n{plan}"
        );
    }
}
