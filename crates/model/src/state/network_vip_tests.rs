//! Services keyed by network address (a VIP's network and its IP), as
//! ztunnel keys them (`src/state/service.rs` `ServiceStore::by_vip`, a map
//! from `NetworkAddress`): two networks whose services share a VIP each
//! keep theirs, and a client resolves the VIP on its own network
//! (`src/state.rs` `find_upstream` with the source workload's network).

#![expect(
    clippy::unwrap_used,
    reason = "a bad fixture should fail the test loudly"
)]

use std::{net::IpAddr, sync::Arc};

use super::*;
use crate::config::{Vip, changes::Changes, entries::EntryKey};

/// `east-web` and `west-web` (one namespace) share 10.96.0.10 on their
/// networks, `plain` has it on the default one; each has a pod of its
/// network as its endpoint.
const MESH: &str = r#"
workloads:
- {uid: east-pod, name: east-pod, namespace: a, workloadIps: [10.0.0.1], network: east,
   services: {'a/east-web.a.svc.cluster.local': {80: 8080}}}
- {uid: west-pod, name: west-pod, namespace: a, workloadIps: [10.0.0.2], network: west,
   services: {'a/west-web.a.svc.cluster.local': {80: 8080}}}
services:
- {name: east-web, namespace: a, hostname: east-web.a.svc.cluster.local, vips: ['east/10.96.0.10', 'east/fd00::10'], ports: {80: 8080}}
- {name: west-web, namespace: a, hostname: west-web.a.svc.cluster.local, vips: ['west/10.96.0.10'], ports: {80: 8080}}
- {name: plain, namespace: a, hostname: plain.a.svc.cluster.local, vips: ['/10.96.0.10'], ports: {80: 8080}}
"#;

fn state() -> MeshState {
    MeshState::from_config(&LocalConfig::parse(MESH, "vips").unwrap()).unwrap()
}

fn name(entry: Option<&Arc<ServiceEntry>>) -> Option<&str> {
    entry.map(|e| &*e.service.name)
}

#[test]
fn one_vip_on_two_networks_is_two_services_each_client_gets_its_own() {
    let state = state();
    let vip = "10.96.0.10".parse().unwrap();
    let on = |network| name(state.services.by_vip_on(network, vip, "a"));
    assert_eq!(on("east"), Some("east-web"));
    assert_eq!(on("west"), Some("west-web"));
    assert_eq!(on(""), Some("plain"));
    assert_eq!(on("north"), None, "no service of that network there");
    assert_eq!(
        name(
            state
                .services
                .by_vip_on("east", "fd00::10".parse().unwrap(), "a")
        ),
        Some("east-web")
    );
    assert_eq!(
        name(
            state
                .services
                .by_vip_on("west", "fd00::10".parse().unwrap(), "a")
        ),
        None,
        "east's IPv6 VIP is not west's"
    );
    assert_eq!(
        name(
            state
                .services
                .by_vip_at("west", "::ffff:10.96.0.10".parse().unwrap())
        ),
        Some("west-web")
    );
    assert_eq!(state.services.by_vip.network_count(), 3);

    // A lookup for no client in particular is on the node's network.
    assert_eq!(name(state.services.by_vip(vip)), Some("plain"));
    let west = state.clone().on_network("west");
    assert_eq!(name(west.services.by_vip(vip)), Some("west-web"));
    assert_eq!(name(west.services.by_vip_for(vip, "a")), Some("west-web"));
    // Each service's endpoint is its network's pod.
    let endpoint = |network| {
        state.services.by_vip_on(network, vip, "a").map(|e| {
            e.endpoints()
                .iter()
                .next()
                .unwrap()
                .workload
                .uid
                .to_string()
        })
    };
    assert_eq!(endpoint("east").as_deref(), Some("east-pod"));
    assert_eq!(endpoint("west").as_deref(), Some("west-pod"));
}

#[test]
fn a_vip_changing_network_is_indexed_again() {
    let file = LocalConfig::parse(MESH, "vips").unwrap();
    let state = MeshState::from_config(&file).unwrap();
    let vip = "10.96.0.10".parse().unwrap();
    // east-web's IPv4 VIP moves to the network `south`.
    let mut moved = file.services[0].clone();
    moved.vips[0] = Vip::new("south", vip);
    let changes = Changes {
        services: vec![(EntryKey::file(0), Some(Arc::new(moved)))],
        ..Changes::default()
    };
    let (next, affected) = state.apply_tracked(&changes).unwrap();
    let on = |network| name(next.services.by_vip_on(network, vip, "a"));
    assert_eq!(on("south"), Some("east-web"));
    assert_eq!(on("east"), None, "gone from its old network");
    assert_eq!(on("west"), Some("west-web"), "the other network's kept");
    assert_eq!(on(""), Some("plain"));
    assert_eq!(
        name(
            next.services
                .by_vip_on("east", "fd00::10".parse().unwrap(), "a")
        ),
        Some("east-web"),
        "its other VIP stays where it was"
    );
    assert!(affected.touches(vip), "{affected:?}");
    // The state it was made from is untouched.
    assert_eq!(
        name(state.services.by_vip_on("east", vip, "a")),
        Some("east-web")
    );
    // And back: the network that emptied is dropped, the old one refilled.
    let back = next
        .apply(&Changes {
            services: vec![(EntryKey::file(0), Some(Arc::new(file.services[0].clone())))],
            ..Changes::default()
        })
        .unwrap();
    assert_eq!(
        name(back.services.by_vip_on("east", vip, "a")),
        Some("east-web")
    );
    assert_eq!(back.services.by_vip_on("south", vip, "a").map(|_| ()), None);
    assert_eq!(back.services.by_vip.network_count(), 3);
}

