#![expect(
    clippy::unwrap_used,
    reason = "a bad fixture should fail the test loudly"
)]

use super::*;
use std::sync::Arc;

use crate::istio_api::{
    security::{Authorization, Clause, Rule, ServiceAccountMatch},
    workload::{
        Address, LoadBalancing, NamespacedHostname, NetworkAddress, Port, PortList,
        WorkloadStatus as XdsStatus, address,
    },
};
use crate::state::MeshState;
use crate::xds::resources::Versioned;

thread_local! {
    /// The encoding of each resource `held` made, by where it is held:
    /// what [`seed_responses`] sends.
    static ENCODED: std::cell::RefCell<std::collections::HashMap<usize, Vec<u8>>> =
        std::cell::RefCell::default();
}

fn held<T: IntoModel>(resource: T) -> std::sync::Arc<Versioned<T>> {
    let held = std::sync::Arc::new(Versioned::new(&"".into(), "1", &resource));
    let at = std::sync::Arc::as_ptr(&held) as usize;
    ENCODED.with(|encoded| encoded.borrow_mut().insert(at, resource.encode_to_vec()));
    held
}

fn workload(uid: &str, ip: [u8; 4]) -> workload::Workload {
    workload::Workload {
        uid: uid.into(),
        name: format!("{uid}-pod"),
        namespace: "shop".into(),
        addresses: vec![ip.to_vec()],
        service_account: "web".into(),
        tunnel_protocol: TunnelProtocol::Hbone as i32,
        ..Default::default()
    }
}

fn put_workload(r: &mut XdsResources, w: workload::Workload) {
    let address = Address {
        r#type: Some(address::Type::Workload(w.clone())),
    };
    r.addresses.insert(w.uid.as_str().into(), held(address));
}

fn put_service(r: &mut XdsResources, s: workload::Service) {
    let key = format!("{}/{}", s.namespace, s.hostname);
    let address = Address {
        r#type: Some(address::Type::Service(s)),
    };
    r.addresses.insert(key.into(), held(address));
}

fn exact(v: &str) -> StringMatch {
    StringMatch {
        match_type: Some(MatchType::Exact(v.into())),
    }
}

