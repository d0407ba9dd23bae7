//! Endpoint choice across networks, case by case as ztunnel's own tests
//! set them up (`src/proxy/outbound.rs`: `build_request_wrong_network`,
//! `build_request_double_hbone`, `build_request_failover_to_remote`) and
//! as its `src/state.rs` `load_balance` filters endpoints.

#![expect(
    clippy::unwrap_used,
    reason = "a bad fixture should fail the test loudly"
)]

use super::*;

/// A client on the default network; `example.com` with one endpoint on
/// each kind of footing: here, on `remote` by address without a gateway
/// (`wrong`), on `remote` without an address behind a gateway (`behind`,
/// as istiod sends another network's pods), on `remote` with neither
/// (`lost`), and here without an address but with a gateway (`odd`: WDS
/// sends a gateway to every client, a same-network one must not use it).
/// `failover` prefers the network and fails over.
const MESH: &str = r#"
workloads:
- {uid: client, name: client, namespace: default, workloadIps: [127.0.0.1]}
- {uid: here, name: here, namespace: default, workloadIps: [127.0.0.2],
   services: {'default/example.com': {80: 8080}, 'default/failover.com': {80: 8080}}}
- {uid: wrong, name: wrong, namespace: default, workloadIps: [10.0.0.2], network: remote,
   services: {'default/example.com': {80: 8080}, 'default/wrong.com': {80: 8080}}}
- {uid: behind, name: behind, namespace: default, network: remote,
   networkGateway: {address: 10.22.1.1, hbonePort: 15009},
   services: {'default/example.com': {80: 8080}, 'default/remote.com': {80: 8080}, 'default/failover.com': {80: 8080}}}
- {uid: lost, name: lost, namespace: default, network: remote,
   services: {'default/example.com': {80: 8080}}}
- {uid: odd, name: odd, namespace: default,
   networkGateway: {address: 10.22.1.1, hbonePort: 15009},
   services: {'default/example.com': {80: 8080}}}
services:
- {name: example, namespace: default, hostname: example.com, vips: ['/127.0.0.3'], ports: {80: 8080}}
- {name: wrong, namespace: default, hostname: wrong.com, vips: ['/127.0.0.4'], ports: {80: 8080}}
- {name: remote, namespace: default, hostname: remote.com, vips: ['/127.0.0.5'], ports: {80: 8080}}
- {name: failover, namespace: default, hostname: failover.com, vips: ['/127.0.0.6'], ports: {80: 8080},
   routing: {mode: failover, preferences: [network]}}
"#;

fn state() -> MeshState {
    MeshState::from_config(&LocalConfig::parse(MESH, "networks").unwrap()).unwrap()
}

/// The uids of the endpoints a client (`source`, else one on
/// `local_network`) may be sent to at `vip`:80, in order, `via <gateway>`
/// after those reached through their network gateway.
fn chosen(state: &MeshState, vip: &str, source: Option<&str>, local_network: &str) -> Vec<String> {
    let entry = state.services.by_vip(vip.parse().unwrap()).unwrap();
    let source = source.map(|ip| state.workloads.by_ip(ip.parse().unwrap()).unwrap());
    entry
        .candidates(
            ([0, 0, 0, 0], 80).into(),
            0,
            source.map(Arc::as_ref),
            local_network,
            |_| false,
        )
        .into_iter()
        .map(|e| match e.addr {
            EndpointAddr::Gateway(gateway) => format!(
                "{} via {}:{}",
                e.workload.workload.uid,
                gateway.address.map(|a| a.to_string()).unwrap_or_default(),
                gateway.hbone_port
            ),
            _ => e.workload.workload.uid.to_string(),
        })
        .collect()
}

#[test]
fn the_clients_network_directly_another_only_through_a_gateway() {
    let state = state();
    // `wrong` is ztunnel's `build_request_wrong_network` (it picks it and
    // refuses the connection: we leave it out); `lost` and `odd` are
    // dropped by its `load_balance`; `behind` is its
    // `build_request_double_hbone`: through the gateway.
    let expected = ["here", "behind via 10.22.1.1:15009"];
    assert_eq!(chosen(&state, "127.0.0.3", Some("127.0.0.1"), ""), expected);
    assert_eq!(chosen(&state, "127.0.0.3", None, ""), expected);
}

#[test]
fn a_service_only_on_another_network_is_reached_through_gateways_alone() {
    let state = state();
    assert!(chosen(&state, "127.0.0.4", Some("127.0.0.1"), "").is_empty());
    assert_eq!(
        chosen(&state, "127.0.0.5", Some("127.0.0.1"), ""),
        ["behind via 10.22.1.1:15009"]
    );
}

#[test]
fn the_network_compared_is_the_clients_workloads_then_the_nodes() {
    let state = state();
    // A client the mesh does not know is on the node's network: on
    // `remote`, the endpoint there with an address is its own, `behind`
    // (no address) is dropped, `here` has no gateway, and `odd` is on
    // another network now, behind a gateway.
    assert_eq!(chosen(&state, "127.0.0.4", None, "remote"), ["wrong"]);
    assert_eq!(
        chosen(&state, "127.0.0.3", None, "remote"),
        ["wrong", "odd via 10.22.1.1:15009"]
    );
    // A known client goes by its workload's network whatever the node's.
    assert_eq!(
        chosen(&state, "127.0.0.3", Some("127.0.0.1"), "remote"),
        ["here", "behind via 10.22.1.1:15009"]
    );
}

#[test]
fn network_failover_goes_through_the_gateway_when_nothing_here_is_left() {
    // ztunnel `build_request_failover_to_remote`: with the local endpoint
    // healthy the connection stays here (the remote one comes after, for
    // failover); with it gone, through `behind`'s gateway.
    let state = state();
    assert_eq!(
        chosen(&state, "127.0.0.6", Some("127.0.0.1"), ""),
        ["here", "behind via 10.22.1.1:15009"]
    );
    let text = MESH.replace(
        "{uid: here, name: here, namespace: default,",
        "{uid: here, name: here, namespace: default, status: Unhealthy,",
    );
    let sick = MeshState::from_config(&LocalConfig::parse(&text, "sick").unwrap()).unwrap();
    assert_eq!(
        chosen(&sick, "127.0.0.6", Some("127.0.0.1"), ""),
        ["behind via 10.22.1.1:15009"]
    );
}

#[test]
fn a_network_gateway_reads_as_a_waypoint_does_and_is_checked_as_one() {
    let state = state();
    let behind = state
        .workloads
        .iter()
        .find(|w| &*w.workload.uid == "behind")
        .unwrap();
    assert_eq!(
        behind.workload.network_gateway.as_deref(),
        Some(&crate::config::Waypoint {
            address: Some([10, 22, 1, 1].into()),
            network: None,
            hostname: None,
            hbone_port: 15009,
        })
    );
    let bad = MESH.replace(
        "{address: 10.22.1.1, hbonePort: 15009}",
        "{hbonePort: 15009}",
    );
    let err = LocalConfig::parse(&bad, "bad").unwrap_err().to_string();
    assert!(err.contains("networkGateway"), "{err}");
}
