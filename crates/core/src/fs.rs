//! Small file helpers: bounded reads of files a stranger may have written,
//! and the mount table.

use std::path::{Path, PathBuf};

/// Reads at most `limit` bytes of the file at `path`; the flag says
/// whether it holds more. A file larger than a reader accepts is never read
/// whole (config files, tokens).
pub fn read_at_most(path: &Path, limit: usize) -> std::io::Result<(Vec<u8>, bool)> {
    use std::io::Read as _;
    let mut bytes = Vec::new();
    std::fs::File::open(path)?
        .take(limit as u64 + 1)
        .read_to_end(&mut bytes)?;
    let more = bytes.len() > limit;
    bytes.truncate(limit);
    Ok((bytes, more))
}

/// The first cgroup v2 mount point: `/sys/fs/cgroup` on unified hosts,
/// `/sys/fs/cgroup/unified` on hybrid ones.
pub fn cgroup2_mount() -> Option<PathBuf> {
    mount_points("cgroup2").into_iter().next()
}

/// Mount points of every filesystem of type `fstype`, in the order of
/// `/proc/self/mountinfo`.
pub fn mount_points(fstype: &str) -> Vec<PathBuf> {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    mount_points_in(&mountinfo, fstype)
}

/// [`mount_points`] of a `mountinfo` text.
fn mount_points_in(mountinfo: &str, fstype: &str) -> Vec<PathBuf> {
    mountinfo
        .lines()
        .filter_map(|line| {
            // Fields: id parent dev root mount_point ... - fstype source options
            let (left, right) = line.split_once(" - ")?;
            let mount_point = left.split_whitespace().nth(4)?;
            (right.split_whitespace().next()? == fstype).then(|| PathBuf::from(mount_point))
        })
        .collect()
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test files")]
mod tests {
    use super::*;

    #[test]
    fn reads_up_to_the_limit_and_says_whether_there_is_more() {
        let path = std::env::temp_dir().join(format!("dp-core-fs-{}", std::process::id()));
        std::fs::write(&path, b"0123456789").unwrap();
        assert_eq!(
            read_at_most(&path, 10).unwrap(),
            (b"0123456789".to_vec(), false)
        );
        assert_eq!(read_at_most(&path, 4).unwrap(), (b"0123".to_vec(), true));
        std::fs::remove_file(&path).unwrap();
        assert!(read_at_most(&path, 4).is_err());
    }

    #[test]
    fn finds_mount_points_by_type_in_order() {
        let mountinfo = "\
22 1 0:21 / /sys rw,nosuid shared:7 - sysfs sysfs rw
30 22 0:26 / /sys/fs/cgroup rw,nosuid shared:9 - cgroup2 cgroup2 rw
31 22 0:27 / /sys/fs/bpf rw,nosuid shared:10 - bpf bpf rw,mode=700
40 30 0:26 / /tmp/cg rw - cgroup2 cgroup2 rw
";
        assert_eq!(
            mount_points_in(mountinfo, "cgroup2"),
            [PathBuf::from("/sys/fs/cgroup"), PathBuf::from("/tmp/cg")]
        );
        assert_eq!(
            mount_points_in(mountinfo, "bpf"),
            [PathBuf::from("/sys/fs/bpf")]
        );
        assert!(mount_points_in(mountinfo, "tmpfs").is_empty());
    }
}
