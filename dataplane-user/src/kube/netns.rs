//! Finding the network namespace of a pod that already runs on this node.
//!
//! The CNI plugin is handed the namespace path (`CNI_NETNS`); the
//! reconciler, enrolling pods that started before the agent or while the
//! plugin was not installed, has only the pod's uid. Without a CRI client
//! it finds the namespace through `/proc`:
//!
//! 1. Every container of a pod runs in a cgroup whose path contains the pod
//!    uid: `kubepods/burstable/pod<uid>/...` with the cgroupfs driver,
//!    `kubepods-burstable-pod<uid with _ for ->.slice/...` with systemd.
//!    The processes whose `/proc/<pid>/cgroup` names the uid belong to the
//!    pod; the oldest of them (the sandbox's pause process, which lives as
//!    long as the sandbox) is chosen.
//! 2. The runtime pins each sandbox's namespace with a bind mount under
//!    `/var/run/netns` (containerd: `cni-<id>`, CRI-O: `<id>`). The file
//!    there with the same inode as `/proc/<pid>/ns/net` is returned: that
//!    path lives exactly as long as the sandbox, which is what the agent's
//!    vanished-namespace check expects. When no such file exists,
//!    `/proc/<pid>/ns/net` of the pause process is returned.
//!
//! Processes in the agent's own network namespace are ignored, so a
//! host-network pod is never mistaken for an isolated one. The agent needs
//! the host's `/proc` (`hostPID: true`) and `/var/run/netns` mounted.

use std::{
    fs,
    os::unix::fs::MetadataExt as _,
    path::{Path, PathBuf},
};

/// Finds pods' network namespaces.
pub trait NetnsLocator: Send + Sync {
    /// The network namespace path of the pod with this uid, if it runs here.
    fn locate(&self, uid: &str) -> Option<PathBuf>;
}

/// [`NetnsLocator`] scanning `/proc` (see the module documentation).
#[derive(Debug, Clone)]
pub struct ProcNetnsLocator {
    /// The host's procfs.
    pub proc_root: PathBuf,
    /// Directories where the runtime pins sandbox namespaces.
    pub netns_dirs: Vec<PathBuf>,
}

impl Default for ProcNetnsLocator {
    fn default() -> Self {
        Self {
            proc_root: PathBuf::from("/proc"),
            netns_dirs: vec![PathBuf::from("/var/run/netns"), PathBuf::from("/run/netns")],
        }
    }
}

impl NetnsLocator for ProcNetnsLocator {
    fn locate(&self, uid: &str) -> Option<PathBuf> {
        let own = ns_identity(&self.proc_root.join("self/ns/net"))?;
        let needles = [uid.to_owned(), uid.replace('-', "_")];
        let mut best: Option<(u64, PathBuf, (u64, u64))> = None;
        for entry in fs::read_dir(&self.proc_root).ok()?.flatten() {
            let name = entry.file_name();
            let Some(pid) = name
                .to_str()
                .filter(|n| n.bytes().all(|b| b.is_ascii_digit()))
            else {
                continue;
            };
            let dir = self.proc_root.join(pid);
            let Ok(cgroup) = fs::read_to_string(dir.join("cgroup")) else {
                continue;
            };
            if !cgroup_names_pod(&cgroup, &needles) {
                continue;
            }
            let ns_path = dir.join("ns/net");
            let Some(ns) = ns_identity(&ns_path) else {
                continue;
            };
            if ns == own {
                continue;
            }
            let Some(start) = start_time(&dir) else {
                continue;
            };
            if best.as_ref().is_none_or(|(s, _, _)| start < *s) {
                best = Some((start, ns_path, ns));
            }
        }
        let (_, proc_path, ns) = best?;
        Some(self.pinned_path(ns).unwrap_or(proc_path))
    }
}

impl ProcNetnsLocator {
    /// The runtime's bind mount of the namespace with this identity.
    fn pinned_path(&self, ns: (u64, u64)) -> Option<PathBuf> {
        self.netns_dirs.iter().find_map(|dir| {
            fs::read_dir(dir).ok()?.flatten().find_map(|entry| {
                let path = entry.path();
                (ns_identity(&path) == Some(ns)).then_some(path)
            })
        })
    }
}

/// Whether a `/proc/<pid>/cgroup` text puts the process in the pod whose
/// uid (or its systemd spelling) is in `needles`.
fn cgroup_names_pod(cgroup: &str, needles: &[String]) -> bool {
    cgroup.lines().any(|line| {
        let path = line.splitn(3, ':').nth(2).unwrap_or("");
        needles
            .iter()
            .any(|n| !n.is_empty() && path.contains(n.as_str()))
    })
}

/// (device, inode) of a namespace file: equal for two paths naming the same
/// namespace.
fn ns_identity(path: &Path) -> Option<(u64, u64)> {
    fs::metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

/// The process's start time in clock ticks since boot (`stat` field 22).
fn start_time(proc_dir: &Path) -> Option<u64> {
    let stat = fs::read_to_string(proc_dir.join("stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses: count
    // fields after its closing parenthesis.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cgroupfs_and_systemd_spellings_match() {
        let uid = "0a1b2c3d-1111-2222-3333-444455556666";
        let needles = [uid.to_owned(), uid.replace('-', "_")];
        let cgroupfs = format!("0::/kubepods/burstable/pod{uid}/abcdef\n");
        let systemd = format!(
            "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{}.slice/cri-containerd-1.scope\n",
            uid.replace('-', "_")
        );
        let hybrid = format!("12:pids:/kubepods/pod{uid}/x\n0::/\n");
        assert!(cgroup_names_pod(&cgroupfs, &needles));
        assert!(cgroup_names_pod(&systemd, &needles));
        assert!(cgroup_names_pod(&hybrid, &needles));
        assert!(!cgroup_names_pod(
            "0::/user.slice/session-1.scope\n",
            &needles
        ));
    }

    #[test]
    fn own_start_time_is_readable() {
        assert!(start_time(Path::new("/proc/self")).is_some());
    }

    #[test]
    fn own_namespace_is_never_returned() {
        // Every process of this test runs in the test's own namespace, so
        // even a needle matching all of them finds nothing.
        let locator = ProcNetnsLocator::default();
        let me = fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
        let path = me.lines().next().and_then(|l| l.splitn(3, ':').nth(2));
        if let Some(path) = path.filter(|p| p.len() > 1) {
            assert_eq!(locator.locate(path), None);
        }
    }
}
