//! Leftovers of a benchmark run that was killed outright (SIGKILL, a lost
//! machine session): namespaces, cgroups, bpffs directories and temporary
//! directories named `dpt-bench...-<pid>-<n>` whose process is gone are
//! removed before a new run starts. Anything of a live process is left
//! alone.

use std::path::{Path, PathBuf};

/// The prefix every benchmark object carries.
pub const PREFIX: &str = "dpt-bench";

/// Removes the leftovers of dead benchmark runs; returns how many.
pub fn sweep() -> usize {
    let mut removed = 0;
    for name in stale_names(Path::new("/var/run/netns")) {
        if crate::run("ip", &["netns", "del", &name]).is_ok() {
            removed += 1;
        }
    }
    if let Some(root) = dataplane_user::preflight::cgroup2_mount() {
        for name in stale_names(&root) {
            remove_cgroup(&root.join(name));
            removed += 1;
        }
    }
    for dir in [PathBuf::from("/sys/fs/bpf"), std::env::temp_dir()] {
        for name in stale_names(&dir) {
            if std::fs::remove_dir_all(dir.join(name)).is_ok() {
                removed += 1;
            }
        }
    }
    removed
}

fn stale_names(dir: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .filter_map(Result::ok)
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|name| name.starts_with(PREFIX))
        .filter(|name| {
            owner_pid(name).is_some_and(|pid| !Path::new(&format!("/proc/{pid}")).exists())
        })
        .collect()
}

/// The pid in `dpt-<tag>-<pid>-<n>`.
fn owner_pid(name: &str) -> Option<u32> {
    let mut parts = name.rsplitn(3, '-');
    let _n = parts.next()?;
    parts.next()?.parse().ok()
}

fn remove_cgroup(path: &Path) {
    let _ = std::fs::write(path.join("cgroup.kill"), "1");
    if let Ok(entries) = std::fs::read_dir(path) {
        for entry in entries.filter_map(Result::ok) {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                remove_cgroup(&entry.path());
            }
        }
    }
    for _ in 0..100 {
        if std::fs::remove_dir(path).is_ok() {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owner_pid_is_the_second_to_last_field() {
        assert_eq!(owner_pid("dpt-benchen1-4242-7"), Some(4242));
        assert_eq!(owner_pid("dpt-bench-agent-a-4242-7"), Some(4242));
        assert_eq!(owner_pid("dpt-bench"), None);
    }
}
