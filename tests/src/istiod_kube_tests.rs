//! The derivation against istiod's rules, one rule at a time, on the
//! stand-in API's pod fixture (Services and waypoints: `services_tests.rs`).

use std::collections::HashMap;
use std::sync::Arc;

use dataplane_user::istio_api::workload::{
    NetworkMode, TunnelProtocol, WorkloadStatus, WorkloadType,
};
use serde_json::{Value, json};

use super::*;
use crate::cni_kubeapi::fixture;

fn web() -> Value {
    match fixture(
        "pod_web.json",
        &[("NODE", "node-a"), ("UID_WEB", "u1"), ("NS_UID_SHOP", "n1")],
    ) {
        Ok(pod) => pod,
        Err(err) => panic!("the pod fixture: {err}"),
    }
}

fn derive(pod: &Value) -> workload::Workload {
    match pod_workload(pod, &Cluster::default()) {
        Some(w) => w,
        None => panic!("no workload for {pod}"),
    }
}

fn annotated(value: &str) -> Value {
    let mut pod = web();
    pod["metadata"]["annotations"] = json!({ REDIRECTION_ANNOTATION: value });
    pod
}

#[test]
fn a_pod_becomes_the_workload_istiod_builds() {
    let w = derive(&web());
    assert_eq!(w.uid, "Kubernetes//Pod/shop/web-7d9c8b6f5-x2x4q");
    assert_eq!(
        (w.name.as_str(), w.namespace.as_str()),
        ("web-7d9c8b6f5-x2x4q", "shop")
    );
    assert_eq!(w.cluster_id, "Kubernetes");
    assert_eq!(
        w.addresses,
        vec![
            vec![10, 244, 1, 11],
            "fd00:10:244:1::b"
                .parse::<std::net::Ipv6Addr>()
                .map(|ip| ip.octets().to_vec())
                .unwrap_or_default(),
        ]
    );
    assert_eq!(w.service_account, "web");
    assert_eq!(w.node, "node-a");
    assert_eq!(w.trust_domain, "", "cluster.local is sent as empty");
    assert_eq!(w.status, WorkloadStatus::Healthy as i32);
    assert_eq!(w.workload_name, "web", "the Deployment's name");
    assert_eq!(w.workload_type, WorkloadType::Pod as i32);
    assert_eq!(
        (w.canonical_name.as_str(), w.canonical_revision.as_str()),
        ("web", "latest")
    );
    assert_eq!(w.network_mode, NetworkMode::Standard as i32);
    assert_eq!(w.tunnel_protocol, TunnelProtocol::None as i32);
}

#[test]
fn only_the_enabled_annotation_or_the_tunnel_label_gives_hbone() {
    let enabled = derive(&annotated("enabled"));
    assert_eq!(enabled.tunnel_protocol, TunnelProtocol::Hbone as i32);
    assert!(!enabled.native_tunnel);
    for other in ["pending", "Enabled", ""] {
        assert_eq!(
            derive(&annotated(other)).tunnel_protocol,
            TunnelProtocol::None as i32,
            "{other:?}"
        );
    }
    let mut native = web();
    native["metadata"]["labels"]["networking.istio.io/tunnel"] = "h2c,http".into();
    let native = derive(&native);
    assert_eq!(native.tunnel_protocol, TunnelProtocol::Hbone as i32);
    assert!(native.native_tunnel);
    // A mutual-TLS label is no tunnel (EnableMtlsTransportProtocol off).
    let mut mtls = web();
    mtls["metadata"]["labels"]["security.istio.io/tlsMode"] = "istio".into();
    assert_eq!(derive(&mtls).tunnel_protocol, TunnelProtocol::None as i32);
}

