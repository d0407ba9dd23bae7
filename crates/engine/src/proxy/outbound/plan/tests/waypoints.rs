//! Connections to a service behind a waypoint go through it, never around
//! it, and a weighted set of waypoints shares them by weight.

use super::*;

/// `api` sits behind the waypoint service `waypoint` (two instances); the
/// `shop` service names the same waypoint by hostname; `db` names one by
/// an address nobody has.
const WAYPOINTS: &str = r#"
workloads:
- {uid: api, name: api, namespace: shop, serviceAccount: api, workloadIps: [10.1.0.20],
   waypoint: {hostname: shop/waypoint.shop.svc.cluster.local},
   services: {'shop/shop.shop.svc.cluster.local': {80: 8080}}}
- {uid: wp-1, name: wp-1, namespace: shop, serviceAccount: waypoint, workloadIps: [10.1.0.31],
   services: {'shop/waypoint.shop.svc.cluster.local': {15008: 15008}}}
- {uid: wp-2, name: wp-2, namespace: shop, serviceAccount: waypoint, workloadIps: [10.2.0.32],
   services: {'shop/waypoint.shop.svc.cluster.local': {15008: 15008}}}
- {uid: db, name: db, namespace: shop, serviceAccount: db, workloadIps: [10.1.0.40],
   waypoint: {address: 10.9.9.9}}
services:
- {name: shop, namespace: shop, hostname: shop.shop.svc.cluster.local, vips: ['/10.96.0.20'], ports: {80: 8080},
   waypoint: {hostname: shop/waypoint.shop.svc.cluster.local, hbonePort: 15008}}
- {name: waypoint, namespace: shop, hostname: waypoint.shop.svc.cluster.local, vips: ['/10.96.0.30'], ports: {15008: 15008}}
"#;

#[test]
fn waypoints_are_gone_through_and_never_bypassed() {
    let state = MeshState::from_config(&LocalConfig::parse(WAYPOINTS, "wp").unwrap()).unwrap();
    let client = Identity::new("cluster.local", "front", "web").unwrap();
    let waypoint = Identity::new("cluster.local", "shop", "waypoint").unwrap();
    let choice = |dead: &[&str], start| Fixed {
        dead: dead.iter().map(|ip| ip.parse().unwrap()).collect(),
        start,
    };
    let wp = "spiffe://cluster.local/ns/shop/sa/waypoint";
    let api = "spiffe://cluster.local/ns/shop/sa/api";
    let describe_from = |source: &Identity, dst: &str, dead: &[&str], start| {
        describe(&plan(
            &state,
            source,
            CLIENT,
            dst.parse().unwrap(),
            &choice(dead, start),
        ))
    };
    // To the workload: through its waypoint, the authority unchanged.
    assert_eq!(
        describe_from(&client, "10.1.0.20:8080", &[], 0),
        format!(
            "tunnel 10.1.0.20:8080 via 10.1.0.31:15008 expecting {wp} then tunnel 10.1.0.20:8080 via 10.2.0.32:15008 expecting {wp}"
        )
    );
    // Balanced over the instances; a dead one is tried last.
    assert_eq!(
        describe_from(&client, "10.1.0.20:8080", &["10.2.0.32"], 1),
        format!(
            "tunnel 10.1.0.20:8080 via 10.1.0.31:15008 expecting {wp} then tunnel 10.1.0.20:8080 via 10.2.0.32:15008 expecting {wp}"
        )
    );
    // To the service: through the service's waypoint, to the VIP.
    assert_eq!(
        describe_from(&client, "10.96.0.20:80", &[], 1),
        format!(
            "[shop/shop.shop.svc.cluster.local] tunnel 10.96.0.20:80 via 10.2.0.32:15008 expecting {wp} then tunnel 10.96.0.20:80 via 10.1.0.31:15008 expecting {wp}"
        )
    );
    // The waypoint itself goes straight to the workload (no loop).
    assert_eq!(
        describe_from(&waypoint, "10.1.0.20:8080", &[], 0),
        format!("tunnel 10.1.0.20:8080 via 10.1.0.20:15008 expecting {api}")
    );
    // A waypoint the mesh does not know: refused, not bypassed.
    assert_eq!(
        describe_from(&client, "10.1.0.40:5432", &[], 0),
        "refuse no_endpoints: the waypoint of workload db has no instance the mesh knows"
    );

    // The destination side adds no rule of its own, as ztunnel: without a
    // policy saying otherwise, a client that goes around the waypoint (its
    // node does not know of it) and plaintext are let in.
    let decide = |peer: Option<&Identity>| {
        state.authorize(&crate::policy::Request {
            peer,
            src: "10.1.0.31:40000".parse().unwrap(),
            dst: "10.1.0.20:8080".parse().unwrap(),
        })
    };
    assert_eq!(decide(Some(&waypoint)), Ok(()));
    assert_eq!(decide(Some(&client)), Ok(()));
    assert_eq!(decide(None), Ok(()));
}

