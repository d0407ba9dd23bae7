//! istiod's address resources from Kubernetes objects: the test istiod
//! derives each pod's `istio.workload.Workload` and each Service's
//! `istio.workload.Service` from the objects the stand-in API server holds
//! (the state the agent's reconciler reads and its `pods/status` patches
//! change), with istiod's own rules, and serves them live over delta xDS.
//!
//! The rules are istio/istio 86c9f01f,
//! `pilot/pkg/serviceregistry/ambient/workloads.go` `podWorkloadBuilder`,
//! `services.go` `serviceServiceBuilder` and `waypoints.go`, and what they
//! call (cited where used). Above all `setTunnelProtocol`:
//! only a pod annotated `ambient.istio.io/redirection: enabled` (written by
//! the node agent once it captures the pod) or labelled
//! `networking.istio.io/tunnel: http` gets `TunnelProtocol: HBONE`;
//! `pending` or no annotation leaves it `NONE`, plain TCP to every peer
//! (`pkg/config/constants/constants.go`, `AmbientRedirectionEnabled`: "The
//! presence of this annotation with this specific value indicates the pod
//! is captured. Anything else indicates it is not.").
//!
//! Objects read, by their API paths (see [`Index`]): pods, Services,
//! namespaces, Gateways and GatewayClasses (`gateway.networking.k8s.io/v1`),
//! EndpointSlices (`discovery.k8s.io/v1`) and ServiceEntries
//! (`networking.istio.io/v1`). The test istiod reads them from the
//! stand-in server's store as an informer would hold them (not through
//! its HTTP list/watch, which only the agent uses).
//!
//! A workload is filled as istiod fills it: uid, name, namespace,
//! addresses, service account, node, cluster id, network, trust domain,
//! status, workload name and type, canonical name and revision, network
//! mode, tunnel protocol and native tunnel; `services`, from the Services
//! and ServiceEntries of its namespace whose selector matches its labels,
//! a named `targetPort` resolved against its container ports
//! ([`services`]), and from the Services whose EndpointSlices name the
//! pod as an endpoint's `targetRef` ([`endpoint_slices`]); `waypoint`,
//! from its `istio.io/use-waypoint` label, else its namespace's, when that
//! waypoint takes workload traffic; and on a waypoint's own pod
//! `application_tunnel`, from its Gateway's (or GatewayClass's)
//! `ambient.istio.io/waypoint-inbound-binding` ([`waypoints`]). An
//! EndpointSlice's endpoints that are not pods are workloads of their own
//! (host network, no identity). A Service gets its hostname, VIPs on the
//! cluster's network, ports, load balancing, IP families, `canonical`,
//! the waypoint of its label, else its namespace's, when that waypoint
//! takes service traffic, and `weighted_waypoints` when a canary waypoint
//! is named beside it. A ServiceEntry's Services and endpoint workloads
//! are [`crate::istiod_serviceentry`]'s, with the Service's waypoints, and
//! one hostname is served once per namespace, a Kubernetes Service
//! winning over ServiceEntries ([`service_entries`]). A waypoint is a
//! Gateway with a status address; its address is that hostname
//! (`namespace/hostname`), else that IP, on port 15008, as istiod's
//! gateway controller writes it once the waypoint runs.
//!
//! Left out, because they come from objects the stand-in does not hold or
//! settings it does not model: `authorization_policies`
//! (AuthorizationPolicy and PeerAuthentication; with
//! `PILOT_AUTO_ALLOW_WAYPOINT_POLICY` off, as by default, istiod adds no
//! waypoint policies either), ports' `app_protocol` (our workload API
//! has no such field), WorkloadEntries, a ServiceEntry endpoint's own
//! waypoint and policies, the mesh's `serviceEntryVisibility` (every
//! ServiceEntry is public), waypoint namespace selectors with
//! `matchExpressions` (treated as matching nothing), `locality` (the
//! Node's topology labels) and `network_gateway` (the mesh's networks).
//! Tests publish policies to the test istiod directly beside these. The
//! per-pod `LEGACY_ISTIO_MTLS` rule
//! is left out too: istiod's ambient index runs with
//! `EnableMtlsTransportProtocol` off (`pilot/pkg/bootstrap/servicecontroller.go`).

use std::collections::BTreeMap;
use std::hash::{Hash as _, Hasher as _};
use std::net::IpAddr;

