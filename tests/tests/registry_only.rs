//! The mesh's outbound traffic policy (MeshConfig
//! `outboundTrafficPolicy.mode`, `--outbound-traffic-policy`;
//! istio/istio#54281): under `ALLOW_ANY` (the default) an enrolled pod
//! reaches an address the mesh does not know straight from the pod; under
//! `REGISTRY_ONLY` that connection is reset, counted under
//! `reason="registry_only"` and `response_flags="REGISTRY_ONLY"` and
//! written as a refused access record, while mesh services, a ServiceEntry
//! resolved by DNS (whose address is that same unknown pod's) and a port
//! the pod excludes from capture keep working.
//!
//! Topology: one simulated node; `client` (enrolled, its outbound port
//! 9001 excluded from capture) and `server` (enrolled, behind the service
//! `echo`) in the mesh; `outside`, a pod the mesh does not know, serving
//! echo on 9000 and 9001. The agent is standalone, its DNS upstream a
//! stand-in on loopback answering every name under `up.test` with
//! `outside`'s address.

use std::net::{Ipv4Addr, SocketAddr};

use dataplane_tests::{
    Agent, TempDir,
    dns::FakeDns,
    mesh::{NAMESPACE, config_of, endpoint_of, hbone_workload, service, write_config},
    observe::{access_records, field, scrape, sum_matching},
    topology::{Node, Pod},
    traffic::{echo, echo_server, try_stream},
};
use dataplane_user::config::{Protocol, Workload};

/// The mesh service `echo`, in front of `server`.
const ECHO_VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 50);
/// The ServiceEntry `ext` (`resolution: DNS`, host `ext.up.test`).
const EXT_VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 51);
/// The port of `outside` the client's capture excludes.
const EXCLUDED: u16 = 9001;

struct World {
    client: Pod,
    outside: Pod,
    agent: Agent,
    _upstream: FakeDns,
    _servers: Vec<dataplane_tests::Responder>,
    _dir: TempDir,
    // Last: the node's namespace goes after its pods'.
    _node: Node,
}

/// The ServiceEntry `ext`'s endpoint as istiod builds it for
/// `resolution: DNS` without endpoints: the host as its hostname, no
/// address, plain TCP.
fn dns_endpoint() -> Workload {
    Workload {
        uid: format!("Kubernetes/networking.istio.io/ServiceEntry/{NAMESPACE}/ext/ext.up.test")
            .into(),
        name: "ext".to_owned(),
        namespace: NAMESPACE.into(),
        hostname: "ext.up.test".into(),
        service_account: "default".into(),
        trust_domain: "cluster.local".into(),
        protocol: Protocol::Tcp,
        ..Workload::default()
    }
}

/// The world, its agent started with `flags`, the client enrolled with
/// outbound port [`EXCLUDED`] left uncaptured.
fn world(tag: &str, flags: &[&str]) -> anyhow::Result<World> {
    let mut node = Node::new(tag, 1)?;
    let client = node.add_pod(tag)?;
    let server = node.add_pod(tag)?;
    let outside = node.add_pod(tag)?;
    let upstream = FakeDns::on_loopback(outside.ip4)?;
    let servers = vec![
        echo_server(&server, 9000)?,
        echo_server(&outside, 9000)?,
        echo_server(&outside, EXCLUDED)?,
    ];
    let dir = TempDir::new(tag)?;
    let echo_service = service("echo", NAMESPACE, ECHO_VIP.into(), &[(80, 9000)]);
    let mut server_workload = hbone_workload(&server, "server", "node1");
    endpoint_of(&mut server_workload, &echo_service);
    let mut ext = service("ext", NAMESPACE, EXT_VIP.into(), &[(80, 9000)]);
    ext.hostname = "ext.up.test".into();
    let mut ext_endpoint = dns_endpoint();
    endpoint_of(&mut ext_endpoint, &ext);
    // Enrolled below, with its exclusion.
    let mut client_workload = hbone_workload(&client, "client", "node1");
    client_workload.netns = None;
    let mut config = config_of(vec![client_workload, server_workload, ext_endpoint]);
    config.services = vec![echo_service, ext];
    let path = write_config(dir.path(), "mesh.yaml", &config)?;
    let upstream_addr = upstream.addr().to_string();
    let flags = [&["--dns-upstream", upstream_addr.as_str()], flags].concat();
    let agent = Agent::standalone(tag, &node, "node1", &path, &dir.path().join("ca"), &flags)?;
    let mut spec = Agent::spec_for(&client, "client");
    spec.service_account = "client".to_owned();
    spec.exclusions.outbound_ports = vec![EXCLUDED];
    let response = agent.enroll(spec)?;
    anyhow::ensure!(response.ok, "enrolling the client: {:?}", response.error);
    Ok(World {
        client,
        outside,
        agent,
        _upstream: upstream,
        _servers: servers,
        _dir: dir,
        _node: node,
    })
}

