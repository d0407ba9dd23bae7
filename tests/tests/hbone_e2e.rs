//! HBONE end to end: two simulated nodes, one agent per node, pods enrolled
//! from a shared local config (standalone mode), one built-in CA. Captured
//! connections to mesh workloads travel in mutual-TLS HTTP/2 CONNECT tunnels;
//! identities, trust domains and CAs are enforced in the handshake.
//!
//! Certificates and carriage come from the agents' certificate lists and
//! `/metrics`. Access records (log target `access`) are matched as log text
//! because operators consume those lines: their text is the product; so is
//! the pool's `HBONE connection established` line, the only report of a
//! handshake.

use std::{collections::HashSet, net::SocketAddr};

use dataplane_tests::{
    Agent,
    capture::PacketCapture,
    mesh::{TwoNodes, addr, write_config},
    observe::{access_records, family, field, scrape, sum_matching},
    traffic::{echo, echo_server, holding_server, stream, try_stream, wait_until},
};
use dataplane_user::control::Request;

const MIB: usize = 1024 * 1024;

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

#[test]
fn server_with_the_wrong_identity_is_rejected() -> anyhow::Result<()> {
    let mesh = TwoNodes::new("hbwrongid")?;
    let truth = mesh.config()?;
    // Node1 believes `remote` runs as another service account.
    let mut lie = mesh.mesh_config();
    std::sync::Arc::make_mut(&mut lie.workloads[2]).service_account = "somebody-else".into();
    let lie = write_config(mesh.dir.path(), "lie.yaml", &lie)?;
    let a1 = mesh.agent("hb", 1, &lie, &[])?;
    let _a2 = mesh.agent("hb", 2, &truth, &[])?;
    let _remote = echo_server(&mesh.remote, 9000)?;
    let out = try_stream(
        &mesh.client,
        &["echo", &addr(&mesh.remote, 9000).to_string(), "100", "1"],
    )?;
    assert_ne!(out.code, Some(0), "must not connect: {out:?}");
    let _ = wait_until("the client's agent to log the refusal", || {
        Ok(a1.log_text().contains("sa/somebody-else"))
    });
    let log = a1.log_text();
    assert!(
        log.contains("sa/somebody-else"),
        "the client names the identity it expected:\n{log}"
    );
    Ok(())
}

