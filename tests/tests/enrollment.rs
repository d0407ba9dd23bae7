//! Enrollment through the agent's enrollment actor: a changed pod is
//! re-enrolled make-before-break (its listening sockets never close, so no
//! connection is refused, and its previous engine lets the connections it
//! accepted finish), and a pod that leaves takes its certificate with it.

use std::{
    io,
    net::{SocketAddr, TcpStream},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::Duration,
};

use dataplane_tests::{
    Agent,
    observe::{scrape, sum},
    topology::{Node, Pod},
    traffic::{echo, echo_server, wait_until},
};
use dataplane_user::{control::Request, inspect::CertInfo};

/// The inode of the socket listening on `port` inside the pod, from
/// `/proc/net/tcp6` as the pod's namespace shows it to a thread inside it (the engine's inbound
/// and HBONE listeners are dual-stack `[::]` sockets).
fn listener_inode(pod: &Pod, port: u16) -> anyhow::Result<u64> {
    let table = pod
        .netns
        .run(|| std::fs::read_to_string("/proc/thread-self/net/tcp6"))??;
    let local_suffix = format!(":{port:04X}");
    for line in table.lines().skip(1) {
        let fields: Vec<&str> = line.split_whitespace().collect();
        // local_address, rem_address, st (0A = LISTEN), ..., inode at 9.
        if fields.len() > 9 && fields[1].ends_with(&local_suffix) && fields[3] == "0A" {
            return Ok(fields[9].parse()?);
        }
    }
    anyhow::bail!("nothing listens on port {port} in the pod:\n{table}")
}

fn certificates(agent: &Agent) -> anyhow::Result<Vec<String>> {
    let response = agent.call(&Request::Certs)?;
    anyhow::ensure!(response.ok, "certs refused: {:?}", response.error);
    let certs: Vec<CertInfo> = serde_json::from_value(response.report.unwrap_or_default())?;
    Ok(certs.into_iter().map(|c| c.identity).collect())
}

#[test]
fn re_enrolling_a_changed_pod_keeps_its_listening_sockets_and_refuses_nothing() -> anyhow::Result<()>
{
    let mut node = Node::new("enrmbb", 1)?;
    let pod = node.add_pod("enrmbb")?;
    let stranger = node.add_pod("enrmbb")?;
    let agent = Agent::start("enrmbb", &node, &[])?;
    let mut spec = Agent::spec_for(&pod, "server");
    let added = agent.enroll(spec.clone())?;
    anyhow::ensure!(added.ok, "enroll refused: {:?}", added.error);
    let before = [listener_inode(&pod, 15006)?, listener_inode(&pod, 15008)?];

    // A pod outside the mesh connects to the pod's HBONE port in a loop
    // while the pod is re-enrolled with another identity, over and over.
    let stop = Arc::new(AtomicBool::new(false));
    let (attempts, refused) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let errors = Arc::new(Mutex::new(Vec::new()));
    let target = SocketAddr::new(pod.ip4.into(), 15008);
    let prober = {
        let (stop, attempts, refused, errors) = (
            Arc::clone(&stop),
            Arc::clone(&attempts),
            Arc::clone(&refused),
            Arc::clone(&errors),
        );
        let netns = stranger.netns.path().to_path_buf();
        std::thread::spawn(move || {
            dataplane_user::netns::run_in_netns(&netns, move || {
                while !stop.load(Ordering::Relaxed) {
                    attempts.fetch_add(1, Ordering::Relaxed);
                    if let Err(err) = TcpStream::connect_timeout(&target, Duration::from_secs(5)) {
                        refused.fetch_add(1, Ordering::Relaxed);
                        errors
                            .lock()
                            .map_err(|_| io::Error::other("poisoned"))?
                            .push(err.to_string());
                    }
                }
                Ok::<_, io::Error>(())
            })
        })
    };
    let mut accounts = Vec::new();
    for round in 0..20 {
        spec.service_account = format!("sa-{round}");
        accounts.push(spec.service_account.clone());
        let response = agent.enroll(spec.clone())?;
        anyhow::ensure!(response.ok, "re-enroll refused: {:?}", response.error);
    }
    stop.store(true, Ordering::Relaxed);
    prober
        .join()
        .map_err(|_| anyhow::anyhow!("prober panicked"))???;

    let after = [listener_inode(&pod, 15006)?, listener_inode(&pod, 15008)?];
    assert_eq!(
        before, after,
        "re-enrollment replaced the pod's listening sockets"
    );
    assert_eq!(
        refused.load(Ordering::Relaxed),
        0,
        "connections refused during re-enrollment (of {}): {:?}",
        attempts.load(Ordering::Relaxed),
        errors.lock().map(|e| e.clone())
    );
    // Only the identity in force keeps a certificate.
    let held = certificates(&agent)?;
    assert_eq!(
        held,
        vec!["spiffe://cluster.local/ns/test/sa/sa-19".to_owned()],
        "certificates of identities no pod has any more must go"
    );
    // ztunnel's lifecycle counters: an engine per enrollment (the first
    // and 20 re-enrollments), each counted as it ends: the previous ones
    // as they drain, the last and any still draining when the pod leaves.
    let counted = |name: &str| -> anyhow::Result<f64> { Ok(sum(&scrape(&agent)?, name)) };
    assert_eq!(counted("workload_manager_proxies_started_total")?, 21.0);
    let removed = agent.call(&Request::Remove {
        uid: Some(spec.uid.clone()),
        netns: None,
    })?;
    anyhow::ensure!(removed.removed == Some(true), "not removed: {removed:?}");
    wait_until("every engine of the pod to end", || {
        Ok(counted("workload_manager_proxies_stopped_total")? == 21.0)
    })?;
    assert_eq!(counted("workload_manager_proxies_started_total")?, 21.0);
    Ok(())
}

