//! One row per routing rule: a destination, the endpoints found dead, and
//! the plan written out in words.

#![expect(
    clippy::unwrap_used,
    reason = "a bad fixture should fail the test loudly"
)]

use std::{
    collections::HashSet,
    net::{IpAddr, SocketAddr},
    sync::Arc,
};

use super::*;
use crate::config::LocalConfig;

/// [`super::plan`] under the default policy, `ALLOW_ANY`, which every
/// row but the registry-only ones plans under.
fn plan(
    state: &MeshState,
    source: &Identity,
    src: IpAddr,
    dst: SocketAddr,
    choice: &impl EndpointChoice,
) -> OutboundPlan {
    super::plan(
        state,
        source,
        src,
        dst,
        choice,
        OutboundTrafficPolicy::AllowAny,
    )
}

/// Three HBONE workloads behind one VIP (two on one node, one on
/// another), a plain-TCP workload, a dual-stack workload, a service
/// without endpoints, and a ServiceEntry's whose endpoint has a DNS name
/// and no IP.
const MESH: &str = r#"
workloads:
- uid: a
  name: a
  namespace: shop
  serviceAccount: echo
  workloadIps: [10.1.0.11]
  services: {'shop/echo.shop.svc.cluster.local': {80: 9000}}
- uid: b
  name: b
  namespace: shop
  serviceAccount: echo
  workloadIps: [10.1.0.12]
  services: {'shop/echo.shop.svc.cluster.local': {80: 9000}}
- uid: c
  name: c
  namespace: shop
  serviceAccount: echo-v2
  workloadIps: [10.2.0.11]
  services: {'shop/echo.shop.svc.cluster.local': {80: 9001}}
- uid: legacy
  name: legacy
  namespace: old
  serviceAccount: legacy
  protocol: TCP
  workloadIps: [10.1.0.20]
- uid: dual
  name: dual
  namespace: shop
  serviceAccount: dual
  workloadIps: [10.1.0.30, 'fd00:1::30']
- uid: Kubernetes/networking.istio.io/ServiceEntry/shop/api/api.example.com
  name: api
  namespace: shop
  protocol: TCP
  hostname: api.example.com
  services: {'shop/api.example.com': {443: 8443}}
- uid: no-address
  name: no-address
  namespace: shop
  services: {'shop/api.example.com': {443: 8443}}
services:
- name: echo
  namespace: shop
  hostname: echo.shop.svc.cluster.local
  vips: ['/10.96.0.10', '/fd00:96::10']
  ports: {80: 9000}
  subjectAltNames: ['cluster.local/ns/shop/sa/echo-canary']
- name: empty
  namespace: shop
  hostname: empty.shop.svc.cluster.local
  vips: ['/10.96.0.11']
- name: private
  namespace: shop
  hostname: private.shop.svc.cluster.local
  vips: ['/10.96.0.12']
  visibility: namespace
- name: api
  namespace: shop
  hostname: api.example.com
  vips: ['/240.240.0.1']
  ports: {443: 443}
"#;

/// A client address the mesh does not know.
const CLIENT: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(10, 9, 9, 9));

/// Fixed inputs: endpoints found dead, and where balancing starts.
struct Fixed {
    dead: HashSet<IpAddr>,
    start: usize,
}

impl EndpointChoice for Fixed {
    fn is_dead(&self, ip: IpAddr) -> bool {
        self.dead.contains(&ip)
    }

    fn start(&self, _: &ServiceEntry) -> usize {
        self.start
    }

    /// The start as the draw, so a table row picks the weighted waypoint.
    fn draw(&self, below: u64) -> u64 {
        self.start as u64 % below
    }
}

