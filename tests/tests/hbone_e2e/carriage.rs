//! What the tunnels carry and how: 16 MiB exactly on one node and across
//! nodes, keepalive on every proxied socket, only TLS on the node link, a
//! non-mesh destination passed through, one handshake for fifty
//! connections, one trace id on both nodes' records, rotation under load,
//! and the first bytes sent with the request.

use super::*;

#[test]
fn same_node_and_cross_node_tunnels_carry_16_mib_exactly() -> anyhow::Result<()> {
    let mesh = TwoNodes::new("hbbytes")?;
    let config = mesh.config()?;
    let a1 = mesh.agent("hb", 1, &config, &[])?;
    let a2 = mesh.agent("hb", 2, &config, &[])?;
    assert_eq!(
        a1.call(&Request::List)?.pods.len(),
        2,
        "node1 enrolls its two pods"
    );
    assert_eq!(a2.call(&Request::List)?.pods.len(), 1);
    let _local = echo_server(&mesh.local, 9000)?;
    let _remote = echo_server(&mesh.remote, 9000)?;

    echo(&mesh.client, addr(&mesh.local, 9000), 16 * MIB, 11)?;
    echo(
        &mesh.client,
        SocketAddr::new(mesh.remote.ip6.into(), 9000),
        16 * MIB,
        12,
    )?;

    // Access records are written as connections close, which can be after
    // the client is done.
    let _ = wait_until("both agents to log the tunnels", || {
        Ok(a1.log_text().matches("protocol=\"HBONE\"").count() >= 3
            && a2.log_text().contains(&format!("bytes_sent={}", 16 * MIB)))
    });
    let log1 = a1.log_text();
    let log2 = a2.log_text();
    assert!(log1.matches("protocol=\"HBONE\"").count() >= 3, "{log1}");
    assert!(
        log2.contains("src_identity=\"spiffe://cluster.local/ns/test/sa/client\""),
        "the remote side saw the client's identity:\n{log2}"
    );
    assert!(log2.contains(&format!("bytes_sent={}", 16 * MIB)), "{log2}");
    Ok(())
}

/// ztunnel's `KEEPALIVE_*` settings, as ours: every socket the agents
/// accept or dial for a tunnelled connection probes when idle, with the
/// configured idle time; the apps' own sockets are left as they are.
#[test]
fn every_proxied_socket_keeps_alive_with_the_configured_idle_time() -> anyhow::Result<()> {
    let mesh = TwoNodes::new("hbalive")?;
    let config = mesh.config()?;
    let args = ["--keepalive-time", "77s", "--keepalive-interval", "5s"];
    let _a1 = mesh.agent("hb", 1, &config, &args)?;
    let a2 = mesh.agent("hb", 2, &config, &args)?;
    let server = holding_server(&mesh.remote, 9000)?;
    let dst = addr(&mesh.remote, 9000).to_string();
    std::thread::scope(|scope| -> anyhow::Result<()> {
        let held = scope.spawn(|| stream(&mesh.client, &["hold", &dst, "20"]));
        wait_until("the tunnel to be up", || {
            Ok(a2.status()?.connections_open >= 1)
        })?;
        for (pod, name) in [(&mesh.client, "client"), (&mesh.remote, "server")] {
            // ss shows one timer per socket: while a segment is still
            // unacknowledged it is the retransmit timer, so wait until
            // every agent socket is idle.
            let idle = |sockets: &[String]| {
                sockets
                    .iter()
                    .filter(|line| line.contains("\"dataplane\""))
                    .all(|line| !line.contains("timer:(on"))
            };
            let _ = wait_until("the agent sockets to be idle", || {
                Ok(idle(&pod.netns.established_tcp()?))
            });
            let sockets = pod.netns.established_tcp()?;
            let agents: Vec<&String> = sockets
                .iter()
                .filter(|line| line.contains("\"dataplane\""))
                .collect();
            // The client's: accepted on 15001, dialed to 15008; the
            // server's: accepted on 15008, dialed to the app.
            assert!(agents.len() >= 2, "{name}: {sockets:#?}");
            for line in &agents {
                // 77 s idle: the timer reads 1min<n>sec, never ztunnel's
                // default 180 s (2min<n>sec).
                assert!(
                    line.contains("timer:(keepalive,1min"),
                    "{name}: an agent socket without the configured keepalive: {line}\n{sockets:#?}"
                );
            }
            assert!(
                sockets
                    .iter()
                    .any(|line| !line.contains("\"dataplane\"") && !line.contains("keepalive")),
                "{name}: the app's socket is its own business: {sockets:#?}"
            );
        }
        let outcome = held
            .join()
            .map_err(|_| anyhow::anyhow!("holder panicked"))??;
        assert_eq!(outcome, "open");
        Ok(())
    })?;
    drop(server);
    Ok(())
}