/// A service with a weighted set of waypoints (a canary from `waypoint` to
/// `waypoint-v2`): each connection takes one drawn by weight (ztunnel
/// `sample_weighted_waypoint`), weight 0 never; either waypoint's own
/// connections go to the service; all weights 0 is the primary.
#[test]
fn a_weighted_waypoint_set_shares_the_connections_by_weight() {
    const WEIGHTED: &str = r#"
workloads:
- {uid: api, name: api, namespace: shop, serviceAccount: api, workloadIps: [10.1.0.20],
   services: {'shop/shop.shop.svc.cluster.local': {80: 8080}, 'shop/zero.shop.svc.cluster.local': {80: 8080}}}
- {uid: wp-1, name: wp-1, namespace: shop, serviceAccount: waypoint, workloadIps: [10.1.0.31]}
- {uid: wp-2, name: wp-2, namespace: shop, serviceAccount: waypoint-v2, workloadIps: [10.1.0.32]}
- {uid: wp-3, name: wp-3, namespace: shop, serviceAccount: waypoint-v3, workloadIps: [10.1.0.33]}
services:
- {name: shop, namespace: shop, hostname: shop.shop.svc.cluster.local, vips: ['/10.96.0.20'], ports: {80: 8080},
   waypoint: {address: 10.1.0.31},
   weightedWaypoints: [{waypoint: {address: 10.1.0.31}, weight: 3}, {waypoint: {address: 10.1.0.33}, weight: 0},
                       {waypoint: {address: 10.1.0.32}, weight: 1}]}
- {name: zero, namespace: shop, hostname: zero.shop.svc.cluster.local, vips: ['/10.96.0.21'], ports: {80: 8080},
   waypoint: {address: 10.1.0.31},
   weightedWaypoints: [{waypoint: {address: 10.1.0.32}, weight: 0}]}
"#;
    let state = MeshState::from_config(&LocalConfig::parse(WEIGHTED, "weighted").unwrap()).unwrap();
    let client = Identity::new("cluster.local", "front", "web").unwrap();
    let via = |source: &Identity, dst: &str, draw: usize| {
        let choice = Fixed {
            dead: HashSet::new(),
            start: draw,
        };
        describe(&plan(&state, source, CLIENT, dst.parse().unwrap(), &choice))
    };
    let through = |ip: &str, sa: &str| {
        format!(
            "[shop/shop.shop.svc.cluster.local] tunnel 10.96.0.20:80 via {ip}:15008 \
             expecting spiffe://cluster.local/ns/shop/sa/{sa}"
        )
    };
    // Draws 0..3 of 4 are the first's (weight 3), 3 the last's; the one
    // of weight 0 never.
    for draw in 0..3 {
        assert_eq!(
            via(&client, "10.96.0.20:80", draw),
            through("10.1.0.31", "waypoint")
        );
    }
    assert_eq!(
        via(&client, "10.96.0.20:80", 3),
        through("10.1.0.32", "waypoint-v2")
    );
    // Either waypoint's own connection goes to the service's endpoint.
    for sa in ["waypoint", "waypoint-v2"] {
        let waypoint = Identity::new("cluster.local", "shop", sa).unwrap();
        assert_eq!(
            via(&waypoint, "10.96.0.20:80", 3),
            format!(
                "[shop/shop.shop.svc.cluster.local] tunnel 10.1.0.20:8080 via 10.1.0.20:15008 \
                 expecting spiffe://cluster.local/ns/shop/sa/api"
            )
        );
    }
    // Nothing to draw from: the primary.
    assert_eq!(
        via(&client, "10.96.0.21:80", 0),
        "[shop/zero.shop.svc.cluster.local] tunnel 10.96.0.21:80 via 10.1.0.31:15008 \
         expecting spiffe://cluster.local/ns/shop/sa/waypoint"
    );
}
