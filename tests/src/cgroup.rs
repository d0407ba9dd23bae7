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
        // cgroup.kill (5.14+) SIGKILLs every member; then wait for them to go
        // before rmdir, which fails while the cgroup is populated.
        let _ = std::fs::write(self.path.join("cgroup.kill"), "1");
        let deadline = Instant::now() + Duration::from_secs(5);
        while !self.pids().is_empty() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        if let Err(e) = std::fs::remove_dir(&self.path) {
            eprintln!("cleanup: cannot remove cgroup {}: {e}", self.path.display());
        }
    }
}
