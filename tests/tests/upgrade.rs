//! Upgrading the agent in place (`dataplane run --takeover`): the new agent
//! receives the running agent's instance lock and in-pod listening sockets
//! over the control socket, serves them before the old one stops
//! accepting, and the old one drains and exits 0. Connections made at full
//! rate across several hand-overs are never refused, never reset, and every
//! echo comes back byte for byte.
//!
//! Topology: one simulated node; `client` and `server` are enrolled HBONE
//! pods (client -> 15001 -> HBONE -> server's 15008 -> app), `outsider` is
//! not enrolled (outsider -> server's 15006, inbound plaintext capture).
//! Both loops cross every hand-over: the test waits for each loop to make
//! progress before and after each one.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::Path,
    process::Command,
};

use dataplane_tests::{
    Agent, ChildGuard, TempDir,
    mesh::{addr, config_of, hbone_workload, write_config},
    process::target_binary,
    spawn_in,
    topology::{Node, Pod},
    traffic::{echo_server, http, wait_until},
};

/// Hand-overs per run.
const HANDOVERS: usize = 3;

/// Bytes echoed per connection of a loop.
const BYTES: &str = "16384";

/// Good exchanges each loop must make between two hand-overs, so every
/// hand-over happens with both loops running.
const PROGRESS_STEP: u64 = 40;

/// A `dp-stream loop` running in a pod.
struct Loop {
    name: &'static str,
    dir: TempDir,
    child: ChildGuard,
}

impl Loop {
    fn start(name: &'static str, pod: &Pod, dst: std::net::SocketAddr) -> anyhow::Result<Self> {
        let dir = TempDir::new("upgloop")?;
        let mut cmd = Command::new(target_binary("dp-stream", "built with the tests")?);
        cmd.args(["loop", &dst.to_string(), BYTES]).arg(dir.path());
        let child = spawn_in(cmd, Some(pod.netns.path()), Some(pod.cgroup.path()))?;
        Ok(Self { name, dir, child })
    }

    /// Good exchanges so far.
    fn progress(&self) -> u64 {
        std::fs::read_to_string(self.dir.path().join("progress"))
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0)
    }

    /// Waits until `more` good exchanges were made beyond the count now.
    fn advance(&mut self, more: u64) -> anyhow::Result<()> {
        let from = self.progress();
        wait_until(&format!("the {} loop to make progress", self.name), || {
            anyhow::ensure!(self.child.is_running(), "the {} loop exited", self.name);
            Ok(self.progress() >= from + more)
        })
    }

    /// Stops the loop and returns its counts.
    fn finish(self) -> anyhow::Result<serde_json::Value> {
        std::fs::write(self.dir.path().join("stop"), "")?;
        let out = self.child.wait(std::time::Duration::from_secs(60))?;
        anyhow::ensure!(
            out.code == Some(0),
            "{} loop failed: {}",
            self.name,
            out.stderr
        );
        Ok(serde_json::from_str(out.stdout.trim())?)
    }
}

/// Listening sockets in `pod`'s network namespace: port -> socket inode.
fn listening_inodes(pod: &Pod) -> anyhow::Result<BTreeMap<u16, BTreeSet<u64>>> {
    let tables = pod.netns.run(|| {
        ["tcp", "tcp6"].map(|t| std::fs::read_to_string(format!("/proc/thread-self/net/{t}")))
    })?;
    let mut out: BTreeMap<u16, BTreeSet<u64>> = BTreeMap::new();
    for table in tables {
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
                out.entry(port).or_default().insert(inode);
            }
        }
    }
    Ok(out)
}

/// Socket inodes process `pid` holds descriptors of.
fn sockets_held(pid: u32) -> anyhow::Result<BTreeSet<u64>> {
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
fn engine_listeners(pods: [&Pod; 2]) -> anyhow::Result<BTreeSet<u64>> {
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

/// The agents' log without the access records of connections that went
/// well (one per connection here).
fn log_of(agent: &Agent) -> String {
    agent
        .log_text()
        .lines()
        .filter(|l| !l.contains("access: ") || !l.contains("error=\"-\""))
        .collect::<Vec<_>>()
        .join("\n")
}

/// A loopback address with a port free now.
fn free_port() -> anyhow::Result<std::net::SocketAddr> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?)
}

fn lock_pid(agent: &Agent) -> anyhow::Result<u32> {
    let text = std::fs::read_to_string(
        Path::new(agent.state_dir())
            .join(agent.instance())
            .join("agent.lock"),
    )?;
    Ok(text.trim().parse()?)
}

