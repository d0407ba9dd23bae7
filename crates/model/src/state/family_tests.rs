//! Which address of a dual-stack endpoint a connection goes to: the one of
//! the destination's family, within the service's `ipFamilies` (ztunnel
//! `src/state.rs` `pick_workload_destination_or_resolve`; its
//! `src/proxy/outbound.rs` test `service_ip_families` is the first case
//! here), for service endpoints, waypoint and network gateway instances.

#![expect(
    clippy::unwrap_used,
    reason = "a bad fixture should fail the test loudly"
)]

use std::net::{IpAddr, SocketAddr};

use super::*;
use crate::config::{IpFamily, LocalConfig};

/// `dual` has an IPv4 and an IPv6 address, `v4` an IPv4 one only,
/// `named` an IPv4 one and a hostname. `svc-*` are one service per
/// `ipFamilies` value, each with a VIP of either family; `wp` is a
/// waypoint service of `dual`; `front` is behind `wp` by hostname,
/// `side` by its IPv4 VIP, `back` behind the workload `dual` by its
/// hostname.
const MESH: &str = r#"
workloads:
- {uid: dual, name: dual, namespace: a, hostname: dual.example, workloadIps: [10.0.0.2, 'fd00::2'],
   services: {a/svc-auto.a.svc.cluster.local: {}, a/svc-dual.a.svc.cluster.local: {},
              a/svc-v4.a.svc.cluster.local: {}, a/svc-v6.a.svc.cluster.local: {},
              a/wp.a.svc.cluster.local: {}}}
- {uid: v4, name: v4, namespace: a, workloadIps: [10.0.0.4], services: {a/only6.a.svc.cluster.local: {}}}
- {uid: named, name: named, namespace: a, hostname: named.example, workloadIps: [10.0.0.5],
   services: {a/only6.a.svc.cluster.local: {}}}
- {uid: front, name: front, namespace: a, workloadIps: [10.0.0.6],
   waypoint: {hostname: a/wp.a.svc.cluster.local, hbonePort: 15008}}
- {uid: side, name: side, namespace: a, workloadIps: [10.0.0.7], waypoint: {address: 10.96.0.9, hbonePort: 15008}}
- {uid: back, name: back, namespace: a, workloadIps: [10.0.0.8],
   waypoint: {hostname: a/dual.example, hbonePort: 15008}}
services:
- {name: svc-auto, namespace: a, hostname: svc-auto.a.svc.cluster.local, vips: ['/10.96.0.1', '/fd00:96::1'], ports: {80: 80}}
- {name: svc-dual, namespace: a, hostname: svc-dual.a.svc.cluster.local, vips: ['/10.96.0.2', '/fd00:96::2'], ports: {80: 80},
   ipFamilies: Dual}
- {name: svc-v4, namespace: a, hostname: svc-v4.a.svc.cluster.local, vips: ['/10.96.0.3', '/fd00:96::3'], ports: {80: 80},
   ipFamilies: IPv4}
- {name: svc-v6, namespace: a, hostname: svc-v6.a.svc.cluster.local, vips: ['/10.96.0.4', '/fd00:96::4'], ports: {80: 80},
   ipFamilies: IPv6}
- {name: only6, namespace: a, hostname: only6.a.svc.cluster.local, vips: ['/10.96.0.5'], ports: {80: 80}, ipFamilies: IPv6}
- {name: wp, namespace: a, hostname: wp.a.svc.cluster.local, vips: ['/10.96.0.9', '/fd00:96::9'], ports: {15008: 15008}}
"#;

fn state() -> MeshState {
    MeshState::from_config(&LocalConfig::parse(MESH, "families").unwrap()).unwrap()
}

fn ip(text: &str) -> IpAddr {
    text.parse().unwrap()
}

/// Where the first candidate of the service at `vip` goes for a
/// connection to `vip`:80.
fn endpoint(state: &MeshState, vip: &str) -> Option<EndpointAddr> {
    let dst = SocketAddr::new(ip(vip), 80);
    let entry = state.services.by_vip_at("", dst.ip()).unwrap();
    let candidates = entry.candidates(dst, 0, None, "", |_| false);
    candidates.into_iter().next().map(|e| e.addr)
}

fn at(addr: &str) -> Option<EndpointAddr> {
    Some(EndpointAddr::Ip(SocketAddr::new(ip(addr), 80)))
}