use dataplane_user::istio_api::{
    ADDRESS_TYPE,
    discovery::Resource,
    workload::{self, Address, NetworkMode, TunnelProtocol, WorkloadStatus, WorkloadType, address},
};
use prost::Message as _;
use serde_json::Value;

use crate::cni_kubeapi::{FakeApi, Objects};
use crate::istio_resources::resource;
use crate::istiod::{Publisher, TestIstiod};

mod endpoint_slices;
mod service_entries;
mod services;
mod waypoints;
pub use waypoints::{
    USE_WAYPOINT, USE_WAYPOINT_CANARY, USE_WAYPOINT_CANARY_NAMESPACE, USE_WAYPOINT_CANARY_WEIGHT,
    USE_WAYPOINT_NAMESPACE,
};

/// The annotation istio-cni (and our agent) writes on captured pods
/// (istio/api `annotation.AmbientRedirection`).
pub const REDIRECTION_ANNOTATION: &str = "ambient.istio.io/redirection";

/// What istiod is configured with that a pod's workload carries.
#[derive(Debug, Clone)]
pub struct Cluster {
    /// istiod's `CLUSTER_ID`.
    pub id: String,
    /// The mesh config's trust domain.
    pub trust_domain: String,
    /// istiod's `DOMAIN_SUFFIX`: Services are `<name>.<ns>.svc.<suffix>`.
    pub domain_suffix: String,
    /// The cluster's network (istiod's `FetchLocalNetworkID`): on every
    /// workload, Service VIP and waypoint address it builds.
    pub network: String,
}

impl Default for Cluster {
    /// istiod's defaults: `CLUSTER_ID` `Kubernetes`
    /// (`constants.DefaultClusterName`), trust domain and domain suffix
    /// `cluster.local`, no network (`""`, as istiod without `meshNetworks`
    /// or a `topology.istio.io/network` label).
    fn default() -> Self {
        Self {
            id: "Kubernetes".to_owned(),
            trust_domain: "cluster.local".to_owned(),
            domain_suffix: "cluster.local".to_owned(),
            network: String::new(),
        }
    }
}

/// A JSON object of strings (labels, annotations) as a map; anything else
/// is empty.
pub(crate) fn strings(value: &Value) -> BTreeMap<&str, &str> {
    value
        .as_object()
        .map(|m| {
            m.iter()
                .filter_map(|(k, v)| Some((k.as_str(), v.as_str()?)))
                .collect()
        })
        .unwrap_or_default()
}

/// The workload istiod builds for `pod` (a Kubernetes Pod as JSON), or
/// `None` when it builds none: `podWorkloadBuilder`.
pub fn pod_workload(pod: &Value, cluster: &Cluster) -> Option<workload::Workload> {
    let (meta, spec, status) = (&pod["metadata"], &pod["spec"], &pod["status"]);
    // `kubeutil.CheckPodTerminal`: succeeded and failed pods are skipped.
    if matches!(status["phase"].as_str(), Some("Succeeded" | "Failed")) {
        return None;
    }
    let addresses = pod_addresses(status)?;
    let (name, namespace) = (meta["name"].as_str()?, meta["namespace"].as_str()?);
    let labels = strings(&meta["labels"]);
    let annotations = strings(&meta["annotations"]);
    // Kubernetes' Ready condition, and not being deleted.
    let ready = status["conditions"].as_array().is_some_and(|conditions| {
        conditions
            .iter()
            .any(|c| c["type"] == "Ready" && c["status"] == "True")
    });
    let deleting = !meta["deletionTimestamp"].is_null();
    let workload_name = workload_name(pod, &labels);
    let (canonical_name, canonical_revision) = canonical_service(&labels, &workload_name);
    let mut w = workload::Workload {
        // `generatePodUID` (helpers.go).
        uid: format!("{}//Pod/{namespace}/{name}", cluster.id),
        name: name.to_owned(),
        namespace: namespace.to_owned(),
        cluster_id: cluster.id.clone(),
        network: cluster.network.clone(),
        addresses,
        service_account: spec["serviceAccountName"]
            .as_str()
            .unwrap_or_default()
            .to_owned(),
        node: spec["nodeName"].as_str().unwrap_or_default().to_owned(),
        status: if ready && !deleting {
            WorkloadStatus::Healthy
        } else {
            WorkloadStatus::Unhealthy
        } as i32,
        // `pickTrustDomain`: the default trust domain is sent as "".
        trust_domain: match cluster.trust_domain.as_str() {
            "cluster.local" => String::new(),
            other => other.to_owned(),
        },
        workload_name,
        workload_type: WorkloadType::Pod as i32,
        canonical_name,
        canonical_revision,
        ..Default::default()
    };
    if spec["hostNetwork"].as_bool() == Some(true) {
        w.network_mode = NetworkMode::HostNetwork as i32;
    }
    set_tunnel_protocol(&labels, &annotations, &mut w);
    Some(w)
}

