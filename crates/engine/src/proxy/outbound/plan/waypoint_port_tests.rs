//! Where a waypoint's instance is dialled (ztunnel `src/state.rs`
//! `fetch_waypoint`): an instance of a waypoint service at the port the
//! waypoint's HBONE port maps to as a port of that service (its own
//! mapping first, then the service's: `find_upstream_from_service`), a
//! waypoint workload at the HBONE port as given, a workload named by
//! hostname included (`find_hostname`'s fallback). The tunnel's
//! `:authority` is the original destination whichever it is
//! (`src/proxy/outbound.rs` `build_request`: `HboneAddress::SocketAddr(target)`).

#![expect(
    clippy::unwrap_used,
    reason = "a bad fixture should fail the test loudly"
)]

use std::net::{IpAddr, SocketAddr};

use super::*;
use crate::config::LocalConfig;

/// `api` is behind the waypoint service `waypoint` (by hostname), whose
/// HBONE port maps to 15019; of its instances `wp-1` has no mapping of
/// its own for it, `wp-2` maps it to 15018. `db` is behind the workload
/// `wp-w` named by hostname (no service has it), whose service `other`
/// maps 15008 elsewhere. `web` is behind the service `waypoint-zero`,
/// whose HBONE port maps to 0: only its instance with a mapping of its
/// own is one.
const MESH: &str = r#"
workloads:
- {uid: api, name: api, namespace: shop, serviceAccount: api, workloadIps: [10.1.0.20],
   waypoint: {hostname: shop/waypoint.shop.svc.cluster.local, hbonePort: 15008}}
- {uid: wp-1, name: wp-1, namespace: shop, serviceAccount: waypoint, workloadIps: [10.1.0.31],
   services: {'shop/waypoint.shop.svc.cluster.local': {15021: 15021},
              'shop/waypoint-zero.shop.svc.cluster.local': {15021: 15021}}}
- {uid: wp-2, name: wp-2, namespace: shop, serviceAccount: waypoint, workloadIps: [10.1.0.32],
   services: {'shop/waypoint.shop.svc.cluster.local': {15008: 15018},
              'shop/waypoint-zero.shop.svc.cluster.local': {15008: 15028}}}
- {uid: db, name: db, namespace: shop, serviceAccount: db, workloadIps: [10.1.0.40],
   waypoint: {hostname: shop/wp-w.example.com, hbonePort: 15008}}
- {uid: wp-w, name: wp-w, namespace: shop, serviceAccount: wp-w, hostname: wp-w.example.com,
   workloadIps: [10.1.0.50], services: {'shop/other.shop.svc.cluster.local': {15008: 15099}}}
- {uid: web, name: web, namespace: shop, serviceAccount: web, workloadIps: [10.1.0.60],
   waypoint: {address: 10.96.0.31, hbonePort: 15008}}
services:
- {name: waypoint, namespace: shop, hostname: waypoint.shop.svc.cluster.local, vips: ['/10.96.0.30'],
   ports: {15008: 15019}, subjectAltNames: ['cluster.local/ns/shop/sa/waypoint-alt']}
- {name: waypoint-zero, namespace: shop, hostname: waypoint-zero.shop.svc.cluster.local, vips: ['/10.96.0.31'],
   ports: {15008: 0}}
- {name: other, namespace: shop, hostname: other.shop.svc.cluster.local, vips: ['/10.96.0.32'],
   ports: {15008: 15099}}
"#;

/// Nothing dead, balancing from the first instance.
struct First;

impl EndpointChoice for First {
    fn is_dead(&self, _: IpAddr) -> bool {
        false
    }

    fn start(&self, _: &ServiceEntry) -> usize {
        0
    }

    fn draw(&self, _: u64) -> u64 {
        0
    }
}

/// Each hop of the plan from `source` (service account in `shop`) to
/// `dst`: `authority via address expecting identities`, or the refusal.
fn hops(state: &MeshState, source: &str, dst: &str) -> Vec<String> {
    let source = Identity::new("cluster.local", "shop", source).unwrap();
    let client: IpAddr = "10.9.9.9".parse().unwrap();
    let dst: SocketAddr = dst.parse().unwrap();
    let plan = plan(
        state,
        &source,
        client,
        dst,
        &First,
        OutboundTrafficPolicy::AllowAny,
    );
    let hop = |hop: &Hop| match hop {
        Hop::Tunnel(t) => {
            let mut expected = vec![t.dst_identity.to_uri()];
            expected.extend(t.alt_identities.iter().map(Identity::to_uri));
            format!("{} via {} expecting {}", t.dst, t.via, expected.join("|"))
        }
        other => format!("{other:?}"),
    };
    match &plan.action {
        Action::Hop(h) => vec![hop(h)],
        Action::Failover(all) => all.iter().map(hop).collect(),
        Action::Refuse { detail, .. } => vec![format!("refused: {detail}")],
    }
}

fn state() -> MeshState {
    MeshState::from_config(&LocalConfig::parse(MESH, "waypoint ports").unwrap()).unwrap()
}

const ID: &str = "spiffe://cluster.local/ns/shop/sa/";

#[test]
fn a_waypoint_services_instances_are_dialled_at_its_hbone_ports_target() {
    let state = state();
    let expecting = format!("{ID}waypoint|{ID}waypoint-alt");
    assert_eq!(
        hops(&state, "client", "10.1.0.20:8080"),
        [
            // The service's target port for 15008.
            format!("10.1.0.20:8080 via 10.1.0.31:15019 expecting {expecting}"),
            // The instance's own mapping first.
            format!("10.1.0.20:8080 via 10.1.0.32:15018 expecting {expecting}"),
        ]
    );
    // A target port of 0 is no port: only the instance mapping it itself.
    assert_eq!(
        hops(&state, "client", "10.1.0.60:80"),
        [format!(
            "10.1.0.60:80 via 10.1.0.32:15028 expecting {ID}waypoint"
        )]
    );
}

#[test]
fn a_waypoint_named_by_a_workloads_hostname_is_that_workload_at_the_hbone_port() {
    let state = state();
    // No service has the hostname: the workload of it, at 15008 as given
    // (not its service's mapping), expecting its identity alone.
    assert_eq!(
        hops(&state, "client", "10.1.0.40:5432"),
        [format!(
            "10.1.0.40:5432 via 10.1.0.50:15008 expecting {ID}wp-w"
        )]
    );
    // Its own connections are a waypoint's: straight to the workload.
    assert_eq!(
        hops(&state, "wp-w", "10.1.0.40:5432"),
        [format!(
            "10.1.0.40:5432 via 10.1.0.40:15008 expecting {ID}db"
        )]
    );
    // It is the waypoint of what names it (the sandwich check).
    let wp_w = state
        .workloads
        .iter()
        .find(|w| &*w.workload.uid == "wp-w")
        .unwrap();
    let ip = |s: &str| s.parse::<IpAddr>().unwrap();
    assert!(state.is_waypoint_of(ip("10.1.0.40"), wp_w, ip("10.1.0.50")));
    assert!(!state.is_waypoint_of(ip("10.1.0.20"), wp_w, ip("10.1.0.50")));
}
