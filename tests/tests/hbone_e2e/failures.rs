//! Failures reach the client: a peer that never answers is flagged
//! `NETWORK_POLICY`, and an app that is down closes the client's connection.

use super::*;

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