#[test]
fn a_pod_that_leaves_takes_its_certificate_but_not_a_shared_one() -> anyhow::Result<()> {
    let mut node = Node::new("enrcert", 1)?;
    let a = node.add_pod("enrcert")?;
    let b = node.add_pod("enrcert")?;
    let c = node.add_pod("enrcert")?;
    let agent = Agent::start("enrcert", &node, &[])?;
    // a and b share the default service account; c has its own.
    agent.enroll(Agent::spec_for(&a, "a"))?;
    agent.enroll(Agent::spec_for(&b, "b"))?;
    let mut c_spec = Agent::spec_for(&c, "c");
    c_spec.service_account = "own".into();
    agent.enroll(c_spec)?;
    let shared = "spiffe://cluster.local/ns/test/sa/default".to_owned();
    let own = "spiffe://cluster.local/ns/test/sa/own".to_owned();
    let mut held = certificates(&agent)?;
    held.sort();
    assert_eq!(held, vec![shared.clone(), own.clone()]);

    for uid in ["uid-c", "uid-a"] {
        let removed = agent.call(&Request::Remove {
            uid: Some(uid.into()),
            netns: None,
        })?;
        anyhow::ensure!(
            removed.removed == Some(true),
            "{uid} not removed: {removed:?}"
        );
    }
    assert_eq!(
        certificates(&agent)?,
        vec![shared],
        "b still uses the shared identity; c's went with it"
    );
    agent.call(&Request::Remove {
        uid: Some("uid-b".into()),
        netns: None,
    })?;
    assert!(certificates(&agent)?.is_empty());
    Ok(())
}