/// The plan in words: `tunnel DST via VIA expecting ID[|ALT]`,
/// `direct DST [to WORKLOAD]`, `refuse REASON: DETAIL`, hops joined by
/// ` then `, prefixed by `[service] ` for a VIP.
fn describe(plan: &OutboundPlan) -> String {
    let hop = |hop: &Hop| match hop {
        Hop::Direct { dst, workload } => match workload {
            Some(w) => format!("direct {dst} to {}", w.workload.name),
            None => format!("direct {dst}"),
        },
        Hop::Tunnel(t) => {
            let mut expected = vec![t.dst_identity.to_uri()];
            expected.extend(t.alt_identities.iter().map(Identity::to_uri));
            format!(
                "tunnel {} via {} expecting {}",
                t.dst,
                t.via,
                expected.join("|")
            )
        }
        Hop::Resolve(r) => format!(
            "resolve {}:{} to {}{}",
            r.hostname,
            r.port,
            r.workload.workload.name,
            if r.workload.speaks_hbone() {
                " (tunnel)"
            } else {
                ""
            }
        ),
    };
    let action = match &plan.action {
        Action::Hop(h) => hop(h),
        Action::Failover(hops) => hops.iter().map(hop).collect::<Vec<_>>().join(" then "),
        Action::Refuse { reason, detail } => format!("refuse {}: {detail}", reason.as_str()),
    };
    match &plan.service {
        Some(service) => format!("[{}/{}] {action}", service.namespace, service.hostname),
        None => action,
    }
}

const ID: &str = "spiffe://cluster.local/ns/shop/sa/";

