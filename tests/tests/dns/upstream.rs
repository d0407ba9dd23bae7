//! Names the mesh does not know go to the upstream server: forwarded,
//! answered with SERVFAIL when the upstream is silent, and a large answer
//! truncated over UDP, whole over TCP.

use super::*;

#[test]
fn other_names_are_forwarded_upstream() -> anyhow::Result<()> {
    let upstream = FakeDns::on_loopback(UPSTREAM_TAG)?;
    let w = world("dnsfwd", upstream.addr())?;
    let server = asked(ASKED_V4);
    let reply = query(
        &w.client,
        "udp-connected",
        server,
        "www.up.test.",
        "A",
        Some(1400),
    )?;
    assert_eq!(a(&reply), [IpAddr::from(UPSTREAM_TAG)], "{reply:?}");
    assert_eq!(reply.from, ASKED_V4);
    // Forwarded as the pod sent it: the upstream saw the pod's EDNS0
    // record (1400, not the resolver's own 1232; a retry may have sent it
    // twice), and none on a query that had none.
    let seen = upstream.edns_payloads();
    assert!(
        !seen.is_empty() && seen.iter().all(|p| *p == Some(1400)),
        "the upstream saw EDNS payloads {seen:?}, not the pod's 1400"
    );
    let reply = query(&w.client, "tcp", server, "www2.up.test.", "A", None)?;
    assert_eq!(a(&reply), [IpAddr::from(UPSTREAM_TAG)], "{reply:?}");
    let seen = upstream.edns_payloads();
    assert_eq!(seen.last(), Some(&None), "EDNS added to a query: {seen:?}");
    // The upstream's NXDOMAIN reaches the pod as it is.
    let reply = query(&w.client, "udp", server, "missing.up.test.", "A", None)?;
    assert_eq!(reply.rcode, "Non-Existent Domain", "{reply:?}");
    // A mesh-domain name the mesh does not know is the upstream's too.
    let reply = query(
        &w.client,
        "udp",
        server,
        &format!("nope.{NAMESPACE}.svc.cluster.local."),
        "A",
        None,
    )?;
    assert_eq!(reply.rcode, "Non-Existent Domain", "{reply:?}");
    let asked_upstream = upstream.queries();
    assert!(asked_upstream >= 4, "{asked_upstream}");
    // Asked again: from the cache.
    query(&w.client, "udp", server, "www.up.test.", "A", Some(1232))?;
    assert_eq!(upstream.queries(), asked_upstream);
    let samples = scrape(&w.agent)?;
    let answers = |kind: &str| value(&samples, "dataplane_dns_answers_total", &[("kind", kind)]);
    assert_eq!(answers("forwarded"), Some(2.0));
    assert_eq!(answers("nxdomain"), Some(2.0));
    assert_eq!(answers("cached"), Some(1.0));
    assert_eq!(sum(&samples, "istio_dns_requests_total"), 5.0);
    assert!(sum(&samples, "istio_dns_upstream_requests_total") >= 4.0);
    Ok(())
}

#[test]
fn an_upstream_that_does_not_answer_gives_servfail_before_the_stub_gives_up() -> anyhow::Result<()>
{
    // Bound, never answering: the agent must not leave the pod waiting
    // past its own 5 s timeout (dp-dns fails without an answer by then).
    let (_silent, addr) = FakeDns::silent()?;
    let w = world("dnsdown", addr)?;
    for mode in ["udp-connected", "tcp"] {
        let reply = query(&w.client, mode, asked(ASKED_V4), "www.up.test.", "A", None)?;
        assert_eq!(reply.rcode, "Server Failure", "{mode}: {reply:?}");
    }
    // Mesh names still answer.
    let name = format!("echo.{NAMESPACE}.svc.cluster.local.");
    let reply = query(&w.client, "udp", asked(ASKED_V4), &name, "A", None)?;
    assert_eq!(a(&reply), [IpAddr::from(ECHO_VIP)]);
    let samples = scrape(&w.agent)?;
    assert_eq!(
        value(
            &samples,
            "dataplane_dns_answers_total",
            &[("kind", "servfail")]
        ),
        Some(2.0)
    );
    assert_eq!(
        value(&samples, "dataplane_dns_answers_total", &[("kind", "mesh")]),
        Some(1.0)
    );
    assert!(sum(&samples, "istio_dns_upstream_failures_total") >= 2.0);
    Ok(())
}

#[test]
fn a_4k_answer_is_truncated_over_udp_and_whole_over_tcp() -> anyhow::Result<()> {
    let upstream = FakeDns::on_loopback(UPSTREAM_TAG)?;
    let w = world("dnsbig", upstream.addr())?;
    let server = asked(ASKED_V4);
    let udp = query(
        &w.client,
        "udp-connected",
        server,
        "big.up.test.",
        "A",
        Some(1232),
    )?;
    assert!(udp.truncated, "{udp:?}");
    assert!(udp.answers.is_empty());
    let tcp = query(&w.client, "tcp", server, "big.up.test.", "A", None)?;
    assert!(!tcp.truncated);
    assert_eq!(tcp.addrs().len(), BIG_RECORDS);
    assert!(tcp.bytes > 4096, "{} bytes", tcp.bytes);
    Ok(())
}