#[test]
fn one_namespace_may_use_a_vip_once_per_network() {
    let twice = r#"
services:
- {name: x, namespace: a, hostname: x.a, vips: ['east/10.96.0.9']}
- {name: y, namespace: a, hostname: y.a, vips: ['east/10.96.0.9']}
"#;
    let err = LocalConfig::parse(twice, "t").unwrap_err().to_string();
    assert!(
        err.contains("services[1].vips") && err.contains("network `east`"),
        "{err}"
    );
    let on_a_workload = r#"
workloads:
- {uid: p, name: p, namespace: a, workloadIps: [10.96.0.9], network: east}
services:
- {name: x, namespace: a, hostname: x.a, vips: ['west/10.96.0.9']}
- {name: y, namespace: a, hostname: y.a, vips: ['east/10.96.0.9']}
"#;
    let err = LocalConfig::parse(on_a_workload, "t")
        .unwrap_err()
        .to_string();
    assert!(err.contains("services[1].vips"), "{err}");
}

#[test]
fn the_file_keeps_each_vips_network() {
    let state = state();
    let config = state.config();
    let east = config
        .services
        .iter()
        .find(|s| s.name == "east-web")
        .unwrap();
    assert_eq!(
        east.vips,
        [
            "east/10.96.0.10".parse::<Vip>().unwrap(),
            "east/fd00::10".parse().unwrap()
        ]
    );
    let json = serde_json::to_value(&config).unwrap();
    assert_eq!(json["services"][0]["vips"][0], "east/10.96.0.10");
    assert_eq!(json["services"][2]["vips"][0], "/10.96.0.10");
}

/// A VIP range (a ServiceEntry's CIDR `addresses`) is its network's only,
/// as ztunnel's `NetworkCidr`: `ServiceStore::get_best_by_cidr_vip` skips
/// a range whose network is not the destination's. Here east's /24 is
/// narrower than west's /16, so a lookup that ignored networks would give
/// a west client east's range (the longest prefix).
#[test]
fn a_vip_range_holds_destinations_of_its_own_network_only() {
    let text = r#"
services:
- {name: east-range, namespace: a, hostname: e.example.com, cidrVips: ['east/192.0.2.0/24']}
- {name: west-range, namespace: a, hostname: w.example.com, cidrVips: ['west/192.0.0.0/16']}
- {name: plain-range, namespace: a, hostname: p.example.com, cidrVips: ['198.51.100.0/24']}
"#;
    let file = LocalConfig::parse(text, "ranges").unwrap();
    let state = MeshState::from_config(&file).unwrap();
    let ip = "192.0.2.7".parse().unwrap();
    fn on<'a>(state: &'a MeshState, network: &str, ip: IpAddr) -> Option<&'a str> {
        name(state.services.by_vip_on(network, ip, "a"))
    }
    assert_eq!(on(&state, "east", ip), Some("east-range"));
    assert_eq!(on(&state, "west", ip), Some("west-range"));
    assert_eq!(on(&state, "", ip), None, "no range of the default network");
    let plain = "198.51.100.1".parse().unwrap();
    assert_eq!(on(&state, "", plain), Some("plain-range"));
    assert_eq!(on(&state, "east", plain), None);
    // For no client in particular: on the node's network.
    assert_eq!(name(state.services.by_vip(plain)), Some("plain-range"));
    let east = state.clone().on_network("east");
    assert_eq!(name(east.services.by_vip(ip)), Some("east-range"));

    // east's range moves to west: gone from east, and west's clients now
    // get it (the longer prefix).
    let mut moved = file.services[0].clone();
    moved.cidr_vips[0] = "west/192.0.2.0/24".parse().unwrap();
    let next = state
        .apply(&Changes {
            services: vec![(EntryKey::file(0), Some(Arc::new(moved)))],
            ..Changes::default()
        })
        .unwrap();
    assert_eq!(on(&next, "east", ip), None, "gone from its old network");
    assert_eq!(on(&next, "west", ip), Some("east-range"));
    assert_eq!(on(&state, "east", ip), Some("east-range"), "old state kept");
    // The file form keeps the network.
    let json = serde_json::to_value(next.config()).unwrap();
    assert_eq!(json["services"][0]["cidrVips"][0], "west/192.0.2.0/24");
    assert_eq!(json["services"][2]["cidrVips"][0], "/198.51.100.0/24");
}
