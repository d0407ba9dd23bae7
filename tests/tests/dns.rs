//! DNS capture end to end: queries from inside an enrolled pod, to a
//! server address nobody listens on, are steered by the kernel programs
//! (`connect`, `sendmsg`, `recvmsg`, `getpeername`) to the agent's resolver
//! in the pod, which answers mesh names from the config and forwards the
//! rest to an upstream server the test runs on loopback.
//!
//! Topology: one simulated node, an agent in standalone mode with
//! `--dns-capture` and `--dns-upstream` pointing at a stand-in server, a
//! pod `client` (DNS captured) and a pod `plain` (`dnsCapture: false`).

use std::{
    collections::HashMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
};

use dataplane_tests::{
    Agent, TempDir,
    dns::{BIG_RECORDS, DnsReply, FakeDns, getent, query},
    mesh::{NAMESPACE, config_of, endpoint_of, hbone_workload, service, write_config},
    observe::{field, parse_fields, scrape, sum, value},
    topology::{Node, Pod},
    traffic::{http, wait_until},
};

/// A server address the pods ask: no DNS server is there, so only a
/// captured query gets an answer.
const ASKED_V4: &str = "10.1.0.53:53";
const ASKED_V6: &str = "[fd00:1::53]:53";
const ECHO_VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const DUAL_VIP4: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 20);
const DUAL_VIP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x20);
/// What the upstream stand-in answers for names under `up.test`.
const UPSTREAM_TAG: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 1);

struct World {
    client: Pod,
    plain: Pod,
    agent: Agent,
    _dir: TempDir,
    // Last: the node's namespace goes after its pods'.
    node: Node,
}

/// A node with `client` (DNS captured by the agent's default) and `plain`
/// (opted out in its workload), services `echo` (IPv4) and `dual`
/// (dual-stack), and an agent forwarding to `upstream`.
fn world(tag: &str, upstream: SocketAddr) -> anyhow::Result<World> {
    world_with(tag, upstream, Vec::new())
}

/// [`world`] with `extra` services besides `echo` and `dual`.
fn world_with(
    tag: &str,
    upstream: SocketAddr,
    extra: Vec<dataplane_user::config::Service>,
) -> anyhow::Result<World> {
    let mut node = Node::new(tag, 1)?;
    let client = node.add_pod(tag)?;
    let plain = node.add_pod(tag)?;
    let dir = TempDir::new(tag)?;
    let mut plain_workload = hbone_workload(&plain, "plain", "node1");
    plain_workload.dns_capture = Some(false);
    // `plain` is an endpoint of every extra service (a headless one
    // answers with it).
    for extra in &extra {
        endpoint_of(&mut plain_workload, extra);
    }
    let mut config = config_of(vec![
        hbone_workload(&client, "client", "node1"),
        plain_workload,
    ]);
    let mut dual = service("dual", NAMESPACE, DUAL_VIP4.into(), &[(80, 9000)]);
    dual.vips.push(IpAddr::V6(DUAL_VIP6).into());
    config.services = vec![
        service("echo", NAMESPACE, ECHO_VIP.into(), &[(80, 9000)]),
        dual,
    ];
    config.services.extend(extra);
    let path = write_config(dir.path(), "mesh.yaml", &config)?;
    let upstream = upstream.to_string();
    let agent = Agent::standalone(
        tag,
        &node,
        "node1",
        &path,
        &dir.path().join("ca"),
        // DNS capture is the agent's default (Istio's since 1.29).
        &["--dns-upstream", &upstream],
    )?;
    Ok(World {
        client,
        plain,
        agent,
        _dir: dir,
        node,
    })
}

fn asked(addr: &str) -> SocketAddr {
    addr.parse().expect("a fixed address")
}

fn a(reply: &DnsReply) -> Vec<IpAddr> {
    reply.addrs()
}

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

