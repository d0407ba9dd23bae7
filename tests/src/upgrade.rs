//! What the upgrade tests (`tests/upgrade.rs`, `tests/chart_upgrade.rs`)
//! share: a connection loop at full rate through a node, and the checks
//! that a new agent serves on the very sockets the old one listened on.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::Path,
    process::Command,
    time::Duration,
};

use crate::{ChildGuard, TempDir, process::target_binary, spawn_in, topology::Pod, traffic};

/// Bytes echoed per connection of a loop.
const BYTES: &str = "16384";

/// A `dp-stream loop` running in a pod: one connection after another to
/// an echo server, as fast as they go, each echo checked byte for byte;
/// counts good exchanges, refusals, resets and corruptions.
#[derive(Debug)]
pub struct Loop {
    name: &'static str,
    dir: TempDir,
    child: ChildGuard,
}

impl Loop {
    /// Starts the loop from `pod` to `dst`.
    pub fn start(name: &'static str, pod: &Pod, dst: std::net::SocketAddr) -> anyhow::Result<Self> {
        let dir = TempDir::new("upgloop")?;
        let mut cmd = Command::new(target_binary("dp-stream", "built with the tests")?);
        cmd.args(["loop", &dst.to_string(), BYTES]).arg(dir.path());
        let child = spawn_in(cmd, Some(pod.netns.path()), Some(pod.cgroup.path()))?;
        Ok(Self { name, dir, child })
    }

    /// Good exchanges so far.
    pub fn progress(&self) -> u64 {
        std::fs::read_to_string(self.dir.path().join("progress"))
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0)
    }

    /// Waits until `more` good exchanges were made beyond the count now.
    pub fn advance(&mut self, more: u64) -> anyhow::Result<()> {
        let from = self.progress();
        traffic::wait_until(&format!("the {} loop to make progress", self.name), || {
            anyhow::ensure!(self.child.is_running(), "the {} loop exited", self.name);
            Ok(self.progress() >= from + more)
        })
    }

    /// Stops the loop and returns its counts (`ok`, `refused`, `reset`,
    /// `corrupt`, `other`).
    pub fn finish(self) -> anyhow::Result<serde_json::Value> {
        std::fs::write(self.dir.path().join("stop"), "")?;
        let out = self.child.wait(Duration::from_secs(60))?;
        anyhow::ensure!(
            out.code == Some(0),
            "{} loop failed: {}",
            self.name,
            out.stderr
        );
        Ok(serde_json::from_str(out.stdout.trim())?)
    }

    /// The loop's name.
    pub fn name(&self) -> &'static str {
        self.name
    }
}

/// Fails naming the loop and `log` unless `counts` (from [`Loop::finish`])
/// has no refused, reset, corrupt or otherwise failed exchange and at
/// least `min_ok` good ones.
pub fn assert_clean(name: &str, counts: &serde_json::Value, min_ok: u64, log: &str) {
    for failure in ["refused", "reset", "corrupt", "other"] {
        assert_eq!(counts[failure], 0, "{name} loop: {counts}\n{log}");
    }
    assert!(
        counts["ok"].as_u64().unwrap_or(0) >= min_ok,
        "{name} loop: {counts}"
    );
}

/// Listening sockets in `pod`'s network namespace: port -> socket inode.
pub fn listening_inodes(pod: &Pod) -> anyhow::Result<BTreeMap<u16, BTreeSet<u64>>> {
    let mut out: BTreeMap<u16, BTreeSet<u64>> = BTreeMap::new();
    for (_, port, inode) in listening(pod)? {
        out.entry(port).or_default().insert(inode);
    }
    Ok(out)
}

/// Listening sockets in `pod`'s network namespace: port -> the kernel
/// tables they are in, `tcp` (IPv4 sockets) or `tcp6` (IPv6 ones, dual-stack
/// included).
pub fn listening_tables(pod: &Pod) -> anyhow::Result<BTreeMap<u16, BTreeSet<&'static str>>> {
    let mut out: BTreeMap<u16, BTreeSet<&'static str>> = BTreeMap::new();
    for (table, port, _) in listening(pod)? {
        out.entry(port).or_default().insert(table);
    }
    Ok(out)
}

/// `(table, port, inode)` of every listening TCP socket in `pod`'s
/// network namespace.
fn listening(pod: &Pod) -> anyhow::Result<Vec<(&'static str, u16, u64)>> {
    const TABLES: [&str; 2] = ["tcp", "tcp6"];
    let tables = pod
        .netns
        .run(|| TABLES.map(|t| std::fs::read_to_string(format!("/proc/thread-self/net/{t}"))))?;
    let mut out = Vec::new();
    for (name, table) in TABLES.into_iter().zip(tables) {
        for line in table?.lines().skip(1) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            // sl local rem st tx:rx tr:when retr uid timeout inode
            let (Some(local), Some(state), Some(inode)) =
                (fields.get(1), fields.get(3), fields.get(9))
            else {
                continue;
            };
            if *state != "0A" {
                continue;
            }
            let port = local
                .rsplit(':')
                .next()
                .and_then(|p| u16::from_str_radix(p, 16).ok());
            if let (Some(port), Ok(inode)) = (port, inode.parse()) {
                out.push((name, port, inode));
            }
        }
    }
    Ok(out)
}

/// Socket inodes process `pid` holds descriptors of.
pub fn sockets_held(pid: u32) -> anyhow::Result<BTreeSet<u64>> {
    let mut out = BTreeSet::new();
    for entry in std::fs::read_dir(format!("/proc/{pid}/fd"))? {
        let Ok(target) = std::fs::read_link(entry?.path()) else {
            continue;
        };
        if let Some(inode) = target
            .to_str()
            .and_then(|t| t.strip_prefix("socket:["))
            .and_then(|t| t.strip_suffix(']'))
            .and_then(|t| t.parse().ok())
        {
            out.insert(inode);
        }
    }
    Ok(out)
}

/// The engine's listeners (15001, 15006, 15008) of both enrolled pods.
pub fn engine_listeners(pods: [&Pod; 2]) -> anyhow::Result<BTreeSet<u64>> {
    let mut out = BTreeSet::new();
    for pod in pods {
        let table = listening_inodes(pod)?;
        for port in [15001, 15006, 15008] {
            let found = table
                .get(&port)
                .ok_or_else(|| anyhow::anyhow!("no listener on {port} in a pod"))?;
            out.extend(found);
        }
    }
    Ok(out)
}

/// An agents' log without the access records of connections that went
/// well (one per connection in these tests).
pub fn without_good_access_records(log: &str) -> String {
    log.lines()
        .filter(|l| !l.contains("access: ") || !l.contains("error=\"-\""))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The pid written in the instance lock of `instance` under `state_dir`:
/// the agent in charge.
pub fn lock_pid(state_dir: &Path, instance: &str) -> anyhow::Result<u32> {
    let text = std::fs::read_to_string(state_dir.join(instance).join("agent.lock"))?;
    Ok(text.trim().parse()?)
}
