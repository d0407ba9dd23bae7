//! The harness sweeps what a killed test process left behind: a network
//! namespace, a cgroup, a bpffs directory, a temporary directory and a
//! process still running for it, all named after a pid that no longer
//! runs. Resources of a live process stay.

use std::{path::Path, process::Command};

use dataplane_tests::{run, stale};

#[test]
fn leftovers_of_a_dead_test_process_are_swept_and_a_live_ones_kept() -> anyhow::Result<()> {
    // A pid that has certainly exited: a child we waited for.
    let dead_pid = {
        let mut child = Command::new("true").spawn()?;
        let pid = child.id();
        child.wait()?;
        pid
    };
    let dead_name = format!("dpt-sweep-{dead_pid}-0");
    let live_name = format!("dpt-sweep-{}-999", std::process::id());
    let cgroup_root = dataplane_user::preflight::cgroup2_mount()
        .ok_or_else(|| anyhow::anyhow!("no cgroup2 mount"))?;
    let dirs = [
        Path::new("/sys/fs/bpf").to_path_buf(),
        std::env::temp_dir(),
        cgroup_root.clone(),
    ];
    for name in [&dead_name, &live_name] {
        run("ip", &["netns", "add", name])?;
        for dir in &dirs {
            std::fs::create_dir(dir.join(name))?;
        }
    }
    // A process still running on behalf of the dead one.
    let mut orphan = Command::new("sleep")
        .arg("600")
        .arg(format!("/sys/fs/bpf/{dead_name}"))
        .spawn()?;

    stale::sweep();

    let netns = run("ip", &["netns", "list"])?;
    // SIGKILL is delivered at once; 10 s only bounds a hang.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let orphan_ended = loop {
        if orphan.try_wait()?.is_some() {
            break true;
        }
        if std::time::Instant::now() > deadline {
            break false;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    };
    let dead_left: Vec<_> = dirs
        .iter()
        .filter(|d| d.join(&dead_name).exists())
        .collect();
    let live_kept = dirs.iter().all(|d| d.join(&live_name).exists());
    // Clean up the live one (ours) before asserting.
    let _ = run("ip", &["netns", "del", &live_name]);
    for dir in &dirs {
        let _ = std::fs::remove_dir(dir.join(&live_name));
    }
    let _ = orphan.kill();
    let _ = orphan.wait();

    assert!(!netns.contains(&dead_name), "dead netns kept: {netns}");
    assert!(netns.contains(&live_name), "live netns swept: {netns}");
    assert!(dead_left.is_empty(), "dead leftovers kept in {dead_left:?}");
    assert!(live_kept, "a live process's directories were swept");
    assert!(orphan_ended, "the orphan process still runs");
    Ok(())
}