#[test]
fn every_field_the_data_plane_acts_on_is_carried_over() {
    let mut r = XdsResources::default();
    let mut web = workload("web-1", [10, 0, 0, 5]);
    web.trust_domain = "example.org".into();
    web.node = "node-a".into();
    web.network = "net1".into();
    web.canonical_name = "web".into();
    web.canonical_revision = "v2".into();
    web.workload_name = "web-deploy".into();
    web.cluster_id = "c1".into();
    web.status = XdsStatus::Unhealthy as i32;
    web.authorization_policies = vec!["shop/only-front".into()];
    web.locality = Some(workload::Locality {
        region: "eu".into(),
        zone: "eu-1".into(),
        subzone: String::new(),
    });
    web.waypoint = Some(GatewayAddress {
        destination: Some(gateway_address::Destination::Hostname(NamespacedHostname {
            namespace: "shop".into(),
            hostname: "waypoint.shop.svc.cluster.local".into(),
        })),
        hbone_mtls_port: 15008,
    });
    // ztunnel `build_request_double_hbone`: a gateway by address, on the
    // gateway's own HBONE port.
    web.network_gateway = Some(GatewayAddress {
        destination: Some(gateway_address::Destination::Address(NetworkAddress {
            network: "net1".into(),
            address: vec![10, 22, 1, 1],
            length: None,
        })),
        hbone_mtls_port: 15009,
    });
    web.services.insert(
        "shop/web.shop.svc.cluster.local".into(),
        PortList {
            ports: vec![Port {
                service_port: 80,
                target_port: 8080,
            }],
        },
    );
    put_workload(&mut r, web);
    let mut waypoint = workload("waypoint-1", [10, 0, 0, 7]);
    waypoint.application_tunnel = Some(workload::ApplicationTunnel {
        protocol: workload::application_tunnel::Protocol::Proxy as i32,
        port: 15088,
    });
    put_workload(&mut r, waypoint);
    let mut plain = workload("legacy", [10, 0, 0, 6]);
    plain.application_tunnel = Some(workload::ApplicationTunnel {
        protocol: workload::application_tunnel::Protocol::None as i32,
        port: 0,
    });
    plain.tunnel_protocol = TunnelProtocol::None as i32;
    plain.service_account = String::new();
    put_workload(&mut r, plain);
    // A ServiceEntry endpoint with `resolution: DNS`, as istio's
    // `serviceEntryWorkloadBuilder` sends it: a hostname, no address.
    let mut dns = workload(
        "Kubernetes/networking.istio.io/ServiceEntry/shop/api/api.example.com",
        [0, 0, 0, 0],
    );
    dns.addresses.clear();
    dns.name = "api".into();
    dns.hostname = "api.example.com".into();
    dns.tunnel_protocol = TunnelProtocol::None as i32;
    put_workload(&mut r, dns);
    put_service(
        &mut r,
        workload::Service {
            name: "web".into(),
            namespace: "shop".into(),
            hostname: "web.shop.svc.cluster.local".into(),
            addresses: vec![NetworkAddress {
                network: "net1".into(),
                address: vec![10, 96, 0, 10],
                length: None,
            }],
            ports: vec![Port {
                service_port: 80,
                target_port: 8080,
            }],
            subject_alt_names: vec!["spiffe://example.org/ns/shop/sa/web".into(), "junk".into()],
            load_balancing: Some(LoadBalancing {
                routing_preference: vec![XdsScope::Zone as i32, XdsScope::Node as i32],
                mode: Mode::Failover as i32,
                health_policy: XdsHealthPolicy::AllowAll as i32,
            }),
            ..Default::default()
        },
    );
    r.authorizations.insert(
        "shop/only-front".into(),
        held(Authorization {
            name: "only-front".into(),
            namespace: "shop".into(),
            scope: security::Scope::WorkloadSelector as i32,
            action: security::Action::Deny as i32,
            rules: vec![Rule {
                clauses: vec![Clause {
                    matches: vec![security::Match {
                        namespaces: vec![StringMatch {
                            match_type: Some(MatchType::Prefix("front".into())),
                        }],
                        service_accounts: vec![ServiceAccountMatch {
                            namespace: "front".into(),
                            service_account: "ui".into(),
                        }],
                        principals: vec![exact("cluster.local/ns/a/sa/b")],
                        source_ips: vec![security::Address {
                            address: vec![10, 1, 0, 0],
                            length: 16,
                        }],
                        destination_ports: vec![8080],
                        ..Default::default()
                    }],
                }],
            }],
            dry_run: true,
        }),
    );

    seed_responses(&r);
    let out = translate(&r, "xds://istiod");
    let c = &out.config;
    let web = c.workloads.iter().find(|w| &*w.uid == "web-1").unwrap();
    assert_eq!(&*web.trust_domain, "example.org");
    assert_eq!(web.protocol, Protocol::Hbone);
    assert_eq!(web.status, WorkloadStatus::Unhealthy);
    assert_eq!(&*web.locality().zone, "eu-1");
    assert_eq!((&*web.network, &*web.cluster_id), ("net1", "c1"));
    assert_eq!(&*web.workload_name, "web-deploy");
    assert_eq!(&*web.canonical_revision, "v2");
    assert_eq!(
        web.waypoint.as_ref().and_then(|w| w.hostname.as_deref()),
        Some("shop/waypoint.shop.svc.cluster.local")
    );
    assert_eq!(
        web.network_gateway.as_deref(),
        Some(&config::Waypoint {
            address: Some([10, 22, 1, 1].into()),
            network: Some("net1".into()),
            hostname: None,
            hbone_port: 15009,
        })
    );
    let ports = web.services.get("shop/web.shop.svc.cluster.local");
    assert_eq!(ports.and_then(|p| p.target(80)), Some(8080));
    assert_eq!(web.application_tunnel, None);
    let waypoint = c
        .workloads
        .iter()
        .find(|w| &*w.uid == "waypoint-1")
        .unwrap();
    assert_eq!(
        waypoint.application_tunnel,
        Some(config::ApplicationTunnel {
            protocol: config::AppTunnelProtocol::Proxy,
            port: Some(15088)
        })
    );
    let legacy = c.workloads.iter().find(|w| &*w.uid == "legacy").unwrap();
    // Port 0 is istiod's "unset": the port the client asked for.
    assert_eq!(
        legacy.application_tunnel,
        Some(config::ApplicationTunnel {
            protocol: config::AppTunnelProtocol::None,
            port: None
        })
    );
    assert_eq!(legacy.protocol, Protocol::Tcp);
    assert_eq!(&*legacy.service_account, "default");
    let dns = c.workloads.iter().find(|w| w.name == "api").unwrap();
    assert_eq!(
        (&*dns.hostname, dns.workload_ips.len()),
        ("api.example.com", 0)
    );
    let svc = &c.services[0];
    // The VIP's network is kept (ztunnel keys services by it).
    assert_eq!(
        svc.vips,
        ["net1/10.96.0.10".parse::<config::Vip>().unwrap()]
    );
    assert_eq!(svc.health_policy, HealthPolicy::AllowAll);
    assert_eq!(svc.routing.mode, RoutingMode::Failover);
    assert_eq!(
        svc.routing.preferences,
        [RoutingScope::Zone, RoutingScope::Node]
    );
    assert_eq!(
        svc.subject_alt_names,
        ["spiffe://example.org/ns/shop/sa/web"]
    );
    assert!(
        out.dropped.iter().any(|d| d.contains("`junk`")),
        "{:?}",
        out.dropped
    );
    let p = &c.policies[0];
    assert_eq!(
        (p.scope, p.action, p.dry_run),
        (Scope::WorkloadSelector, Action::Deny, true)
    );
    let m = &p.rules[0][0][0];
    assert_eq!(m.namespaces, ["front*"]);
    assert_eq!(m.service_accounts, ["front/ui"]);
    assert_eq!(m.source_ips, ["10.1.0.0/16".parse::<IpNet>().unwrap()]);
    assert_eq!(m.destination_ports, [8080]);

    // The translation is a state the agent can run: it indexes, and it
    // reads back as a local file would.
    let state = MeshState::from_config(c).unwrap();
    assert_eq!(state.workloads.len(), 4);
    let text = c.to_yaml().unwrap();
    let reread = LocalConfig::parse(&text, "reread").unwrap();
    assert_eq!(reread.workloads, c.workloads, "{text}");
    assert_eq!(reread.services, c.services, "{text}");
}