#[test]
fn what_a_pod_sends_its_resolver_is_bounded() -> anyhow::Result<()> {
    use std::{
        io::{ErrorKind, Read as _},
        net::{TcpStream, UdpSocket},
        time::Duration,
    };

    use hickory_proto::{
        op::{Message, MessageType, OpCode, Query, ResponseCode},
        rr::{Name, RecordType},
    };

    let upstream = FakeDns::on_loopback(UPSTREAM_TAG)?;
    let w = world("dnsbound", upstream.addr())?;
    let resolver: SocketAddr = "127.0.0.1:15053".parse()?;
    let mut query = Message::new(0x77, MessageType::Query, OpCode::Query);
    query.queries.push(Query::query(
        Name::from_ascii(format!("echo.{NAMESPACE}.svc.cluster.local."))?,
        RecordType::A,
    ));
    let valid = query.to_vec()?;
    // A stranger in the pod talks to the resolver directly.
    let (garbage, valid_after, surplus, idle) =
        w.client.netns.run(move || -> anyhow::Result<_> {
            let udp = UdpSocket::bind("127.0.0.1:0")?;
            udp.set_read_timeout(Some(Duration::from_secs(10)))?;
            let mut buf = vec![0u8; 65_535];
            // A header followed by nonsense: FORMERR.
            udp.send_to(
                &[0x12, 0x34, 0x01, 0, 0, 9, 0, 9, 0, 9, 0, 9, 0xff, 0xff],
                resolver,
            )?;
            let n = udp.recv(&mut buf)?;
            let garbage = Message::from_vec(&buf[..n])?.metadata.response_code;
            // Over the size bound: dropped; the next query still answers.
            udp.send_to(&vec![0u8; 5000], resolver)?;
            udp.send_to(&valid, resolver)?;
            let n = udp.recv(&mut buf)?;
            let valid_after = Message::from_vec(&buf[..n])?.metadata.id;
            // TCP: 64 connections are served; the next one is reset.
            let held: Vec<TcpStream> = (0..64)
                .map(|_| TcpStream::connect(resolver))
                .collect::<Result<_, _>>()?;
            let mut extra = TcpStream::connect(resolver)?;
            extra.set_read_timeout(Some(Duration::from_secs(10)))?;
            let surplus = extra.read(&mut buf).map_err(|e| e.kind());
            // An idle connection is reset (after 10 s; 30 s is the liveness
            // bound).
            let mut first = held
                .into_iter()
                .next()
                .ok_or_else(|| anyhow::anyhow!("no connection"))?;
            first.set_read_timeout(Some(Duration::from_secs(30)))?;
            let idle = first.read(&mut buf).map_err(|e| e.kind());
            Ok((garbage, valid_after, surplus, idle))
        })??;
    assert_eq!(garbage, ResponseCode::FormErr);
    assert_eq!(valid_after, 0x77);
    assert_eq!(surplus, Err(ErrorKind::ConnectionReset));
    assert_eq!(idle, Err(ErrorKind::ConnectionReset));
    let samples = scrape(&w.agent)?;
    assert_eq!(
        value(
            &samples,
            "dataplane_dns_answers_total",
            &[("kind", "formerr")]
        ),
        Some(1.0)
    );
    assert!(
        value(
            &samples,
            "dataplane_dns_answers_total",
            &[("kind", "refused")]
        ) >= Some(1.0)
    );
    Ok(())
}

/// The queries a pod makes, on the log target `dns` (as ztunnel's): off at
/// the default level, one record per query once `dns=debug` is set, naming
/// the pod, the query, the result and how many records answered it.
#[test]
fn queries_are_logged_on_their_own_target_when_asked() -> anyhow::Result<()> {
    let upstream = FakeDns::on_loopback(UPSTREAM_TAG)?;
    let w = world("dnslog", upstream.addr())?;
    let server = asked(ASKED_V4);
    let mesh_name = format!("echo.{NAMESPACE}.svc.cluster.local.");
    let records = |agent: &Agent| -> Vec<HashMap<String, String>> {
        agent
            .log_text()
            .lines()
            .filter_map(|line| line.split_once(" dns: query answered "))
            .map(|(_, fields)| parse_fields(fields))
            .collect()
    };
    query(&w.client, "udp", server, &mesh_name, "A", None)?;
    assert!(records(&w.agent).is_empty(), "{}", w.agent.log_text());
    let admin = w.agent.admin_addr()?;
    let (status, body) = http(admin, "POST", "/logging?level=info,dns=debug")?;
    assert_eq!(status, 200, "{body}");
    query(&w.client, "udp", server, &mesh_name, "A", None)?;
    query(&w.client, "tcp", server, "www.up.test.", "A", None)?;
    wait_until("both queries to be logged", || {
        Ok(records(&w.agent).len() >= 2)
    })?;
    let logged = records(&w.agent);
    let mesh = logged
        .iter()
        .find(|r| field(r, "domain") == mesh_name)
        .ok_or_else(|| anyhow::anyhow!("no record of {mesh_name}: {logged:?}"))?;
    assert_eq!(
        (
            field(mesh, "result"),
            field(mesh, "answers"),
            field(mesh, "query"),
            field(mesh, "protocol"),
            field(mesh, "src_namespace"),
        ),
        ("mesh", "1", "A", "udp", NAMESPACE),
        "{mesh:?}"
    );
    assert!(!field(mesh, "src_workload").is_empty(), "{mesh:?}");
    let forwarded = logged
        .iter()
        .find(|r| field(r, "domain") == "www.up.test.")
        .ok_or_else(|| anyhow::anyhow!("no record of www.up.test.: {logged:?}"))?;
    assert_eq!(
        (field(forwarded, "result"), field(forwarded, "protocol")),
        ("forwarded", "tcp"),
        "{forwarded:?}"
    );
    Ok(())
}