/// What the mesh knows, reached under either policy: the service, the
/// ServiceEntry resolved by DNS (to `outside`), and `outside` on the port
/// the client does not capture.
fn mesh_destinations_work(w: &World) -> anyhow::Result<()> {
    echo(&w.client, SocketAddr::new(ECHO_VIP.into(), 80), 2048, 1)?;
    echo(&w.client, SocketAddr::new(EXT_VIP.into(), 80), 2048, 2)?;
    echo(
        &w.client,
        SocketAddr::new(w.outside.ip4.into(), EXCLUDED),
        2048,
        3,
    )?;
    Ok(())
}

/// The connections the agent refused for the registry, by our reason and
/// by Istio's flag.
fn refused(agent: &Agent) -> anyhow::Result<(f64, f64)> {
    let samples = scrape(agent)?;
    Ok((
        sum_matching(
            &samples,
            "dataplane_tcp_connections_failed_total",
            &[("direction", "outbound"), ("reason", "registry_only")],
        ),
        sum_matching(
            &samples,
            "istio_tcp_connections_failed_total",
            &[
                ("reporter", "source"),
                ("response_flags", "REGISTRY_ONLY"),
                ("source_workload", "client"),
            ],
        ),
    ))
}

#[test]
fn allow_any_lets_an_unknown_destination_through() -> anyhow::Result<()> {
    let w = world("regaa", &[])?;
    mesh_destinations_work(&w)?;
    // Straight from the pod to an address no workload or service has.
    echo(
        &w.client,
        SocketAddr::new(w.outside.ip4.into(), 9000),
        2048,
        4,
    )?;
    let opened = sum_matching(
        &scrape(&w.agent)?,
        "istio_tcp_connections_opened_total",
        &[("reporter", "source"), ("source_workload", "client")],
    );
    // The service, the ServiceEntry and the unknown address; not the
    // excluded port, which the agent never saw.
    assert_eq!(opened, 3.0);
    assert_eq!(refused(&w.agent)?, (0.0, 0.0));
    Ok(())
}

#[test]
fn registry_only_resets_an_unknown_destination_and_keeps_the_mesh() -> anyhow::Result<()> {
    let tag = "regro";
    // From the mesh config file, as Istio's ConfigMap gives it.
    let dir = TempDir::new(&format!("{tag}m"))?;
    let mesh_config = dir.path().join("mesh");
    std::fs::write(
        &mesh_config,
        "outboundTrafficPolicy:\n  mode: REGISTRY_ONLY\n",
    )?;
    let mesh_config = mesh_config.display().to_string();
    let w = world(tag, &["--mesh-config", &mesh_config])?;
    mesh_destinations_work(&w)?;
    let unknown = SocketAddr::new(w.outside.ip4.into(), 9000);
    let out = try_stream(&w.client, &["expect-reset", &unknown.to_string()])?;
    assert_eq!(out.stdout, "reset", "{out:?}");
    // Counted and written before the reset is sent: read at once.
    assert_eq!(refused(&w.agent)?, (1.0, 1.0));
    let log = w.agent.log_text();
    let records = access_records(&log, "connection refused");
    let ours: Vec<_> = records
        .iter()
        .filter(|r| field(r, "reason") == "registry_only")
        .collect();
    assert_eq!(ours.len(), 1, "{log}");
    assert_eq!(
        (
            field(ours[0], "dst"),
            field(ours[0], "response_flags"),
            field(ours[0], "direction"),
            field(ours[0], "src_workload"),
        ),
        (
            unknown.to_string().as_str(),
            "REGISTRY_ONLY",
            "outbound",
            "client"
        ),
    );
    // The flag wins over the file: the same agent's world with
    // `--outbound-traffic-policy allow-any` lets it through.
    drop(w);
    let w = world(
        "regrf",
        &[
            "--mesh-config",
            &mesh_config,
            "--outbound-traffic-policy",
            "allow-any",
        ],
    )?;
    echo(
        &w.client,
        SocketAddr::new(w.outside.ip4.into(), 9000),
        100,
        5,
    )?;
    assert_eq!(refused(&w.agent)?, (0.0, 0.0));
    Ok(())
}