/// A ServiceEntry's CIDR `addresses` arrive with a prefix length
/// (`NetworkAddress.length`, istio `toNetworkAddressFromCidr`): a range of
/// the service, host bits cleared; a full-length one is a plain VIP; a
/// prefix longer than the address is refused on arrival
/// (`xds::resources::tests`).
#[test]
fn cidr_addresses_are_vip_ranges() {
    let address = |ip: [u8; 4], length| NetworkAddress {
        network: String::new(),
        address: ip.to_vec(),
        length,
    };
    // A range keeps its network (ztunnel `network_cidr(network, cidr)`).
    let on_east = NetworkAddress {
        network: "east".into(),
        ..address([10, 7, 0, 0], Some(16))
    };
    let mut r = XdsResources::default();
    put_service(
        &mut r,
        workload::Service {
            name: "egress".into(),
            namespace: "shop".into(),
            hostname: "egress.example.com".into(),
            addresses: vec![
                address([192, 0, 2, 9], Some(24)),
                address([198, 51, 100, 1], Some(32)),
                address([198, 51, 100, 2], None),
                on_east,
            ],
            ..Default::default()
        },
    );
    seed_responses(&r);
    let out = translate(&r, "xds://istiod");
    let svc = &out.config.services[0];
    assert_eq!(
        svc.cidr_vips,
        [
            // Host bits as sent, as ztunnel keeps them.
            "/192.0.2.9/24".parse::<config::VipRange>().unwrap(),
            "east/10.7.0.0/16".parse().unwrap()
        ]
    );
    assert_eq!(
        svc.vips,
        [
            "198.51.100.1".parse::<config::Vip>().unwrap(),
            "198.51.100.2".parse().unwrap()
        ]
    );
    let state = MeshState::from_config(&out.config).unwrap();
    let found = state.services.by_vip("192.0.2.77".parse().unwrap());
    assert_eq!(found.map(|e| e.service.name.as_str()), Some("egress"));
    let reread = LocalConfig::parse(&out.config.to_yaml().unwrap(), "reread").unwrap();
    assert_eq!(reread.services, out.config.services);
}