#[test]
fn a_pod_cannot_take_an_ip_another_pod_owns() -> anyhow::Result<()> {
    let mut node = Node::new("enrip", 1)?;
    let victim = node.add_pod("enrip")?;
    let thief = node.add_pod("enrip")?;
    let agent = Agent::start("enrip", &node, &[])?;
    agent.enroll(Agent::spec_for(&victim, "victim"))?;
    let mut stolen = Agent::spec_for(&thief, "thief");
    stolen.ips = vec![victim.ip4.into()];
    let error = match agent.enroll(stolen) {
        Ok(response) => anyhow::bail!(
            "a second owner of {} was accepted: {response:?}",
            victim.ip4
        ),
        Err(err) => format!("{err:#}"),
    };
    assert!(
        error.contains(&victim.ip4.to_string()) && error.contains("uid-victim"),
        "the refusal names the address and its owner: {error}"
    );
    // The victim is untouched: still captured, every IP pointing at it.
    let status = agent.status()?;
    let pod = status
        .pods
        .iter()
        .find(|p| p.uid == "uid-victim")
        .ok_or_else(|| anyhow::anyhow!("victim missing from status"))?;
    assert!(pod.captured, "{}", pod.reason);
    Ok(())
}

/// Istio's `ambient.istio.io/bypass-inbound-capture`: the pod's inbound
/// connections reach its apps uncaptured, its outbound ones are still
/// captured, and its HBONE port still answers (the engine's listener is
/// bound in the pod, found without `sk_lookup`).
#[test]
fn a_pod_that_bypasses_inbound_capture_still_has_its_outbound_captured() -> anyhow::Result<()> {
    let mut node = Node::new("enrbyp", 1)?;
    let open = node.add_pod("enrbyp")?;
    let other = node.add_pod("enrbyp")?;
    let agent = Agent::start("enrbyp", &node, &[])?;
    let mut spec = Agent::spec_for(&open, "open");
    spec.exclusions.bypass_inbound = true;
    agent.enroll(spec)?;
    agent.enroll(Agent::spec_for(&other, "other"))?;
    let _open_server = echo_server(&open, 9000)?;
    let _other_server = echo_server(&other, 9000)?;
    let counters = |agent: &Agent| -> anyhow::Result<(u64, u64)> {
        Ok((
            agent.counter("redirected_outbound")?,
            agent.counter("redirected_inbound")?,
        ))
    };

    // Into the bypassing pod: the sender's outbound is captured, the
    // receiver's inbound is not.
    let before = counters(&agent)?;
    echo(&other, SocketAddr::new(open.ip4.into(), 9000), 1000, 1)?;
    assert_eq!(counters(&agent)?, (before.0 + 1, before.1));
    // Out of it: both captured.
    echo(&open, SocketAddr::new(other.ip4.into(), 9000), 1000, 2)?;
    assert_eq!(counters(&agent)?, (before.0 + 2, before.1 + 1));
    // Its HBONE listener still takes connections.
    let hbone = SocketAddr::new(open.ip4.into(), dataplane_common::HBONE_PORT);
    node.netns()
        .run(move || TcpStream::connect_timeout(&hbone, Duration::from_secs(10)))??;
    assert_eq!(counters(&agent)?, (before.0 + 2, before.1 + 1));
    Ok(())
}

#[test]
fn status_checks_every_pod_ip_in_the_kernel() -> anyhow::Result<()> {
    use aya::maps::{HashMap, Map, MapData};
    use dataplane_common::{IpAddr16, PodInbound};
    use dataplane_user::redirect::PinLayout;

    let mut node = Node::new("enrstat", 1)?;
    let pod = node.add_pod("enrstat")?;
    let agent = Agent::start("enrstat", &node, &[])?;
    agent.enroll(Agent::spec_for(&pod, "web"))?;
    let captured = |status: &dataplane_user::inspect::StatusReport| {
        status
            .pods
            .iter()
            .find(|p| p.uid == "uid-web")
            .map(|p| (p.captured, p.reason.clone()))
    };
    let before = captured(&agent.status()?);
    assert!(before.as_ref().is_some_and(|c| c.0), "{before:?}");

    // Someone removes the pod's IPv4 inbound entry behind the agent's back.
    let pins = PinLayout::new(agent.bpffs(), agent.instance());
    let data = MapData::from_pin(pins.map(dataplane_common::maps::POD_INBOUND))?;
    let mut map: HashMap<MapData, IpAddr16, PodInbound> =
        HashMap::try_from(Map::from_map_data(data)?)?;
    map.remove(&IpAddr16::from_ipv4_be(u32::from(pod.ip4).to_be()))?;

    let (ok, reason) =
        captured(&agent.status()?).ok_or_else(|| anyhow::anyhow!("pod missing from status"))?;
    assert!(!ok, "status still says captured: {reason}");
    assert!(reason.contains(&pod.ip4.to_string()), "{reason}");
    Ok(())
}

