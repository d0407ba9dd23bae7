//! Workloads keyed by network address (network and IP), as ztunnel keys
//! them (`src/state/workload.rs` `WorkloadStore::by_addr`): two networks
//! whose pod ranges overlap each keep their pod at an address, a lookup
//! of captured traffic is on this node's network (`src/state.rs`
//! `fetch_workload_by_address` with `pi.cfg.network`), and a gateway
//! named by address is looked up on its own network
//! (`fetch_network_gateway`).

#![expect(
    clippy::unwrap_used,
    reason = "a bad fixture should fail the test loudly"
)]

use std::sync::Arc;

use super::*;
use crate::config::Waypoint;

/// `east-pod` and `west-pod` share 10.0.0.1 on their networks and
/// `plain` has it on the default one; `east-gw` and `west-gw` share
/// 10.22.1.1; `far` is on `west` behind its gateway, named without a
/// network (as the file may name it).
const MESH: &str = r#"
workloads:
- {uid: east-pod, name: east-pod, namespace: a, workloadIps: [10.0.0.1, 'fd00::1'], network: east}
- {uid: west-pod, name: west-pod, namespace: b, workloadIps: [10.0.0.1, 'fd00::1'], network: west}
- {uid: plain, name: plain, namespace: c, workloadIps: [10.0.0.1]}
- {uid: east-gw, name: east-gw, namespace: istio-system, serviceAccount: east-gw, workloadIps: [10.22.1.1], network: east}
- {uid: west-gw, name: west-gw, namespace: istio-system, serviceAccount: west-gw, workloadIps: [10.22.1.1], network: west}
- {uid: far, name: far, namespace: b, network: west,
   networkGateway: {address: 10.22.1.1, hbonePort: 15009}}
"#;

fn state() -> MeshState {
    MeshState::from_config(&LocalConfig::parse(MESH, "networks").unwrap()).unwrap()
}

fn uid_at(state: &MeshState, network: &str, ip: &str) -> Option<String> {
    state
        .workloads
        .by_addr(network, ip.parse().unwrap())
        .map(|w| w.workload.uid.to_string())
}

fn uid_of(workload: Option<&Arc<MeshWorkload>>) -> Option<&str> {
    workload.map(|w| &*w.workload.uid)
}

#[test]
fn one_ip_on_two_networks_is_two_workloads_each_found_on_its_own() {
    let state = state();
    let at = |network, ip| uid_at(&state, network, ip);
    assert_eq!(at("east", "10.0.0.1").as_deref(), Some("east-pod"));
    assert_eq!(at("west", "10.0.0.1").as_deref(), Some("west-pod"));
    assert_eq!(at("", "10.0.0.1").as_deref(), Some("plain"));
    assert_eq!(at("west", "fd00::1").as_deref(), Some("west-pod"));
    assert_eq!(at("east", "::ffff:10.0.0.1").as_deref(), Some("east-pod"));
    assert_eq!(at("north", "10.0.0.1"), None, "a network nobody is on");
    assert_eq!(state.workloads.len(), 6);
    assert_eq!(state.workloads.by_addr.network_count(), 3);
}

#[test]
fn captured_traffic_is_looked_up_on_the_nodes_network() {
    let ip = "10.0.0.1".parse().unwrap();
    // A node without a network sees the default network's pod, as before
    // networks were keyed.
    let state = state();
    assert_eq!(state.workloads.network(), "");
    assert_eq!(uid_of(state.workloads.by_ip(ip)), Some("plain"));
    let west = state.clone().on_network("west");
    assert_eq!(uid_of(west.workloads.by_ip(ip)), Some("west-pod"));
    assert_eq!(west.peer_at(ip).namespace.as_deref(), Some("b"));
    // A state made from it by a change looks up on the same network.
    let gone = Changes {
        workloads: vec![(EntryKey::file(2), None)],
        ..Changes::default()
    };
    let next = west.apply(&gone).unwrap();
    assert_eq!(next.workloads.network(), "west");
    assert_eq!(uid_of(next.workloads.by_ip(ip)), Some("west-pod"));
    // ztunnel keys the empty network as any other: a node on `east` does
    // not see the default network's pod.
    let east = state.on_network("east");
    assert_eq!(
        uid_of(east.workloads.by_ip("10.0.0.1".parse().unwrap())),
        Some("east-pod")
    );
}