/// `getPodIPs` (`status.podIPs`, else `status.podIP`) as bytes; `None`
/// when there is none or one does not parse (istiod then builds no
/// workload).
fn pod_addresses(status: &Value) -> Option<Vec<Vec<u8>>> {
    let listed: Vec<&Value> = status["podIPs"]
        .as_array()
        .map(|ips| ips.iter().map(|e| &e["ip"]).collect())
        .unwrap_or_default();
    let ips: Vec<&str> = if listed.is_empty() {
        status["podIP"]
            .as_str()
            .filter(|ip| !ip.is_empty())
            .into_iter()
            .collect()
    } else {
        listed.iter().map(|ip| ip.as_str()).collect::<Option<_>>()?
    };
    if ips.is_empty() {
        return None;
    }
    ips.iter()
        .map(|ip| match ip.parse::<IpAddr>().ok()? {
            IpAddr::V4(v4) => Some(v4.octets().to_vec()),
            IpAddr::V6(v6) => Some(v6.octets().to_vec()),
        })
        .collect()
}

/// `setTunnelProtocol` (workloads.go), with `EnableMtlsTransportProtocol`
/// off as in istiod's ambient index.
pub(crate) fn set_tunnel_protocol(
    labels: &BTreeMap<&str, &str>,
    annotations: &BTreeMap<&str, &str>,
    w: &mut workload::Workload,
) {
    if annotations.get(REDIRECTION_ANNOTATION) == Some(&"enabled") {
        w.tunnel_protocol = TunnelProtocol::Hbone as i32;
    }
    // `model.SupportsTunnel(labels, model.TunnelHTTP)` (pilot/pkg/model/
    // service.go): the label is a comma-separated list.
    if labels
        .get("networking.istio.io/tunnel")
        .is_some_and(|tl| tl.split(',').any(|t| t == "http"))
    {
        w.tunnel_protocol = TunnelProtocol::Hbone as i32;
        w.native_tunnel = true;
    }
}

/// `workloadName`: `kubeutil.GetWorkloadMetaFromPod` (pkg/kube/util.go),
/// the controller's name for a generated pod (a Deployment's for its
/// ReplicaSets' pods, a CronJob's for its Jobs'), overridden by the
/// `service.istio.io/workload-name` label.
fn workload_name(pod: &Value, labels: &BTreeMap<&str, &str>) -> String {
    let meta = &pod["metadata"];
    let mut name = meta["name"].as_str().unwrap_or_default().to_owned();
    let generated = meta["generateName"].as_str().is_some_and(|g| !g.is_empty());
    let controller = meta["ownerReferences"]
        .as_array()
        .and_then(|refs| refs.iter().find(|r| r["controller"] == true));
    if let (true, Some(controller)) = (generated, controller) {
        let kind = controller["kind"].as_str().unwrap_or_default();
        let owner = controller["name"].as_str().unwrap_or_default();
        name = owner.to_owned();
        let label = |key: &str| labels.get(key).copied().filter(|v| !v.is_empty());
        // strings.TrimSuffix: unchanged unless `-<hash>` ends the name.
        let trim = |hash: &str| {
            owner
                .strip_suffix(hash)
                .and_then(|s| s.strip_suffix('-'))
                .unwrap_or(owner)
                .to_owned()
        };
        let ends_with = |key: &str| label(key).filter(|hash| owner.ends_with(hash));
        if let ("ReplicaSet", Some(hash)) = (kind, ends_with("pod-template-hash")) {
            name = trim(hash);
        } else if let ("ReplicaSet", Some(hash)) = (kind, ends_with("rollouts-pod-template-hash")) {
            // An Argo Rollout's.
            name = trim(hash);
        } else if let ("ReplicationController", Some(config)) = (kind, label("deploymentconfig")) {
            // An OpenShift DeploymentConfig's.
            name = config.to_owned();
        } else if kind == "Job" {
            // `cronJobNameRegexp` `(.+)-\d{8,10}$`: a CronJob's Job.
            if let Some((cron, stamp)) = owner.rsplit_once('-')
                && !cron.is_empty()
                && (8..=10).contains(&stamp.len())
                && stamp.bytes().all(|b| b.is_ascii_digit())
            {
                name = cron.to_owned();
            }
        }
    }
    if let Some(workload_name) = labels.get("service.istio.io/workload-name") {
        name = (*workload_name).to_owned();
    }
    name
}

