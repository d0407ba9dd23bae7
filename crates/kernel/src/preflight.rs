//! Start-up checks that turn a missing capability, filesystem or kernel
//! feature into one message naming what is missing and how to fix it,
//! instead of a failed syscall deep inside the loader.
//!
//! All checks run and every problem is reported at once, so an operator fixes
//! the pod spec in one go. Kernel features are probed, not inferred from the
//! release ([`crate::features`]): a missing one reads
//! `needs sk_lookup programs: kernel >= 5.9`. Where an older kernel has a
//! cheaper way (raising `RLIMIT_MEMLOCK` before 5.11, reading namespace
//! cookies through a BPF program before 5.14), it is put in place and logged.

use std::{
    fmt,
    path::{Path, PathBuf},
};

use caps::{CapSet, Capability};
use nix::sys::statfs::{BPF_FS_MAGIC, CGROUP2_SUPER_MAGIC, statfs};
use tracing::{info, warn};

use dataplane_core::error::Chain;

use crate::features;

/// Capabilities the agent needs, with what each is for.
pub const REQUIRED_CAPABILITIES: [(Capability, &str); 3] = [
    (Capability::CAP_BPF, "load eBPF programs and create maps"),
    (
        Capability::CAP_NET_ADMIN,
        "load and attach cgroup socket programs, set socket marks",
    ),
    (
        Capability::CAP_SYS_ADMIN,
        "enter pod network namespaces (setns), pin in bpffs",
    ),
];

/// Oldest kernel the programs can run on at all (`sk_lookup`; see
/// [`crate::features::MIN_KERNEL`]).
pub const MIN_KERNEL: (u32, u32) = crate::features::MIN_KERNEL;

/// Oldest kernel the project is tested on (`cargo xtask vm-test`).
pub const OLDEST_TESTED_KERNEL: (u32, u32) = (5, 10);

/// One thing that stops the agent from starting.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Problem {
    /// Effective capabilities lack some the agent needs.
    MissingCapabilities {
        /// Names of the missing capabilities and what each is for.
        missing: Vec<(String, &'static str)>,
    },
    /// The bpffs directory is not on a bpf filesystem.
    NotBpffs {
        /// The directory that was checked.
        path: PathBuf,
    },
    /// No cgroup v2 hierarchy is mounted (cgroup v1 only).
    NoCgroupV2,
    /// The attach cgroup is not on a cgroup v2 filesystem.
    NotCgroupV2 {
        /// The directory that was checked.
        path: PathBuf,
    },
    /// The kernel lacks a feature the redirection programs need.
    MissingKernelFeature {
        /// The feature (`sk_lookup programs`).
        what: &'static str,
        /// The first kernel that has it.
        since: features::KernelVersion,
        /// The running kernel's release string.
        release: String,
    },
    /// The kernel needs a fallback for a newer feature, and it fails.
    FallbackFailed {
        /// What failed and why, with its causes.
        reason: String,
    },
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Problem::MissingCapabilities { missing } => {
                write!(f, "missing capabilities:")?;
                for (name, why) in missing {
                    write!(f, " {name} (to {why});")?;
                }
                write!(
                    f,
                    " run as root, or grant them (DaemonSet: securityContext.capabilities.add)"
                )
            }
            Problem::NotBpffs { path } => write!(
                f,
                "{} is not on a bpf filesystem, so maps and links cannot be pinned; \
                 mount bpffs with `mount -t bpf bpf /sys/fs/bpf` (DaemonSet: a hostPath \
                 volume of /sys/fs/bpf) and pass --bpffs with a directory on it",
                path.display()
            ),
            Problem::NoCgroupV2 => write!(
                f,
                "no cgroup v2 hierarchy is mounted (cgroup v1 only), and the redirection \
                 programs attach to a cgroup v2 directory; mount one with \
                 `mount -t cgroup2 none /sys/fs/cgroup/unified` or boot with \
                 systemd.unified_cgroup_hierarchy=1"
            ),
            Problem::NotCgroupV2 { path } => write!(
                f,
                "{} is not a cgroup v2 directory (cgroup v1 or not a cgroup); pass a \
                 directory of the cgroup2 mount with --cgroup (see `grep cgroup2 /proc/mounts`)",
                path.display()
            ),
            Problem::MissingKernelFeature {
                what,
                since,
                release,
            } => write!(
                f,
                "needs {what}: kernel >= {}.{} (this kernel is {release}; supported: {}.{} \
                 and newer)",
                since.0, since.1, OLDEST_TESTED_KERNEL.0, OLDEST_TESTED_KERNEL.1
            ),
            Problem::FallbackFailed { reason } => write!(f, "{reason}"),
        }
    }
}

/// Every problem found, reported together.
#[derive(Debug, thiserror::Error)]
#[error("the agent cannot start on this host:\n{}", list(.problems))]
pub struct PreflightError {
    /// What is wrong, in check order.
    pub problems: Vec<Problem>,
}