#[test]
fn removing_or_moving_one_leaves_the_other_network_s_pod_in_place() {
    let config = LocalConfig::parse(MESH, "networks").unwrap();
    let state = MeshState::from_config(&config).unwrap();
    let gone = Changes {
        workloads: vec![(EntryKey::file(0), None)],
        ..Changes::default()
    };
    let next = state.apply(&gone).unwrap();
    assert_eq!(uid_at(&next, "east", "10.0.0.1"), None);
    assert_eq!(uid_at(&next, "east", "fd00::1"), None);
    assert_eq!(
        uid_at(&next, "west", "10.0.0.1").as_deref(),
        Some("west-pod")
    );
    assert_eq!(uid_at(&next, "", "10.0.0.1").as_deref(), Some("plain"));
    // `east` still holds its gateway.
    assert_eq!(next.workloads.by_addr.network_count(), 3);
    // The state in force is as it was.
    assert_eq!(
        uid_at(&state, "east", "10.0.0.1").as_deref(),
        Some("east-pod")
    );

    // A workload that changes network is found on the new one only; a
    // network left empty is dropped.
    let mut moved = (*config.workloads[2]).clone();
    moved.network = "north".into();
    let moves = Changes {
        workloads: vec![(EntryKey::file(2), Some(Arc::new(moved)))],
        ..Changes::default()
    };
    let next = state.apply(&moves).unwrap();
    assert_eq!(uid_at(&next, "", "10.0.0.1"), None);
    assert_eq!(uid_at(&next, "north", "10.0.0.1").as_deref(), Some("plain"));
    assert_eq!(
        uid_at(&next, "east", "10.0.0.1").as_deref(),
        Some("east-pod")
    );
    assert_eq!(
        next.workloads.by_addr.network_count(),
        3,
        "`` gone, `north` in"
    );
}

#[test]
fn one_ip_twice_on_one_network_is_two_claimants_in_the_state_but_refused_in_the_file() {
    let config = LocalConfig::parse(MESH, "networks").unwrap();
    let state = MeshState::from_config(&config).unwrap();
    let mut twin = (*config.workloads[2]).clone();
    twin.network = "west".into();
    let joins = Changes {
        workloads: vec![(EntryKey::file(2), Some(Arc::new(twin)))],
        ..Changes::default()
    };
    // Both held on west (ztunnel `WorkloadByAddr::Many`); of two alike,
    // the last in entry order is found. See `claimants_tests`.
    let next = state.apply(&joins).unwrap();
    let ip = "10.0.0.1".parse().unwrap();
    let uids: Vec<&str> = next
        .workloads
        .claimants("west", ip)
        .iter()
        .map(|w| &*w.workload.uid)
        .collect();
    assert_eq!(uids, ["west-pod", "plain"]);
    assert_eq!(
        next.workloads.by_addr("west", ip).map(|w| &*w.workload.uid),
        Some("plain")
    );
    // And by the parser, naming the entry.
    let text = MESH.replace(
        "workloadIps: [10.0.0.1]}",
        "workloadIps: [10.0.0.1], network: east}",
    );
    let err = dataplane_core::error::Chain(&LocalConfig::parse(&text, "cfg.yaml").unwrap_err())
        .to_string();
    assert!(
        err.contains("workloads[2].workloadIps") && err.contains("on network `east`"),
        "{err}"
    );
}

#[test]
fn a_gateway_by_address_is_looked_up_on_its_network() {
    let state = state().on_network("east");
    let far = state
        .workloads
        .iter()
        .find(|w| &*w.workload.uid == "far")
        .unwrap();
    let gateway = far.workload.network_gateway.as_deref().unwrap();
    assert_eq!(gateway.network, None);
    let instance = |target: Option<WaypointTarget>| {
        target.map(|t| {
            let (w, addr) = &t.instances[0];
            (w.workload.uid.to_string(), addr.to_string())
        })
    };
    // Not named: the network of the workload behind it, not the node's.
    assert_eq!(
        instance(state.network_gateway(gateway, &far.workload, [0, 0, 0, 0].into(), 0)),
        Some(("west-gw".to_owned(), "10.22.1.1:15009".to_owned()))
    );
    // Named (as istiod sends it): that network.
    let named = |network: &str| Waypoint {
        network: Some(network.into()),
        ..gateway.clone()
    };
    assert_eq!(
        instance(state.network_gateway(&named("east"), &far.workload, [0, 0, 0, 0].into(), 0))
            .map(|(uid, _)| uid),
        Some("east-gw".to_owned())
    );
    assert_eq!(
        instance(state.network_gateway(&named("south"), &far.workload, [0, 0, 0, 0].into(), 0)),
        None,
        "no gateway at that address on that network"
    );
    // A waypoint without a network is on the node's.
    assert_eq!(
        instance(state.waypoint(gateway, [0, 0, 0, 0].into(), 0)).map(|(uid, _)| uid),
        Some("east-gw".to_owned())
    );
    assert_eq!(
        instance(state.waypoint(&named("west"), [0, 0, 0, 0].into(), 0)).map(|(uid, _)| uid),
        Some("west-gw".to_owned())
    );
}