#[test]
fn takeover_refuses_resets_and_corrupts_no_connection_across_restarts() -> anyhow::Result<()> {
    let mut node = Node::new("upgrade", 1)?;
    let client = node.add_pod("upgrade")?;
    let server = node.add_pod("upgrade")?;
    let outsider = node.add_pod("upgrade")?;
    let dir = TempDir::new("upgrade")?;
    let config = config_of(vec![
        hbone_workload(&client, "client", "node1"),
        hbone_workload(&server, "server", "node1"),
    ]);
    let config = write_config(dir.path(), "mesh.yaml", &config)?;
    let ca = dir.path().join("ca");
    // Fixed endpoint ports, as on a node: each new agent serves them once
    // the old one has let go.
    let readiness = free_port()?.to_string();
    let mut agent = Agent::standalone(
        "upgrade",
        &node,
        "node1",
        &config,
        &ca,
        &["--drain-timeout", "10s", "--readiness-addr", &readiness],
    )?;
    let _echo = echo_server(&server, 9000)?;
    let sockets = engine_listeners([&client, &server])?;

    let dst = addr(&server, 9000);
    let mut meshed = Loop::start("client (HBONE)", &client, dst)?;
    let mut plain = Loop::start("outsider (plaintext inbound)", &outsider, dst)?;
    meshed.advance(PROGRESS_STEP)?;
    plain.advance(PROGRESS_STEP)?;
    for round in 0..HANDOVERS {
        let before = agent.pid();
        let took = agent.take_over()?;
        let log = log_of(&agent);
        assert_eq!(Some(took.old_pid), before);
        assert_eq!(
            took.old_exit,
            Some(0),
            "round {round}: the old agent exits 0:\n{log}"
        );
        // The new agent holds the lock, the same listening sockets (so the
        // kernel's socket-map entries still name live sockets), and
        // serves on them.
        assert_eq!(lock_pid(&agent)?, took.new_pid, "{log}");
        assert_eq!(engine_listeners([&client, &server])?, sockets, "{log}");
        let held = sockets_held(took.new_pid)?;
        assert!(
            sockets.is_subset(&held),
            "round {round}: the new agent holds every listening socket: {sockets:?} vs {held:?}"
        );
        let status = agent.status()?;
        assert!(status.ready, "{status:?}");
        wait_until("the new agent to serve the readiness port", || {
            Ok(http(agent.readiness_addr()?, "GET", "/healthz/ready")
                .is_ok_and(|(code, _)| code == 200))
        })?;
        assert!(status.pods.iter().all(|p| p.captured), "{status:?}");
        meshed.advance(PROGRESS_STEP)?;
        plain.advance(PROGRESS_STEP)?;
    }
    let log = log_of(&agent);
    for (name, counts) in [("meshed", meshed.finish()?), ("plaintext", plain.finish()?)] {
        eprintln!("{name} loop across {HANDOVERS} hand-overs: {counts}");
        for failure in ["refused", "reset", "corrupt", "other"] {
            assert_eq!(counts[failure], 0, "{name} loop: {counts}\n{log}");
        }
        assert!(
            counts["ok"].as_u64().unwrap_or(0) >= PROGRESS_STEP * (HANDOVERS as u64 + 1),
            "{counts}"
        );
    }
    Ok(())
}

#[test]
fn a_takeover_that_fails_leaves_the_running_agent_in_charge() -> anyhow::Result<()> {
    let mut node = Node::new("upgfail", 1)?;
    let client = node.add_pod("upgfail")?;
    let server = node.add_pod("upgfail")?;
    let agent = Agent::start("upgfail", &node, &[])?;
    agent.enroll(Agent::spec_for(&client, "client"))?;
    let _echo = echo_server(&server, 9000)?;
    let old_pid = agent
        .pid()
        .ok_or_else(|| anyhow::anyhow!("agent not running"))?;

    // A new agent whose CA directory is unusable fails after it has
    // received the lock and the sockets, before it serves anything.
    let dir = TempDir::new("upgfail")?;
    let not_a_dir = dir.path().join("ca-file");
    std::fs::write(&not_a_dir, "")?;
    let out = Command::new(dataplane_tests::agent_binary()?)
        .arg("run")
        .arg("--instance")
        .arg(agent.instance())
        .arg("--state-dir")
        .arg(agent.state_dir())
        .arg("--bpffs")
        .arg(agent.bpffs())
        .arg("--cgroup")
        .arg(node.cgroup().path())
        .arg("--ca-dir")
        .arg(&not_a_dir)
        .args(["--readiness-addr", "127.0.0.1:0"])
        .args(["--metrics-addr", "127.0.0.1:0"])
        .args(["--admin-addr", "127.0.0.1:0"])
        .arg("--takeover")
        .output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("received the running agent's instance lock and listening sockets"),
        "the new agent got as far as the sockets: {stderr}"
    );

    // The running agent goes on: it answers, holds the lock under its own
    // pid again, enrolls again, and its pod's traffic flows.
    // Until it resumes, its pod set is frozen and an enrollment is refused
    // with "retry"; once it has resumed, the enrollment succeeds.
    let server_spec = Agent::spec_for(&server, "server");
    wait_until("the running agent to resume", || {
        Ok(agent
            .enroll(server_spec.clone())
            .is_ok_and(|added| added.ok))
    })?;
    assert_eq!(agent.status()?.pid, old_pid);
    assert_eq!(lock_pid(&agent)?, old_pid);
    dataplane_tests::traffic::echo(&client, addr(&server, 9000), 64 * 1024, 7)?;
    assert!(agent.status()?.pods.iter().all(|p| p.captured));
    Ok(())
}

#[test]
fn takeover_with_no_agent_running_starts_as_usual() -> anyhow::Result<()> {
    let mut node = Node::new("upgnone", 1)?;
    let pod = node.add_pod("upgnone")?;
    let agent = Agent::start("upgnone", &node, &["--takeover"])?;
    let status = agent.status()?;
    assert!(status.ready, "{status:?}");
    assert_eq!(Some(status.pid), agent.pid());
    assert_eq!(lock_pid(&agent)?, status.pid);
    assert!(agent.enroll(Agent::spec_for(&pod, "pod"))?.ok);
    Ok(())
}