fn list(problems: &[Problem]) -> String {
    problems
        .iter()
        .map(|p| format!("  - {p}"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// What to check.
#[derive(Debug, Clone)]
pub struct PreflightInput<'a> {
    /// bpffs directory for pins.
    pub bpffs: &'a Path,
    /// Attach cgroup, or `None` when it is to be detected.
    pub cgroup: Option<&'a Path>,
}

/// Runs every check. On success returns the cgroup to attach to (the one
/// given, or the detected cgroup v2 mount).
pub fn check(input: &PreflightInput<'_>) -> Result<PathBuf, PreflightError> {
    let mut problems = Vec::new();
    let support = match check_capabilities() {
        Some(p) => {
            // Without them every probe fails with EPERM: report only this.
            problems.push(p);
            None
        }
        None => Some(features::probe()),
    };
    if let Some(support) = &support {
        problems.extend(missing_features(support));
    }
    if !on_filesystem(input.bpffs, BPF_FS_MAGIC) {
        problems.push(Problem::NotBpffs {
            path: input.bpffs.to_path_buf(),
        });
    }
    let cgroup = match input.cgroup {
        Some(path) if on_filesystem(path, CGROUP2_SUPER_MAGIC) => Some(path.to_path_buf()),
        Some(path) => {
            problems.push(Problem::NotCgroupV2 {
                path: path.to_path_buf(),
            });
            None
        }
        None => {
            let found = cgroup2_mount();
            if found.is_none() {
                problems.push(Problem::NoCgroupV2);
            }
            found
        }
    };
    if let Some(support) = &support
        && problems.is_empty()
    {
        problems.extend(apply_fallbacks(support));
    }
    match cgroup {
        Some(cgroup) if problems.is_empty() => Ok(cgroup),
        _ => Err(PreflightError { problems }),
    }
}

/// The required kernel features `support` lacks; inconclusive probes are
/// logged and left to the loader.
fn missing_features(support: &features::KernelSupport) -> Vec<Problem> {
    for undecided in &support.undecided {
        warn!(kernel = %support.release, "{undecided}; loading the programs will tell");
    }
    support
        .missing
        .iter()
        .map(|r| Problem::MissingKernelFeature {
            what: r.what,
            since: r.since,
            release: support.release.clone(),
        })
        .collect()
}

/// Puts in place (and logs) the fallbacks the kernel needs.
fn apply_fallbacks(support: &features::KernelSupport) -> Vec<Problem> {
    let mut problems = Vec::new();
    for fallback in &support.fallbacks {
        match features::apply(*fallback) {
            Ok(()) => info!(kernel = %support.release, "{fallback}"),
            Err(e) => problems.push(Problem::FallbackFailed {
                reason: Chain(&e).to_string(),
            }),
        }
    }
    problems
}

fn check_capabilities() -> Option<Problem> {
    let last_known = std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
        .ok()
        .and_then(|s| s.trim().parse::<u8>().ok());
    let missing: Vec<(String, &'static str)> = REQUIRED_CAPABILITIES
        .iter()
        .filter(|(cap, _)| {
            // CAP_BPF is unknown to kernels before 5.8; there CAP_SYS_ADMIN
            // (also required) covers it.
            let known = last_known.is_none_or(|last| cap.index() <= last);
            known && !caps::has_cap(None, CapSet::Effective, *cap).unwrap_or(false)
        })
        .map(|(cap, why)| (cap.to_string(), *why))
        .collect();
    (!missing.is_empty()).then_some(Problem::MissingCapabilities { missing })
}

/// `(major, minor)` of a kernel release string such as `6.18.44-foo`.
pub fn parse_release(release: &str) -> Option<(u32, u32)> {
    let mut parts = release.split(|c: char| !c.is_ascii_digit());
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some((major, minor))
}

fn on_filesystem(path: &Path, magic: nix::sys::statfs::FsType) -> bool {
    statfs(path).is_ok_and(|s| s.filesystem_type() == magic)
}

pub use dataplane_core::fs::{cgroup2_mount, mount_points};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_kernel_releases() {
        assert_eq!(parse_release("6.18.44-fc-v669"), Some((6, 18)));
        assert_eq!(parse_release("5.10.0-32-cloud-amd64"), Some((5, 10)));
        assert_eq!(parse_release("garbage"), None);
    }

    #[test]
    fn problems_name_the_fix() {
        let text = PreflightError {
            problems: vec![
                Problem::NoCgroupV2,
                Problem::NotBpffs {
                    path: "/tmp/x".into(),
                },
            ],
        }
        .to_string();
        assert!(text.contains("mount -t cgroup2"), "{text}");
        assert!(text.contains("/tmp/x is not on a bpf filesystem"), "{text}");
        assert!(text.contains("mount -t bpf bpf /sys/fs/bpf"), "{text}");
    }

    #[test]
    fn a_missing_feature_names_the_kernel_that_has_it() {
        let text = Problem::MissingKernelFeature {
            what: "sk_lookup programs",
            since: (5, 9),
            release: "5.4.0-1-amd64".into(),
        }
        .to_string();
        assert!(
            text.starts_with(
                "needs sk_lookup programs: kernel >= 5.9 (this kernel is 5.4.0-1-amd64"
            ),
            "{text}"
        );
    }
}
