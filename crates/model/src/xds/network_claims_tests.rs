//! The model's address claims are by network address, as the mesh state
//! keys workloads (ztunnel `src/state/workload.rs` `WorkloadStore::by_addr`):
//! pods of two networks at one IP are both kept, push by push, and so is
//! a second pod at one IP on one network (ztunnel `WorkloadByAddr`).

#![expect(
    clippy::unwrap_used,
    reason = "a bad fixture should fail the test loudly"
)]

use std::net::IpAddr;
use std::sync::Arc;

use super::*;
use crate::istio_api::workload::{self, Address, TunnelProtocol, address};
use crate::state::MeshState;
use crate::xds::resources::{Versioned, XdsResources};

fn put(r: &mut XdsResources, uid: &str, network: &str) {
    let w = workload::Workload {
        uid: uid.into(),
        name: uid.into(),
        namespace: "shop".into(),
        addresses: vec![vec![10, 0, 0, 5]],
        network: network.into(),
        tunnel_protocol: TunnelProtocol::Hbone as i32,
        ..Default::default()
    };
    let resource = Address {
        r#type: Some(address::Type::Workload(w)),
    };
    let name: Arc<str> = uid.into();
    let held = Versioned::new(&name, "1", &resource);
    r.addresses.insert(name, Arc::new(held));
}

/// Who the state, looking captured traffic up on `network`, finds at
/// 10.0.0.5.
fn at(model: &XdsModel, network: &str) -> Option<String> {
    let state = MeshState::from_config(&model.entries().translated("xds").config)
        .unwrap()
        .on_network(network);
    let ip: IpAddr = "10.0.0.5".parse().unwrap();
    state
        .workloads
        .by_ip(ip)
        .map(|w| w.workload.uid.to_string())
}

#[test]
fn pods_of_two_networks_at_one_ip_are_both_kept_push_by_push() {
    let mut r = XdsResources::default();
    let mut model = XdsModel::default();
    put(&mut r, "east-pod", "east");
    model.update(&r);
    put(&mut r, "west-pod", "west");
    model.update(&r);
    assert!(
        model.entries().translated("xds").dropped.is_empty(),
        "{:?}",
        model.entries().translated("xds").dropped
    );
    assert_eq!(at(&model, "east").as_deref(), Some("east-pod"));
    assert_eq!(at(&model, "west").as_deref(), Some("west-pod"));

    // A second pod at the address on `west` is no conflict: both keep
    // it, and the state finds the best of them (ztunnel
    // `WorkloadByAddr::get`; equals here, so the last in entry order).
    let dropped = |model: &XdsModel| model.entries().translated("xds").dropped;
    put(&mut r, "west-x", "west");
    model.update(&r);
    assert!(dropped(&model).is_empty(), "{:?}", dropped(&model));
    assert_eq!(at(&model, "west").as_deref(), Some("west-x"));
    assert_eq!(at(&model, "east").as_deref(), Some("east-pod"));

    // `west-x` goes: `west-pod` is found again, `east-pod` keeps its.
    r.addresses.remove("west-x");
    model.update(&r);
    assert!(dropped(&model).is_empty(), "{:?}", dropped(&model));
    assert_eq!(at(&model, "west").as_deref(), Some("west-pod"));
    assert_eq!(at(&model, "east").as_deref(), Some("east-pod"));

    // `east-pod` moves to `west`: `east` is left without a pod at the
    // address, `west` holds both.
    put(&mut r, "east-pod", "west");
    model.update(&r);
    assert_eq!(at(&model, "east"), None);
    assert_eq!(at(&model, "west").as_deref(), Some("west-pod"));
    assert!(dropped(&model).is_empty(), "{:?}", dropped(&model));
    let on_west = model
        .entries()
        .translated("xds")
        .config
        .workloads
        .iter()
        .filter(|w| !w.workload_ips.is_empty())
        .count();
    assert_eq!(on_west, 2);

    // Push by push is what a whole translation makes.
    let whole = crate::xds::translate(&r, "xds");
    assert_eq!(
        whole.config.workloads,
        model.entries().translated("xds").config.workloads
    );
}

/// A service from istiod with its VIP 10.0.0.5 on `network`.
fn put_service(r: &mut XdsResources, name: &str, network: &str) {
    let s = workload::Service {
        name: name.into(),
        namespace: "shop".into(),
        hostname: format!("{name}.shop.svc.cluster.local"),
        addresses: vec![workload::NetworkAddress {
            network: network.into(),
            address: vec![10, 0, 0, 5],
            length: None,
        }],
        ..Default::default()
    };
    let resource = Address {
        r#type: Some(address::Type::Service(s)),
    };
    let key: Arc<str> = format!("shop/{name}.shop.svc.cluster.local").into();
    let held = Versioned::new(&key, "1", &resource);
    r.addresses.insert(key, Arc::new(held));
}

/// istiod's services keep their VIP's network (ztunnel
/// `ServiceStore::by_vip` keys by `NetworkAddress`): one VIP on two
/// networks is two services, each found on its network only; a VIP is
/// claimed on its own network, so a pod at that IP on another network is
/// no conflict, and one on the same network is (the workload keeps the
/// address, as entries are resolved by kind: [`EntryKind`]).
#[test]
fn services_of_two_networks_at_one_vip_are_each_found_on_their_own() {
    let mut r = XdsResources::default();
    let mut model = XdsModel::default();
    put_service(&mut r, "east-svc", "east");
    put_service(&mut r, "west-svc", "west");
    put(&mut r, "west-pod", "north");
    model.update(&r);
    let translated = model.entries().translated("xds");
    assert!(translated.dropped.is_empty(), "{:?}", translated.dropped);
    let state = MeshState::from_config(&translated.config).unwrap();
    let ip: IpAddr = "10.0.0.5".parse().unwrap();
    let on = |network| {
        state
            .services
            .by_vip_on(network, ip, "shop")
            .map(|e| e.service.name.clone())
    };
    assert_eq!(on("east").as_deref(), Some("east-svc"));
    assert_eq!(on("west").as_deref(), Some("west-svc"));
    assert_eq!(on(""), None);

    // A pod at the VIP on `east`: `east-svc` loses it, `west-svc` not.
    put(&mut r, "east-pod", "east");
    model.update(&r);
    let translated = model.entries().translated("xds");
    assert_eq!(translated.dropped.len(), 1, "{:?}", translated.dropped);
    let vips = |name: &str| {
        let service = translated.config.services.iter().find(|s| s.name == name);
        service.unwrap().vips.len()
    };
    assert_eq!((vips("east-svc"), vips("west-svc")), (0, 1));
}