#[test]
fn the_nodes_own_network_namespace_cannot_be_enrolled() -> anyhow::Result<()> {
    let node = Node::new("enrhost", 1)?;
    let agent = Agent::start("enrhost", &node, &[])?;
    let pid = agent
        .pid()
        .ok_or_else(|| anyhow::anyhow!("agent not running"))?;
    // The agent's own namespace (on a node, a host-network agent's is the
    // node's), by its path and by another process's path to the same
    // namespace (this test runs in it too): identity counts, not the path.
    let own = [
        format!("/proc/{pid}/ns/net"),
        format!("/proc/{}/ns/net", std::process::id()),
    ];
    for (n, path) in own.iter().enumerate() {
        let spec = Agent::spec_for_netns(path, &format!("host{n}"), "10.9.9.9");
        let error = match agent.enroll(spec) {
            Ok(response) => anyhow::bail!("{path} was enrolled: {response:?}"),
            Err(err) => format!("{err:#}"),
        };
        assert!(
            error.contains("host-network pods cannot be enrolled"),
            "{path}: {error}"
        );
    }
    // The init process's: refused as the node's namespace, or (where this
    // sandbox's init hides it) because it cannot be opened at all.
    let init = Agent::spec_for_netns("/proc/1/ns/net", "init", "10.9.9.8");
    assert!(agent.enroll(init).is_err(), "/proc/1/ns/net was enrolled");
    assert!(agent.call(&Request::List)?.pods.is_empty());
    Ok(())
}

/// TCP connections to or from port 15008 inside `pod` (established ones:
/// the HBONE connections of its engine, pooled or served).
fn hbone_connections(pod: &Pod) -> anyhow::Result<usize> {
    let mut count = 0;
    for table in ["/proc/thread-self/net/tcp", "/proc/thread-self/net/tcp6"] {
        let text = pod.netns.run(move || std::fs::read_to_string(table))??;
        count += text
            .lines()
            .skip(1)
            .filter(|line| {
                let fields: Vec<&str> = line.split_whitespace().collect();
                // st 01 = ESTABLISHED; 3AA0 = 15008.
                fields.len() > 3
                    && fields[3] == "01"
                    && (fields[1].ends_with(":3AA0") || fields[2].ends_with(":3AA0"))
            })
            .count();
    }
    Ok(count)
}

/// Two pods of one node, both HBONE workloads of a config file that a
/// standalone agent enrolls them from (so the connections between them
/// travel in tunnels), each with a holding server on 9000.
struct TwoPods {
    agent: Agent,
    dir: dataplane_tests::TempDir,
    first: Pod,
    staying: Pod,
    _holding: [std::thread::JoinHandle<()>; 2],
    _node: Node,
}

impl TwoPods {
    /// `config` makes the config file's text from the two pods.
    fn start(
        tag: &str,
        config: impl Fn(&Pod, &Pod) -> dataplane_user::config::LocalConfig,
    ) -> anyhow::Result<Self> {
        use dataplane_tests::{mesh, traffic::holding_server};
        let mut node = Node::new(tag, 1)?;
        let first = node.add_pod(tag)?;
        let staying = node.add_pod(tag)?;
        let dir = dataplane_tests::TempDir::new(tag)?;
        let path = mesh::write_config(dir.path(), "mesh.yaml", &config(&first, &staying))?;
        let agent = Agent::standalone(tag, &node, "node1", &path, &dir.path().join("ca"), &[])?;
        anyhow::ensure!(agent.call(&Request::List)?.pods.len() == 2);
        let holding = [
            holding_server(&first, 9000)?,
            holding_server(&staying, 9000)?,
        ];
        Ok(Self {
            agent,
            dir,
            first,
            staying,
            _holding: holding,
            _node: node,
        })
    }
}

