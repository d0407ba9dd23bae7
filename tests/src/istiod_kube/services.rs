//! Kubernetes Services as istiod's `istio.workload.Service`s, and the
//! `services` of the pods they select, with istiod's rules (istio/istio
//! 86c9f01f, `pilot/pkg/serviceregistry/ambient/services.go` and
//! `workloads.go`, cited per function).

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;

use dataplane_user::istio_api::workload::{
    self, IpFamilies, LoadBalancing, NetworkAddress, Port, PortList, load_balancing,
};
use serde_json::Value;

use super::waypoints::{self, Waypoint};
use super::{Cluster, Index, strings};

/// `annotation.NetworkingTrafficDistribution`.
const TRAFFIC_DISTRIBUTION: &str = "networking.istio.io/traffic-distribution";

/// Which object a [`ServiceInfo`] comes from (`ServiceInfo.Source.Kind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Source {
    /// A Kubernetes Service.
    Service,
    /// A ServiceEntry (one info per host).
    ServiceEntry,
}

/// istiod's `model.ServiceInfo`: the Service it serves and what the
/// workloads' `services` need from the object.
#[derive(Debug, Clone)]
pub(crate) struct ServiceInfo {
    pub service: workload::Service,
    /// `PortNames[port].TargetPortName`: each service port's named
    /// `targetPort`, if named (a Service's only).
    pub target_port_names: BTreeMap<u32, String>,
    /// `PortNames[port].PortName`: each service port's name (`""` when
    /// unnamed).
    pub port_names: BTreeMap<u32, String>,
    /// `LabelSelector`: a Service's `spec.selector`, a ServiceEntry's
    /// `spec.workloadSelector.labels`.
    pub selector: BTreeMap<String, String>,
    pub source: Source,
    /// `CreationTime`, `metadata.creationTimestamp` (RFC 3339, so ordered
    /// as text; none is Go's zero time, before any).
    pub created: Option<String>,
    /// The object's `metadata.name` (a ServiceEntry's, for its workloads).
    pub object_name: String,
}

