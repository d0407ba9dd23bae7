//! The scraped Prometheus counters: equal to the connections and bytes made,
//! growing while a connection is open, and counting refusals with a reason.

use super::*;

#[test]
fn scraped_counters_equal_the_connections_and_bytes_made() -> anyhow::Result<()> {
    let mesh = TwoNodes::new("opmetrics")?;
    let (a1, a2) = mesh.agents("op", &mesh.mesh_config())?;
    let _remote = doubling_server(&mesh.remote, 9000)?;
    let _plain = doubling_server(&mesh.plain, 9100)?;
    let (hbone, plain) = ([1000, 2000, 4000], [300, 500]);
    for len in hbone {
        exchange(&mesh.client, addr(&mesh.remote, 9000), len)?;
    }
    for len in plain {
        exchange(&mesh.client, addr(&mesh.plain, 9100), len)?;
    }
    // Bytes are counted as connections close, which can be after the
    // client is done: the access records say when.
    wait_until("every connection to be logged as closed", || {
        Ok(
            access_records(&a1.log_text(), "connection closed").len() >= 5
                && access_records(&a2.log_text(), "connection closed").len() >= 3,
        )
    })?;
    let (s1, s2) = (scrape(&a1)?, scrape(&a2)?);
    let (h, p): (usize, usize) = (hbone.iter().sum(), plain.iter().sum());
    let (h, p) = (h as f64, p as f64);
    let out_mtls = tcp_labels("source", "client", Some("remote"), true);
    let out_plain = tcp_labels("source", "client", None, false);
    let in_mtls = tcp_labels("destination", "client", Some("remote"), true);
    assert_tcp(&s1, &out_mtls, 3.0, h, 2.0 * h);
    assert_tcp(&s1, &out_plain, 2.0, p, 2.0 * p);
    assert_tcp(&s2, &in_mtls, 3.0, h, 2.0 * h);
    // Nothing else was counted, and labels come in Istio's order.
    let opened = "istio_tcp_connections_opened_total";
    assert_eq!(family(&s1, opened).len(), 2, "{s1:#?}");
    assert_eq!(family(&s2, opened).len(), 1, "{s2:#?}");
    let both = || s1.iter().chain(&s2);
    for s in both().filter(|s| s.name.starts_with("istio_tcp_")) {
        let keys: Vec<&str> = s.labels.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(keys, TCP_LABELS, "{s:?}");
    }
    // Nothing is open any more, and nothing failed.
    let open = "dataplane_tcp_connections_open";
    assert_eq!(value(&s1, open, &[("direction", "outbound")]), Some(0.0));
    assert_eq!(value(&s2, open, &[("direction", "inbound")]), Some(0.0));
    let gauges: Vec<_> = both().filter(|s| s.name == open).collect();
    assert!(gauges.iter().all(|s| s.value == 0.0), "{gauges:?}");
    let failed: Vec<_> = both().filter(|s| s.name.contains("failed")).collect();
    assert!(failed.iter().all(|s| s.value == 0.0), "{failed:?}");
    assert_eq!(value(&s1, "dataplane_enrolled_pods", &[]), Some(2.0));
    // Kernel counters are exported as read from the pinned map: every
    // connection of the client was redirected.
    let redirected = [("event", "redirected_outbound")];
    let kernel = value(&s1, "dataplane_kernel_events_total", &redirected);
    assert_eq!(kernel, Some(5.0), "{s1:#?}");
    assert_eq!(a1.counter("redirected_outbound")?, 5);
    let expiry = "dataplane_certificate_expiry_timestamp_seconds";
    let expires = value(&s1, expiry, &[("identity", CLIENT_ID)]).unwrap_or_default();
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?;
    assert!(expires > now.as_secs_f64(), "{expires} {s1:#?}");
    let build = [
        ("component", "dataplane"),
        ("tag", env!("CARGO_PKG_VERSION")),
    ];
    assert_eq!(value(&s1, "istio_build", &build), Some(1.0), "{s1:#?}");
    // Istio's other path to the same page (ztunnel `src/metrics/server.rs`
    // serves `/metrics` and `/stats/prometheus`), as some scrape configs
    // ask for it; anything else is not found.
    let (status, body) = http(a1.metrics_addr()?, "GET", "/stats/prometheus")?;
    assert_eq!(status, 200, "{body}");
    let tcp = |samples: Vec<Sample>| -> Vec<Sample> {
        samples
            .into_iter()
            .filter(|s| s.name.starts_with("istio_tcp_"))
            .collect()
    };
    assert_eq!(tcp(parse_exposition(&body)?), tcp(s1.clone()));
    assert_eq!(http(a1.metrics_addr()?, "GET", "/stats")?.0, 404);
    Ok(())
}

