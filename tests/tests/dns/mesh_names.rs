//! Names the mesh knows, answered by the agent: VIPs over UDP and TCP,
//! short names through the pod's search domains, dual-stack services,
//! hostnames several namespaces share, VIPs on other networks, wildcards,
//! and services without a VIP.

use super::*;

#[test]
fn mesh_names_answer_with_their_vip_over_udp_and_tcp() -> anyhow::Result<()> {
    let upstream = FakeDns::on_loopback(UPSTREAM_TAG)?;
    let w = world("dnsmesh", upstream.addr())?;
    let name = format!("echo.{NAMESPACE}.svc.cluster.local.");
    for mode in ["udp", "udp-connected", "tcp"] {
        for server in [ASKED_V4, ASKED_V6] {
            let reply = query(&w.client, mode, asked(server), &name, "A", None)?;
            assert_eq!(reply.rcode, "No Error", "{mode} {server}: {reply:?}");
            assert_eq!(a(&reply), [IpAddr::from(ECHO_VIP)], "{mode} {server}");
        }
    }
    // Answered in the pod, not upstream.
    assert_eq!(upstream.queries(), 0);
    assert!(w.agent.counter("dns_redirected")? >= 6);
    Ok(())
}

#[test]
fn short_names_expand_through_the_pods_search_domains() -> anyhow::Result<()> {
    let upstream = FakeDns::on_loopback(UPSTREAM_TAG)?;
    let w = world("dnssearch", upstream.addr())?;
    let server = asked(ASKED_V4);
    for name in [
        "echo.".to_owned(),
        format!("echo.{NAMESPACE}."),
        format!("echo.{NAMESPACE}.svc."),
        // A stub resolver appended the pod's search domain to a full name.
        format!("echo.{NAMESPACE}.svc.cluster.local.{NAMESPACE}.svc.cluster.local."),
    ] {
        let reply = query(&w.client, "udp-connected", server, &name, "A", None)?;
        assert_eq!(reply.rcode, "No Error", "{name}: {reply:?}");
        assert_eq!(a(&reply), [IpAddr::from(ECHO_VIP)], "{name}");
    }
    // `echo.svc.cluster.local` is `echo` with `svc.cluster.local` appended:
    // a CNAME to the short name, then its address.
    let reply = query(
        &w.client,
        "udp",
        server,
        "echo.svc.cluster.local.",
        "A",
        None,
    )?;
    assert_eq!(
        reply.answers.first().map(String::as_str),
        Some("CNAME echo."),
        "{reply:?}"
    );
    assert_eq!(a(&reply), [IpAddr::from(ECHO_VIP)]);
    assert_eq!(upstream.queries(), 0);
    Ok(())
}

#[test]
fn a_dual_stack_service_answers_aaaa_and_a_v4_one_nodata() -> anyhow::Result<()> {
    let upstream = FakeDns::on_loopback(UPSTREAM_TAG)?;
    let w = world("dnsaaaa", upstream.addr())?;
    let server = asked(ASKED_V6);
    let dual = format!("dual.{NAMESPACE}.svc.cluster.local.");
    let reply = query(&w.client, "udp", server, &dual, "AAAA", None)?;
    assert_eq!(a(&reply), [IpAddr::from(DUAL_VIP6)], "{reply:?}");
    let reply = query(&w.client, "udp", server, &dual, "A", None)?;
    assert_eq!(a(&reply), [IpAddr::from(DUAL_VIP4)], "{reply:?}");
    // The name exists without an IPv6 address: NOERROR, no records.
    let echo = format!("echo.{NAMESPACE}.svc.cluster.local.");
    let reply = query(&w.client, "udp", server, &echo, "AAAA", None)?;
    assert_eq!(reply.rcode, "No Error", "{reply:?}");
    assert!(reply.answers.is_empty(), "{reply:?}");
    assert_eq!(upstream.queries(), 0);
    Ok(())
}

/// One external host defined in several namespaces (a ServiceEntry each):
/// the pod gets one its namespace may see, its own namespace's first, then
/// the canonical one (ztunnel `dns/server.rs` `find_server`,
/// `ServiceMatch::find_best_match`); a name only another namespace may see
/// is the upstream's.
#[test]
fn a_shared_hostname_answers_with_the_service_the_pods_namespace_sees() -> anyhow::Result<()> {
    use dataplane_user::config::Visibility;
    let upstream = FakeDns::on_loopback(UPSTREAM_TAG)?;
    let host = "db.ext.example";
    let entry = |ns: &str, vip: [u8; 4], canonical, visibility| {
        let mut s = service("db", ns, IpAddr::from(vip), &[(5432, 5432)]);
        s.hostname = host.to_owned();
        s.canonical = canonical;
        s.visibility = visibility;
        s
    };
    let hidden = {
        let mut s = entry("other", [10, 96, 0, 34], false, Visibility::Namespace);
        s.hostname = "hidden.up.test".to_owned();
        s
    };
    let w = world_with(
        "dnsshare",
        upstream.addr(),
        vec![
            entry("other", [10, 96, 0, 31], false, Visibility::Namespace),
            entry("canon", [10, 96, 0, 32], true, Visibility::Public),
            entry("plain", [10, 96, 0, 33], false, Visibility::Public),
            hidden,
        ],
    )?;
    let server = asked(ASKED_V4);
    let reply = query(&w.client, "udp", server, &format!("{host}."), "A", None)?;
    assert_eq!(a(&reply), [IpAddr::from([10, 96, 0, 32])], "{reply:?}");
    assert_eq!(upstream.queries(), 0);
    // Another namespace's only: the upstream answers (its tag).
    let reply = query(&w.client, "udp", server, "hidden.up.test.", "A", None)?;
    assert_eq!(a(&reply), [IpAddr::from(UPSTREAM_TAG)], "{reply:?}");
    assert_eq!(upstream.queries(), 1);
    Ok(())
}

