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

use std::{collections::BTreeSet, net::SocketAddr, process::Command};

use dataplane_tests::{
    Agent, TempDir,
    mesh::{TwoNodes, addr, config_of, hbone_workload, write_config},
    observe::{family, scrape},
    redirector_node::pod_entries,
    topology::{Node, Pod},
    traffic::{echo, echo_server, http, try_stream, wait_until},
    upgrade::{
        Loop, assert_clean, engine_listeners, listening_tables, lock_pid, sockets_held,
        without_good_access_records,
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

/// `--ipv6-enabled false` (ztunnel's `IPV6_ENABLED=false`), forced on this
/// dual-stack host as on a node booted with `ipv6.disable=1`.
const IPV6_OFF: [&str; 2] = ["--ipv6-enabled", "false"];

/// The in-pod listeners: 15001 outbound, 15006 inbound, 15008 HBONE, and
/// the resolver's 15053 (DNS capture is on by default).
const IN_POD_PORTS: [u16; 4] = [15001, 15006, 15008, 15053];

/// Fails unless every in-pod listener of `pod` is an IPv4 socket (in
/// `/proc/net/tcp`, none in `tcp6`).
fn assert_ipv4_listeners_only(name: &str, pod: &Pod) -> anyhow::Result<()> {
    let tables = listening_tables(pod)?;
    for port in IN_POD_PORTS {
        assert_eq!(
            tables.get(&port),
            Some(&BTreeSet::from(["tcp"])),
            "{name}'s listeners on {port} are IPv4 alone: {tables:?}"
        );
    }
    Ok(())
}

/// Fails unless the kernel's `LISTENERS` holds `agent`'s sockets for
/// `pod`'s IPv4 address alone (never an IPv4 socket under its IPv6
/// address), while its IPv6 address stays captured inbound (so that
/// `sk_lookup` drops rather than lets it through).
fn assert_ipv4_keys_only(agent: &Agent, pod: &Pod) -> anyhow::Result<()> {
    let pins = dataplane_user::redirect::PinLayout::new(agent.bpffs(), agent.instance());
    let entries = pod_entries(
        &pins,
        pod.netns.cookie()?,
        &[pod.ip4.into(), pod.ip6.into()],
    )?;
    let listeners: Vec<&String> = entries
        .iter()
        .filter(|e| e.starts_with("listener "))
        .collect();
    let want =
        [15006, 15008].map(|port| format!("listener {}", SocketAddr::new(pod.ip4.into(), port)));
    assert_eq!(listeners, want.iter().collect::<Vec<_>>(), "{entries:?}");
    assert!(
        entries.contains(&format!("pod_inbound {}", pod.ip6)),
        "{entries:?}"
    );
    Ok(())
}

/// HBONE connections `agent` opened as the client's node.
fn tunnels_opened(agent: &Agent) -> anyhow::Result<f64> {
    let samples = scrape(agent)?;
    Ok(family(&samples, "istio_tcp_connections_opened_total")
        .iter()
        .filter(|s| {
            let has = |key: &str, value: &str| s.labels.iter().any(|(k, v)| k == key && v == value);
            has("connection_security_policy", "mutual_tls") && has("reporter", "source")
        })
        .map(|s| s.value)
        .sum())
}

#[test]
fn agents_with_ipv6_off_listen_on_ipv4_alone_carry_hbone_and_hand_over() -> anyhow::Result<()> {
    let mesh = TwoNodes::new("v4only")?;
    let config = mesh.config()?;
    let mut a1 = mesh.agent("v4only", 1, &config, &IPV6_OFF)?;
    let a2 = mesh.agent("v4only", 2, &config, &IPV6_OFF)?;
    let _echo = echo_server(&mesh.remote, 9000)?;
    for (name, pod) in [
        ("client", &mesh.client),
        ("local", &mesh.local),
        ("remote", &mesh.remote),
    ] {
        assert_ipv4_listeners_only(name, pod)?;
    }
    assert_ipv4_keys_only(&a1, &mesh.client)?;
    assert_ipv4_keys_only(&a2, &mesh.remote)?;
    // The pods' IPv6 addresses have no listener: their outbound IPv6 is
    // refused (captured to [::1]:15001, where nothing listens), never sent
    // uncaptured; the pods stay captured, IPv4 and all.
    let v6 = SocketAddr::new(mesh.remote.ip6.into(), 9000).to_string();
    let refused = try_stream(&mesh.client, &["echo", &v6, "16", "1"])?;
    assert!(
        refused.code == Some(1) && refused.stderr.contains("refused"),
        "an IPv6 connection from an enrolled pod is refused: {refused:?}"
    );
    for agent in [&a1, &a2] {
        let status = agent.status()?;
        assert!(
            status.ready && status.pods.iter().all(|p| p.captured),
            "{status:?}"
        );
        // Readiness and metrics answer on the agent's IPv4 addresses.
        assert!(agent.readiness_addr()?.is_ipv4() && agent.metrics_addr()?.is_ipv4());
        let (code, _) = http(agent.readiness_addr()?, "GET", "/healthz/ready")?;
        assert_eq!(code, 200);
    }

    // IPv4 goes end to end through an HBONE tunnel between the nodes.
    let dst = addr(&mesh.remote, 9000);
    echo(&mesh.client, dst, 64 * 1024, 7)?;
    wait_until("node1's agent to count the tunnel", || {
        Ok(tunnels_opened(&a1)? >= 1.0)
    })?;

    // A hand-over between agents with IPv6 off keeps the very sockets.
    let sockets = engine_listeners([&mesh.client, &mesh.local])?;
    let took = a1.take_over()?;
    let log = log_of(&a1);
    assert_eq!(took.old_exit, Some(0), "{log}");
    assert_eq!(
        engine_listeners([&mesh.client, &mesh.local])?,
        sockets,
        "{log}"
    );
    assert_ipv4_listeners_only("client", &mesh.client)?;
    echo(&mesh.client, dst, 64 * 1024, 8)?;

    // One with IPv6 on cannot serve them: it is refused and the running
    // agent goes on in charge, on the same sockets.
    let out = Command::new(dataplane_tests::agent_binary()?)
        .arg("run")
        .arg("--instance")
        .arg(a1.instance())
        .arg("--state-dir")
        .arg(a1.state_dir())
        .arg("--bpffs")
        .arg(a1.bpffs())
        .arg("--cgroup")
        .arg(mesh.n1.cgroup().path())
        .arg("--ca-dir")
        .arg(mesh.shared_ca())
        .args(["--config", &config.display().to_string(), "--node", "node1"])
        .args(["--readiness-addr", "127.0.0.1:0"])
        .args(["--metrics-addr", "127.0.0.1:0"])
        .args(["--admin-addr", "127.0.0.1:0"])
        .args(["--ipv6-enabled", "true", "--takeover"])
        .output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("this agent runs with --ipv6-enabled true")
            && stderr.contains("start it with the running agent's --ipv6-enabled"),
        "the refusal names the setting and the fix: {stderr}"
    );
    wait_until("the running agent to resume", || {
        Ok(a1.status().is_ok_and(|s| s.pid == took.new_pid)
            && agent_lock_pid(&a1).is_ok_and(|pid| pid == took.new_pid))
    })?;
    assert_eq!(engine_listeners([&mesh.client, &mesh.local])?, sockets);
    echo(&mesh.client, dst, 64 * 1024, 9)?;
    Ok(())
}
