//! Which instances a waypoint's service offers (ztunnel `src/state.rs`
//! `load_balance` in `ServiceResolutionMode::Waypoint`), and when a
//! workload is the waypoint of an address (ztunnel `src/proxy/inbound.rs`
//! `validate_destination`).

#![expect(
    clippy::unwrap_used,
    reason = "a bad fixture should fail the test loudly"
)]

use super::*;
use crate::config::LocalConfig;

/// `wp-tunnel` and `wp-plain` serve the waypoint services `wp` (no HBONE
/// port) and `wp-hbone` (15008); `web` is behind `wp` by VIP, `api` behind
/// `wp-hbone` by hostname, `db` behind `wp-plain` by address, `free`
/// behind none; `svc` (a service) is behind `wp`.
const MESH: &str = r#"
workloads:
- {uid: wp-tunnel, name: wp-tunnel, namespace: a, serviceAccount: wp, workloadIps: [10.0.0.1],
   applicationTunnel: {protocol: PROXY, port: 15088},
   services: {a/wp.a.svc.cluster.local: {15021: 15021}, a/wp-hbone.a.svc.cluster.local: {15008: 15008}}}
- {uid: wp-plain, name: wp-plain, namespace: a, serviceAccount: wp, workloadIps: [10.0.0.2],
   services: {a/wp.a.svc.cluster.local: {15021: 15021}, a/wp-hbone.a.svc.cluster.local: {15008: 15008}}}
- {uid: web, name: web, namespace: a, workloadIps: [10.0.0.3], waypoint: {address: 10.96.0.1, hbonePort: 15008}}
- {uid: api, name: api, namespace: a, workloadIps: [10.0.0.4], waypoint: {hostname: a/wp-hbone.a.svc.cluster.local, hbonePort: 15008}}
- {uid: db, name: db, namespace: a, workloadIps: [10.0.0.5], waypoint: {address: 10.0.0.2, hbonePort: 15008}}
- {uid: free, name: free, namespace: a, workloadIps: [10.0.0.6]}
services:
- {name: wp, namespace: a, hostname: wp.a.svc.cluster.local, vips: ['/10.96.0.1'], ports: {15021: 15021}}
- {name: wp-hbone, namespace: a, hostname: wp-hbone.a.svc.cluster.local, vips: ['/10.96.0.2'], ports: {15008: 15008}}
- {name: svc, namespace: a, hostname: svc.a.svc.cluster.local, vips: ['/10.96.0.3'], ports: {80: 8080},
   waypoint: {address: 10.96.0.1, hbonePort: 15008}}
"#;

fn state() -> MeshState {
    MeshState::from_config(&LocalConfig::parse(MESH, "waypoints").unwrap()).unwrap()
}

fn uids(target: Option<WaypointTarget>) -> Vec<String> {
    let mut uids: Vec<String> = target
        .unwrap()
        .instances
        .iter()
        .map(|(w, _)| w.workload.uid.to_string())
        .collect();
    uids.sort();
    uids
}

fn waypoint_of(state: &MeshState, uid: &str) -> Waypoint {
    let workload = state.workloads.iter().find(|w| &*w.workload.uid == uid);
    *workload.unwrap().workload.waypoint.clone().unwrap()
}

#[test]
fn a_waypoint_service_without_the_hbone_port_offers_its_tunnel_instances_alone() {
    let state = state();
    // `wp` lacks 15008: only the instance with an application tunnel,
    // whichever the balancing starts at.
    let web = waypoint_of(&state, "web");
    for start in 0..4 {
        assert_eq!(
            uids(state.waypoint(&web, [0, 0, 0, 0].into(), start)),
            ["wp-tunnel"]
        );
    }
    // `wp-hbone` has it: both.
    let api = waypoint_of(&state, "api");
    assert_eq!(
        uids(state.waypoint(&api, [0, 0, 0, 0].into(), 0)),
        ["wp-plain", "wp-tunnel"]
    );
}

#[test]
fn a_workload_is_the_waypoint_of_what_names_it_and_of_nothing_else() {
    let state = state();
    let by_uid = |uid: &str| {
        let found = state.workloads.iter().find(|w| &*w.workload.uid == uid);
        Arc::clone(found.unwrap())
    };
    let (tunnel, plain) = (by_uid("wp-tunnel"), by_uid("wp-plain"));
    let ip = |s: &str| s.parse::<IpAddr>().unwrap();
    let is = |target: &str, local: &Arc<MeshWorkload>, on: &str| {
        state.is_waypoint_of(ip(target), local, ip(on))
    };
    // `web` names the service `wp` (by VIP), of which both are endpoints.
    assert!(is("10.0.0.3", &plain, "10.0.0.2"));
    assert!(is("10.0.0.3", &tunnel, "10.0.0.1"));
    // `api` names `wp-hbone` by hostname.
    assert!(is("10.0.0.4", &plain, "10.0.0.2"));
    // `db` names `wp-plain` by its address: not `wp-tunnel`.
    assert!(is("10.0.0.5", &plain, "10.0.0.2"));
    assert!(!is("10.0.0.5", &tunnel, "10.0.0.1"));
    // A service VIP behind `wp`.
    assert!(is("10.96.0.3", &plain, "10.0.0.2"));
    // No waypoint, or nothing at the address.
    assert!(!is("10.0.0.6", &plain, "10.0.0.2"));
    assert!(!is("10.9.9.9", &plain, "10.0.0.2"));
}

/// `g` on network `far` is behind the gateway service `gw` (by hostname),
/// whose HBONE port maps to 15443 (ztunnel `fetch_network_gateway`:
/// `find_upstream_from_service` in `ServiceResolutionMode::Standard`);
/// `gw-none` lacks the port, so none of its instances is one.
const GATEWAYS: &str = r#"
workloads:
- {uid: gw-1, name: gw-1, namespace: istio-system, serviceAccount: eastwest, workloadIps: [10.2.0.9], network: far,
   services: {istio-system/gw: {15021: 15021}, istio-system/gw-none: {15021: 15021}}}
- {uid: g, name: g, namespace: a, network: far,
   networkGateway: {hostname: istio-system/gw, hbonePort: 15008}}
- {uid: h, name: h, namespace: a, network: far,
   networkGateway: {hostname: istio-system/gw-none, hbonePort: 15008}}
services:
- {name: gw, namespace: istio-system, hostname: gw, vips: ['far/10.96.9.1'], ports: {15008: 15443}}
- {name: gw-none, namespace: istio-system, hostname: gw-none, vips: ['far/10.96.9.2'], ports: {15021: 15021}}
"#;

#[test]
fn a_gateway_service_is_dialled_at_its_hbone_ports_target() {
    let state = MeshState::from_config(&LocalConfig::parse(GATEWAYS, "gateways").unwrap()).unwrap();
    let gateway_of = |uid: &str| {
        let behind = state.workloads.iter().find(|w| &*w.workload.uid == uid);
        let behind = &behind.unwrap().workload;
        let gateway = behind.network_gateway.as_deref().unwrap();
        let target = state
            .network_gateway(gateway, behind, [0, 0, 0, 0].into(), 0)
            .unwrap();
        let vias: Vec<String> = target
            .instances
            .iter()
            .map(|(_, via)| via.to_string())
            .collect();
        vias
    };
    assert_eq!(gateway_of("g"), ["10.2.0.9:15443"]);
    assert!(gateway_of("h").is_empty());
}