#[test]
fn only_tls_crosses_the_node_link() -> anyhow::Result<()> {
    let mesh = TwoNodes::new("hbwire")?;
    let config = mesh.config()?;
    let _a1 = mesh.agent("hb", 1, &config, &[])?;
    let _a2 = mesh.agent("hb", 2, &config, &[])?;
    let _remote = echo_server(&mesh.remote, 9000)?;
    let marker = "PLAINTEXT-MARKER-0123456789-must-never-be-seen";
    let capture = PacketCapture::start(mesh.n1.netns(), "to2")?;
    let reply = stream(
        &mesh.client,
        &["echo-text", &addr(&mesh.remote, 9000).to_string(), marker],
    )?;
    let seen = capture.finish();
    assert_eq!(reply, marker, "the echo came back through the tunnel");
    assert!(
        seen.tcp_frames_on_port(15008) > 0,
        "tunnel traffic crossed the link"
    );
    assert!(
        !seen.contains(marker.as_bytes()),
        "payload appeared in clear on the wire"
    );
    assert_eq!(
        seen.tcp_frames_not_on_port(15008),
        0,
        "only HBONE crosses the link"
    );
    Ok(())
}

#[test]
fn non_mesh_destination_is_passed_through() -> anyhow::Result<()> {
    let mesh = TwoNodes::new("hbplain")?;
    let config = mesh.config()?;
    let a1 = mesh.agent("hb", 1, &config, &[])?;
    let _plain = echo_server(&mesh.plain, 9100)?;
    echo(&mesh.client, addr(&mesh.plain, 9100), 65_536, 3)?;
    let dst = format!("dst={}", addr(&mesh.plain, 9100));
    let _ = wait_until("the agent to log the connection", || {
        Ok(a1.log_text().contains(&dst))
    });
    let log = a1.log_text();
    assert!(
        log.contains(&format!("dst={}", addr(&mesh.plain, 9100))),
        "{log}"
    );
    // Carried in plain TCP, never through a tunnel.
    let samples = scrape(&a1)?;
    let opened = |security: &str| -> f64 {
        family(&samples, "istio_tcp_connections_opened_total")
            .iter()
            .filter(|s| {
                s.labels
                    .iter()
                    .any(|(k, v)| k == "connection_security_policy" && v == security)
            })
            .map(|s| s.value)
            .sum()
    };
    assert_eq!(opened("none"), 1.0, "{samples:?}");
    assert_eq!(opened("mutual_tls"), 0.0, "{samples:?}");
    Ok(())
}

#[test]
fn fifty_connections_between_one_pod_pair_use_one_handshake() -> anyhow::Result<()> {
    let mesh = TwoNodes::new("hbpool")?;
    let config = mesh.config()?;
    let a1 = mesh.agent("hb", 1, &config, &[])?;
    let a2 = mesh.agent("hb", 2, &config, &[])?;
    let _remote = echo_server(&mesh.remote, 9000)?;
    for seed in 0..50 {
        echo(&mesh.client, addr(&mesh.remote, 9000), 1024, seed)?;
    }
    let _ = wait_until("the server's agent to log 50 closed connections", || {
        Ok(a2.log_text().matches("connection closed").count() >= 50)
    });
    assert_eq!(
        a1.log_text()
            .matches("HBONE connection established")
            .count(),
        1
    );
    let inbound = a2.log_text();
    assert_eq!(
        inbound.matches("connection closed").count(),
        50,
        "{inbound}"
    );
    Ok(())
}

