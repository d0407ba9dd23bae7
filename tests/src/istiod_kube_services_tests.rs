//! Services, the pods' `services` and waypoint attachment against istiod's
//! rules, on the stand-in API's pod fixture and Service, namespace and
//! Gateway objects written here as the API server returns them.

use std::collections::HashMap;
use std::sync::Arc;

use dataplane_user::istio_api::workload::{
    ApplicationTunnel, GatewayAddress, IpFamilies, NamespacedHostname, Port, application_tunnel,
    gateway_address,
};
use prost::Message as _;
use serde_json::{Value, json};

use super::super::*;
use super::web;

pub(super) const POD: &str = "/api/v1/namespaces/shop/pods/web-7d9c8b6f5-x2x4q";
pub(super) const POD_UID: &str = "Kubernetes//Pod/shop/web-7d9c8b6f5-x2x4q";
pub(super) const SERVICE_KEY: &str = "shop/web.shop.svc.cluster.local";

/// The fixture pod with its container port named `web` (8080/TCP), as a
/// Deployment exposing it by name declares it.
pub(super) fn named_pod() -> Value {
    let mut pod = web();
    pod["spec"]["containers"][0]["ports"][0]["name"] = "web".into();
    pod
}

/// Service `web` in `shop` selecting `app: web`: 80 to the named port
/// `web`, 81 to 9001.
pub(super) fn service() -> Value {
    json!({
        "kind": "Service", "apiVersion": "v1",
        "metadata": {"name": "web", "namespace": "shop", "labels": {}},
        "spec": {
            "type": "ClusterIP",
            "clusterIP": "10.96.0.10", "clusterIPs": ["10.96.0.10"],
            "ipFamilies": ["IPv4"],
            "selector": {"app": "web"},
            "ports": [
                {"name": "http", "port": 80, "targetPort": "web", "protocol": "TCP"},
                {"name": "admin", "port": 81, "targetPort": 9001, "protocol": "TCP"}
            ]
        }
    })
}

pub(super) fn namespace(labels: Value) -> Value {
    json!({"kind": "Namespace", "apiVersion": "v1",
           "metadata": {"name": "shop", "labels": labels}})
}

/// A Gateway that istiod's controller has given a hostname address (a
/// running waypoint), taking `traffic` traffic.
pub(super) fn gateway(namespace: &str, name: &str, traffic: &str) -> Value {
    json!({
        "kind": "Gateway", "apiVersion": "gateway.networking.k8s.io/v1",
        "metadata": {"name": name, "namespace": namespace,
                     "labels": {"istio.io/waypoint-for": traffic}},
        "spec": {"gatewayClassName": "istio-waypoint",
                 "listeners": [{"name": "mesh", "port": 15008, "protocol": "HBONE"}]},
        "status": {"addresses": [
            {"type": "IPAddress", "value": "10.96.0.99"},
            {"type": "Hostname", "value": format!("{name}.{namespace}.svc.cluster.local")}
        ]}
    })
}

pub(super) fn gateway_path(namespace: &str, name: &str) -> String {
    format!("/apis/gateway.networking.k8s.io/v1/namespaces/{namespace}/gateways/{name}")
}

/// The address `gateway(namespace, name, _)` gives its users.
pub(super) fn waypoint_address(namespace: &str, name: &str) -> GatewayAddress {
    GatewayAddress {
        destination: Some(gateway_address::Destination::Hostname(NamespacedHostname {
            namespace: namespace.to_owned(),
            hostname: format!("{name}.{namespace}.svc.cluster.local"),
        })),
        hbone_mtls_port: 15008,
    }
}

pub(super) fn objects(list: Vec<(String, Value)>) -> Objects {
    Arc::new(list.into_iter().collect::<HashMap<_, _>>())
}

