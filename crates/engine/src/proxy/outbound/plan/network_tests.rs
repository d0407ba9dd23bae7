//! Plans across networks: a pod or service endpoint on another network
//! than the client's (its workload's, else the node's `--network`) is not
//! reached directly (ztunnel `src/proxy/outbound.rs` `build_request`,
//! `build_request_wrong_network`).

#![expect(
    clippy::unwrap_used,
    reason = "a bad fixture should fail the test loudly"
)]

use std::net::{IpAddr, SocketAddr};

use super::*;
use crate::config::LocalConfig;

/// A client on `east`, a pod there and one on `west` (no gateway), both
/// endpoints of `echo`.
const MESH: &str = r#"
workloads:
- {uid: client, name: client, namespace: shop, workloadIps: [10.1.0.1], network: east}
- {uid: here, name: here, namespace: shop, serviceAccount: echo, workloadIps: [10.1.0.2], network: east,
   services: {'shop/echo': {80: 9000}}}
- {uid: there, name: there, namespace: shop, serviceAccount: echo, workloadIps: [10.2.0.2], network: west,
   services: {'shop/echo': {80: 9000}}}
services:
- {name: echo, namespace: shop, hostname: echo, vips: ['/10.96.0.10'], ports: {80: 9000}}
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
    let state = MeshState::from_config(&LocalConfig::parse(MESH, "networks").unwrap()).unwrap();
    let source = Identity::new("cluster.local", "shop", "default").unwrap();
    let plan = plan(
        &state,
        &source,
        src.parse().unwrap(),
        dst.parse::<SocketAddr>().unwrap(),
        &OnNetwork(node_network),
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
    // The client's workload is on `east`, whatever the node says.
    for node in ["", "east", "west"] {
        assert_eq!(
            hops("10.1.0.1", "10.2.0.2:9000", node),
            ["direct 10.2.0.2:9000"]
        );
        assert_eq!(
            hops("10.1.0.1", "10.1.0.2:9000", node),
            ["tunnel 10.1.0.2:9000"]
        );
    }
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
        hops("10.1.0.1", "10.96.0.10:80", ""),
        ["tunnel 10.1.0.2:9000"]
    );
    assert_eq!(
        hops("10.9.9.9", "10.96.0.10:80", "west"),
        ["tunnel 10.2.0.2:9000"]
    );
    assert_eq!(hops("10.9.9.9", "10.96.0.10:80", ""), ["refused"]);
}
