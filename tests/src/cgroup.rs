//! A cgroup v2 directory owned by a test; its processes are killed and the
//! directory removed on drop.

use std::{
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use crate::unique_name;

/// A cgroup v2 directory directly under the cgroup2 mount.
#[derive(Debug)]
pub struct Cgroup {
    path: PathBuf,
}

impl Cgroup {
    /// Creates `<cgroup2 mount>/dpt-<tag>-...`.
    pub fn new(tag: &str) -> anyhow::Result<Self> {
        let root = dataplane_user::preflight::cgroup2_mount()
            .ok_or_else(|| anyhow::anyhow!("no cgroup2 mount found; run `cargo xtask setup`"))?;
        let path = root.join(unique_name(tag));
        std::fs::create_dir(&path)
            .map_err(|e| anyhow::anyhow!("cannot create cgroup {}: {e}", path.display()))?;
        Ok(Self { path })
    }

    /// Creates `<parent>/dpt-<tag>-...` (a pod's cgroup under its node's).
    pub fn child(parent: &Cgroup, tag: &str) -> anyhow::Result<Self> {
        let path = parent.path.join(unique_name(tag));
        std::fs::create_dir(&path)
            .map_err(|e| anyhow::anyhow!("cannot create cgroup {}: {e}", path.display()))?;
        Ok(Self { path })
    }

    /// The cgroup directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Pids currently in the cgroup.
    pub fn pids(&self) -> Vec<u32> {
        std::fs::read_to_string(self.path.join("cgroup.procs"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect()
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        remove_tree(&self.path);
    }
}

/// Kills every process in the cgroup subtree at `path` and removes it,
/// children first (rmdir fails on a populated or non-leaf cgroup). A subtree
/// already removed (a node's guard went first) is not an error.
pub(crate) fn remove_tree(path: &Path) {
    if !path.exists() {
        return;
    }
    // cgroup.kill (5.14+) SIGKILLs every member of the whole subtree.
    let _ = std::fs::write(path.join("cgroup.kill"), "1");
    if let Ok(entries) = std::fs::read_dir(path) {
        for entry in entries.filter_map(Result::ok) {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                remove_tree(&entry.path());
            }
        }
    }
    let populated = || {
        std::fs::read_to_string(path.join("cgroup.events"))
            .map(|s| s.contains("populated 1"))
            .unwrap_or(false)
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    while populated() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    if let Err(e) = std::fs::remove_dir(path)
        && e.kind() != std::io::ErrorKind::NotFound
    {
        eprintln!("cleanup: cannot remove cgroup {}: {e}", path.display());
    }
}