/// A weighted set of waypoints is carried over beside the primary.
#[test]
fn weighted_waypoints_are_carried_over() {
    let gateway = |ip: [u8; 4]| GatewayAddress {
        destination: Some(gateway_address::Destination::Address(NetworkAddress {
            network: String::new(),
            address: ip.to_vec(),
            length: None,
        })),
        hbone_mtls_port: 15008,
    };
    let mut r = XdsResources::default();
    put_service(
        &mut r,
        workload::Service {
            name: "shop".into(),
            namespace: "shop".into(),
            hostname: "shop.shop.svc.cluster.local".into(),
            waypoint: Some(gateway([10, 1, 0, 31])),
            weighted_waypoints: vec![
                workload::WeightedWaypoint {
                    destination: Some(gateway([10, 1, 0, 31])),
                    weight: 90,
                },
                workload::WeightedWaypoint {
                    destination: Some(gateway([10, 1, 0, 32])),
                    weight: 10,
                },
            ],
            ..Default::default()
        },
    );
    seed_responses(&r);
    let out = translate(&r, "xds://istiod");
    let svc = &out.config.services[0];
    let set: Vec<(Option<IpAddr>, u32)> = svc
        .weighted_waypoints
        .iter()
        .map(|w| (w.waypoint.address, w.weight))
        .collect();
    assert_eq!(
        set,
        [
            (Some("10.1.0.31".parse().unwrap()), 90),
            (Some("10.1.0.32".parse().unwrap()), 10)
        ]
    );
    let reread = LocalConfig::parse(&out.config.to_yaml().unwrap(), "reread").unwrap();
    assert_eq!(reread.services, out.config.services);
}

/// Host-network pods share their node's address: istiod sends each with
/// it and `network_mode: HOST_NETWORK`, and ztunnel indexes them by uid
/// only (`WorkloadStore::insert`), so the address names no workload and is
/// no conflict.
#[test]
fn host_network_pods_share_their_nodes_address_without_owning_it() {
    let mut r = XdsResources::default();
    for uid in ["exporter-1", "agent-1"] {
        let mut w = workload(uid, [192, 168, 0, 7]);
        w.network_mode = workload::NetworkMode::HostNetwork as i32;
        w.tunnel_protocol = TunnelProtocol::None as i32;
        put_workload(&mut r, w);
    }
    put_workload(&mut r, workload("pod-1", [10, 0, 0, 9]));
    seed_responses(&r);
    let out = translate(&r, "xds://istiod");
    assert!(out.dropped.is_empty(), "{:?}", out.dropped);
    let c = &out.config;
    assert_eq!(c.workloads.len(), 3);
    assert!(
        c.workloads.iter().filter(|w| &*w.uid != "pod-1").all(
            |w| w.host_network && *w.workload_ips == ["192.168.0.7".parse::<IpAddr>().unwrap()]
        )
    );
    let state = MeshState::from_config(c).unwrap();
    assert!(
        state
            .workloads
            .by_ip("192.168.0.7".parse().unwrap())
            .is_none()
    );
    assert!(state.workloads.by_ip("10.0.0.9".parse().unwrap()).is_some());
    // The file form keeps it, and accepts the shared address.
    let reread = LocalConfig::parse(&c.to_yaml().unwrap(), "reread").unwrap();
    assert_eq!(reread.workloads, c.workloads);
}

#[test]
fn address_conflicts_resolve_the_same_way_every_time() {
    let mut r = XdsResources::default();
    // A pod replaced under the same IP: both are held for a moment (the
    // second spells it as an IPv4-mapped IPv6 address), and a service
    // claims it too.
    put_workload(&mut r, workload("a-old", [10, 0, 0, 5]));
    let mut mapped = workload("b-new", [0; 4]);
    mapped.addresses = vec![[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 0, 0, 5].to_vec()];
    put_workload(&mut r, mapped);
    put_service(
        &mut r,
        workload::Service {
            name: "clash".into(),
            namespace: "shop".into(),
            hostname: "clash".into(),
            addresses: vec![NetworkAddress {
                network: String::new(),
                address: vec![10, 0, 0, 5],
                length: None,
            }],
            ..Default::default()
        },
    );
    let out = translate(&r, "xds");
    let ips: Vec<_> = out
        .config
        .workloads
        .iter()
        .map(|w| w.workload_ips.len())
        .collect();
    // Both workloads keep it (the state holds both and finds the best,
    // ztunnel `WorkloadByAddr`); the service loses it to the first.
    assert_eq!(ips, [1, 1]);
    assert!(out.config.services[0].vips.is_empty());
    assert_eq!(out.dropped.len(), 1, "{:?}", out.dropped);
    assert!(
        out.dropped[0]
            .starts_with("service shop/clash: address 10.0.0.5 is already workload a-old's")
    );
    let state = MeshState::from_config(&out.config).unwrap();
    assert_eq!(
        state
            .workloads
            .claimants("", "10.0.0.5".parse().unwrap())
            .len(),
        2
    );

    // One workload listing its address twice keeps it once.
    let mut r = XdsResources::default();
    let mut twice = workload("twice", [10, 0, 0, 6]);
    twice.addresses.push(vec![10, 0, 0, 6]);
    put_workload(&mut r, twice);
    let out = translate(&r, "xds");
    assert_eq!(
        *out.config.workloads[0].workload_ips,
        ["10.0.0.6".parse::<IpAddr>().unwrap()]
    );
    assert!(MeshState::from_config(&out.config).is_ok());
}

