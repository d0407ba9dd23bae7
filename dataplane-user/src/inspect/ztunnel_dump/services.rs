//! Services as ztunnel writes them (`services`).

use std::{collections::BTreeMap, sync::Arc};

use serde::Serialize;

use super::workloads::{GatewayAddress, gateway};
use crate::config::{HealthPolicy, RoutingMode, RoutingScope, Service, Workload, WorkloadStatus};

/// A service as ztunnel serializes `state::service::Service`
/// (`src/state/service.rs`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ZtunnelService {
    name: String,
    namespace: String,
    hostname: String,
    /// `NetworkAddress`es, `network/ip`.
    vips: Vec<String>,
    /// `NetworkCidr`s: `{network, cidr}`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    cidr_vips: Vec<NetworkCidr>,
    /// `HashMap<u16, u16>`: service port -> target port, keys as strings.
    ports: BTreeMap<u16, u16>,
    /// `EndpointSet`: a map keyed by workload uid.
    endpoints: BTreeMap<String, ZtunnelEndpoint>,
    subject_alt_names: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    waypoint: Option<GatewayAddress>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    weighted_waypoints: Vec<WeightedWaypoint>,
    #[serde(skip_serializing_if = "Option::is_none")]
    load_balancer: Option<LoadBalancer>,
    /// `Option<IpFamily>`: `Dual`, `IPv4` or `IPv6`; absent for automatic.
    #[serde(skip_serializing_if = "Option::is_none")]
    ip_families: Option<crate::config::IpFamily>,
    canonical: bool,
    /// Always written, `Public` by default (`Visibility`).
    visibility: &'static str,
}

/// ztunnel's `WeightedWaypoint` (`src/state/service.rs`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct WeightedWaypoint {
    destination: GatewayAddress,
    weight: u32,
}

/// ztunnel's `NetworkCidr` (`src/state/workload.rs`: derived, no rename).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NetworkCidr {
    network: String,
    cidr: String,
}

/// ztunnel's `Endpoint` (`src/state/service.rs`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ZtunnelEndpoint {
    workload_uid: String,
    /// The workload's own port list for this service.
    port: BTreeMap<u16, u16>,
    status: WorkloadStatus,
}

/// ztunnel's `LoadBalancer`: enum variants by their Rust names
/// (`LoadBalancerScopes`, `LoadBalancerMode`, `LoadBalancerHealthPolicy`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct LoadBalancer {
    routing_preferences: Vec<&'static str>,
    mode: &'static str,
    health_policy: &'static str,
}

/// Every service of the mesh, sorted by hostname.
pub(super) fn sorted(services: &[Service], workloads: &[Arc<Workload>]) -> Vec<ZtunnelService> {
    let mut services: Vec<ZtunnelService> =
        services.iter().map(|s| service(s, workloads)).collect();
    services.sort_by(|a, b| a.hostname.cmp(&b.hostname));
    services
}

fn service(s: &Service, workloads: &[Arc<Workload>]) -> ZtunnelService {
    let key = s.key();
    // ztunnel fills `endpoints` from each workload's `services` entry for
    // this service (`ServiceStore::insert_endpoint`), keyed by workload
    // uid, whatever the workload's health.
    let endpoints = workloads
        .iter()
        .filter_map(|w| {
            let ports = w.services.get(&key)?;
            Some((
                w.uid.to_string(),
                ZtunnelEndpoint {
                    workload_uid: w.uid.to_string(),
                    port: ports.iter().collect(),
                    status: w.status,
                },
            ))
        })
        .collect();
    let load_balancer = (s.health_policy != HealthPolicy::default()
        || s.routing != crate::config::Routing::default())
    .then(|| LoadBalancer {
        routing_preferences: s.routing.preferences.iter().map(|p| scope(*p)).collect(),
        mode: mode(s.routing.mode),
        health_policy: match s.health_policy {
            HealthPolicy::OnlyHealthy => "OnlyHealthy",
            HealthPolicy::AllowAll => "AllowAll",
        },
    });
    ZtunnelService {
        name: s.name.clone(),
        namespace: s.namespace.clone(),
        hostname: s.hostname.clone(),
        vips: s.vips.iter().map(ToString::to_string).collect(),
        cidr_vips: s
            .cidr_vips
            .iter()
            .map(|range| NetworkCidr {
                network: range.network.to_string(),
                cidr: range.net.to_string(),
            })
            .collect(),
        ports: s.ports.clone(),
        endpoints,
        subject_alt_names: s.subject_alt_names.clone(),
        waypoint: s.waypoint.as_ref().and_then(gateway),
        weighted_waypoints: s
            .weighted_waypoints
            .iter()
            .filter_map(|w| {
                Some(WeightedWaypoint {
                    destination: gateway(&w.waypoint)?,
                    weight: w.weight,
                })
            })
            .collect(),
        load_balancer,
        ip_families: s.ip_families,
        canonical: s.canonical,
        visibility: match s.visibility {
            crate::config::Visibility::Public => "Public",
            crate::config::Visibility::Namespace => "Namespace",
        },
    }
}

/// `LoadBalancerScopes` variant names.
fn scope(scope: RoutingScope) -> &'static str {
    match scope {
        RoutingScope::Region => "Region",
        RoutingScope::Zone => "Zone",
        RoutingScope::Subzone => "Subzone",
        RoutingScope::Node => "Node",
        RoutingScope::Cluster => "Cluster",
        RoutingScope::Network => "Network",
    }
}

/// `LoadBalancerMode` variant names.
fn mode(mode: RoutingMode) -> &'static str {
    match mode {
        RoutingMode::Standard => "Standard",
        RoutingMode::Strict => "Strict",
        RoutingMode::Failover => "Failover",
        RoutingMode::Passthrough => "Passthrough",
    }
}
