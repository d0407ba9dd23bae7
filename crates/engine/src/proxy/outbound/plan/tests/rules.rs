//! Which plan an address gets: the table of routing rules, the registry-only
//! policy, services scoped to a namespace, the identity tunnels present, and
//! ServiceEntry VIP ranges.

use super::*;

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
        describe(&super::super::plan(
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
    let through = super::super::plan(
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