#[test]
fn a_resource_istiod_did_not_change_is_not_translated_again() {
    let mut r = XdsResources::default();
    put_workload(&mut r, workload("a", [10, 0, 0, 1]));
    put_workload(&mut r, workload("b", [10, 0, 0, 2]));
    put_workload(&mut r, workload("c", [10, 0, 0, 3]));
    let mut model = crate::xds::XdsModel::default();
    let first = model.update(&r).translated("xds");
    // b changes, c goes, d comes.
    let mut b = workload("b", [10, 0, 0, 2]);
    b.service_account = "renamed".into();
    put_workload(&mut r, b);
    r.addresses.remove("c");
    put_workload(&mut r, workload("d", [10, 0, 0, 1]));
    let second = model.update(&r).translated("xds");
    let uid = |t: &Translated, i: usize| t.config.workloads[i].uid.to_string();
    assert_eq!(
        (0..3).map(|i| uid(&second, i)).collect::<Vec<_>>(),
        ["a", "b", "d"]
    );
    // a is the very entry translated before; b is new.
    assert!(Arc::ptr_eq(
        &first.config.workloads[0],
        &second.config.workloads[0]
    ));
    assert_eq!(&*second.config.workloads[1].service_account, "renamed");
    // d claims a's address too: both keep it (a workload's address is
    // no conflict with another's), the cached a intact.
    assert_eq!(
        *second.config.workloads[2].workload_ips,
        ["10.0.0.1".parse::<IpAddr>().unwrap()]
    );
    assert!(second.dropped.is_empty(), "{:?}", second.dropped);
    let fresh = translate(&r, "xds");
    assert_eq!(fresh.config, second.config);
    assert_eq!(fresh.dropped, second.dropped);
    // Removed resources leave the model.
    assert_eq!(model.entries().workloads.len(), 3);
}