#[test]
fn a_pod_that_leaves_takes_its_tunnels_and_pooled_connections_with_it() -> anyhow::Result<()> {
    use dataplane_tests::{mesh, traffic::stream};
    let pods = TwoPods::start("enrleave", |leaving, staying| {
        mesh::config_of(vec![
            mesh::hbone_workload(leaving, "leaving", "node1"),
            mesh::hbone_workload(staying, "staying", "node1"),
        ])
    })?;
    let (agent, leaving, staying) = (&pods.agent, &pods.first, &pods.staying);
    let to = |pod: &Pod| SocketAddr::new(pod.ip4.into(), 9000).to_string();

    // One held connection each way: the leaving pod's outbound tunnel
    // (over its pooled HBONE connection) and an inbound HBONE stream into it.
    std::thread::scope(|scope| -> anyhow::Result<()> {
        let (out_dst, in_dst) = (to(staying), to(leaving));
        let outbound = scope.spawn(move || stream(leaving, &["hold", &out_dst, "25"]));
        let inbound = scope.spawn(move || stream(staying, &["hold", &in_dst, "25"]));
        let opened = wait_until("both connections open on both legs", || {
            anyhow::ensure!(
                !outbound.is_finished() && !inbound.is_finished(),
                "a client ended before both connections were open"
            );
            Ok(agent.status()?.connections_open >= 4)
        });
        if let Err(err) = opened {
            // Say what each client saw: a refusal, an early close, or
            // nothing yet.
            let seen = |client: std::thread::ScopedJoinHandle<'_, anyhow::Result<String>>| {
                if client.is_finished() {
                    format!("{:?}", client.join().map_err(|_| "panicked"))
                } else {
                    "still holding".to_owned()
                }
            };
            anyhow::bail!(
                "{err:#} (open legs: {:?}; outbound client: {}; inbound client: {})\nthe agent's log:\n{}",
                agent.status().map(|s| s.connections_open).ok(),
                seen(outbound),
                seen(inbound),
                agent.log_text()
            );
        }
        // Its pooled connection out and the one served in.
        assert_eq!(hbone_connections(leaving)?, 2);
        let closed_before = sum(&scrape(agent)?, "istio_tcp_connections_closed_total");

        let removed = agent.call(&Request::Remove {
            uid: Some("uid-leaving".into()),
            netns: None,
        })?;
        anyhow::ensure!(removed.removed == Some(true), "{removed:?}");

        // Both applications see their connection end well before the
        // 25 s they would otherwise wait.
        for (what, client) in [("outbound", outbound), ("inbound", inbound)] {
            let seen = client
                .join()
                .map_err(|_| anyhow::anyhow!("{what} client panicked"))??;
            assert_eq!(seen, "closed", "{what} connection outlived the pod");
        }
        wait_until("every leg to close", || {
            Ok(agent.status()?.connections_open == 0)
        })?;
        // Each of the four legs wrote its record.
        let closed = sum(&scrape(agent)?, "istio_tcp_connections_closed_total") - closed_before;
        assert_eq!(closed, 4.0, "one closed record per leg");
        Ok(())
    })?;
    // No HBONE connection of the departed pod is left, pooled or served.
    wait_until("the pod's HBONE connections to close", || {
        Ok(hbone_connections(leaving)? == 0)
    })?;
    Ok(())
}

