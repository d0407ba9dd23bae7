//! Who the handshake refuses: a server with the wrong identity, a client of
//! another CA or trust domain, plaintext and HTTP/1 on 15008, and a
//! classical client of a post-quantum-only agent.

use super::*;

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