/// `kubelabels.CanonicalService` (pkg/kube/labels/labels.go): the first
/// of its name labels, else the workload name; the first of its revision
/// labels, else `latest`.
pub(crate) fn canonical_service(
    labels: &BTreeMap<&str, &str>,
    workload_name: &str,
) -> (String, String) {
    let first = |keys: &[&str]| {
        keys.iter()
            .find_map(|k| labels.get(k).map(|v| (*v).to_owned()))
    };
    (
        first(&[
            "service.istio.io/canonical-name",
            "app.kubernetes.io/name",
            "app",
        ])
        .unwrap_or_else(|| workload_name.to_owned()),
        first(&[
            "service.istio.io/canonical-revision",
            "app.kubernetes.io/version",
            "version",
        ])
        .unwrap_or_else(|| "latest".to_owned()),
    )
}

/// The objects istiod's collections hold, from the API server's paths.
#[derive(Debug, Default)]
pub(crate) struct Index<'a> {
    /// `/api/v1/namespaces/<ns>/pods/<name>`.
    pub pods: Vec<&'a Value>,
    /// `/api/v1/namespaces/<ns>/services/<name>`.
    pub services: Vec<&'a Value>,
    /// `/api/v1/namespaces/<ns>`, by name.
    pub namespaces: BTreeMap<&'a str, &'a Value>,
    /// `/apis/gateway.networking.k8s.io/v1/namespaces/<ns>/gateways/<name>`.
    pub gateways: Vec<&'a Value>,
    /// `/apis/gateway.networking.k8s.io/v1/gatewayclasses/<name>`, by name.
    pub gateway_classes: BTreeMap<&'a str, &'a Value>,
    /// `/apis/discovery.k8s.io/v1/namespaces/<ns>/endpointslices/<name>`.
    pub endpoint_slices: Vec<&'a Value>,
    /// `/apis/networking.istio.io/v1/namespaces/<ns>/serviceentries/<name>`.
    pub service_entries: Vec<&'a Value>,
}

impl<'a> Index<'a> {
    /// Sorts `objects` by kind from their paths (a subresource's path,
    /// `.../pods/<name>/status`, is none of them), each kind in path order
    /// (so ties istiod breaks by its informers' order break the same way
    /// every time here).
    pub(crate) fn new(objects: &'a Objects) -> Self {
        let mut index = Self::default();
        let mut sorted: Vec<(&String, &Value)> = objects.iter().collect();
        sorted.sort_by_key(|(path, _)| *path);
        for (path, object) in sorted {
            let parts: Vec<&str> = path.split('/').collect();
            match parts.as_slice() {
                ["", "api", "v1", "namespaces", ns, kind, name]
                    if !ns.is_empty() && !name.is_empty() =>
                {
                    match *kind {
                        "pods" => index.pods.push(object),
                        "services" => index.services.push(object),
                        _ => {}
                    }
                }
                ["", "api", "v1", "namespaces", ns] if !ns.is_empty() => {
                    index.namespaces.insert(*ns, object);
                }
                ["", "apis", group, "v1", "namespaces", ns, kind, name]
                    if !ns.is_empty() && !name.is_empty() =>
                {
                    match (*group, *kind) {
                        ("gateway.networking.k8s.io", "gateways") => index.gateways.push(object),
                        ("discovery.k8s.io", "endpointslices") => {
                            index.endpoint_slices.push(object);
                        }
                        ("networking.istio.io", "serviceentries") => {
                            index.service_entries.push(object);
                        }
                        _ => {}
                    }
                }
                [
                    "",
                    "apis",
                    "gateway.networking.k8s.io",
                    "v1",
                    "gatewayclasses",
                    name,
                ] if !name.is_empty() => {
                    index.gateway_classes.insert(*name, object);
                }
                _ => {}
            }
        }
        index
    }
}

/// `body` as an address resource named `name`, its version a digest of
/// the body, so an unchanged object is never pushed again.
fn address_resource(name: &str, body: &Address) -> Resource {
    let mut digest = std::hash::DefaultHasher::new();
    body.encode_to_vec().hash(&mut digest);
    let version = format!("{:016x}", digest.finish());
    resource(ADDRESS_TYPE, name, &version, body)
}