/// What `r` holds as the two responses that would have brought it: seeds
/// of the `xds_response` fuzz target.
fn seed_responses(r: &XdsResources) {
    use crate::istio_api::{
        ADDRESS_TYPE, AUTHORIZATION_TYPE,
        discovery::{DeltaDiscoveryResponse, Resource},
    };
    use prost::Message as _;
    fn response<T: IntoModel>(type_url: &str, held: &crate::xds::resources::Held<T>) -> Vec<u8> {
        DeltaDiscoveryResponse {
            type_url: type_url.into(),
            nonce: "n".into(),
            resources: held
                .iter()
                .map(|(name, v)| Resource {
                    name: name.to_string(),
                    version: v.version.to_string(),
                    resource: Some(prost_types::Any {
                        type_url: type_url.into(),
                        value: ENCODED.with(|encoded| {
                            let at = Arc::as_ptr(v) as usize;
                            encoded.borrow().get(&at).cloned().unwrap_or_default()
                        }),
                    }),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }
        .encode_to_vec()
    }
    crate::fuzz_seeds::seed("xds_response", response(ADDRESS_TYPE, &r.addresses));
    crate::fuzz_seeds::seed(
        "xds_response",
        response(AUTHORIZATION_TYPE, &r.authorizations),
    );
}

/// Services of several namespaces may share a hostname and a VIP (a
/// ServiceEntry per namespace for one external host): istiod sends each,
/// and ztunnel keeps them all and gives each client the best for it
/// (`src/state/service.rs` `get_best_by_vip`, `get_best_by_host`,
/// `ServiceMatch::find_best_match`, `Service::visible_to`).
#[test]
fn services_sharing_a_vip_are_chosen_per_client_namespace() {
    let vip: IpAddr = "10.96.0.9".parse().unwrap();
    let host = "db.example.com";
    let entry =
        |ns: &str, canonical: bool, visibility: workload::service::Visibility| workload::Service {
            name: "db".into(),
            namespace: ns.into(),
            hostname: host.into(),
            addresses: vec![NetworkAddress {
                network: String::new(),
                address: vec![10, 96, 0, 9],
                length: None,
            }],
            canonical,
            visibility: visibility as i32,
            ..Default::default()
        };
    use workload::service::Visibility::{Namespace, Public};
    let mut r = XdsResources::default();
    put_service(&mut r, entry("a", false, Namespace));
    put_service(&mut r, entry("b", true, Public));
    put_service(&mut r, entry("c", false, Public));
    let out = translate(&r, "xds");
    assert!(out.dropped.is_empty(), "{:?}", out.dropped);
    let state = MeshState::from_config(&out.config).unwrap();
    let by_vip = |ns| {
        state
            .services
            .by_vip_for(vip, ns)
            .map(|e| e.service.namespace.clone())
    };
    let by_host = |ns| {
        state
            .services
            .by_hostname_for(host, ns)
            .map(|e| e.service.namespace.clone())
    };
    // The client's own namespace first, even when only it may see it.
    assert_eq!(by_vip("a").as_deref(), Some("a"));
    assert_eq!(by_vip("c").as_deref(), Some("c"));
    assert_eq!(by_host("a").as_deref(), Some("a"));
    // Else the canonical one; never one its namespace may not see.
    assert_eq!(by_vip("d").as_deref(), Some("b"));
    assert_eq!(by_host("d").as_deref(), Some("b"));
    assert_eq!(
        state
            .services
            .by_vip(vip)
            .map(|e| e.service.namespace.as_str()),
        Some("b")
    );
    assert_eq!(
        state
            .services
            .by_key("c/db.example.com")
            .map(|e| e.service.namespace.as_str()),
        Some("c")
    );
    // A waypoint named `namespace/hostname` is that namespace's service.
    let waypoint = crate::config::Waypoint {
        address: None,
        network: None,
        hostname: Some("c/db.example.com".into()),
        hbone_port: 15008,
    };
    assert_eq!(
        state
            .waypoint_service(&waypoint)
            .map(|e| e.service.namespace.as_str()),
        Some("c")
    );

    // Only the namespace-scoped one left: to any other namespace the VIP
    // and the name are no service's.
    let mut r = XdsResources::default();
    put_service(&mut r, entry("a", false, Namespace));
    let state = MeshState::from_config(&translate(&r, "xds").config).unwrap();
    assert!(state.services.by_vip_for(vip, "d").is_none());
    assert!(state.services.by_hostname_for(host, "d").is_none());
    assert!(state.services.by_vip_for(vip, "a").is_some());

    // A visibility istiod may add later reads as PUBLIC, as ztunnel's does.
    let mut unknown = entry("e", false, Public);
    unknown.visibility = 7;
    let mut r = XdsResources::default();
    put_service(&mut r, unknown);
    let state = MeshState::from_config(&translate(&r, "xds").config).unwrap();
    assert!(state.services.by_vip_for(vip, "d").is_some());
}

/// `ip_families` as ztunnel reads it (`src/state/service.rs`
/// `From<IpFamilies> for Option<IpFamily>`: `AUTOMATIC` is none); a value
/// it does not know keeps the service, as automatic, with a note.
#[test]
fn a_services_ip_families_are_carried_over_and_an_unknown_value_noted() {
    use crate::config::IpFamily;
    let service = |families: i32| workload::Service {
        name: "db".into(),
        namespace: "a".into(),
        hostname: "db.a.svc.cluster.local".into(),
        ip_families: families,
        ..Default::default()
    };
    for (families, expected) in [
        (workload::IpFamilies::Automatic, None),
        (workload::IpFamilies::Ipv4Only, Some(IpFamily::IPv4)),
        (workload::IpFamilies::Ipv6Only, Some(IpFamily::IPv6)),
        (workload::IpFamilies::Dual, Some(IpFamily::Dual)),
    ] {
        let mut r = XdsResources::default();
        put_service(&mut r, service(families as i32));
        let out = translate(&r, "xds");
        assert!(out.dropped.is_empty(), "{:?}", out.dropped);
        assert_eq!(out.config.services[0].ip_families, expected, "{families:?}");
    }
    let mut r = XdsResources::default();
    put_service(&mut r, service(9));
    let out = translate(&r, "xds");
    assert_eq!(out.config.services.len(), 1);
    assert_eq!(out.config.services[0].ip_families, None);
    assert!(
        out.dropped.iter().any(|d| d.contains("ip_families 9")),
        "{:?}",
        out.dropped
    );
}