/// The pod's workload and the Service istiod derives from `list`.
fn derive_all(list: Vec<(String, Value)>) -> (workload::Workload, Option<workload::Service>) {
    let derived = address_resources(&objects(list), &Cluster::default());
    let decode = |name: &str| {
        derived
            .get(name)
            .and_then(|r| r.resource.as_ref())
            .and_then(|any| Address::decode(any.value.as_slice()).ok())
            .and_then(|a| a.r#type)
    };
    let workload = match decode(POD_UID) {
        Some(address::Type::Workload(w)) => w,
        other => panic!("no workload for the pod: {other:?}"),
    };
    let service = match decode(SERVICE_KEY) {
        Some(address::Type::Service(s)) => Some(s),
        _ => None,
    };
    (workload, service)
}

fn with(pod: Value, svc: Value) -> Vec<(String, Value)> {
    vec![
        (POD.to_owned(), pod),
        ("/api/v1/namespaces/shop/services/web".to_owned(), svc),
    ]
}

pub(super) fn port(service: u32, target: u32) -> Port {
    Port {
        service_port: service,
        target_port: target,
    }
}

#[test]
fn a_service_becomes_istiods_service() {
    let (_, svc) = derive_all(with(named_pod(), service()));
    let svc = svc.unwrap_or_default();
    assert_eq!((svc.name.as_str(), svc.namespace.as_str()), ("web", "shop"));
    assert_eq!(svc.hostname, "web.shop.svc.cluster.local");
    assert_eq!(svc.addresses.len(), 1);
    assert_eq!(svc.addresses[0].address, vec![10, 96, 0, 10]);
    assert_eq!(svc.addresses[0].network, "");
    // A named target port is 0 on the Service: each pod resolves it.
    assert_eq!(svc.ports, vec![port(80, 0), port(81, 9001)]);
    assert_eq!(svc.ip_families, IpFamilies::Ipv4Only as i32);
    assert!(svc.canonical);
    assert_eq!(svc.waypoint, None);
    assert_eq!(svc.load_balancing, None);

    let mut headless = service();
    headless["spec"]["clusterIP"] = "None".into();
    headless["spec"]["clusterIPs"] = json!(["None"]);
    let (_, svc) = derive_all(with(named_pod(), headless));
    assert_eq!(svc.map(|s| s.addresses.len()), Some(0), "headless: no VIP");
    let mut external = service();
    external["spec"]["type"] = "ExternalName".into();
    assert!(derive_all(with(named_pod(), external)).1.is_none());
}

#[test]
fn a_named_target_port_is_the_pods_container_port_of_that_name() {
    let (w, _) = derive_all(with(named_pod(), service()));
    assert_eq!(w.services.keys().collect::<Vec<_>>(), vec![SERVICE_KEY]);
    assert_eq!(
        w.services[SERVICE_KEY].ports,
        vec![port(80, 8080), port(81, 9001)]
    );
    // A pod that does not name the port is left out of it, not sent to 0.
    let (w, _) = derive_all(with(web(), service()));
    assert_eq!(w.services[SERVICE_KEY].ports, vec![port(81, 9001)]);
    // Only a TCP port of that name counts.
    let mut udp = named_pod();
    udp["spec"]["containers"][0]["ports"][0]["protocol"] = "UDP".into();
    let (w, _) = derive_all(with(udp, service()));
    assert_eq!(w.services[SERVICE_KEY].ports, vec![port(81, 9001)]);
    // A native sidecar's port is found; a plain init container's is not.
    let mut sidecar = web();
    sidecar["spec"]["initContainers"] = json!([
        {"name": "init", "ports": [{"name": "web", "containerPort": 7070, "protocol": "TCP"}]},
        {"name": "side", "restartPolicy": "Always",
         "ports": [{"name": "web", "containerPort": 7080, "protocol": "TCP"}]}
    ]);
    let (w, _) = derive_all(with(sidecar, service()));
    assert_eq!(
        w.services[SERVICE_KEY].ports,
        vec![port(80, 7080), port(81, 9001)]
    );
}

#[test]
fn only_a_non_empty_selector_matching_the_pods_labels_in_its_namespace_selects_it() {
    let selects = |svc: Value| !derive_all(with(named_pod(), svc)).0.services.is_empty();
    assert!(selects(service()));
    let mut subset = service();
    subset["spec"]["selector"] = json!({"pod-template-hash": "7d9c8b6f5"});
    assert!(selects(subset), "a selector is a subset of the labels");
    let mut other = service();
    other["spec"]["selector"] = json!({"app": "web", "tier": "front"});
    assert!(!selects(other), "every selector label must match");
    let mut value = service();
    value["spec"]["selector"] = json!({"app": "api"});
    assert!(!selects(value));
    let mut empty = service();
    empty["spec"]["selector"] = json!({});
    assert!(!selects(empty), "an empty selector selects nothing");
    let mut none = service();
    none["spec"]
        .as_object_mut()
        .map(|spec| spec.remove("selector"));
    assert!(!selects(none));
    let mut elsewhere = service();
    elsewhere["metadata"]["namespace"] = "legacy".into();
    let list = vec![
        (POD.to_owned(), named_pod()),
        (
            "/api/v1/namespaces/legacy/services/web".to_owned(),
            elsewhere,
        ),
    ];
    assert!(
        derive_all(list).0.services.is_empty(),
        "another namespace's"
    );
}

/// The pod's and the Service's waypoints with the namespace labelled
/// `ns_labels`, the pod `pod_labels` and the Service `svc_labels` added,
/// and waypoints `wp` (all traffic), `svc-only` (service traffic) in
/// `shop` and `shared` (all traffic, any namespace) in `infra`.
fn waypoints_of(
    ns_labels: Value,
    pod_labels: &[(&str, &str)],
    svc_labels: &[(&str, &str)],
) -> (Option<GatewayAddress>, Option<GatewayAddress>) {
    let mut pod = named_pod();
    for (k, v) in pod_labels {
        pod["metadata"]["labels"][*k] = (*v).into();
    }
    let mut svc = service();
    for (k, v) in svc_labels {
        svc["metadata"]["labels"][*k] = (*v).into();
    }
    let mut shared = gateway("infra", "shared", "all");
    shared["spec"]["listeners"][0]["allowedRoutes"] = json!({"namespaces": {"from": "All"}});
    let mut list = with(pod, svc);
    list.extend([
        ("/api/v1/namespaces/shop".to_owned(), namespace(ns_labels)),
        (gateway_path("shop", "wp"), gateway("shop", "wp", "all")),
        (
            gateway_path("shop", "svc-only"),
            gateway("shop", "svc-only", "service"),
        ),
        (gateway_path("infra", "shared"), shared),
        (
            gateway_path("infra", "private"),
            gateway("infra", "private", "all"),
        ),
    ]);
    let (w, s) = derive_all(list);
    (w.waypoint, s.and_then(|s| s.waypoint))
}

#[test]
fn the_objects_own_waypoint_label_wins_over_its_namespaces_and_none_opts_out() {
    let wp = Some(waypoint_address("shop", "wp"));
    let ns = json!({"istio.io/use-waypoint": "wp"});
    assert_eq!(waypoints_of(json!({}), &[], &[]), (None, None));
    assert_eq!(waypoints_of(ns.clone(), &[], &[]), (wp.clone(), wp.clone()));
    // Pod over namespace; Service over namespace; each on its own.
    let shared = Some(waypoint_address("infra", "shared"));
    let elsewhere = [
        ("istio.io/use-waypoint", "shared"),
        ("istio.io/use-waypoint-namespace", "infra"),
    ];
    assert_eq!(
        waypoints_of(ns.clone(), &elsewhere, &[]),
        (shared.clone(), wp.clone())
    );
    assert_eq!(
        waypoints_of(ns.clone(), &[], &elsewhere),
        (wp.clone(), shared)
    );
    // `none` opts out of the namespace's.
    let none = [("istio.io/use-waypoint", "none")];
    assert_eq!(waypoints_of(ns.clone(), &none, &[]), (None, wp.clone()));
    assert_eq!(waypoints_of(ns.clone(), &[], &none), (wp, None));
    // A named waypoint that does not exist, or that does not take the
    // object's namespace (its listener's default `Same`), is none: the
    // namespace's is not used instead.
    let missing = [("istio.io/use-waypoint", "nowhere")];
    assert_eq!(waypoints_of(ns.clone(), &missing, &missing), (None, None));
    let private = [
        ("istio.io/use-waypoint", "private"),
        ("istio.io/use-waypoint-namespace", "infra"),
    ];
    assert_eq!(waypoints_of(ns, &private, &private), (None, None));
}

#[test]
fn a_waypoint_for_services_only_serves_the_service() {
    let svc_only = Some(waypoint_address("shop", "svc-only"));
    // From the namespace: the workload silently has none.
    let ns = json!({"istio.io/use-waypoint": "svc-only"});
    assert_eq!(waypoints_of(ns, &[], &[]), (None, svc_only.clone()));
    // On the pod itself: none either (istiod reports it in status).
    let own = [("istio.io/use-waypoint", "svc-only")];
    assert_eq!(waypoints_of(json!({}), &own, &own), (None, svc_only));
    // A workload-only waypoint serves no Service.
    let mut list = with(named_pod(), service());
    list.push((
        "/api/v1/namespaces/shop".to_owned(),
        namespace(json!({"istio.io/use-waypoint": "wl"})),
    ));
    list.push((
        gateway_path("shop", "wl"),
        gateway("shop", "wl", "workload"),
    ));
    let (w, s) = derive_all(list);
    assert_eq!(w.waypoint, Some(waypoint_address("shop", "wl")));
    assert_eq!(s.and_then(|s| s.waypoint), None);
}

#[test]
fn a_gateway_is_a_waypoint_once_it_has_an_address_ip_when_no_hostname() {
    let ns = json!({"istio.io/use-waypoint": "wp"});
    let mut list = with(named_pod(), service());
    list.push(("/api/v1/namespaces/shop".to_owned(), namespace(ns)));
    let mut pending = gateway("shop", "wp", "all");
    pending["status"] = json!({});
    list.push((gateway_path("shop", "wp"), pending));
    assert_eq!(derive_all(list.clone()).0.waypoint, None, "no address yet");
    let mut by_ip = gateway("shop", "wp", "all");
    by_ip["status"]["addresses"] = json!([{"type": "IPAddress", "value": "10.96.0.99"}]);
    if let Some(last) = list.last_mut() {
        last.1 = by_ip;
    }
    let w = derive_all(list).0;
    let address = w.waypoint.and_then(|g| match g.destination {
        Some(gateway_address::Destination::Address(a)) => Some((a.address, g.hbone_mtls_port)),
        _ => None,
    });
    assert_eq!(address, Some((vec![10, 96, 0, 99], 15008)));
}

#[test]
fn a_waypoints_own_pod_gets_its_inbound_binding_and_no_waypoint() {
    let mut pod = named_pod();
    pod["metadata"]["labels"]["gateway.networking.k8s.io/gateway-name"] = "wp".into();
    let mut wp = gateway("shop", "wp", "all");
    wp["metadata"]["annotations"] =
        json!({"ambient.istio.io/waypoint-inbound-binding": "PROXY/15088"});
    let mut list = with(pod, service());
    list.push((
        "/api/v1/namespaces/shop".to_owned(),
        namespace(json!({"istio.io/use-waypoint": "wp"})),
    ));
    list.push((gateway_path("shop", "wp"), wp.clone()));
    let w = derive_all(list.clone()).0;
    assert_eq!(w.waypoint, None);
    assert_eq!(
        w.application_tunnel,
        Some(ApplicationTunnel {
            protocol: application_tunnel::Protocol::Proxy as i32,
            port: 15088,
        })
    );
    // The class's annotation when the Gateway has none; nonsense is none.
    let class = json!({"kind": "GatewayClass", "metadata": {"name": "istio-waypoint",
        "annotations": {"ambient.istio.io/waypoint-inbound-binding": "PROXY"}}});
    wp["metadata"]["annotations"] = json!({});
    let mut from_class = list.clone();
    from_class.pop();
    from_class.push((gateway_path("shop", "wp"), wp.clone()));
    from_class.push((
        "/apis/gateway.networking.k8s.io/v1/gatewayclasses/istio-waypoint".to_owned(),
        class,
    ));
    assert_eq!(
        derive_all(from_class).0.application_tunnel.map(|t| t.port),
        Some(0)
    );
    wp["metadata"]["annotations"] = json!({"ambient.istio.io/waypoint-inbound-binding": "HTTP/80"});
    list.pop();
    list.push((gateway_path("shop", "wp"), wp));
    assert_eq!(derive_all(list).0.application_tunnel, None);
}

#[test]
fn load_balancing_and_ip_families_follow_the_service_then_its_namespace() {
    use dataplane_user::istio_api::workload::{LoadBalancing, load_balancing::*};
    let lb = |spec: Value, svc_ann: Value, ns_ann: Value| {
        let mut svc = service();
        for (k, v) in spec.as_object().into_iter().flatten() {
            svc["spec"][k] = v.clone();
        }
        svc["metadata"]["annotations"] = svc_ann;
        let mut list = with(named_pod(), svc);
        let mut ns = namespace(json!({}));
        ns["metadata"]["annotations"] = ns_ann;
        list.push(("/api/v1/namespaces/shop".to_owned(), ns));
        derive_all(list).1.unwrap_or_default()
    };
    let scopes = |s: &[Scope], mode: Mode| LoadBalancing {
        routing_preference: s.iter().map(|s| *s as i32).collect(),
        mode: mode as i32,
        health_policy: HealthPolicy::OnlyHealthy as i32,
    };
    let zone = scopes(
        &[Scope::Network, Scope::Region, Scope::Zone],
        Mode::Failover,
    );
    let node = scopes(
        &[
            Scope::Network,
            Scope::Region,
            Scope::Zone,
            Scope::Subzone,
            Scope::Node,
        ],
        Mode::Failover,
    );
    let key = "networking.istio.io/traffic-distribution";
    let none = json!({});
    assert_eq!(
        lb(none.clone(), none.clone(), none.clone()).load_balancing,
        None
    );
    // Local internal traffic policy wins over any distribution.
    let local = json!({"internalTrafficPolicy": "Local", "trafficDistribution": "PreferClose"});
    assert_eq!(
        lb(local, none.clone(), none.clone()).load_balancing,
        Some(scopes(&[Scope::Node], Mode::Strict))
    );
    // The spec field, then the Service's annotation, then the namespace's.
    let spec = json!({"trafficDistribution": "PreferSameNode"});
    let ann_zone = json!({key: "PreferClose"});
    assert_eq!(
        lb(spec, ann_zone.clone(), none.clone()).load_balancing,
        Some(node.clone())
    );
    assert_eq!(
        lb(
            none.clone(),
            ann_zone.clone(),
            json!({key: "PreferSameNode"})
        )
        .load_balancing,
        Some(zone.clone())
    );
    assert_eq!(
        lb(none.clone(), none.clone(), json!({key: "prefersamenode"})).load_balancing,
        Some(node)
    );
    // An unknown Service annotation is "any", the namespace's unread.
    assert_eq!(
        lb(none.clone(), json!({key: "nearby"}), ann_zone).load_balancing,
        None
    );
    // Not-ready endpoints allowed, with or without a preference.
    let mut all = lb(
        json!({"publishNotReadyAddresses": true}),
        none.clone(),
        none.clone(),
    );
    assert_eq!(
        all.load_balancing.take().map(|l| l.health_policy),
        Some(HealthPolicy::AllowAll as i32)
    );
    let families = |f: Value| lb(json!({"ipFamilies": f}), none.clone(), none.clone()).ip_families;
    assert_eq!(families(json!(["IPv6"])), IpFamilies::Ipv6Only as i32);
    assert_eq!(families(json!(["IPv4", "IPv6"])), IpFamilies::Dual as i32);
    assert_eq!(families(json!([])), IpFamilies::Automatic as i32);
}