#[test]
fn terminal_addressless_and_unparsable_pods_have_no_workload() {
    let cluster = Cluster::default();
    for phase in ["Succeeded", "Failed"] {
        let mut pod = web();
        pod["status"]["phase"] = phase.into();
        assert!(pod_workload(&pod, &cluster).is_none(), "{phase}");
    }
    let mut pending = web();
    pending["status"]["phase"] = "Pending".into();
    assert!(
        pod_workload(&pending, &cluster).is_some(),
        "a pending pod with an IP"
    );
    let mut none = web();
    none["status"]["podIPs"] = json!([]);
    none["status"]["podIP"] = "".into();
    assert!(pod_workload(&none, &cluster).is_none());
    let mut one = web();
    one["status"]["podIPs"] = Value::Null;
    assert_eq!(derive(&one).addresses, vec![vec![10, 244, 1, 11]]);
    let mut garbage = web();
    garbage["status"]["podIPs"] = json!([{"ip": "10.0.0.1"}, {"ip": "nonsense"}]);
    assert!(pod_workload(&garbage, &cluster).is_none());
}

#[test]
fn unready_and_deleted_pods_are_unhealthy() {
    let mut unready = web();
    unready["status"]["conditions"][1]["status"] = "False".into();
    assert_eq!(derive(&unready).status, WorkloadStatus::Unhealthy as i32);
    let mut deleted = web();
    deleted["metadata"]["deletionTimestamp"] = "2026-05-04T10:00:00Z".into();
    assert_eq!(derive(&deleted).status, WorkloadStatus::Unhealthy as i32);
}

#[test]
fn names_and_trust_domain_follow_istiod() {
    let mut cron = web();
    cron["metadata"]["ownerReferences"][0]["kind"] = "Job".into();
    cron["metadata"]["ownerReferences"][0]["name"] = "nightly-29123456".into();
    assert_eq!(derive(&cron).workload_name, "nightly");
    let mut job = cron.clone();
    job["metadata"]["ownerReferences"][0]["name"] = "once-123".into();
    assert_eq!(derive(&job).workload_name, "once-123");
    let mut bare = web();
    bare["metadata"]["generateName"] = Value::Null;
    assert_eq!(derive(&bare).workload_name, "web-7d9c8b6f5-x2x4q");
    let mut labelled = web();
    labelled["metadata"]["labels"] = json!({
        "app": "a", "app.kubernetes.io/name": "b", "version": "v2",
        "service.istio.io/workload-name": "named",
    });
    let w = derive(&labelled);
    assert_eq!(w.workload_name, "named");
    assert_eq!(
        (w.canonical_name.as_str(), w.canonical_revision.as_str()),
        ("b", "v2")
    );
    let other = Cluster {
        id: "east".to_owned(),
        trust_domain: "example.org".to_owned(),
        network: "east-net".to_owned(),
        ..Cluster::default()
    };
    let w = pod_workload(&web(), &other).unwrap_or_default();
    assert_eq!(
        (w.uid.as_str(), w.trust_domain.as_str(), w.network.as_str()),
        (
            "east//Pod/shop/web-7d9c8b6f5-x2x4q",
            "example.org",
            "east-net"
        )
    );
    let mut host = web();
    host["spec"]["hostNetwork"] = true.into();
    assert_eq!(derive(&host).network_mode, NetworkMode::HostNetwork as i32);
}

#[test]
fn only_pod_objects_are_served_and_a_change_gets_a_new_version() {
    let path = "/api/v1/namespaces/shop/pods/web-7d9c8b6f5-x2x4q";
    let objects = |pod: Value| -> Objects {
        Arc::new(HashMap::from([
            (path.to_owned(), pod.clone()),
            (format!("{path}/status"), pod.clone()),
            ("/api/v1/namespaces/shop".to_owned(), pod),
        ]))
    };
    let cluster = Cluster::default();
    let before = address_resources(&objects(web()), &cluster);
    let uid = "Kubernetes//Pod/shop/web-7d9c8b6f5-x2x4q";
    assert_eq!(before.keys().collect::<Vec<_>>(), vec![uid]);
    let again = address_resources(&objects(web()), &cluster);
    assert_eq!(before, again, "same pod, same version");
    let after = address_resources(&objects(annotated("enabled")), &cluster);
    assert_ne!(before[uid].version, after[uid].version);
}

#[path = "istiod_kube_services_tests.rs"]
mod services_tests;

#[path = "istiod_kube_slices_tests.rs"]
mod slices_tests;