#[test]
fn client_of_another_ca_is_rejected() -> anyhow::Result<()> {
    let mesh = TwoNodes::new("hbotherca")?;
    let config = mesh.config()?;
    let other_ca = mesh.dir.path().join("other-ca");
    let a1 = mesh.agent_with_ca("hb", 1, &config, &other_ca, &[])?;
    let a2 = mesh.agent("hb", 2, &config, &[])?;
    let _remote = echo_server(&mesh.remote, 9000)?;
    let out = try_stream(
        &mesh.client,
        &["echo", &addr(&mesh.remote, 9000).to_string(), "100", "1"],
    )?;
    assert_ne!(out.code, Some(0), "must not connect: {out:?}");
    // Counted on both sides: the server knows no source workload before
    // the handshake, so only its own family has it; the client's tunnel
    // was refused, which Istio flags CONNECT.
    wait_until("the server to count the TLS refusal", || {
        let refused = sum_matching(
            &scrape(&a2)?,
            "dataplane_tcp_connections_failed_total",
            &[("direction", "inbound"), ("reason", "tls_handshake")],
        );
        Ok(refused >= 1.0)
    })?;
    let flagged = sum_matching(
        &scrape(&a1)?,
        "istio_tcp_connections_failed_total",
        &[("reporter", "source"), ("response_flags", "CONNECT")],
    );
    assert!(flagged >= 1.0, "client counted {flagged} CONNECT failures");
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

/// A peer whose HBONE port drops what reaches it (as a Kubernetes
/// NetworkPolicy does) is flagged `NETWORK_POLICY` once the dial times out,
/// as ztunnel flags a timed-out connect to a peer (`src/proxy/pool.rs`).
#[test]
fn a_peer_that_never_answers_is_flagged_network_policy() -> anyhow::Result<()> {
    let mesh = TwoNodes::new("hbnetpol")?;
    let config = mesh.config()?;
    let a1 = mesh.agent("hb", 1, &config, &[])?;
    let _a2 = mesh.agent("hb", 2, &config, &[])?;
    let _remote = echo_server(&mesh.remote, 9000)?;
    // Gone with the pod's namespace at the end of the test.
    let drop_hbone = std::process::Command::new("ip")
        .args(["netns", "exec", mesh.remote.netns.name()])
        .args([
            "iptables", "-I", "INPUT", "-p", "tcp", "--dport", "15008", "-j", "DROP",
        ])
        .status()?;
    anyhow::ensure!(drop_hbone.success(), "iptables: {drop_hbone}");
    let out = try_stream(
        &mesh.client,
        &["echo", &addr(&mesh.remote, 9000).to_string(), "100", "1"],
    )?;
    assert_ne!(out.code, Some(0), "must not connect: {out:?}");
    wait_until("the client's agent to flag the refusal", || {
        let samples = scrape(&a1)?;
        Ok(sum_matching(
            &samples,
            "istio_tcp_connections_failed_total",
            &[("reporter", "source"), ("response_flags", "NETWORK_POLICY")],
        ) >= 1.0
            && sum_matching(
                &samples,
                "dataplane_tcp_connections_failed_total",
                &[("direction", "outbound"), ("reason", "tunnel_timeout")],
            ) >= 1.0)
    })?;
    // The flag in the access record is a feature of its own (the one test
    // of it: others take the outcome from the counters above).
    let log = a1.log_text();
    let refused = access_records(&log, "connection refused");
    assert!(
        refused
            .iter()
            .any(|r| field(r, "response_flags") == "NETWORK_POLICY"),
        "{log}"
    );
    Ok(())
}

#[test]
fn client_of_another_trust_domain_is_rejected() -> anyhow::Result<()> {
    let mesh = TwoNodes::new("hbtd")?;
    let config = mesh.config()?;
    let _a1 = mesh.agent("hb", 1, &config, &[])?;
    let a2 = mesh.agent("hb", 2, &config, &["--trust-domain", "other.example"])?;
    let _remote = echo_server(&mesh.remote, 9000)?;
    let out = try_stream(
        &mesh.client,
        &["echo", &addr(&mesh.remote, 9000).to_string(), "100", "1"],
    )?;
    assert_ne!(out.code, Some(0), "must not connect: {out:?}");
    wait_until("the server to log the refusal", || {
        Ok(a2.log_text().contains("outside this server's trust domain"))
    })?;
    Ok(())
}

#[test]
fn plaintext_and_http1_to_15008_are_rejected_and_the_agent_survives() -> anyhow::Result<()> {
    let mesh = TwoNodes::new("hbjunk")?;
    let config = mesh.config()?;
    let a2 = mesh.agent("hb", 2, &config, &[])?;
    let hbone = addr(&mesh.remote, 15008).to_string();
    // `plain` is not enrolled: it talks to 15008 directly.
    for junk in ["GET / HTTP/1.1\r\nHost: x\r\n\r\n", "hello in the clear"] {
        let out = try_stream(&mesh.plain, &["echo-text", &hbone, junk])?;
        assert_ne!(out.stdout, junk, "nothing may echo plaintext");
    }
    wait_until("the refusals to be logged", || {
        Ok(a2.log_text().matches("TLS handshake refused").count() >= 2)
    })?;
    assert_eq!(
        a2.call(&Request::List)?.pods.len(),
        1,
        "agent still serving"
    );
    Ok(())
}

#[test]
fn app_down_closes_the_client_connection() -> anyhow::Result<()> {
    let mesh = TwoNodes::new("hbdown")?;
    let config = mesh.config()?;
    let a1 = mesh.agent("hb", 1, &config, &[])?;
    let _a2 = mesh.agent("hb", 2, &config, &[])?;
    // Nothing listens on 9999 in `remote`.
    let out = try_stream(
        &mesh.client,
        &["expect-reset", &addr(&mesh.remote, 9999).to_string()],
    )?;
    assert_eq!(out.stdout, "reset", "{out:?}");
    // The client's agent writes the refusal before it resets the client:
    // read at once.
    let log = a1.log_text();
    assert!(log.contains("503"), "{log}");
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

/// With `--crl-path` (ztunnel's `CRL_PATH`): once the file revokes the
/// certificate of `revoked` (`client` or `remote`), the open tunnel is reset
/// by the agent holding the file (`on`: the server's node, 2, or the
/// client's, 1) and new connections are refused in the handshake.
fn revocation_resets_and_refuses(tag: &str, on: u8, revoked: &str) -> anyhow::Result<()> {
    let mesh = TwoNodes::new(tag)?;
    let config = mesh.config()?;
    let crl = mesh.dir.path().join("ca-crl.pem");
    let crl_flag = crl.to_string_lossy().into_owned();
    let flags = |n: u8| -> Vec<&str> {
        if n == on {
            vec!["--crl-path", &crl_flag]
        } else {
            Vec::new()
        }
    };
    // The file is written once the first agent has created the CA; until
    // it exists, nothing is revoked.
    let a1 = mesh.agent("hb", 1, &config, &flags(1))?;
    let ca = dataplane_user::identity::Ca::load_or_generate(&mesh.shared_ca())?;
    std::fs::write(&crl, ca.revocation_list(&[], 1)?)?;
    let a2 = mesh.agent("hb", 2, &config, &flags(2))?;
    let _remote = echo_server(&mesh.remote, 9000)?;
    let _held = holding_server(&mesh.remote, 9100)?;
    echo(&mesh.client, addr(&mesh.remote, 9000), 1024, 1)?;
    let (owner, holder) = if revoked == "client" {
        (&a1, &a2)
    } else {
        (&a2, &a1)
    };
    std::thread::scope(|scope| -> anyhow::Result<()> {
        let hold = scope.spawn(|| {
            try_stream(
                &mesh.client,
                &["hold-end", &addr(&mesh.remote, 9100).to_string(), "25"],
            )
        });
        std::thread::sleep(std::time::Duration::from_secs(2));
        let suffix = format!("/sa/{revoked}");
        let serials: Vec<Vec<u8>> = owner
            .certs()?
            .into_iter()
            .filter(|c| c.identity.ends_with(&suffix))
            .map(|c| {
                c.serial
                    .split(':')
                    .map(|b| u8::from_str_radix(b, 16))
                    .collect::<Result<Vec<u8>, _>>()
            })
            .collect::<Result<_, _>>()?;
        anyhow::ensure!(!serials.is_empty(), "no certificate of {revoked} listed");
        let revoked_at = std::time::Instant::now();
        std::fs::write(&crl, ca.revocation_list(&serials, 2)?)?;
        let held = hold
            .join()
            .map_err(|_| anyhow::anyhow!("hold thread panicked"))??;
        anyhow::ensure!(
            held.stdout != "open" && revoked_at.elapsed() < std::time::Duration::from_secs(15),
            "the open connection was not ended: {held:?}"
        );
        Ok(())
    })?;
    let out = try_stream(
        &mesh.client,
        &["echo", &addr(&mesh.remote, 9000).to_string(), "100", "2"],
    )?;
    anyhow::ensure!(
        out.code != Some(0),
        "connected despite the revocation: {out:?}"
    );
    let log = holder.log_text();
    anyhow::ensure!(
        log.contains("the peer's certificate was revoked") && log.contains("Revoked"),
        "the agent with the file logs the reset and the refusal:\n{log}"
    );
    Ok(())
}

#[test]
fn a_revoked_client_is_reset_and_then_refused() -> anyhow::Result<()> {
    revocation_resets_and_refuses("hbcrl", 2, "client")
}

#[test]
fn a_revoked_server_is_reset_and_then_refused() -> anyhow::Result<()> {
    revocation_resets_and_refuses("hbcrs", 1, "remote")
}

/// `--compliance-policy pqc` (Istio's `COMPLIANCE_POLICY=pqc`) on the
/// server's node: the agents still tunnel to each other (both offer
/// X25519MLKEM768), a client offering only X25519 is refused at the hello,
/// one offering only X25519MLKEM768 is let in.
#[test]
fn a_post_quantum_only_agent_refuses_a_classical_client() -> anyhow::Result<()> {
    use dataplane_tests::stranger::StrangerTls;
    let mesh = TwoNodes::new("hbpqc")?;
    let config = mesh.config()?;
    let _a1 = mesh.agent("hb", 1, &config, &[])?;
    let _a2 = mesh.agent("hb", 2, &config, &["--compliance-policy", "pqc"])?;
    let _remote = echo_server(&mesh.remote, 9000)?;
    echo(&mesh.client, addr(&mesh.remote, 9000), 1024, 1)?;
    let offering = |group| {
        let mut provider = dataplane_user::tls::provider_for(Default::default());
        provider.kx_groups.retain(|g| g.name() == group);
        StrangerTls::with_provider(
            &mesh.shared_ca(),
            "stranger",
            "spiffe://cluster.local/ns/test/sa/remote",
            std::sync::Arc::new(provider),
        )
    };
    let target = addr(&mesh.remote, 15008);
    let classical = offering(rustls::NamedGroup::X25519)?;
    let refused = classical.connect(&mesh.plain, target, &[]);
    anyhow::ensure!(refused.is_err(), "an X25519-only client was let in");
    let hybrid = offering(rustls::NamedGroup::X25519MLKEM768)?;
    let tls = hybrid.connect(&mesh.plain, target, &[])?;
    anyhow::ensure!(
        tls.conn.negotiated_key_exchange_group().map(|g| g.name())
            == Some(rustls::NamedGroup::X25519MLKEM768),
        "not X25519MLKEM768"
    );
    Ok(())
}