#[test]
fn a_pod_re_enrolled_under_a_new_identity_keeps_its_open_connections() -> anyhow::Result<()> {
    use dataplane_tests::{
        mesh,
        traffic::{holding_server, stream},
    };
    let workloads = |moving: &Pod, staying: &Pod, account: &str| {
        let mut moved = mesh::hbone_workload(moving, "moving", "node1");
        moved.service_account = account.into();
        mesh::config_of(vec![
            moved,
            mesh::hbone_workload(staying, "staying", "node1"),
        ])
    };
    let pods = TwoPods::start("enrkeep", |moving, staying| {
        workloads(moving, staying, "moving")
    })?;
    let (agent, dir, moving, staying) = (&pods.agent, pods.dir.path(), &pods.first, &pods.staying);
    let rewrite =
        |account: &str| mesh::write_config(dir, "mesh.yaml", &workloads(moving, staying, account));
    let _echo_moving = echo_server(moving, 9001)?;
    let _echo_staying = echo_server(staying, 9001)?;
    let to = |pod: &Pod, port| SocketAddr::new(pod.ip4.into(), port);
    let identity =
        |account: &str| format!("spiffe://cluster.local/ns/{}/sa/{account}", mesh::NAMESPACE);

    std::thread::scope(|scope| -> anyhow::Result<()> {
        // Held each way across the re-enrollment: the pod's outbound tunnel
        // (its previous engine's pool) and an inbound HBONE stream into it.
        let (out_dst, in_dst) = (to(staying, 9000).to_string(), to(moving, 9000).to_string());
        let outbound = scope.spawn(move || stream(moving, &["hold-end", &out_dst, "8"]));
        let inbound = scope.spawn(move || stream(staying, &["hold-end", &in_dst, "8"]));
        wait_until("both held connections open on both legs", || {
            anyhow::ensure!(
                !outbound.is_finished() && !inbound.is_finished(),
                "a client ended before the re-enrollment"
            );
            Ok(agent.status()?.connections_open >= 4)
        })?;

        rewrite("moved")?;
        wait_until("the pod to be re-enrolled under its new identity", || {
            Ok(certificates(agent)? == vec![identity("moved"), identity("staying")])
        })?;
        // The previous engine kept what it had accepted: neither
        // application saw its connection end in the 8 s it held it.
        for (what, client) in [("outbound", outbound), ("inbound", inbound)] {
            let seen = client
                .join()
                .map_err(|_| anyhow::anyhow!("{what} client panicked"))??;
            assert_eq!(
                seen,
                "open",
                "the {what} connection did not survive the re-enrollment\nthe agent's log:\n{}",
                agent.log_text()
            );
        }
        Ok(())
    })?;
    // New connections each way go to the new engine, whose certificate the
    // peer's client now expects.
    echo(staying, to(moving, 9001), 64 * 1024, 1)?;
    echo(moving, to(staying, 9001), 64 * 1024, 2)?;
    // The previous engine drained: every leg closed, nothing left open.
    wait_until("every leg to close", || {
        Ok(agent.status()?.connections_open == 0)
    })?;

    // A pod that leaves takes its previous engine's connections with it,
    // without waiting for that engine's drain.
    let _in_moving = holding_server(moving, 9000)?;
    std::thread::scope(|scope| -> anyhow::Result<()> {
        let in_dst = to(moving, 9000).to_string();
        let held = scope.spawn(move || stream(staying, &["hold-end", &in_dst, "20"]));
        wait_until("the held connection open on both legs", || {
            anyhow::ensure!(!held.is_finished(), "the client ended early");
            Ok(agent.status()?.connections_open >= 2)
        })?;
        rewrite("moving")?;
        wait_until("the pod to be re-enrolled again", || {
            Ok(certificates(agent)? == vec![identity("moving"), identity("staying")])
        })?;
        let gone = mesh::config_of(vec![mesh::hbone_workload(staying, "staying", "node1")]);
        mesh::write_config(dir, "mesh.yaml", &gone)?;
        let seen = held
            .join()
            .map_err(|_| anyhow::anyhow!("client panicked"))??;
        assert_ne!(seen, "open", "the connection outlived the pod that left");
        Ok(())
    })?;
    Ok(())
}