/// A service with VIPs on several networks answers with the ones on the
/// client's network only (ztunnel `dns/server.rs` `get_addresses`:
/// `client.network == vip.network`); one whose VIPs are all another
/// network's is still the mesh's name, with no record (NODATA), not the
/// upstream's. The node here is on the default network.
#[test]
fn a_service_answers_with_its_vips_on_the_clients_network_only() -> anyhow::Result<()> {
    let upstream = FakeDns::on_loopback(UPSTREAM_TAG)?;
    let on = |network: &str, vip: [u8; 4]| dataplane_user::config::Vip::new(network, vip.into());
    let mut split = service(
        "split",
        NAMESPACE,
        IpAddr::from([10, 96, 0, 41]),
        &[(80, 80)],
    );
    split.vips = vec![on("west", [10, 96, 0, 42]), on("", [10, 96, 0, 41])];
    let mut far = service("far", NAMESPACE, IpAddr::from([10, 96, 0, 43]), &[(80, 80)]);
    far.vips = vec![on("west", [10, 96, 0, 43])];
    let w = world_with("dnsnet", upstream.addr(), vec![split, far])?;
    let server = asked(ASKED_V4);
    let name = |svc: &str| format!("{svc}.{NAMESPACE}.svc.cluster.local.");
    let reply = query(&w.client, "udp", server, &name("split"), "A", None)?;
    assert_eq!(a(&reply), [IpAddr::from([10, 96, 0, 41])], "{reply:?}");
    let reply = query(&w.client, "udp", server, &name("far"), "A", None)?;
    assert_eq!(reply.rcode, "No Error", "{reply:?}");
    assert!(reply.answers.is_empty(), "{reply:?}");
    assert_eq!(upstream.queries(), 0);
    Ok(())
}

/// A ServiceEntry for `*.wild.example` answers for every name under it
/// (the most specific wildcard first), for the name asked, with no CNAME
/// (ztunnel `dns/server.rs` `get_wildcards`, `lookup`).
#[test]
fn a_wildcard_hostname_answers_for_the_names_under_it() -> anyhow::Result<()> {
    let upstream = FakeDns::on_loopback(UPSTREAM_TAG)?;
    let wild = |host: &str, vip: [u8; 4]| {
        let mut s = service("wild", NAMESPACE, IpAddr::from(vip), &[(443, 443)]);
        s.name = host.replace('*', "star");
        s.hostname = host.to_owned();
        s
    };
    let w = world_with(
        "dnswild",
        upstream.addr(),
        vec![
            wild("*.wild.example", [10, 96, 0, 41]),
            wild("*.deep.wild.example", [10, 96, 0, 42]),
        ],
    )?;
    let server = asked(ASKED_V4);
    for (name, vip) in [
        ("api.wild.example.", [10, 96, 0, 41]),
        ("a.b.wild.example.", [10, 96, 0, 41]),
        ("api.deep.wild.example.", [10, 96, 0, 42]),
    ] {
        let reply = query(&w.client, "udp", server, name, "A", None)?;
        assert_eq!(a(&reply), [IpAddr::from(vip)], "{name}: {reply:?}");
    }
    assert_eq!(upstream.queries(), 0);
    // The wildcard's own parent is not under it: the upstream's to answer
    // (the stand-in knows only `up.test`).
    let reply = query(&w.client, "udp", server, "wild.example.", "A", None)?;
    assert_eq!(reply.rcode, "Non-Existent Domain", "{reply:?}");
    assert_eq!(upstream.queries(), 1);
    Ok(())
}

/// A service without a VIP is answered only when it is a Kubernetes
/// headless service (`*.svc.<domain>`: its endpoints' addresses); any
/// other (a ServiceEntry without addresses, resolution DNS) is asked
/// upstream, where the name is real, as ztunnel's `find_server` does.
#[test]
fn a_service_without_a_vip_is_answered_only_when_headless() -> anyhow::Result<()> {
    let upstream = FakeDns::on_loopback(UPSTREAM_TAG)?;
    let vipless = |name: &str, hostname: &str| {
        let mut s = service(
            name,
            NAMESPACE,
            Ipv4Addr::UNSPECIFIED.into(),
            &[(5432, 5432)],
        );
        s.vips.clear();
        s.hostname = hostname.to_owned();
        s
    };
    let w = world_with(
        "dnsnovip",
        upstream.addr(),
        vec![
            vipless("db", &format!("db.{NAMESPACE}.svc.cluster.local")),
            vipless("ext", "vipless.up.test"),
        ],
    )?;
    let server = asked(ASKED_V4);
    let reply = query(&w.client, "udp", server, "db.", "A", None)?;
    assert_eq!(a(&reply), [IpAddr::from(w.plain.ip4)], "{reply:?}");
    assert_eq!(upstream.queries(), 0);
    let reply = query(&w.client, "udp", server, "vipless.up.test.", "A", None)?;
    assert_eq!(a(&reply), [IpAddr::from(UPSTREAM_TAG)], "{reply:?}");
    assert_eq!(upstream.queries(), 1);
    Ok(())
}