#[test]
fn byte_counters_grow_while_a_connection_is_open() -> anyhow::Result<()> {
    let mesh = TwoNodes::new("oplive")?;
    let (a1, a2) = mesh.agents("op", &mesh.mesh_config())?;
    // Accepts and never answers: the connection stays open with one byte
    // from the client, until the client gives up.
    let _held = holding_server(&mesh.remote, 9000)?;
    let target = addr(&mesh.remote, 9000).to_string();
    std::thread::scope(|scope| -> anyhow::Result<()> {
        let holder = scope.spawn(|| try_stream(&mesh.client, &["hold", &target, "5"]));
        for (agent, reporter, direction) in
            [(&a1, "source", "outbound"), (&a2, "destination", "inbound")]
        {
            let labels = tcp_labels(reporter, "client", Some("remote"), true);
            let labels: Vec<(&str, &str)> = labels
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect();
            let received = "istio_tcp_received_bytes_total";
            wait_until("the open connection's byte to be counted", || {
                Ok(value(&scrape(agent)?, received, &labels) == Some(1.0))
            })?;
            let samples = scrape(agent)?;
            let closed = "istio_tcp_connections_closed_total";
            assert_eq!(value(&samples, closed, &labels), Some(0.0), "{samples:#?}");
            let open = [("direction", direction)];
            let gauge = value(&samples, "dataplane_tcp_connections_open", &open);
            assert_eq!(gauge, Some(1.0), "{samples:#?}");
        }
        let held = holder
            .join()
            .map_err(|_| anyhow::anyhow!("the holding client panicked"))??;
        assert_eq!(held.stdout.trim(), "open", "{held:?}");
        Ok(())
    })
}

#[test]
fn refused_connections_are_counted_with_a_reason() -> anyhow::Result<()> {
    let mesh = TwoNodes::new("opdeny")?;
    let mut config = mesh.mesh_config();
    config.policies = vec![policy(
        "no-9001",
        NAMESPACE,
        Scope::Global,
        Action::Deny,
        to_ports(&[9001]),
    )];
    let (a1, a2) = mesh.agents("op", &config)?;
    // Something listens on 9001: only the policy can refuse.
    let _servers = [
        doubling_server(&mesh.remote, 9000)?,
        doubling_server(&mesh.remote, 9001)?,
    ];
    let denied = addr(&mesh.remote, 9001).to_string();
    // Three through HBONE tunnels, two in plaintext from outside the mesh.
    let (c, p) = (&mesh.client, &mesh.plain);
    for from in [c, c, c, p, p] {
        let out = try_stream(from, &["expect-reset", &denied])?;
        assert_eq!(out.stdout, "reset", "{out:?}");
    }
    exchange(&mesh.client, addr(&mesh.remote, 9000), 100)?;
    wait_until(
        "the refusals and the allowed connection to be logged",
        || {
            let log = a2.log_text();
            Ok(access_records(&log, "connection refused").len() >= 5
                && !access_records(&log, "connection closed").is_empty()
                && access_records(&a1.log_text(), "connection refused").len() >= 3)
        },
    )?;
    let log2 = a2.log_text();
    let refused = access_records(&log2, "connection refused");
    assert_eq!(refused.len(), 5, "{log2}");
    for r in &refused {
        assert_eq!(
            (field(r, "reason"), field(r, "direction")),
            ("denied", "inbound")
        );
        assert!(field(r, "error").contains("no-9001"), "{r:?}");
    }
    let via = |p: &str| refused.iter().filter(|r| field(r, "protocol") == p).count();
    assert_eq!((via("HBONE"), via("TCP")), (3, 2), "{log2}");
    let (s1, s2) = (scrape(&a1)?, scrape(&a2)?);
    let failed = "dataplane_tcp_connections_failed_total";
    let denied = [("direction", "inbound"), ("reason", "denied")];
    assert_eq!(value(&s2, failed, &denied), Some(5.0), "{s2:#?}");
    assert_eq!(sum(&s2, failed), 5.0, "{s2:#?}");
    // The client's side sees its tunnels refused (401).
    let tunnel = [("direction", "outbound"), ("reason", "tunnel_failed")];
    assert_eq!(value(&s1, failed, &tunnel), Some(3.0), "{s1:#?}");
    // Refused connections were never opened; the allowed one was.
    assert_eq!(
        sum(&s2, "istio_tcp_connections_opened_total"),
        1.0,
        "{s2:#?}"
    );
    // Istio's family counts them with its response flags: DENY where the
    // policy refused, CONNECT where the client's tunnel was refused.
    let istio_failed = "istio_tcp_connections_failed_total";
    let flagged = |samples: &[Sample], flags: &str, security: &str| -> f64 {
        family(samples, istio_failed)
            .iter()
            .filter(|s| {
                s.labels.contains(&("response_flags".into(), flags.into()))
                    && s.labels
                        .contains(&("connection_security_policy".into(), security.into()))
            })
            .map(|s| s.value)
            .sum()
    };
    assert_eq!(flagged(&s2, "DENY", "mutual_tls"), 3.0, "{s2:#?}");
    assert_eq!(flagged(&s2, "DENY", "none"), 2.0, "{s2:#?}");
    assert_eq!(sum(&s2, istio_failed), 5.0, "{s2:#?}");
    assert_eq!(flagged(&s1, "CONNECT", "mutual_tls"), 3.0, "{s1:#?}");
    Ok(())
}