/// One connection's two access records, on the client's node and on the
/// server's, carry the same trace id (the one its `traceparent` carried),
/// and another connection has another: they can be joined.
#[test]
fn both_nodes_records_of_a_connection_share_its_trace_id() -> anyhow::Result<()> {
    let mesh = TwoNodes::new("hbtrace")?;
    let config = mesh.config()?;
    let a1 = mesh.agent("hb", 1, &config, &[])?;
    let a2 = mesh.agent("hb", 2, &config, &[])?;
    let _remote = echo_server(&mesh.remote, 9000)?;
    for seed in 0..2 {
        echo(&mesh.client, addr(&mesh.remote, 9000), 100, seed)?;
    }
    let ids = |agent: &Agent, direction: &str| -> HashSet<String> {
        access_records(&agent.log_text(), "connection closed")
            .iter()
            .filter(|r| field(r, "direction") == direction && field(r, "protocol") == "HBONE")
            .map(|r| field(r, "trace_id").to_owned())
            .collect()
    };
    wait_until("both nodes to record both connections", || {
        Ok(ids(&a1, "outbound").len() == 2 && ids(&a2, "inbound").len() == 2)
    })?;
    let (sent, received) = (ids(&a1, "outbound"), ids(&a2, "inbound"));
    assert_eq!(sent, received, "{}\n{}", a1.log_text(), a2.log_text());
    for id in &sent {
        assert!(
            id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit()),
            "{id}"
        );
    }
    Ok(())
}

#[test]
fn certificate_rotation_under_load_drops_nothing() -> anyhow::Result<()> {
    let mesh = TwoNodes::new("hbrot")?;
    let config = mesh.config()?;
    let a1 = mesh.agent("hb", 1, &config, &["--cert-lifetime", "2s"])?;
    let a2 = mesh.agent("hb", 2, &config, &["--cert-lifetime", "2s"])?;
    let _remote = echo_server(&mesh.remote, 9000)?;
    let mut seed = 0;
    // Serials each side's workload certificate has had, from the agents'
    // certificate lists.
    let (mut client_serials, mut remote_serials) = (HashSet::new(), HashSet::new());
    let note = |agent: &Agent, identity: &str, seen: &mut HashSet<String>| {
        let certs = agent.certs()?;
        seen.extend(
            certs
                .into_iter()
                .filter(|c| c.identity.ends_with(identity))
                .map(|c| c.serial),
        );
        anyhow::Ok(seen.len())
    };
    // Keep traffic flowing until both sides have rotated twice (three
    // certificates each).
    while note(&a1, "/sa/client", &mut client_serials)? < 3
        || note(&a2, "/sa/remote", &mut remote_serials)? < 3
    {
        seed += 1;
        anyhow::ensure!(seed < 2000, "certificates never rotated");
        echo(&mesh.client, addr(&mesh.remote, 9000), 256 * 1024, seed)?;
    }
    Ok(())
}

#[test]
fn the_first_bytes_go_with_the_request_unless_turned_off() -> anyhow::Result<()> {
    // The client (`echo-text`) writes as soon as it is connected, on the
    // same thread, before its agent has accepted and decided the
    // connection, so its bytes are there to go with the CONNECT request;
    // over five connections, a miss of all would take a client
    // descheduled between its connect and its write every time.
    let cases: [(&[&str], bool); 2] = [(&[], true), (&["--hbone-early-data", "off"], false)];
    for (n, (flags, on)) in cases.into_iter().enumerate() {
        let mesh = TwoNodes::new(&format!("hbearly{n}"))?;
        let config = mesh.config()?;
        let a1 = mesh.agent(&format!("he{n}"), 1, &config, flags)?;
        let _a2 = mesh.agent(&format!("he{n}"), 2, &config, &[])?;
        let _remote = echo_server(&mesh.remote, 9000)?;
        let dst = addr(&mesh.remote, 9000).to_string();
        for _ in 0..5 {
            let reply = stream(&mesh.client, &["echo-text", &dst, "first bytes"])?;
            assert_eq!(reply, "first bytes");
        }
        let early = sum_matching(&scrape(&a1)?, "dataplane_hbone_early_data_total", &[]);
        if on {
            assert!(early >= 1.0, "no tunnel carried early bytes");
        } else {
            assert_eq!(early, 0.0, "early bytes sent although turned off");
        }
    }
    Ok(())
}
