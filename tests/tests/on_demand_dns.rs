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
    istio_resources::workload_resource,
    istiod::{loopback_istiod, xds_flags},
    istiod_kube::Cluster,
    istiod_serviceentry::service_entry_resources,
    mesh::{NAMESPACE, config_of, endpoint_of, hbone_workload, service, write_config},
    observe::{scrape, sum_matching, value},
    topology::{Node, Pod},
    traffic::{echo, echo_server, try_stream},
};
use dataplane_user::config::{Protocol, Workload};
use dataplane_user::istio_api::{ADDRESS_TYPE, AUTHORIZATION_TYPE};

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
        uid: format!("Kubernetes/networking.istio.io/ServiceEntry/{NAMESPACE}/{name}/{host}")
            .into(),
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

/// The same through istiod: a ServiceEntry `ext` (`resolution: DNS`, no
/// endpoints, host `ext.up.test`, port 80 to 9000, the address istiod
/// auto-allocated for it in its status) as the test istiod derives it, and
/// the client pod's workload; the agent takes its mesh from istiod only.
#[test]
fn a_service_entry_from_istiod_is_reached_at_the_address_its_host_resolves_to() -> anyhow::Result<()>
{
    let tag = "odnsi";
    let mut node = Node::new(tag, 1)?;
    let client = node.add_pod(tag)?;
    let outside = node.add_pod(tag)?;
    let upstream = FakeDns::on_loopback(outside.ip4)?;
    let server = echo_server(&outside, 9000)?;
    let dir = TempDir::new(tag)?;
    let (rt, pki, istiod) = loopback_istiod()?;
    let root = dir.path().join("root-cert.pem");
    std::fs::write(&root, &pki.root_pem)?;
    let token = dir.path().join("istio-token");
    std::fs::write(&token, "odns-token\n")?;
    let empty = write_config(dir.path(), "empty.yaml", &config_of(Vec::new()))?;
    let entry = serde_json::json!({
        "apiVersion": "networking.istio.io/v1",
        "kind": "ServiceEntry",
        "metadata": {"name": "ext", "namespace": NAMESPACE},
        "spec": {
            "hosts": ["ext.up.test"],
            "ports": [{"number": 80, "name": "tcp", "protocol": "TCP", "targetPort": 9000}],
            "resolution": "DNS",
            "location": "MESH_EXTERNAL",
        },
        "status": {"addresses": [{"host": "ext.up.test", "value": "240.240.0.7"}]},
    });
    let mut resources = service_entry_resources(&entry, &Cluster::default(), "v1");
    let mut client_workload = hbone_workload(&client, "client", "node1");
    client_workload.netns = None;
    resources.push(workload_resource(&client_workload, "v1"));
    rt.block_on(istiod.publish(ADDRESS_TYPE, resources, &[]))?;
    rt.block_on(istiod.publish(AUTHORIZATION_TYPE, Vec::new(), &[]))?;
    let mut flags = xds_flags(istiod.addr, &root, &token, "dataplane-node1");
    flags.extend(["--dns-upstream".to_owned(), upstream.addr().to_string()]);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let agent = Agent::standalone(tag, &node, "node1", &empty, &dir.path().join("ca"), &flags)?;
    let mut spec = Agent::spec_for(&client, "client");
    spec.service_account = "client".to_owned();
    let response = agent.enroll(spec)?;
    anyhow::ensure!(response.ok, "enrolling the client: {:?}", response.error);

    echo(&client, "240.240.0.7:80".parse()?, 2048, 3)?;
    let request = server
        .next_request(std::time::Duration::from_secs(10))
        .ok_or_else(|| anyhow::anyhow!("the outside server saw no connection"))?;
    assert_eq!(request.peer.ip().to_canonical(), IpAddr::from(client.ip4));
    let samples = scrape(&agent)?;
    let counted = sum_matching(
        &samples,
        "istio_on_demand_dns_total",
        &[("hostname", "ext.up.test"), ("source_workload", "client")],
    );
    assert_eq!(counted, 1.0, "{samples:?}");
    // Named as istiod names the entry's endpoint.
    let opened = sum_matching(
        &samples,
        "istio_tcp_connections_opened_total",
        &[
            ("destination_service", "ext.up.test"),
            ("destination_workload", "ext"),
            (
                "destination_principal",
                "spiffe://cluster.local/ns/test/sa/default",
            ),
        ],
    );
    assert_eq!(opened, 1.0, "{samples:?}");
    drop(agent);
    rt.block_on(istiod.stop());
    Ok(())
}
