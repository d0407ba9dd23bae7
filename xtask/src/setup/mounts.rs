//! The bpf filesystem (pinned maps and links) and a cgroup v2 hierarchy (the
//! socket programs attach to a cgroup), mounted when absent.

use std::path::Path;
use std::process::Command;

use anyhow::{Context as _, Result, bail};

use super::Progress;
use crate::cmd;

/// Where the agent pins by default.
const BPFFS: &str = "/sys/fs/bpf";
/// The cgroup root on every layout.
const CGROUP_ROOT: &str = "/sys/fs/cgroup";
/// Where a hybrid layout (tmpfs at [`CGROUP_ROOT`]) keeps cgroup v2.
const CGROUP_UNIFIED: &str = "/sys/fs/cgroup/unified";

/// One `/proc/mounts` entry: mount point and filesystem type.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Mount {
    /// Where it is mounted.
    point: String,
    /// Filesystem type (`bpf`, `cgroup2`, `tmpfs`, ...).
    fstype: String,
}

/// Parses `/proc/mounts` (device, mount point, type, options, ...).
fn parse_mounts(table: &str) -> Vec<Mount> {
    table
        .lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace().skip(1);
            Some(Mount {
                point: fields.next()?.to_owned(),
                fstype: fields.next()?.to_owned(),
            })
        })
        .collect()
}

/// The current mount table.
fn mounts() -> Result<Vec<Mount>> {
    let table = std::fs::read_to_string("/proc/mounts").context("cannot read /proc/mounts")?;
    Ok(parse_mounts(&table))
}

/// Mounts bpffs at [`BPFFS`] unless a bpf filesystem is there.
pub fn ensure_bpffs(progress: &mut Progress) -> Result<()> {
    let thing = format!("bpffs at {BPFFS}");
    if mounts()?
        .iter()
        .any(|m| m.point == BPFFS && m.fstype == "bpf")
    {
        progress.present(&thing);
        return Ok(());
    }
    if !Path::new(BPFFS).is_dir() {
        bail!(
            "{BPFFS} does not exist: the kernel lacks CONFIG_BPF_SYSCALL or sysfs is not mounted"
        );
    }
    super::require_root("mounting bpffs")?;
    progress.installing(&thing);
    cmd::run(Command::new("mount").args(["-t", "bpf", "bpf", BPFFS]))
}

/// What to do about cgroup v2.
#[derive(Debug, PartialEq, Eq)]
enum Cgroup2 {
    /// Already mounted at this path.
    Present(String),
    /// Mount it at this path (creating the directory first).
    MountAt(&'static str),
}

/// Decides from the mount table where cgroup v2 is or should go.
fn plan_cgroup2(mounts: &[Mount]) -> Result<Cgroup2> {
    if let Some(m) = mounts.iter().find(|m| m.fstype == "cgroup2") {
        return Ok(Cgroup2::Present(m.point.clone()));
    }
    match mounts.iter().rfind(|m| m.point == CGROUP_ROOT) {
        None => Ok(Cgroup2::MountAt(CGROUP_ROOT)),
        Some(m) if m.fstype == "tmpfs" => Ok(Cgroup2::MountAt(CGROUP_UNIFIED)),
        Some(m) => bail!(
            "{CGROUP_ROOT} is a {} mount and no cgroup2 is mounted: mount one by hand \
             (e.g. `mount -t cgroup2 none /mnt/cgroup2`) and pass --cgroup to the agent",
            m.fstype
        ),
    }
}

/// Mounts a cgroup v2 hierarchy unless one is mounted: at
/// `/sys/fs/cgroup/unified` on a hybrid layout, else at `/sys/fs/cgroup`.
pub fn ensure_cgroup2(progress: &mut Progress) -> Result<()> {
    match plan_cgroup2(&mounts()?)? {
        Cgroup2::Present(point) => {
            progress.present(&format!("cgroup v2 at {point}"));
            Ok(())
        }
        Cgroup2::MountAt(point) => {
            super::require_root("mounting cgroup v2")?;
            progress.installing(&format!("cgroup v2 at {point}"));
            std::fs::create_dir_all(point).with_context(|| format!("cannot create {point}"))?;
            cmd::run(Command::new("mount").args(["-t", "cgroup2", "none", point]))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(lines: &[&str]) -> Vec<Mount> {
        parse_mounts(&lines.join("\n"))
    }

    #[test]
    fn finds_bpffs_and_cgroup2_on_hybrid_host() {
        let mounts = table(&[
            "tmpfs /sys/fs/cgroup tmpfs rw,relatime,mode=755 0 0",
            "cgroup /sys/fs/cgroup/cpu cgroup rw,relatime,cpu 0 0",
            "cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0",
            "bpf /sys/fs/bpf bpf rw,relatime 0 0",
        ]);
        assert!(mounts.contains(&Mount {
            point: BPFFS.into(),
            fstype: "bpf".into()
        }));
        assert_eq!(
            plan_cgroup2(&mounts).expect("plan"),
            Cgroup2::Present(CGROUP_UNIFIED.into())
        );
    }

    #[test]
    fn plans_a_cgroup2_mount_for_each_layout() {
        let hybrid = table(&["tmpfs /sys/fs/cgroup tmpfs rw 0 0"]);
        assert_eq!(
            plan_cgroup2(&hybrid).expect("plan"),
            Cgroup2::MountAt(CGROUP_UNIFIED)
        );
        let bare = table(&["sysfs /sys sysfs rw 0 0"]);
        assert_eq!(
            plan_cgroup2(&bare).expect("plan"),
            Cgroup2::MountAt(CGROUP_ROOT)
        );
        let v1_only = table(&["cgroup /sys/fs/cgroup cgroup rw,cpu 0 0"]);
        assert!(plan_cgroup2(&v1_only).is_err());
    }
}