#[test]
fn a_service_endpoint_is_dialled_in_the_destinations_family_within_the_services() {
    let state = state();
    // As ztunnel's `service_ip_families`: single-family services always
    // in theirs, a dual-stack one (and an automatic one) in the family
    // dialled.
    assert_eq!(endpoint(&state, "10.96.0.4"), at("fd00::2"));
    assert_eq!(endpoint(&state, "fd00:96::3"), at("10.0.0.2"));
    assert_eq!(endpoint(&state, "10.96.0.2"), at("10.0.0.2"));
    assert_eq!(endpoint(&state, "fd00:96::2"), at("fd00::2"));
    assert_eq!(endpoint(&state, "fd00:96::1"), at("fd00::2"));
    assert_eq!(endpoint(&state, "10.96.0.1"), at("10.0.0.2"));
}

#[test]
fn an_endpoint_without_an_address_of_the_services_family_is_reached_by_its_hostname_or_not_at_all()
{
    let state = state();
    // `only6` is IPv6-only: `v4` has no address for it and no hostname,
    // `named` is resolved by name (ztunnel resolves a workload's
    // hostname when no address fits).
    let dst = SocketAddr::new(ip("10.96.0.5"), 80);
    let entry = state.services.by_vip_at("", dst.ip()).unwrap();
    let addrs: Vec<EndpointAddr> = entry
        .candidates(dst, 0, None, "", |_| false)
        .into_iter()
        .map(|e| e.addr)
        .collect();
    assert_eq!(
        addrs,
        [EndpointAddr::Hostname(Arc::from("named.example"), 80)]
    );
}

#[test]
fn a_waypoint_instance_follows_the_waypoints_address_else_the_destinations_family() {
    let state = state();
    let waypoint_of = |uid: &str| {
        let workload = state.workloads.iter().find(|w| &*w.workload.uid == uid);
        *workload.unwrap().workload.waypoint.clone().unwrap()
    };
    let via = |uid: &str, original: &str| {
        let target = state.waypoint(&waypoint_of(uid), ip(original), 0).unwrap();
        let instances: Vec<SocketAddr> = target.instances.iter().map(|(_, via)| *via).collect();
        instances
    };
    let hbone = |addr: &str| vec![SocketAddr::new(ip(addr), 15008)];
    // By hostname: the family of the connection's destination.
    assert_eq!(via("front", "fd00::6"), hbone("fd00::2"));
    assert_eq!(via("front", "10.0.0.6"), hbone("10.0.0.2"));
    // By address: the address's family, whatever was dialled (ztunnel
    // `fetch_waypoint`: `target_address` is the waypoint's).
    assert_eq!(via("side", "fd00::7"), hbone("10.0.0.2"));
    // A workload named by hostname: its address of the destination's.
    assert_eq!(via("back", "fd00::8"), hbone("fd00::2"));
    assert_eq!(via("back", "10.0.0.8"), hbone("10.0.0.2"));
}

#[test]
fn pick_address_prefers_the_original_then_its_family_within_the_allowed() {
    let (v4, v6) = (ip("10.0.0.2"), ip("fd00::2"));
    let both = [v4, v6];
    assert_eq!(pick_address(&both, v6, None), Some(v6));
    assert_eq!(pick_address(&both, ip("fd00::9"), None), Some(v6));
    assert_eq!(pick_address(&both, ip("10.0.0.9"), None), Some(v4));
    assert_eq!(
        pick_address(&both, ip("fd00::9"), Some(IpFamily::IPv4)),
        Some(v4)
    );
    assert_eq!(
        pick_address(&both, ip("10.0.0.9"), Some(IpFamily::IPv6)),
        Some(v6)
    );
    assert_eq!(
        pick_address(&both, ip("10.0.0.9"), Some(IpFamily::Dual)),
        Some(v4)
    );
    // None of the family dialled: the first allowed.
    assert_eq!(pick_address(&[v4], ip("fd00::9"), None), Some(v4));
    // None allowed.
    assert_eq!(
        pick_address(&[v4], ip("10.0.0.9"), Some(IpFamily::IPv6)),
        None
    );
    assert_eq!(pick_address(&[], ip("10.0.0.9"), None), None);
    // The address dialled, when the workload has it, whatever the rest.
    assert_eq!(pick_address(&both, v4, Some(IpFamily::IPv6)), Some(v4));
}
