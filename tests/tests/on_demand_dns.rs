//! Service endpoints known by DNS name only (a ServiceEntry with
//! `resolution: DNS`: istiod sends a workload with a `hostname` and no
//! address, istio `serviceEntryWorkloadBuilder`): the agent resolves the
//! name when a connection to the service picks the endpoint and connects
//! to an address it resolved to (ztunnel `src/state.rs`
//! `resolve_on_demand_dns`), counting it in `istio_on_demand_dns_total`.
//!
//! Topology: one simulated node, an agent in standalone mode whose DNS
//! upstream is a stand-in server on loopback that answers every name under
//! `up.test` (but `missing.up.test`) with the address of a pod outside the
//! mesh, where an echo server listens; a meshed pod `client` dials the
//! services' VIPs.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use dataplane_tests::{
    Agent, TempDir,
    dns::FakeDns,
    mesh::{NAMESPACE, config_of, endpoint_of, hbone_workload, service, write_config},
    observe::{scrape, sum_matching, value},
    topology::{Node, Pod},
    traffic::{echo, echo_server, try_stream},
};
use dataplane_user::config::{Protocol, Workload};

const EXT_VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 40);
const MISSING_VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 41);

struct World {
    client: Pod,
    outside: Pod,
    agent: Agent,
    upstream: FakeDns,
    _dir: TempDir,
    // Last: the node's namespace goes after its pods'.
    _node: Node,
}

/// A ServiceEntry endpoint as istiod builds it for `resolution: DNS`
/// without endpoints: named for the entry, uid
/// `<cluster>/networking.istio.io/ServiceEntry/<ns>/<name>/<host>`, the
/// host as its hostname, no address, plain TCP.
fn dns_endpoint(name: &str, host: &str) -> Workload {
    Workload {
        uid: format!("Kubernetes/networking.istio.io/ServiceEntry/{NAMESPACE}/{name}/{host}"),
        name: name.to_owned(),
        namespace: NAMESPACE.into(),
        hostname: host.into(),
        // What the translation of istiod's empty fields gives.
        service_account: "default".into(),
        trust_domain: "cluster.local".into(),
        protocol: Protocol::Tcp,
        ..Workload::default()
    }
}

fn world(tag: &str) -> anyhow::Result<World> {
    let mut node = Node::new(tag, 1)?;
    let client = node.add_pod(tag)?;
    // Not in the config: outside the mesh.
    let outside = node.add_pod(tag)?;
    let upstream = FakeDns::on_loopback(outside.ip4)?;
    let dir = TempDir::new(tag)?;
    let mut ext = service("ext", NAMESPACE, EXT_VIP.into(), &[(80, 9000)]);
    ext.hostname = "ext.up.test".into();
    let mut missing = service("missing", NAMESPACE, MISSING_VIP.into(), &[(80, 9000)]);
    missing.hostname = "missing.up.test".into();
    let mut ext_endpoint = dns_endpoint("ext", "ext.up.test");
    endpoint_of(&mut ext_endpoint, &ext);
    let mut missing_endpoint = dns_endpoint("missing", "missing.up.test");
    endpoint_of(&mut missing_endpoint, &missing);
    let mut config = config_of(vec![
        hbone_workload(&client, "client", "node1"),
        ext_endpoint,
        missing_endpoint,
    ]);
    config.services = vec![ext, missing];
    let path = write_config(dir.path(), "mesh.yaml", &config)?;
    let upstream_addr = upstream.addr().to_string();
    let agent = Agent::standalone(
        tag,
        &node,
        "node1",
        &path,
        &dir.path().join("ca"),
        &["--dns-upstream", &upstream_addr],
    )?;
    Ok(World {
        client,
        outside,
        agent,
        upstream,
        _dir: dir,
        _node: node,
    })
}

#[test]
fn an_endpoint_known_by_name_is_resolved_when_a_connection_picks_it() -> anyhow::Result<()> {
    let w = world("odns")?;
    let server = echo_server(&w.outside, 9000)?;
    let asked_before = w.upstream.queries();
    // Nothing answers at the VIP: only the agent, resolving the name and
    // dialling what it resolved to, makes this echo work.
    let vip = SocketAddr::new(EXT_VIP.into(), 80);
    echo(&w.client, vip, 4096, 1)?;
    let request = server
        .next_request(std::time::Duration::from_secs(10))
        .ok_or_else(|| anyhow::anyhow!("the outside server saw no connection"))?;
    // Plain TCP from inside the pod (the endpoint speaks no HBONE), to
    // the target port.
    let (peer, local) = (request.peer, request.local);
    assert_eq!(
        (
            peer.ip().to_canonical(),
            local.ip().to_canonical(),
            local.port()
        ),
        (
            IpAddr::from(w.client.ip4),
            IpAddr::from(w.outside.ip4),
            9000
        ),
        "{peer} -> {local}"
    );
    // The agent asked the upstream (A and AAAA).
    assert!(w.upstream.queries() >= asked_before + 2);
    let samples = scrape(&w.agent)?;
    let counted = value(
        &samples,
        "istio_on_demand_dns_total",
        &[
            ("hostname", "ext.up.test"),
            ("source_workload", "client"),
            ("source_workload_namespace", NAMESPACE),
            (
                "source_principal",
                "spiffe://cluster.local/ns/test/sa/client",
            ),
            ("source_canonical_service", "client"),
            ("source_canonical_revision", "latest"),
            ("source_app", "client"),
            ("source_version", "latest"),
            ("source_cluster", "unknown"),
        ],
    );
    assert_eq!(counted, Some(1.0), "{samples:?}");
    let opened = sum_matching(
        &samples,
        "istio_tcp_connections_opened_total",
        &[
            ("destination_service", "ext.up.test"),
            ("destination_workload", "ext"),
            ("connection_security_policy", "none"),
        ],
    );
    assert_eq!(opened, 1.0, "{samples:?}");
    // A second connection: the address is cached (its 60 s TTL), not
    // asked again; the empty AAAA answer is kept 5 s only, so it may be.
    let asked = w.upstream.queries();
    echo(&w.client, vip, 100, 2)?;
    assert!(w.upstream.queries() <= asked + 1);
    let samples = scrape(&w.agent)?;
    let counted = sum_matching(
        &samples,
        "istio_on_demand_dns_total",
        &[("hostname", "ext.up.test")],
    );
    assert_eq!(counted, 2.0);
    Ok(())
}

#[test]
fn a_name_that_does_not_resolve_resets_the_client() -> anyhow::Result<()> {
    let w = world("odnsx")?;
    let vip = SocketAddr::new(MISSING_VIP.into(), 80);
    let out = try_stream(&w.client, &["expect-reset", &vip.to_string()])?;
    assert_eq!(out.stdout, "reset", "{out:?}");
    let samples = scrape(&w.agent)?;
    let failed = sum_matching(
        &samples,
        "dataplane_tcp_connections_failed_total",
        &[("direction", "outbound"), ("reason", "dns_failed")],
    );
    assert_eq!(failed, 1.0, "{samples:?}");
    let istio_failed = sum_matching(
        &samples,
        "istio_tcp_connections_failed_total",
        &[
            ("destination_service", "missing.up.test"),
            ("response_flags", "CONNECT"),
        ],
    );
    assert_eq!(istio_failed, 1.0, "{samples:?}");
    let counted = sum_matching(
        &samples,
        "istio_on_demand_dns_total",
        &[("hostname", "missing.up.test")],
    );
    assert_eq!(counted, 1.0, "{samples:?}");
    Ok(())
}
