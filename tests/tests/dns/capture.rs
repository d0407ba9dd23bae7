//! The kernel's side of the capture: the reply comes from the server asked,
//! a pod without capture reaches its own server, glibc resolves through it,
//! and it is back after an agent restart.

use super::*;

#[test]
fn the_reply_comes_from_the_server_asked() -> anyhow::Result<()> {
    let upstream = FakeDns::on_loopback(UPSTREAM_TAG)?;
    let w = world("dnsfrom", upstream.addr())?;
    let name = format!("echo.{NAMESPACE}.svc.cluster.local.");
    for server in [ASKED_V4, ASKED_V6] {
        let unconnected = query(&w.client, "udp", asked(server), &name, "A", None)?;
        assert_eq!(
            unconnected.from, server,
            "recvfrom of an unconnected socket"
        );
        let connected = query(&w.client, "udp-connected", asked(server), &name, "A", None)?;
        assert_eq!(connected.from, server, "recvfrom of a connected socket");
        assert_eq!(connected.peer, server, "getpeername of a connected socket");
        let tcp = query(&w.client, "tcp", asked(server), &name, "A", None)?;
        assert_eq!(tcp.peer, server, "getpeername of a TCP socket");
    }
    assert!(w.agent.counter("dns_reply_rewritten")? >= 4);
    Ok(())
}

#[test]
fn a_pod_without_dns_capture_reaches_its_server_untouched() -> anyhow::Result<()> {
    let upstream = FakeDns::on_loopback(UPSTREAM_TAG)?;
    let w = world("dnsplain", upstream.addr())?;
    // A real server where both pods can reach it, answering with its own
    // tag, so it is clear who answered.
    let direct_tag = Ipv4Addr::new(192, 0, 2, 2);
    let direct = FakeDns::in_netns(w.node.netns(), "10.1.0.1:53".parse()?, direct_tag)?;
    let server = direct.addr();
    let mesh_name = format!("echo.{NAMESPACE}.svc.cluster.local.");

    let plain = query(&w.plain, "udp-connected", server, &mesh_name, "A", None)?;
    assert_eq!(
        plain.rcode, "Non-Existent Domain",
        "the server itself answered: {plain:?}"
    );
    let plain = query(&w.plain, "udp", server, "www.up.test.", "A", None)?;
    assert_eq!(a(&plain), [IpAddr::from(direct_tag)]);
    assert_eq!(direct.queries(), 2);

    // The captured pod asking the same server gets the mesh's answer and
    // the agent's upstream's, never the server's.
    let client = query(&w.client, "udp-connected", server, &mesh_name, "A", None)?;
    assert_eq!(a(&client), [IpAddr::from(ECHO_VIP)]);
    let client = query(&w.client, "udp", server, "www.up.test.", "A", None)?;
    assert_eq!(a(&client), [IpAddr::from(UPSTREAM_TAG)]);
    assert_eq!(direct.queries(), 2);
    let dns_of = |name| w.agent.pod_status(name).map(|p| p.dns_capture);
    assert_eq!(dns_of("client")?, Some(true));
    assert_eq!(dns_of("plain")?, Some(false));
    Ok(())
}

#[test]
fn glibc_resolves_mesh_and_upstream_names_with_the_pods_search_path() -> anyhow::Result<()> {
    let upstream = FakeDns::on_loopback(UPSTREAM_TAG)?;
    let w = world("dnsglibc", upstream.addr())?;
    // A pod's resolv.conf as kubelet writes it, pointing at a cluster DNS
    // address nobody serves: only capture makes names resolve.
    let conf = TempDir::new("dnsglibc-conf")?;
    let resolv = conf.path().join("resolv.conf");
    for nameserver in ["10.1.0.53", "fd00:1::53"] {
        std::fs::write(
            &resolv,
            format!(
                "nameserver {nameserver}\n\
                 search {NAMESPACE}.svc.cluster.local svc.cluster.local cluster.local\n\
                 options ndots:5 attempts:1 timeout:4\n"
            ),
        )?;
        assert_eq!(
            getent(&w.client, &resolv, "echo")?,
            [IpAddr::from(ECHO_VIP)],
            "{nameserver}"
        );
        let dual = getent(&w.client, &resolv, &format!("dual.{NAMESPACE}"))?;
        assert!(dual.contains(&IpAddr::from(DUAL_VIP4)), "{dual:?}");
        assert!(dual.contains(&IpAddr::from(DUAL_VIP6)), "{dual:?}");
        assert_eq!(
            getent(&w.client, &resolv, "www.up.test")?,
            [IpAddr::from(UPSTREAM_TAG)],
            "{nameserver}"
        );
        assert!(getent(&w.client, &resolv, "missing.up.test")?.is_empty());
    }
    Ok(())
}

#[test]
fn the_resolver_is_back_after_an_agent_restart() -> anyhow::Result<()> {
    let upstream = FakeDns::on_loopback(UPSTREAM_TAG)?;
    let mut w = world("dnsrestart", upstream.addr())?;
    let name = format!("echo.{NAMESPACE}.svc.cluster.local.");
    let server = asked(ASKED_V4);
    assert_eq!(
        a(&query(&w.client, "udp", server, &name, "A", None)?),
        [IpAddr::from(ECHO_VIP)]
    );
    // Killed without cleanup, then started again on the same pins: the
    // pod is re-adopted with its DNS capture.
    w.agent.restart()?;
    for mode in ["udp", "udp-connected", "tcp"] {
        let reply = query(&w.client, mode, server, &name, "A", None)?;
        assert_eq!(a(&reply), [IpAddr::from(ECHO_VIP)], "{mode}");
    }
    Ok(())
}