#[test]
fn outbound_plans() {
    let state = MeshState::from_config(&LocalConfig::parse(MESH, "plan").unwrap()).unwrap();
    let source = Identity::new("cluster.local", "front", "web").unwrap();
    let echo = "[shop/echo.shop.svc.cluster.local]";
    let canary = "spiffe://cluster.local/ns/shop/sa/echo-canary";
    #[rustfmt::skip]
    let table: Vec<(&str, &str, &[&str], usize, String)> = vec![
        ("workload speaking HBONE", "10.1.0.11:9000", &[], 0,
            format!("tunnel 10.1.0.11:9000 via 10.1.0.11:15008 expecting {ID}echo")),
        ("workload speaking plain TCP", "10.1.0.20:5432", &[], 0,
            "direct 10.1.0.20:5432 to legacy".into()),
        ("address outside the mesh: passthrough", "192.0.2.7:443", &[], 0,
            "direct 192.0.2.7:443".into()),
        ("service VIP: every endpoint, balancing start first, target ports mapped", "10.96.0.10:80", &[], 1,
            format!("{echo} tunnel 10.1.0.12:9000 via 10.1.0.12:15008 expecting {ID}echo|{canary} \
                     then tunnel 10.2.0.11:9001 via 10.2.0.11:15008 expecting {ID}echo-v2|{canary} \
                     then tunnel 10.1.0.11:9000 via 10.1.0.11:15008 expecting {ID}echo|{canary}")),
        ("service VIP: an endpoint whose node did not answer is tried last", "10.96.0.10:80", &["10.1.0.12"], 1,
            format!("{echo} tunnel 10.2.0.11:9001 via 10.2.0.11:15008 expecting {ID}echo-v2|{canary} \
                     then tunnel 10.1.0.11:9000 via 10.1.0.11:15008 expecting {ID}echo|{canary} \
                     then tunnel 10.1.0.12:9000 via 10.1.0.12:15008 expecting {ID}echo|{canary}")),
        ("service VIP: all dead keeps the balancing order", "10.96.0.10:80", &["10.1.0.11", "10.1.0.12", "10.2.0.11"], 2,
            format!("{echo} tunnel 10.2.0.11:9001 via 10.2.0.11:15008 expecting {ID}echo-v2|{canary} \
                     then tunnel 10.1.0.11:9000 via 10.1.0.11:15008 expecting {ID}echo|{canary} \
                     then tunnel 10.1.0.12:9000 via 10.1.0.12:15008 expecting {ID}echo|{canary}")),
        ("service VIP over IPv6 reaches the same endpoints", "[fd00:96::10]:80", &[], 0,
            format!("{echo} tunnel 10.1.0.11:9000 via 10.1.0.11:15008 expecting {ID}echo|{canary} \
                     then tunnel 10.1.0.12:9000 via 10.1.0.12:15008 expecting {ID}echo|{canary} \
                     then tunnel 10.2.0.11:9001 via 10.2.0.11:15008 expecting {ID}echo-v2|{canary}")),
        ("service endpoint known by DNS name only: resolved when tried; one with neither name nor IP skipped",
            "240.240.0.1:443", &[], 0,
            "[shop/api.example.com] resolve api.example.com:8443 to api".into()),
        ("service without endpoints", "10.96.0.11:80", &[], 0,
            "[shop/empty.shop.svc.cluster.local] refuse no_endpoints: service shop/empty.shop.svc.cluster.local has no endpoints".into()),
        ("workload over IPv6", "[fd00:1::30]:8080", &[], 0,
            format!("tunnel [fd00:1::30]:8080 via [fd00:1::30]:15008 expecting {ID}dual")),
        ("IPv4-mapped IPv6 is the IPv4 workload", "[::ffff:10.1.0.30]:8080", &[], 0,
            format!("tunnel 10.1.0.30:8080 via 10.1.0.30:15008 expecting {ID}dual")),
        ("IPv4-mapped IPv6 outside the mesh stays a passthrough", "[::ffff:192.0.2.7]:443", &[], 0,
            "direct 192.0.2.7:443".into()),
        ("unknown IPv6 address: passthrough", "[2001:db8::1]:443", &[], 0,
            "direct [2001:db8::1]:443".into()),
        ("outbound capture port: refused, not looped", "10.1.0.11:15001", &[], 0,
            "refuse engine_port: destination port 15001 is a capture port of the engine (dialling it would loop)".into()),
        ("inbound capture port: refused, not looped", "192.0.2.7:15006", &[], 0,
            "refuse engine_port: destination port 15006 is a capture port of the engine (dialling it would loop)".into()),
        ("a dead mark on a workload's own address does not stop a direct tunnel", "10.1.0.11:9000", &["10.1.0.11"], 0,
            format!("tunnel 10.1.0.11:9000 via 10.1.0.11:15008 expecting {ID}echo")),
    ];
    let mut failures = Vec::new();
    for (name, dst, dead, start, expected) in table {
        let choice = Fixed {
            dead: dead.iter().map(|ip| ip.parse().unwrap()).collect(),
            start,
        };
        let got = describe(&plan(
            &state,
            &source,
            CLIENT,
            dst.parse().unwrap(),
            &choice,
        ));
        if got != expected {
            failures.push(format!(
                "{name} ({dst}):\n  got      {got}\n  expected {expected}"
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Under `REGISTRY_ONLY` every address the mesh knows plans as under
/// `ALLOW_ANY` (workloads, plain-TCP ones, services, a ServiceEntry whose
/// endpoint is a DNS name); only an address it does not know, or a
/// service the source may not see, is refused instead of passed through.
#[test]
fn registry_only_refuses_only_what_the_mesh_does_not_know() {
    let state = MeshState::from_config(&LocalConfig::parse(MESH, "plan").unwrap()).unwrap();
    let source = Identity::new("cluster.local", "front", "web").unwrap();
    let choice = Fixed {
        dead: HashSet::new(),
        start: 0,
    };
    let under = |policy, dst: &str| {
        describe(&super::plan(
            &state,
            &source,
            CLIENT,
            dst.parse().unwrap(),
            &choice,
            policy,
        ))
    };
    let known = [
        "10.1.0.11:9000",
        "10.1.0.20:5432",
        "10.96.0.10:80",
        "[fd00:96::10]:80",
        "240.240.0.1:443",
        "10.96.0.11:80",
        "[::ffff:10.1.0.30]:8080",
        "10.1.0.11:15001",
    ];
    for dst in known {
        assert_eq!(
            under(OutboundTrafficPolicy::RegistryOnly, dst),
            under(OutboundTrafficPolicy::AllowAny, dst),
            "{dst}"
        );
    }
    #[rustfmt::skip]
    let unknown = [
        ("192.0.2.7:443", "192.0.2.7"),
        ("[::ffff:192.0.2.7]:443", "192.0.2.7"),
        ("[2001:db8::1]:443", "2001:db8::1"),
        // `private` is visible to its namespace only: no service to `front`.
        ("10.96.0.12:80", "10.96.0.12"),
    ];
    for (dst, ip) in unknown {
        assert_eq!(
            under(OutboundTrafficPolicy::RegistryOnly, dst),
            format!(
                "refuse registry_only: {ip} is no workload, service or ServiceEntry address \
                 of the mesh and the outbound traffic policy is REGISTRY_ONLY"
            ),
            "{dst}"
        );
    }
    // A service routed as passthrough (a ServiceEntry with resolution
    // NONE) is in the registry: dialled as addressed.
    let locality =
        MeshState::from_config(&LocalConfig::parse(LOCALITY, "locality").unwrap()).unwrap();
    let through = super::plan(
        &locality,
        &source,
        CLIENT,
        "10.96.1.4:80".parse().unwrap(),
        &choice,
        OutboundTrafficPolicy::RegistryOnly,
    );
    assert_eq!(describe(&through), "[shop/through] direct 10.96.1.4:80");
    assert_eq!(
        FailReason::RegistryOnly.response_flags().as_str(),
        "REGISTRY_ONLY"
    );
}

/// A service only its namespace may see (`exportTo: ["."]`) is no
/// service to a pod of another: its VIP is dialled as addressed, as
/// ztunnel's `find_upstream` finds no visible service there.
#[test]
fn a_namespace_scoped_service_is_a_service_only_to_its_namespace() {
    let state = MeshState::from_config(&LocalConfig::parse(MESH, "plan").unwrap()).unwrap();
    let choice = Fixed {
        dead: HashSet::new(),
        start: 0,
    };
    let dst = "10.96.0.12:80".parse().unwrap();
    let from = |ns| {
        let source = Identity::new("cluster.local", ns, "web").unwrap();
        describe(&plan(&state, &source, CLIENT, dst, &choice))
    };
    assert_eq!(
        from("shop"),
        "[shop/private.shop.svc.cluster.local] refuse no_endpoints: \
         service shop/private.shop.svc.cluster.local has no endpoints"
    );
    assert_eq!(from("front"), "direct 10.96.0.12:80");
}

#[test]
fn tunnels_present_the_source_pods_identity() {
    let state = MeshState::from_config(&LocalConfig::parse(MESH, "plan").unwrap()).unwrap();
    let source = Identity::new("cluster.local", "front", "web").unwrap();
    let choice = Fixed {
        dead: HashSet::new(),
        start: 0,
    };
    let plan = plan(
        &state,
        &source,
        CLIENT,
        "10.1.0.11:9000".parse().unwrap(),
        &choice,
    );
    let Action::Hop(Hop::Tunnel(tunnel)) = plan.action else {
        panic!("expected a tunnel, got {plan:?}");
    };
    assert_eq!(tunnel.src_identity, source);
    assert_eq!(&*tunnel.workload.workload.uid, "a");
}

/// A client in zone-a on node-1 and endpoints spread over zones and nodes
/// (one unhealthy), behind services that differ only in their routing and
/// health policy.
const LOCALITY: &str = r#"
workloads:
- {uid: client, name: client, namespace: shop, workloadIps: [10.1.0.1], node: node-1, locality: {region: r, zone: zone-a}}
- {uid: near, name: near, namespace: shop, workloadIps: [10.1.0.2], node: node-1, locality: {region: r, zone: zone-a},
   services: {'shop/strict': {80: 80}, 'shop/failover': {80: 80}, 'shop/all': {80: 80}, 'shop/through': {80: 80}}}
- {uid: zone, name: zone, namespace: shop, workloadIps: [10.1.0.3], node: node-2, locality: {region: r, zone: zone-a},
   services: {'shop/strict': {80: 80}, 'shop/failover': {80: 80}, 'shop/all': {80: 80}}}
- {uid: far, name: far, namespace: shop, workloadIps: [10.1.0.4], node: node-3, locality: {region: r, zone: zone-b},
   services: {'shop/strict': {80: 80}, 'shop/failover': {80: 80}, 'shop/all': {80: 80}}}
- {uid: sick, name: sick, namespace: shop, workloadIps: [10.1.0.5], node: node-1, status: Unhealthy, locality: {region: r, zone: zone-a},
   services: {'shop/strict': {80: 80}, 'shop/failover': {80: 80}, 'shop/all': {80: 80}}}
services:
- {name: s, namespace: shop, hostname: strict, vips: ['/10.96.1.1'], ports: {80: 80}, routing: {mode: strict, preferences: [region, zone]}}
- {name: f, namespace: shop, hostname: failover, vips: ['/10.96.1.2'], ports: {80: 80}, routing: {mode: failover, preferences: [zone, node]}}
- {name: a, namespace: shop, hostname: all, vips: ['/10.96.1.3'], ports: {80: 80}, healthPolicy: allowAll}
- {name: t, namespace: shop, hostname: through, vips: ['/10.96.1.4'], ports: {80: 80}, routing: {mode: passthrough}}
"#;

#[test]
fn locality_routing_and_health_policy_choose_endpoints() {
    let state = MeshState::from_config(&LocalConfig::parse(LOCALITY, "locality").unwrap()).unwrap();
    let source = Identity::new("cluster.local", "shop", "default").unwrap();
    let choice = Fixed {
        dead: HashSet::new(),
        start: 0,
    };
    let order = |src: &str, dst: &str| -> Vec<String> {
        let plan = plan(
            &state,
            &source,
            src.parse().unwrap(),
            dst.parse().unwrap(),
            &choice,
        );
        match plan.action {
            Action::Failover(hops) => hops
                .iter()
                .map(|h| h.dst().map_or_else(String::new, |d| d.ip().to_string()))
                .collect(),
            Action::Hop(h) => vec![format!(
                "direct {}",
                h.dst().map_or_else(String::new, |d| d.to_string())
            )],
            Action::Refuse { detail, .. } => vec![detail],
        }
    };
    // Strict: only the client's zone; the unhealthy one never.
    assert_eq!(order("10.1.0.1", "10.96.1.1:80"), ["10.1.0.2", "10.1.0.3"]);
    // Failover: same zone and node first, same zone next, the rest last.
    assert_eq!(
        order("10.1.0.1", "10.96.1.2:80"),
        ["10.1.0.2", "10.1.0.3", "10.1.0.4"]
    );
    // A client the mesh does not know: strict has nothing to compare.
    assert_eq!(
        order("10.9.9.9", "10.96.1.1:80"),
        ["service shop/strict has no endpoints"]
    );
    // allowAll keeps the unhealthy endpoint.
    assert_eq!(
        order("10.1.0.1", "10.96.1.3:80"),
        ["10.1.0.2", "10.1.0.3", "10.1.0.4", "10.1.0.5"]
    );
    // Passthrough: the VIP itself, no endpoint chosen.
    assert_eq!(order("10.1.0.1", "10.96.1.4:80"), ["direct 10.96.1.4:80"]);
}

#[test]
fn the_choice_is_even_only_among_equally_close_live_endpoints() {
    let state = MeshState::from_config(&LocalConfig::parse(LOCALITY, "locality").unwrap()).unwrap();
    let client = state.workloads.by_ip("10.1.0.1".parse().unwrap());
    let client = client.map(std::sync::Arc::as_ref);
    let even = |vip: &str, dead: &[&str]| {
        let entry = state.services.by_vip(vip.parse().unwrap()).unwrap();
        let dead: Vec<IpAddr> = dead.iter().map(|ip| ip.parse().unwrap()).collect();
        entry
            .even_candidates(([0, 0, 0, 0], 80).into(), client, "", |ip| {
                dead.contains(&ip)
            })
            .map(|endpoints| {
                endpoints
                    .iter()
                    .map(|e| e.addr.ip().map_or_else(String::new, |ip| ip.to_string()))
                    .collect::<Vec<_>>()
            })
    };
    // No routing preference: every endpoint is as good as another.
    assert_eq!(
        even("10.96.1.3", &[]).unwrap(),
        ["10.1.0.2", "10.1.0.3", "10.1.0.4", "10.1.0.5"]
    );
    // ...unless one is dead, which the engine tries last.
    assert_eq!(even("10.96.1.3", &["10.1.0.4"]), None);
    // Strict keeps the client's zone, where both are equally close.
    assert_eq!(even("10.96.1.1", &[]).unwrap(), ["10.1.0.2", "10.1.0.3"]);
    // Failover orders them by closeness: no even choice.
    assert_eq!(even("10.96.1.2", &[]), None);
    // An endpoint known by DNS name only is the proxy's to resolve: the
    // kernel gets no choice.
    let mesh = MeshState::from_config(&LocalConfig::parse(MESH, "plan").unwrap()).unwrap();
    let api = mesh
        .services
        .by_vip("240.240.0.1".parse().unwrap())
        .unwrap();
    assert!(
        api.even_candidates(([0, 0, 0, 0], 443).into(), None, "", |_| false)
            .is_none()
    );
    assert_eq!(
        api.candidates(([0, 0, 0, 0], 443).into(), 0, None, "", |_| false)
            .len(),
        1
    );
}

/// A choice whose fast path takes some endpoints of every service.
struct Split {
    fixed: Fixed,
    taken: Arc<[IpAddr]>,
}

impl EndpointChoice for Split {
    fn is_dead(&self, ip: IpAddr) -> bool {
        self.fixed.is_dead(ip)
    }

    fn start(&self, service: &ServiceEntry) -> usize {
        self.fixed.start(service)
    }

    fn draw(&self, below: u64) -> u64 {
        self.fixed.draw(below)
    }

    fn taken_by_kernel(&self, _: SocketAddr) -> Option<Arc<[IpAddr]>> {
        Some(Arc::clone(&self.taken))
    }
}

#[test]
fn the_proxy_takes_turns_among_the_endpoints_the_fast_path_leaves_it() {
    let state = MeshState::from_config(&LocalConfig::parse(LOCALITY, "locality").unwrap()).unwrap();
    let source = Identity::new("cluster.local", "shop", "default").unwrap();
    let ip = |s: &str| -> IpAddr { s.parse().unwrap() };
    let order = |start: usize, dead: &[&str]| -> Vec<String> {
        let choice = Split {
            fixed: Fixed {
                dead: dead.iter().map(|d| ip(d)).collect(),
                start,
            },
            taken: [ip("10.1.0.2"), ip("10.1.0.4")].into(),
        };
        let dst = "10.96.1.3:80".parse().unwrap();
        match plan(&state, &source, ip("10.1.0.1"), dst, &choice).action {
            Action::Failover(hops) => hops
                .iter()
                .map(|h| h.dst().map_or_else(String::new, |d| d.ip().to_string()))
                .collect(),
            other => vec![format!("{other:?}")],
        }
    };
    // The others in turn, whatever runs of taken ones lie between them;
    // the taken ones last.
    for (start, first, second) in [(0, "3", "5"), (1, "5", "3"), (2, "3", "5"), (3, "5", "3")] {
        assert_eq!(
            order(start, &[]),
            [
                format!("10.1.0.{first}"),
                format!("10.1.0.{second}"),
                "10.1.0.2".to_owned(),
                "10.1.0.4".to_owned()
            ],
            "start {start}"
        );
    }
    // A dead one of the others is tried after the live one, every time.
    for start in 0..2 {
        assert_eq!(
            order(start, &["10.1.0.3"]),
            ["10.1.0.5", "10.1.0.3", "10.1.0.2", "10.1.0.4"]
        );
    }
}

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

/// Endpoints weighted by their workloads' capacity (a WorkloadEntry's
/// `weight`; ztunnel `load_balance` draws with `choose_weighted`): round
/// robin gives each its weight's turns per round, a random draw its share;
/// weight 0 is never chosen first; unequal weights leave the kernel no
/// even choice.
#[test]
fn endpoints_are_chosen_in_proportion_to_their_capacity() {
    const WEIGHTED: &str = r#"
workloads:
- {uid: big, name: big, namespace: shop, workloadIps: [10.1.0.2], capacity: 3,
   services: {'shop/w.shop.svc.cluster.local': {80: 80}}}
- {uid: none, name: none, namespace: shop, workloadIps: [10.1.0.3], capacity: 0,
   services: {'shop/w.shop.svc.cluster.local': {80: 80}}}
- {uid: small, name: small, namespace: shop, workloadIps: [10.1.0.4],
   services: {'shop/w.shop.svc.cluster.local': {80: 80}}}
services:
- {name: w, namespace: shop, hostname: w.shop.svc.cluster.local, vips: ['/10.96.2.1'],
   ports: {80: 80}}
- {name: r, namespace: shop, hostname: r.shop.svc.cluster.local, vips: ['/10.96.2.2'],
   ports: {80: 80}, loadBalancing: random}
"#;
    let mut text = WEIGHTED.to_owned();
    // The same endpoints in the random service too.
    text = text.replace(
        "{'shop/w.shop.svc.cluster.local': {80: 80}}",
        "{'shop/w.shop.svc.cluster.local': {80: 80}, 'shop/r.shop.svc.cluster.local': {80: 80}}",
    );
    let state = MeshState::from_config(&LocalConfig::parse(&text, "weighted").unwrap()).unwrap();
    let first = |entry: &ServiceEntry| {
        let start = entry.next_start();
        let candidates = entry.candidates(([0, 0, 0, 0], 80).into(), start, None, "", |_| false);
        candidates[0].workload.workload.name.clone()
    };
    let count = |vip: &str, n: usize| {
        let entry = state.services.by_vip(vip.parse().unwrap()).unwrap();
        let mut counts = std::collections::BTreeMap::new();
        for _ in 0..n {
            *counts.entry(first(entry)).or_insert(0usize) += 1;
        }
        counts
    };
    let rr = count("10.96.2.1", 400);
    assert_eq!(rr.get("big"), Some(&300), "{rr:?}");
    assert_eq!(rr.get("small"), Some(&100), "{rr:?}");
    assert_eq!(rr.get("none"), None, "{rr:?}");
    // 4,000 draws of p = 3/4: 3,000 expected, sd 27; the bounds are 20 sd
    // away.
    let random = count("10.96.2.2", 4000);
    let big = random.get("big").copied().unwrap_or(0);
    assert!((2450..=3550).contains(&big), "{random:?}");
    assert_eq!(random.get("none"), None, "{random:?}");
    let entry = state.services.by_vip("10.96.2.1".parse().unwrap()).unwrap();
    assert!(
        entry
            .even_candidates(([0, 0, 0, 0], 80).into(), None, "", |_| false)
            .is_none()
    );
    // Every endpoint stays a candidate for failover, in rotation order.
    assert_eq!(
        entry
            .candidates(([0, 0, 0, 0], 80).into(), 0, None, "", |_| false)
            .len(),
        3
    );
}

/// A ServiceEntry whose `addresses` are CIDRs: a destination in a range,
/// and at no VIP, is that service's; the longest prefix wins, a client's
/// own namespace's service first, one it may not see never (ztunnel
/// `get_best_by_cidr_vip`). Resolution NONE dials the address asked.
#[test]
fn a_destination_in_a_services_vip_range_is_that_services() {
    const RANGES: &str = r#"
workloads:
- {uid: db, name: db, namespace: data, workloadIps: [10.1.0.9], protocol: TCP,
   services: {'data/db.example.com': {5432: 5432}}}
services:
- {name: wide, namespace: egress, hostname: wide.example.com, cidrVips: ['192.0.2.0/24'],
   routing: {mode: passthrough}}
- {name: narrow, namespace: other, hostname: narrow.example.com, cidrVips: ['192.0.2.128/25'],
   routing: {mode: passthrough}}
- {name: db, namespace: data, hostname: db.example.com, cidrVips: ['198.51.100.0/24'],
   ports: {5432: 5432}}
- {name: hidden, namespace: data, hostname: hidden.example.com, cidrVips: ['203.0.113.0/24'],
   visibility: namespace, routing: {mode: passthrough}}
"#;
    let state = MeshState::from_config(&LocalConfig::parse(RANGES, "ranges").unwrap()).unwrap();
    let choice = Fixed {
        dead: HashSet::new(),
        start: 0,
    };
    let from = |ns: &str, dst: &str| {
        let source = Identity::new("cluster.local", ns, "web").unwrap();
        describe(&plan(
            &state,
            &source,
            CLIENT,
            dst.parse().unwrap(),
            &choice,
        ))
    };
    // The longest prefix, whatever the namespaces.
    assert_eq!(
        from("front", "192.0.2.200:443"),
        "[other/narrow.example.com] direct 192.0.2.200:443"
    );
    assert_eq!(
        from("front", "192.0.2.7:443"),
        "[egress/wide.example.com] direct 192.0.2.7:443"
    );
    // The client's own namespace before a longer prefix.
    assert_eq!(
        from("egress", "192.0.2.200:443"),
        "[egress/wide.example.com] direct 192.0.2.200:443"
    );
    // A range with endpoints balances like any VIP.
    assert_eq!(
        from("front", "198.51.100.3:5432"),
        "[data/db.example.com] direct 10.1.0.9:5432 to db"
    );
    // Namespace-scoped: a service to its own namespace only.
    assert_eq!(
        from("data", "203.0.113.1:80"),
        "[data/hidden.example.com] direct 203.0.113.1:80"
    );
    assert_eq!(from("front", "203.0.113.1:80"), "direct 203.0.113.1:80");
    // Outside every range: no service.
    assert_eq!(from("front", "192.0.3.1:443"), "direct 192.0.3.1:443");
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
