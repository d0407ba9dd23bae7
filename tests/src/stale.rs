//! Leftovers of test processes that were killed before their guards ran
//! (SIGKILL, a SIGTERM to the test binary, a machine reset). Guards clean
//! up on drop, including when a test panics, but a killed process drops
//! nothing. So the first name a test process makes sweeps away every `dpt-`
//! resource whose owning process is gone: agents still running on its
//! behalf, network namespaces, cgroups, bpffs directories (their pins
//! detach their links) and temporary directories.
//!
//! Owners are known by the pid in the name (`dpt-<tag>-<pid>-<n>`); a live
//! pid's resources are never touched, so parallel test binaries are safe.

use std::path::Path;

/// Sweeps once per test process.
pub(crate) fn sweep_once() {
    static SWEPT: std::sync::Once = std::sync::Once::new();
    SWEPT.call_once(sweep);
}

/// The owning pid of a `dpt-<tag>-<pid>-<n>` name, if it is one.
fn owner(name: &str) -> Option<u32> {
    let rest = name.strip_prefix("dpt-")?;
    let mut parts = rest.rsplitn(3, '-');
    parts.next()?.parse::<u32>().ok()?;
    let pid = parts.next()?.parse().ok()?;
    parts.next()?;
    Some(pid)
}

/// Whether `name` belongs to a test process that no longer runs.
fn is_stale(name: &str) -> bool {
    owner(name).is_some_and(|pid| !Path::new(&format!("/proc/{pid}")).exists())
}

/// Names of the stale entries of `dir`.
fn stale_entries(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|name| is_stale(name))
        .collect()
}

/// Removes every leftover of dead test processes now.
pub fn sweep() {
    kill_orphans();
    for name in stale_entries(Path::new("/var/run/netns")) {
        let _ = crate::run("ip", &["netns", "del", &name]);
    }
    if let Some(root) = dataplane_user::preflight::cgroup2_mount() {
        for name in stale_entries(&root) {
            crate::cgroup::remove_tree(&root.join(name));
        }
    }
    for dir in [Path::new("/sys/fs/bpf"), &std::env::temp_dir()] {
        for name in stale_entries(dir) {
            let _ = std::fs::remove_dir_all(dir.join(name));
        }
    }
}

/// Kills processes (agents, probes) started for a test process that is
/// gone: their command lines name its resources.
fn kill_orphans() {
    for pid in stale_entries_of_procs() {
        // SAFETY: kill(2) on a pid read from /proc; a pid that exited in
        // between fails with ESRCH.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
}

fn stale_entries_of_procs() -> Vec<i32> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
                return false;
            };
            cmdline
                .split(|b| *b == 0)
                .filter_map(|arg| std::str::from_utf8(arg).ok())
                .flat_map(|arg| arg.split('/'))
                .any(is_stale)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::owner;

    #[test]
    fn owner_is_the_pid_before_the_counter() {
        assert_eq!(owner("dpt-hb1-28288-79"), Some(28288));
        assert_eq!(owner("dpt-hb-pool-n1-28288-57"), Some(28288));
        assert_eq!(owner("dpt-net"), None);
        assert_eq!(owner("dpt-x-12"), None);
        assert_eq!(owner("other-1-2"), None);
    }
}
