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

use std::process::Command;

use dataplane_tests::{
    Agent, TempDir,
    mesh::{addr, config_of, hbone_workload, write_config},
    topology::Node,
    traffic::{echo_server, http, wait_until},
    upgrade::{
        Loop, assert_clean, engine_listeners, lock_pid, sockets_held, without_good_access_records,
    },
};

/// Hand-overs per run.
const HANDOVERS: usize = 3;

/// Good exchanges each loop must make between two hand-overs, so every
/// hand-over happens with both loops running.
const PROGRESS_STEP: u64 = 40;

/// The agents' log without the access records of connections that went
/// well (one per connection here).
fn log_of(agent: &Agent) -> String {
    without_good_access_records(&agent.log_text())
}

/// A loopback address with a port free now.
fn free_port() -> anyhow::Result<std::net::SocketAddr> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?)
}

fn agent_lock_pid(agent: &Agent) -> anyhow::Result<u32> {
    lock_pid(agent.state_dir(), agent.instance())
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
        assert_eq!(agent_lock_pid(&agent)?, took.new_pid, "{log}");
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
        assert_clean(name, &counts, PROGRESS_STEP * (HANDOVERS as u64 + 1), &log);
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
    assert_eq!(agent_lock_pid(&agent)?, old_pid);
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
    assert_eq!(agent_lock_pid(&agent)?, status.pid);
    assert!(agent.enroll(Agent::spec_for(&pod, "pod"))?.ok);
    Ok(())
}