/// The address resources istiod serves for `objects`, by name: each pod's
/// workload (name: its uid), with the Services selecting it, its waypoint
/// or, on a waypoint's own pod, its application tunnel; and each Service
/// (name: `namespace/hostname`), with its waypoint.
pub fn address_resources(objects: &Objects, cluster: &Cluster) -> BTreeMap<String, Resource> {
    let index = Index::new(objects);
    let waypoints = waypoints::waypoints(&index, cluster);
    // `ServicesCollection`: Services and ServiceEntries, one per hostname
    // and namespace.
    let mut typed: Vec<services::ServiceInfo> = index
        .services
        .iter()
        .filter_map(|svc| services::service_info(svc, &index, &waypoints, cluster))
        .collect();
    for entry in &index.service_entries {
        typed.extend(service_entries::infos(entry, &index, &waypoints, cluster));
    }
    let infos = services::select_workload_services(typed);
    // `WorkloadsCollection`: pods', ServiceEntries' and EndpointSlices'.
    let mut workloads: Vec<workload::Workload> = index
        .pods
        .iter()
        .filter_map(|pod| {
            let mut w = pod_workload(pod, cluster)?;
            w.services = services::pod_services(pod, &infos, &index.endpoint_slices, cluster);
            (w.application_tunnel, w.waypoint) =
                waypoints::for_pod(&pod["metadata"], &index, &waypoints);
            Some(w)
        })
        .collect();
    for entry in &index.service_entries {
        workloads.extend(service_entries::workloads(entry, &infos, cluster));
    }
    for slice in &index.endpoint_slices {
        workloads.extend(endpoint_slices::slice_workloads(slice, &infos, cluster));
    }
    let mut derived: BTreeMap<String, Resource> = workloads
        .into_iter()
        .map(|w| {
            let uid = w.uid.clone();
            let body = Address {
                r#type: Some(address::Type::Workload(w)),
            };
            (uid.clone(), address_resource(&uid, &body))
        })
        .collect();
    for info in infos {
        let key = format!("{}/{}", info.service.namespace, info.service.hostname);
        let body = Address {
            r#type: Some(address::Type::Service(info.service)),
        };
        derived.insert(key.clone(), address_resource(&key, &body));
    }
    derived
}

/// The test istiod serving the address resources of a stand-in API
/// server's objects ([`address_resources`]: pods' workloads, Services),
/// derived again and pushed (delta xDS: what changed, what went) whenever
/// an object changes, the agent's own annotation patches included. Stops
/// on drop.
pub struct KubeAddresses {
    task: tokio::task::JoinHandle<()>,
}

impl KubeAddresses {
    /// Starts following `api`'s objects on `runtime`, publishing through
    /// `istiod`. The first derivation is published at once (an empty one
    /// too: agents are then answered).
    pub fn start(
        runtime: &tokio::runtime::Handle,
        api: &FakeApi,
        istiod: &TestIstiod,
        cluster: Cluster,
    ) -> Self {
        let task = runtime.spawn(follow(api.watch_objects(), istiod.publisher(), cluster));
        Self { task }
    }
}

impl Drop for KubeAddresses {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Derives and publishes after every change of `objects` until the API
/// server is gone.
async fn follow(
    mut objects: tokio::sync::watch::Receiver<Objects>,
    istiod: Publisher,
    cluster: Cluster,
) {
    let mut served: Option<BTreeMap<String, Resource>> = None;
    loop {
        let snapshot = objects.borrow_and_update().clone();
        let derived = address_resources(&snapshot, &cluster);
        let held = served.as_ref();
        let changed: Vec<Resource> = derived
            .values()
            .filter(|r| held.and_then(|h| h.get(&r.name)) != Some(*r))
            .cloned()
            .collect();
        let removed: Vec<&str> = held
            .into_iter()
            .flat_map(BTreeMap::keys)
            .filter(|uid| !derived.contains_key(*uid))
            .map(String::as_str)
            .collect();
        if held.is_none() || !changed.is_empty() || !removed.is_empty() {
            // Publishing only fails with no istiod left to publish to.
            if istiod
                .publish(ADDRESS_TYPE, changed, &removed)
                .await
                .is_err()
            {
                return;
            }
        }
        served = Some(derived);
        if objects.changed().await.is_err() {
            return;
        }
    }
}

#[cfg(test)]
#[path = "istiod_kube_tests.rs"]
mod tests;
