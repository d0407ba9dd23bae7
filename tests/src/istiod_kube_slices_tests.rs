//! Services without a selector (EndpointSlices), ServiceEntries selecting
//! pods and canary (weighted) waypoints against istiod's rules, on the
//! stand-in API's pod fixture and objects written here as the API server
//! returns them.

use std::collections::{BTreeMap, HashMap};

use dataplane_user::istio_api::workload::{
    IpFamilies, NetworkAddress, NetworkMode, PortList, WeightedWaypoint, WorkloadStatus,
};
use serde_json::{Value, json};

use super::super::*;
use super::services_tests::{
    POD, POD_UID, SERVICE_KEY, gateway, gateway_path, named_pod, namespace, objects, port, service,
    waypoint_address,
};

const SVC_PATH: &str = "/api/v1/namespaces/shop/services/web";
const SLICE_PATH: &str = "/apis/discovery.k8s.io/v1/namespaces/shop/endpointslices/web-abc12";
const SLICE_UID: &str = "Kubernetes/discovery.k8s.io/EndpointSlice/shop/web-abc12";

/// Every address resource istiod derives from `list`, decoded.
fn derive_every(list: Vec<(String, Value)>) -> BTreeMap<String, address::Type> {
    address_resources(&objects(list), &Cluster::default())
        .into_iter()
        .filter_map(|(name, r)| {
            let any = r.resource?;
            Some((name, Address::decode(any.value.as_slice()).ok()?.r#type?))
        })
        .collect()
}

fn workload_of(derived: &BTreeMap<String, address::Type>, uid: &str) -> Option<workload::Workload> {
    match derived.get(uid) {
        Some(address::Type::Workload(w)) => Some(w.clone()),
        _ => None,
    }
}

fn service_of(derived: &BTreeMap<String, address::Type>, key: &str) -> Option<workload::Service> {
    match derived.get(key) {
        Some(address::Type::Service(s)) => Some(s.clone()),
        _ => None,
    }
}

/// `service()` without its selector: Kubernetes keeps no endpoints for it;
/// whoever runs it writes its EndpointSlices.
fn selectorless() -> Value {
    let mut svc = service();
    svc["spec"].as_object_mut().map(|s| s.remove("selector"));
    svc
}

/// A slice of Service `web` (ports named as its ports: `http` at 8080,
/// `admin` at 9001) with `endpoints`.
fn slice(endpoints: Value) -> Value {
    json!({
        "kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1",
        "metadata": {"name": "web-abc12", "namespace": "shop",
                     "labels": {"kubernetes.io/service-name": "web"}},
        "addressType": "IPv4",
        "ports": [
            {"name": "http", "port": 8080, "protocol": "TCP"},
            {"name": "admin", "port": 9001, "protocol": "TCP"}
        ],
        "endpoints": endpoints
    })
}

/// The fixture pod as an endpoint's target (its namespace, name, uid).
fn pod_ref() -> Value {
    json!({"kind": "Pod", "namespace": "shop", "name": "web-7d9c8b6f5-x2x4q", "uid": "u1"})
}

fn with_slice(svc: Value, slice: Value) -> Vec<(String, Value)> {
    vec![
        (POD.to_owned(), named_pod()),
        (SVC_PATH.to_owned(), svc),
        (SLICE_PATH.to_owned(), slice),
    ]
}

#[test]
fn a_slice_endpoint_that_is_no_pod_becomes_a_host_network_workload_of_the_service() {
    let derived = derive_every(with_slice(
        selectorless(),
        slice(json!([
            {"addresses": ["10.1.2.3"], "conditions": {"ready": true}},
            {"addresses": ["10.1.2.4"], "conditions": {"ready": false}},
            {"addresses": ["10.1.2.5"]}
        ])),
    ));
    let expected = workload::Workload {
        uid: format!("{SLICE_UID}/10.1.2.3"),
        name: "web-abc12".to_owned(),
        namespace: "shop".to_owned(),
        addresses: vec![vec![10, 1, 2, 3]],
        cluster_id: "Kubernetes".to_owned(),
        // The slice port's number, joined to the Service port by name.
        services: HashMap::from([(
            SERVICE_KEY.to_owned(),
            PortList {
                ports: vec![port(80, 8080), port(81, 9001)],
            },
        )]),
        status: WorkloadStatus::Healthy as i32,
        network_mode: NetworkMode::HostNetwork as i32,
        // No identity, tunnel, waypoint, workload name or type: an
        // address is all a slice says.
        ..Default::default()
    };
    assert_eq!(workload_of(&derived, &expected.uid), Some(expected.clone()));
    let unready = workload_of(&derived, &format!("{SLICE_UID}/10.1.2.4"));
    assert_eq!(
        unready.map(|w| w.status),
        Some(WorkloadStatus::Unhealthy as i32)
    );
    let unsaid = workload_of(&derived, &format!("{SLICE_UID}/10.1.2.5"));
    assert_eq!(
        unsaid.map(|w| w.status),
        Some(WorkloadStatus::Healthy as i32),
        "no ready condition: healthy"
    );
    // The Service itself is the selectorless object's, as any Service.
    let svc = service_of(&derived, SERVICE_KEY).unwrap_or_default();
    assert_eq!(
        svc.addresses,
        vec![NetworkAddress {
            network: String::new(),
            address: vec![10, 96, 0, 10],
            length: None,
        }]
    );
    assert_eq!(svc.ports, vec![port(80, 0), port(81, 9001)]);
    assert_eq!(svc.ip_families, IpFamilies::Ipv4Only as i32);
    assert!(svc.canonical);
    // The pod, not selected and not named by the slice, is in no Service.
    assert_eq!(
        workload_of(&derived, POD_UID).map(|w| w.services.is_empty()),
        Some(true)
    );
}

#[test]
fn only_tcp_slice_ports_named_as_a_service_port_are_mapped() {
    let mut s = slice(json!([{"addresses": ["10.1.2.3"]}]));
    s["ports"] = json!([
        {"name": "admin", "port": 9009, "protocol": "UDP"},
        {"name": "other", "port": 7000, "protocol": "TCP"},
        {"name": "http"},
        {"name": "admin", "port": 9002}
    ]);
    let derived = derive_every(with_slice(selectorless(), s));
    let w = workload_of(&derived, &format!("{SLICE_UID}/10.1.2.3")).unwrap_or_default();
    // UDP, an unknown name and a port without a number are left out; a
    // port without a protocol is TCP (the API server's default).
    assert_eq!(w.services[SERVICE_KEY].ports, vec![port(81, 9002)]);
    // A single unnamed Service port takes the slice's unnamed port.
    let mut one = selectorless();
    one["spec"]["ports"] = json!([{"port": 80, "targetPort": 8080, "protocol": "TCP"}]);
    let mut s = slice(json!([{"addresses": ["10.1.2.3"]}]));
    s["ports"] = json!([{"port": 8081, "protocol": "TCP"}]);
    let derived = derive_every(with_slice(one, s));
    let w = workload_of(&derived, &format!("{SLICE_UID}/10.1.2.3")).unwrap_or_default();
    assert_eq!(w.services[SERVICE_KEY].ports, vec![port(80, 8081)]);
}

#[test]
fn unusable_endpoints_and_slices_make_no_workload() {
    let uids = |svc: Option<Value>, slice: Value| -> Vec<String> {
        let mut list = vec![(SLICE_PATH.to_owned(), slice)];
        list.extend(svc.map(|s| (SVC_PATH.to_owned(), s)));
        derive_every(list)
            .into_keys()
            .filter(|k| k.starts_with(SLICE_UID))
            .collect()
    };
    let endpoints = json!([
        {"addresses": ["10.1.2.3"]},
        {"addresses": ["10.1.2.3"]},
        {"addresses": ["10.1.2.6", "not-an-ip"]},
        {"addresses": []},
        {"addresses": ["10.244.1.11"], "targetRef": pod_ref()}
    ]);
    // A repeated first address once; an unparsable one, none, or a pod's
    // endpoint (the pod's own workload carries it) not at all.
    assert_eq!(
        uids(Some(selectorless()), slice(endpoints.clone())),
        [format!("{SLICE_UID}/10.1.2.3")]
    );
    assert!(
        uids(None, slice(endpoints.clone())).is_empty(),
        "no Service"
    );
    let mut external = selectorless();
    external["spec"]["type"] = "ExternalName".into();
    assert!(uids(Some(external), slice(endpoints.clone())).is_empty());
    let mut unlabelled = slice(endpoints.clone());
    unlabelled["metadata"]["labels"] = json!({});
    assert!(uids(Some(selectorless()), unlabelled).is_empty());
    let mut fqdn = slice(endpoints);
    fqdn["addressType"] = "FQDN".into();
    assert!(uids(Some(selectorless()), fqdn).is_empty());
}

#[test]
fn a_pod_named_by_a_slices_target_ref_is_in_that_service() {
    let pod_services = |svc: Value, target: Value| {
        let derived = derive_every(with_slice(
            svc,
            slice(json!([{"addresses": ["10.244.1.11"], "targetRef": target}])),
        ));
        workload_of(&derived, POD_UID)
            .map(|w| w.services)
            .unwrap_or_default()
    };
    // The Service's own ports, a named target port resolved in the pod
    // (not the slice's numbers: the pod's workload is built from the Pod).
    let services = pod_services(selectorless(), pod_ref());
    assert_eq!(
        services.get(SERVICE_KEY).map(|l| l.ports.clone()),
        Some(vec![port(80, 8080), port(81, 9001)])
    );
    // The target must be this pod: kind, name and uid.
    for (key, value) in [("uid", "u2"), ("name", "web-other"), ("kind", "Node")] {
        let mut other = pod_ref();
        other[key] = value.into();
        assert!(pod_services(selectorless(), other).is_empty(), "{key}");
    }
    // A Service that also selects the pod is in its map once.
    let services = pod_services(service(), pod_ref());
    assert_eq!(services.keys().collect::<Vec<_>>(), [SERVICE_KEY]);
}

/// A ServiceEntry in `namespace` for `host` selecting `app: web`: port 80
/// named `web`, port 9090 named `metrics` targeting 9091.
fn entry(namespace: &str, name: &str, host: &str, created: &str) -> Value {
    json!({
        "kind": "ServiceEntry", "apiVersion": "networking.istio.io/v1",
        "metadata": {"name": name, "namespace": namespace, "creationTimestamp": created},
        "spec": {
            "hosts": [host],
            "addresses": ["240.240.1.1"],
            "ports": [{"number": 80, "name": "web", "protocol": "HTTP"},
                      {"number": 9090, "name": "metrics", "targetPort": 9091}],
            "resolution": "STATIC",
            "workloadSelector": {"labels": {"app": "web"}}
        }
    })
}

fn entry_path(namespace: &str, name: &str) -> String {
    format!("/apis/networking.istio.io/v1/namespaces/{namespace}/serviceentries/{name}")
}

#[test]
fn a_service_entry_selecting_the_pod_puts_it_in_the_entrys_service() {
    let list = vec![
        (POD.to_owned(), named_pod()),
        (
            entry_path("shop", "ext"),
            entry("shop", "ext", "web.example.com", "2026-05-04T09:00:00Z"),
        ),
    ];
    let derived = derive_every(list);
    let key = "shop/web.example.com";
    let w = workload_of(&derived, POD_UID).unwrap_or_default();
    // Port 80's name is the pod's container port `web` (8080); 9090 has
    // no such container port and keeps its target.
    assert_eq!(
        w.services.get(key).map(|l| l.ports.clone()),
        Some(vec![port(80, 8080), port(9090, 9091)])
    );
    let svc = service_of(&derived, key).unwrap_or_default();
    assert_eq!(
        (
            svc.name.as_str(),
            svc.namespace.as_str(),
            svc.hostname.as_str()
        ),
        ("ext", "shop", "web.example.com")
    );
    assert_eq!(svc.addresses[0].address, vec![240, 240, 1, 1]);
    assert_eq!(svc.ports, vec![port(80, 80), port(9090, 9091)]);
    assert!(svc.canonical, "the only one of its hostname");
    // A selector that does not match, or another namespace's entry, does
    // not select it; the selector makes no workloads of its own.
    let mut other = entry("shop", "ext", "web.example.com", "2026-05-04T09:00:00Z");
    other["spec"]["workloadSelector"]["labels"] = json!({"app": "api"});
    let elsewhere = entry("legacy", "ext", "web.example.com", "2026-05-04T09:00:00Z");
    for (path, e) in [
        (entry_path("shop", "ext"), other),
        (entry_path("legacy", "ext"), elsewhere),
    ] {
        let derived = derive_every(vec![(POD.to_owned(), named_pod()), (path, e)]);
        let w = workload_of(&derived, POD_UID).unwrap_or_default();
        assert!(w.services.is_empty());
        assert_eq!(derived.len(), 2, "the pod and the entry's Service");
    }
}

#[test]
fn a_hostname_is_served_once_per_namespace_the_service_winning_then_the_oldest_entry() {
    // An entry for the Service's own hostname loses to it: the pod is in
    // the Service, with the Service's ports.
    let mut list = vec![
        (POD.to_owned(), named_pod()),
        (SVC_PATH.to_owned(), service()),
        (
            entry_path("shop", "shadow"),
            entry(
                "shop",
                "shadow",
                "web.shop.svc.cluster.local",
                "2020-01-01T00:00:00Z",
            ),
        ),
    ];
    let derived = derive_every(list.clone());
    assert_eq!(
        service_of(&derived, SERVICE_KEY).map(|s| (s.name, s.canonical)),
        Some(("web".to_owned(), true))
    );
    let w = workload_of(&derived, POD_UID).unwrap_or_default();
    assert_eq!(
        w.services[SERVICE_KEY].ports,
        vec![port(80, 8080), port(81, 9001)]
    );
    // Two entries of one namespace: the older; of two namespaces: both,
    // the older canonical.
    list = vec![
        (
            entry_path("shop", "new"),
            entry("shop", "new", "web.example.com", "2026-05-04T09:00:00Z"),
        ),
        (
            entry_path("shop", "old"),
            entry("shop", "old", "web.example.com", "2026-05-03T09:00:00Z"),
        ),
        (
            entry_path("legacy", "older"),
            entry("legacy", "older", "web.example.com", "2026-05-01T09:00:00Z"),
        ),
    ];
    let derived = derive_every(list);
    let shop = service_of(&derived, "shop/web.example.com").unwrap_or_default();
    let legacy = service_of(&derived, "legacy/web.example.com").unwrap_or_default();
    assert_eq!((shop.name.as_str(), shop.canonical), ("old", false));
    assert_eq!((legacy.name.as_str(), legacy.canonical), ("older", true));
}

/// The weighted waypoints of Service `web` with its labels and
/// annotations `svc_meta`, namespace `shop`'s `ns_meta` (each
/// `{"labels": .., "annotations": ..}`), and waypoints `wp`, `canary`
/// (all traffic), `wl` (workload traffic) in `shop`.
fn weighted_of(svc_meta: Value, ns_meta: Value) -> (Vec<WeightedWaypoint>, bool) {
    let mut svc = service();
    svc["metadata"]["labels"] = svc_meta["labels"].clone();
    svc["metadata"]["annotations"] = svc_meta["annotations"].clone();
    let mut ns = namespace(ns_meta["labels"].clone());
    ns["metadata"]["annotations"] = ns_meta["annotations"].clone();
    let list = vec![
        (SVC_PATH.to_owned(), svc),
        ("/api/v1/namespaces/shop".to_owned(), ns),
        (gateway_path("shop", "wp"), gateway("shop", "wp", "all")),
        (
            gateway_path("shop", "canary"),
            gateway("shop", "canary", "service"),
        ),
        (
            gateway_path("shop", "wl"),
            gateway("shop", "wl", "workload"),
        ),
    ];
    let svc = service_of(&derive_every(list), SERVICE_KEY).unwrap_or_default();
    let primary = svc.waypoint == Some(waypoint_address("shop", "wp"));
    (svc.weighted_waypoints, primary)
}

#[test]
fn a_canary_waypoint_beside_the_primary_splits_by_its_weight() {
    let split = |primary: u32, canary: u32| {
        vec![
            WeightedWaypoint {
                destination: Some(waypoint_address("shop", "wp")),
                weight: primary,
            },
            WeightedWaypoint {
                destination: Some(waypoint_address("shop", "canary")),
                weight: canary,
            },
        ]
    };
    let both = |weight: Option<&str>| {
        let mut meta = json!({"labels": {"istio.io/use-waypoint": "wp",
                                         "istio.io/use-waypoint-canary": "canary"},
                              "annotations": {}});
        if let Some(w) = weight {
            meta["annotations"]["istio.io/use-waypoint-canary-weight"] = w.into();
        }
        weighted_of(meta, json!({"labels": {}, "annotations": {}}))
    };
    assert_eq!(both(Some("10")), (split(90, 10), true));
    assert_eq!(both(None), (split(100, 0), true), "no weight: 0%");
    assert_eq!(both(Some("+100")), (split(0, 100), true));
    // Not a percentage: the canary is dropped, the primary stays.
    for bad in ["101", "-1", "ten", " 5", "5.0"] {
        assert_eq!(both(Some(bad)), (vec![], true), "{bad:?}");
    }
    // From the namespace, labels and weight, when the Service names no
    // waypoint of its own.
    let ns = json!({"labels": {"istio.io/use-waypoint": "wp",
                               "istio.io/use-waypoint-canary": "canary"},
                    "annotations": {"istio.io/use-waypoint-canary-weight": "25"}});
    let empty = json!({"labels": {}, "annotations": {}});
    assert_eq!(weighted_of(empty, ns.clone()), (split(75, 25), true));
    // The Service naming its own primary reads no canary from the
    // namespace.
    let own = json!({"labels": {"istio.io/use-waypoint": "wp"}, "annotations": {}});
    assert_eq!(weighted_of(own, ns), (vec![], true));
    // A canary that is the primary, missing, or not for services: none.
    for canary in ["wp", "nowhere", "wl", "none"] {
        let meta = json!({"labels": {"istio.io/use-waypoint": "wp",
                                     "istio.io/use-waypoint-canary": canary},
                          "annotations": {}});
        let (weighted, primary) = weighted_of(meta, json!({"labels": {}, "annotations": {}}));
        assert_eq!((weighted, primary), (vec![], true), "{canary}");
    }
    // No primary, no canary.
    let alone = json!({"labels": {"istio.io/use-waypoint-canary": "canary"}, "annotations": {}});
    assert_eq!(
        weighted_of(alone, json!({"labels": {}, "annotations": {}})),
        (vec![], false)
    );
}
