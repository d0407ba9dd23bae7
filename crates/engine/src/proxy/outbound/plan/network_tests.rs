//! Plans across networks: a pod or service endpoint on another network
//! than the client's (its workload's, else the node's `--network`) is not
//! reached directly (ztunnel `src/proxy/outbound.rs` `build_request`,
//! `build_request_wrong_network`).

#![expect(
    clippy::unwrap_used,
    reason = "a bad fixture should fail the test loudly"
)]

use std::net::{IpAddr, SocketAddr};

use http::HeaderValue;

use super::*;
use crate::config::LocalConfig;

/// A client on `east`, a pod there and one on `west` (no gateway), both
/// endpoints of `echo`; `remote`'s only endpoint is on `west` without an
/// address, behind the gateway `gw` (ztunnel `build_request_double_hbone`).
/// Each service has its VIP on every network that sees it, as istiod
/// merges a service's VIPs from its clusters' networks (`multicluster.go`).
const MESH: &str = r#"
workloads:
- {uid: client, name: client, namespace: shop, workloadIps: [10.1.0.1], network: east}
- {uid: here, name: here, namespace: shop, serviceAccount: echo, workloadIps: [10.1.0.2], network: east,
   services: {'shop/echo': {80: 9000}}}
- {uid: there, name: there, namespace: shop, serviceAccount: echo, workloadIps: [10.2.0.2], network: west,
   services: {'shop/echo': {80: 9000}}}
- {uid: far, name: far, namespace: shop, serviceAccount: echo, network: west,
   networkGateway: {address: 10.2.0.9, hbonePort: 15009}, services: {'shop/remote.shop.svc.cluster.local': {80: 9000}}}
- {uid: gw, name: gw, namespace: istio-system, serviceAccount: eastwest, workloadIps: [10.2.0.9], network: west}
services:
- {name: echo, namespace: shop, hostname: echo, vips: ['east/10.96.0.10', 'west/10.96.0.10', '/10.96.0.10'], ports: {80: 9000}}
- {name: remote, namespace: shop, hostname: remote.shop.svc.cluster.local, vips: ['east/10.96.0.11', 'west/10.96.0.11'], ports: {80: 9000},
   subjectAltNames: ['cluster.local/ns/shop/sa/echo']}
"#;