/// `serviceServiceBuilder` (services.go): an ExternalName Service is none;
/// the rest `constructService` builds, with the waypoint
/// `fetchWaypointForService` finds. Also none when a port or VIP does not
/// parse (istiod logs and drops the Service).
pub(crate) fn service_info(
    svc: &Value,
    index: &Index<'_>,
    waypoints: &BTreeMap<String, Waypoint>,
    cluster: &Cluster,
) -> Option<ServiceInfo> {
    let (meta, spec) = (&svc["metadata"], &svc["spec"]);
    if spec["type"] == "ExternalName" {
        return None;
    }
    let (name, namespace) = (meta["name"].as_str()?, meta["namespace"].as_str()?);
    let mut ports = Vec::new();
    let mut target_port_names = BTreeMap::new();
    let mut port_names = BTreeMap::new();
    for p in spec["ports"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
    {
        let port = u32::try_from(p["port"].as_u64()?).ok()?;
        port_names.insert(port, p["name"].as_str().unwrap_or_default().to_owned());
        // An IntOrString: `TargetPort.IntVal` is 0 for a named one, and
        // for none (the API server defaults an absent one to the port).
        let target_port = match &p["targetPort"] {
            Value::String(named) => {
                target_port_names.insert(port, named.clone());
                0
            }
            other => other
                .as_u64()
                .and_then(|t| u32::try_from(t).ok())
                .unwrap_or(0),
        };
        ports.push(Port {
            service_port: port,
            target_port,
        });
    }
    let ns = index.namespaces.get(namespace);
    let waypoint = waypoints::for_service(meta, index, waypoints);
    let service = workload::Service {
        name: name.to_owned(),
        namespace: namespace.to_owned(),
        // `kube.ServiceHostname`.
        hostname: format!("{name}.{namespace}.svc.{}", cluster.domain_suffix),
        addresses: vips(spec)
            .into_iter()
            .map(|vip| {
                let ip = vip.parse::<IpAddr>().ok()?;
                Some(NetworkAddress {
                    network: cluster.network.clone(),
                    address: match ip {
                        IpAddr::V4(v4) => v4.octets().to_vec(),
                        IpAddr::V6(v6) => v6.octets().to_vec(),
                    },
                    length: None,
                })
            })
            .collect::<Option<_>>()?,
        ports,
        waypoint: waypoint.and_then(|w| w.address.clone()),
        weighted_waypoints: waypoints::weighted(meta, waypoint, index, waypoints),
        load_balancing: load_balancing(svc, ns.copied()),
        ip_families: ip_families(spec) as i32,
        // "A kubernetes service is always considered to be canonical".
        canonical: true,
        ..Default::default()
    };
    Some(ServiceInfo {
        service,
        target_port_names,
        port_names,
        selector: strings(&spec["selector"])
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect(),
        source: Source::Service,
        created: meta["creationTimestamp"].as_str().map(str::to_owned),
        object_name: name.to_owned(),
    })
}

/// `selectWorkloadServices` (services.go), over every info of one
/// hostname: in each namespace a Kubernetes Service wins, else the oldest
/// ServiceEntry (the first listed of equally old ones); of the winners,
/// the Service, else the oldest ServiceEntry not limited to its namespace
/// (all are public without the mesh's `serviceEntryVisibility`), is
/// marked `canonical`.
pub(crate) fn select_workload_services(infos: Vec<ServiceInfo>) -> Vec<ServiceInfo> {
    // `isBetter`: older, and not displacing a Kubernetes Service.
    let better =
        |a: &ServiceInfo, b: &ServiceInfo| a.created < b.created && b.source != Source::Service;
    let mut by_hostname: BTreeMap<String, Vec<ServiceInfo>> = BTreeMap::new();
    for info in infos {
        by_hostname
            .entry(info.service.hostname.clone())
            .or_default()
            .push(info);
    }
    let mut selected = Vec::new();
    for (_, infos) in by_hostname {
        let mut best: BTreeMap<String, ServiceInfo> = BTreeMap::new();
        for info in infos {
            let namespace = info.service.namespace.clone();
            let replace = info.source == Source::Service
                || best
                    .get(&namespace)
                    .is_none_or(|current| better(&info, current));
            if replace {
                best.insert(namespace, info);
            }
        }
        let mut canonical: Option<&ServiceInfo> = None;
        for info in best.values() {
            if info.source == Source::Service
                || canonical.is_none_or(|current| better(info, current))
            {
                canonical = Some(info);
            }
        }
        let canonical = canonical.map(|c| c.service.namespace.clone());
        for (namespace, mut info) in best {
            if canonical.as_deref() == Some(namespace.as_str()) {
                info.service.canonical = true;
            }
            selected.push(info);
        }
    }
    selected
}

/// `getVIPs`: `spec.clusterIPs`, else `spec.clusterIP`, without `""` and
/// `None` (a headless Service has no VIP).
fn vips(spec: &Value) -> Vec<&str> {
    let listed: Vec<&str> = spec["clusterIPs"]
        .as_array()
        .map(|ips| ips.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let ips = if listed.is_empty() {
        spec["clusterIP"].as_str().into_iter().collect()
    } else {
        listed
    };
    ips.into_iter()
        .filter(|ip| !ip.is_empty() && *ip != "None")
        .collect()
}

/// `constructService`'s load balancing: `internalTrafficPolicy: Local` is
/// node-strict; else the traffic distribution (`model.GetTrafficDistribution`:
/// the spec field, else the Service's, else the namespace's annotation)
/// prefers the same zone or node; `publishNotReadyAddresses` allows
/// unhealthy endpoints.
fn load_balancing(svc: &Value, ns: Option<&Value>) -> Option<LoadBalancing> {
    use load_balancing::{HealthPolicy, Mode, Scope};
    let spec = &svc["spec"];
    let failover = |scopes: &[Scope]| LoadBalancing {
        routing_preference: scopes.iter().map(|s| *s as i32).collect(),
        mode: Mode::Failover as i32,
        health_policy: HealthPolicy::OnlyHealthy as i32,
    };
    let same_zone = [Scope::Network, Scope::Region, Scope::Zone];
    let same_node = [
        Scope::Network,
        Scope::Region,
        Scope::Zone,
        Scope::Subzone,
        Scope::Node,
    ];
    let mut lb = if spec["internalTrafficPolicy"] == "Local" {
        Some(LoadBalancing {
            routing_preference: vec![Scope::Node as i32],
            mode: Mode::Strict as i32,
            health_policy: HealthPolicy::OnlyHealthy as i32,
        })
    } else {
        let annotation = |obj: Option<&Value>| {
            obj.and_then(|o| {
                strings(&o["metadata"]["annotations"])
                    .get(TRAFFIC_DISTRIBUTION)
                    .filter(|v| !v.is_empty())
                    .map(|v| v.to_lowercase())
            })
        };
        let spec_value = match spec["trafficDistribution"].as_str() {
            Some("PreferSameZone" | "PreferClose") => Some(&same_zone[..]),
            Some("PreferSameNode") => Some(&same_node[..]),
            _ => None,
        };
        let chosen = spec_value.or_else(|| {
            // The first annotation set decides, an unknown value as "any".
            match annotation(Some(svc)).or_else(|| annotation(ns))?.as_str() {
                "preferclose" | "prefersamezone" => Some(&same_zone[..]),
                "prefersamenode" => Some(&same_node[..]),
                _ => None,
            }
        });
        chosen.map(failover)
    };
    if spec["publishNotReadyAddresses"] == true {
        lb.get_or_insert_with(LoadBalancing::default).health_policy = HealthPolicy::AllowAll as i32;
    }
    lb
}

/// `constructService`'s IP families: two listed is dual, one its own.
fn ip_families(spec: &Value) -> IpFamilies {
    match spec["ipFamilies"].as_array().map(Vec::as_slice) {
        Some([_, _]) => IpFamilies::Dual,
        Some([family]) if family == "IPv4" => IpFamilies::Ipv4Only,
        Some([_]) => IpFamilies::Ipv6Only,
        _ => IpFamilies::Automatic,
    }
}

/// `podWorkloadBuilder`'s services lookup then `constructServices`
/// (workloads.go). The Services and ServiceEntries (`PILOT_ENABLE_SERVICEENTRY_SELECT_PODS`
/// is on by default) of the pod's namespace whose selector is not empty
/// and matches the pod's labels (`FilterSelectsNonEmpty`), then the
/// Services whose EndpointSlices name the pod
/// ([`super::endpoint_slices::matching_services_without_selectors`]);
/// each keyed `namespace/hostname` with its ports.
///
/// A Service's named target port is the pod's TCP container port of that
/// name (`FindPortName`: containers, then native sidecars, init
/// containers with `restartPolicy: Always`), and a port the pod does not
/// name is left out of its list. A ServiceEntry has no named target port:
/// its port's own name is looked up instead, and when the pod has none
/// its target port (the number, unless set) stays.
pub(crate) fn pod_services(
    pod: &Value,
    services: &[ServiceInfo],
    slices: &[&Value],
    cluster: &Cluster,
) -> HashMap<String, PortList> {
    let namespace = pod["metadata"]["namespace"].as_str().unwrap_or_default();
    let labels = strings(&pod["metadata"]["labels"]);
    let mut matched: Vec<&ServiceInfo> = services
        .iter()
        .filter(|s| s.service.namespace == namespace && !s.selector.is_empty())
        .filter(|s| {
            s.selector
                .iter()
                .all(|(k, v)| labels.get(k.as_str()) == Some(&v.as_str()))
        })
        .collect();
    matched.extend(super::endpoint_slices::matching_services_without_selectors(
        pod, &matched, services, slices, cluster,
    ));
    matched
        .into_iter()
        .map(|s| {
            let ports = s
                .service
                .ports
                .iter()
                .filter_map(|port| {
                    let mut target_port = port.target_port;
                    if let Some(named) = s.target_port_names.get(&port.service_port) {
                        target_port = find_port_name(pod, named)?;
                    } else if let (Source::ServiceEntry, Some(name)) =
                        (s.source, s.port_names.get(&port.service_port))
                        && !name.is_empty()
                    {
                        if let Some(found) = find_port_name(pod, name) {
                            target_port = found;
                        } else if target_port == 0 {
                            target_port = port.service_port;
                        }
                    }
                    Some(Port {
                        service_port: port.service_port,
                        target_port,
                    })
                })
                .collect();
            (
                format!("{}/{}", s.service.namespace, s.service.hostname),
                PortList { ports },
            )
        })
        .collect()
}

/// `FindPortName` (helpers.go): the first TCP container port named
/// `name`. A port without a protocol is TCP: the API server defaults it,
/// so istiod never sees one without.
fn find_port_name(pod: &Value, name: &str) -> Option<u32> {
    let spec = &pod["spec"];
    let containers = spec["containers"].as_array().into_iter().flatten();
    let sidecars = spec["initContainers"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|c| c["restartPolicy"] == "Always");
    containers
        .chain(sidecars)
        .flat_map(|c| c["ports"].as_array().into_iter().flatten())
        .find(|p| p["name"] == name && matches!(p["protocol"].as_str(), None | Some("TCP")))
        .and_then(|p| u32::try_from(p["containerPort"].as_u64()?).ok())
}
