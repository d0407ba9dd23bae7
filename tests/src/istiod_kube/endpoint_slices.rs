//! EndpointSlices (`discovery.k8s.io/v1`) as istiod reads them: the
//! Services a pod is an endpoint of without being selected (a Service
//! without a selector whose slices a controller or user writes), and the
//! workloads of the slices' endpoints that are not pods. istio/istio
//! 86c9f01f, `pilot/pkg/serviceregistry/ambient/workloads.go`, cited per
//! function.
//!
//! Only slices labelled `kubernetes.io/service-name` and not of address
//! type `FQDN` count (`endpointSliceAddressIndex`, `endpointSlicesBuilder`),
//! and only when that Service exists (a Kubernetes Service, not a
//! ServiceEntry of that hostname).

use std::collections::HashMap;
use std::net::IpAddr;

use dataplane_user::istio_api::workload::{self, NetworkMode, Port, PortList, WorkloadStatus};
use serde_json::Value;

use super::services::{ServiceInfo, Source};
use super::{Cluster, strings};

/// `discovery.LabelServiceName`.
const SERVICE_NAME: &str = "kubernetes.io/service-name";

/// The Service `slice` is for: its key `namespace/hostname` and info, when
/// istiod reads the slice at all (labelled, not FQDN) and that Service
/// exists (`krt.FilterKey(serviceKey)` and `Source.Kind == Service`).
fn service_of<'s>(
    slice: &Value,
    services: &'s [ServiceInfo],
    cluster: &Cluster,
) -> Option<(String, &'s ServiceInfo)> {
    if slice["addressType"] == "FQDN" {
        return None;
    }
    let meta = &slice["metadata"];
    let name = *strings(&meta["labels"]).get(SERVICE_NAME)?;
    let namespace = meta["namespace"].as_str()?;
    // `kube.ServiceHostname`.
    let hostname = format!("{name}.{namespace}.svc.{}", cluster.domain_suffix);
    let info = services.iter().find(|s| {
        s.source == Source::Service
            && s.service.namespace == namespace
            && s.service.hostname == hostname
    })?;
    Some((format!("{namespace}/{hostname}"), info))
}

/// `matchingServicesWithoutSelectors`: the Services whose slices list an
/// endpoint whose `targetRef` is this pod (kind `Pod`, its namespace, name
/// and uid: `endpointSliceAddressIndex` keys by all four; an endpoint
/// merely at the pod's IP does not count), less those `selected` already
/// has by hostname.
pub(crate) fn matching_services_without_selectors<'s>(
    pod: &Value,
    selected: &[&ServiceInfo],
    services: &'s [ServiceInfo],
    slices: &[&Value],
    cluster: &Cluster,
) -> Vec<&'s ServiceInfo> {
    let meta = &pod["metadata"];
    let field = |v: &Value, key: &str| v[key].as_str().unwrap_or_default().to_owned();
    let pod_ref = (
        field(meta, "namespace"),
        field(meta, "name"),
        field(meta, "uid"),
    );
    let names_pod = |slice: &&&Value| {
        endpoints(slice).any(|ep| {
            let r = &ep["targetRef"];
            r["kind"] == "Pod"
                && (field(r, "namespace"), field(r, "name"), field(r, "uid")) == pod_ref
        })
    };
    slices
        .iter()
        .filter(names_pod)
        .filter_map(|slice| service_of(slice, services, cluster))
        .map(|(_, info)| info)
        .filter(|info| {
            !selected
                .iter()
                .any(|s| s.service.hostname == info.service.hostname)
        })
        .collect()
}

fn endpoints(slice: &Value) -> impl Iterator<Item = &Value> {
    slice["endpoints"].as_array().into_iter().flatten()
}

/// `endpointSlicesBuilder`: a workload for each endpoint of `slice` that
/// is not a pod's (a pod's is built from the Pod, with far more), by its
/// first address: uid `<cluster>/discovery.k8s.io/EndpointSlice/<ns>/<slice>/<address>`,
/// the slice's name and namespace, every address (an endpoint with one
/// that does not parse, or a first address already seen, is skipped),
/// healthy unless `conditions.ready` is false, host network (an opaque
/// address may be shared), no identity, waypoint or tunnel. Each is in
/// the slice's Service with the slice's TCP ports, each joined by name to
/// the first Service port of that name (an unnamed port is `""`; a slice
/// port without a protocol is TCP, and without a name `""`, as the API
/// server defaults them; one without a port number is skipped).
pub(crate) fn slice_workloads(
    slice: &Value,
    services: &[ServiceInfo],
    cluster: &Cluster,
) -> Vec<workload::Workload> {
    let Some((key, info)) = service_of(slice, services, cluster) else {
        return Vec::new();
    };
    let meta = &slice["metadata"];
    let (Some(name), Some(namespace)) = (meta["name"].as_str(), meta["namespace"].as_str()) else {
        return Vec::new();
    };
    let mut ports = Vec::new();
    for p in slice["ports"].as_array().into_iter().flatten() {
        let Some(target) = p["port"].as_u64().and_then(|n| u32::try_from(n).ok()) else {
            continue;
        };
        if !matches!(p["protocol"].as_str(), None | Some("TCP")) {
            continue;
        }
        let port_name = p["name"].as_str().unwrap_or_default();
        if let Some(svc_port) = info.service.ports.iter().find(|sp| {
            info.port_names
                .get(&sp.service_port)
                .map_or("", String::as_str)
                == port_name
        }) {
            ports.push(Port {
                service_port: svc_port.service_port,
                target_port: target,
            });
        }
    }
    let services = HashMap::from([(key, PortList { ports })]);
    let mut seen = std::collections::HashSet::new();
    let mut built = Vec::new();
    for ep in endpoints(slice) {
        if ep["targetRef"]["kind"] == "Pod" {
            continue;
        }
        let addresses: Vec<&str> = ep["addresses"]
            .as_array()
            .map(|a| a.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let Some(first) = addresses.first().copied() else {
            continue;
        };
        if !seen.insert(first) {
            continue;
        }
        let Some(parsed) = addresses
            .iter()
            .map(|a| match a.parse::<IpAddr>().ok()? {
                IpAddr::V4(v4) => Some(v4.octets().to_vec()),
                IpAddr::V6(v6) => Some(v6.octets().to_vec()),
            })
            .collect::<Option<Vec<_>>>()
        else {
            continue;
        };
        let healthy = ep["conditions"]["ready"].as_bool() != Some(false);
        built.push(workload::Workload {
            uid: format!(
                "{}/discovery.k8s.io/EndpointSlice/{namespace}/{name}/{first}",
                cluster.id
            ),
            name: name.to_owned(),
            namespace: namespace.to_owned(),
            addresses: parsed,
            network: cluster.network.clone(),
            // `pickTrustDomain`: the default trust domain is sent as "".
            trust_domain: match cluster.trust_domain.as_str() {
                "cluster.local" => String::new(),
                other => other.to_owned(),
            },
            services: services.clone(),
            status: if healthy {
                WorkloadStatus::Healthy
            } else {
                WorkloadStatus::Unhealthy
            } as i32,
            cluster_id: cluster.id.clone(),
            network_mode: NetworkMode::HostNetwork as i32,
            ..Default::default()
        });
    }
    built
}