/// The node's network, nothing dead, balancing from the first endpoint.
struct OnNetwork(&'static str);

impl EndpointChoice for OnNetwork {
    fn is_dead(&self, _: IpAddr) -> bool {
        false
    }

    fn start(&self, _: &ServiceEntry) -> usize {
        0
    }

    fn draw(&self, _: u64) -> u64 {
        0
    }

    fn network(&self) -> &str {
        self.0
    }
}

/// Where the plan from `src` to `dst` sends the connection: each hop's
/// destination and whether it tunnels, or `refused`.
fn hops(src: &str, dst: &str, node_network: &'static str) -> Vec<String> {
    // The state looks captured addresses up on the node's network, as the
    // agent builds it.
    let state = MeshState::from_config(&LocalConfig::parse(MESH, "networks").unwrap())
        .unwrap()
        .on_network(node_network);
    let source = Identity::new("cluster.local", "shop", "default").unwrap();
    let plan = plan(
        &state,
        &source,
        src.parse().unwrap(),
        dst.parse::<SocketAddr>().unwrap(),
        &OnNetwork(node_network),
        super::OutboundTrafficPolicy::AllowAny,
    );
    let word = |hop: &Hop| {
        let how = if hop.is_tunnel() { "tunnel" } else { "direct" };
        format!(
            "{how} {}",
            hop.dst().map(|d| d.to_string()).unwrap_or_default()
        )
    };
    match plan.action {
        Action::Hop(hop) => vec![word(&hop)],
        Action::Failover(list) => list.iter().map(word).collect(),
        Action::Refuse { .. } => vec!["refused".to_owned()],
    }
}

#[test]
fn a_pod_on_another_network_is_dialled_as_an_address_outside_the_mesh() {
    // The client's workload is on `east`, its node's network.
    assert_eq!(
        hops("10.1.0.1", "10.2.0.2:9000", "east"),
        ["direct 10.2.0.2:9000"]
    );
    assert_eq!(
        hops("10.1.0.1", "10.1.0.2:9000", "east"),
        ["tunnel 10.1.0.2:9000"]
    );
    // Addresses are looked up on the node's network (ztunnel
    // `src/state/workload.rs` `WorkloadStore::by_addr`): from a node on
    // `west`, 10.1.0.1 is no pod of the mesh and 10.1.0.2 neither.
    assert_eq!(
        hops("10.1.0.1", "10.1.0.2:9000", "west"),
        ["direct 10.1.0.2:9000"]
    );
    // A client the mesh does not know is on the node's network.
    assert_eq!(
        hops("10.9.9.9", "10.2.0.2:9000", "west"),
        ["tunnel 10.2.0.2:9000"]
    );
    assert_eq!(
        hops("10.9.9.9", "10.1.0.2:9000", "west"),
        ["direct 10.1.0.2:9000"]
    );
}

#[test]
fn a_service_goes_to_its_endpoints_on_the_clients_network_only() {
    assert_eq!(
        hops("10.1.0.1", "10.96.0.10:80", "east"),
        ["tunnel 10.1.0.2:9000"]
    );
    assert_eq!(
        hops("10.9.9.9", "10.96.0.10:80", "west"),
        ["tunnel 10.2.0.2:9000"]
    );
    assert_eq!(hops("10.9.9.9", "10.96.0.10:80", ""), ["refused"]);
}

#[test]
fn an_endpoint_behind_a_network_gateway_is_reached_by_double_hbone() {
    let state = MeshState::from_config(&LocalConfig::parse(MESH, "networks").unwrap())
        .unwrap()
        .on_network("east");
    let source = Identity::new("cluster.local", "shop", "default").unwrap();
    let plan = plan(
        &state,
        &source,
        "10.1.0.1".parse().unwrap(),
        "10.96.0.11:80".parse().unwrap(),
        &OnNetwork("east"),
        super::OutboundTrafficPolicy::AllowAny,
    );
    let Action::Failover(hops) = plan.action else {
        panic!("{plan:?}");
    };
    let [Hop::Tunnel(hop)] = hops.as_slice() else {
        panic!("{hops:?}");
    };
    // The outer tunnel: to the gateway's HBONE port, expecting the
    // gateway; the inner one: the service by name, expecting its SANs.
    assert_eq!(hop.via, "10.2.0.9:15009".parse::<SocketAddr>().unwrap());
    assert_eq!(
        hop.dst_identity.to_uri(),
        "spiffe://cluster.local/ns/istio-system/sa/eastwest"
    );
    assert_eq!(&*hop.workload.workload.uid, "far");
    let through = hop.through.as_deref().unwrap();
    assert_eq!(through.authority, "remote.shop.svc.cluster.local:80");
    let inner: Vec<String> = through.identities.iter().map(Identity::to_uri).collect();
    assert_eq!(inner, ["spiffe://cluster.local/ns/shop/sa/echo"]);
    // Without the gateway in the mesh there is no way there (ztunnel:
    // `UnknownNetworkGateway`).
    let text = MESH.replace("workloadIps: [10.2.0.9]", "workloadIps: [10.2.0.8]");
    let state = MeshState::from_config(&LocalConfig::parse(&text, "no-gw").unwrap())
        .unwrap()
        .on_network("east");
    let plan = super::plan(
        &state,
        &source,
        "10.1.0.1".parse().unwrap(),
        "10.96.0.11:80".parse().unwrap(),
        &OnNetwork("east"),
        super::OutboundTrafficPolicy::AllowAny,
    );
    assert!(matches!(plan.action, Action::Refuse { .. }), "{plan:?}");
}

#[test]
fn the_inner_request_names_the_clients_network() {
    let baggage = HeaderValue::from_static("k8s.namespace.name=shop");
    let request = crate::proxy::outbound::gateway::inner_request(
        "remote.shop.svc.cluster.local:80",
        (
            "10.1.0.1:40000".parse().unwrap(),
            Some("remote.shop.svc.cluster.local"),
        ),
        (
            &baggage,
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00",
        ),
        "east",
    )
    .unwrap();
    let header = |name: &str| request.headers().get(name).and_then(|v| v.to_str().ok());
    assert_eq!(header("x-istio-origin-network"), Some("east"));
    assert_eq!(header("baggage"), Some("k8s.namespace.name=shop"));
    assert!(header("forwarded").is_some() && header("traceparent").is_some());
    assert_eq!(
        request.uri().to_string(),
        "remote.shop.svc.cluster.local:80"
    );
}
