//! Workloads as ztunnel writes them (`workloads`).

use std::{net::IpAddr, sync::Arc};

use serde::Serialize;

use crate::config::{ApplicationTunnel, Protocol, Waypoint, Workload, WorkloadStatus};

/// A workload as ztunnel serializes `state::workload::Workload` (ztunnel
/// `src/state/workload.rs`: `rename_all = "camelCase"`, the
/// `skip_serializing_if = "is_default"` fields left out when empty).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ZtunnelWorkload {
    workload_ips: Vec<IpAddr>,
    #[serde(skip_serializing_if = "Option::is_none")]
    waypoint: Option<GatewayAddress>,
    #[serde(skip_serializing_if = "Option::is_none")]
    network_gateway: Option<GatewayAddress>,
    /// `InboundProtocol`: `HBONE` or `TCP`.
    protocol: Protocol,
    network_mode: &'static str,
    #[serde(skip_serializing_if = "str::is_empty")]
    uid: String,
    name: String,
    namespace: String,
    #[serde(skip_serializing_if = "str::is_empty")]
    trust_domain: String,
    #[serde(skip_serializing_if = "str::is_empty")]
    service_account: String,
    #[serde(skip_serializing_if = "str::is_empty")]
    network: String,
    #[serde(skip_serializing_if = "str::is_empty")]
    workload_name: String,
    #[serde(skip_serializing_if = "str::is_empty")]
    canonical_name: String,
    #[serde(skip_serializing_if = "str::is_empty")]
    canonical_revision: String,
    #[serde(skip_serializing_if = "str::is_empty")]
    hostname: String,
    #[serde(skip_serializing_if = "str::is_empty")]
    node: String,
    /// ztunnel's `ApplicationTunnel` (`src/state/workload.rs`):
    /// `{protocol: NONE|PROXY, port}`, `port` null when unset; ours
    /// serializes to the same form.
    #[serde(skip_serializing_if = "Option::is_none")]
    application_tunnel: Option<ApplicationTunnel>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    authorization_policies: Vec<String>,
    /// `HealthStatus`: `Healthy` or `Unhealthy` (our enum's own names).
    status: WorkloadStatus,
    cluster_id: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    locality: Option<Locality>,
    /// `NamespacedHostname`s, serialized `namespace/hostname`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    services: Vec<String>,
    capacity: u32,
}

/// ztunnel's `Locality`: no rename, no skip, so all three keys appear once
/// one is set (the whole struct is skipped when all are empty).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Locality {
    region: String,
    zone: String,
    subzone: String,
}

/// ztunnel's `GatewayAddress`: the destination is `NetworkAddress`
/// (`network/ip`) or `NamespacedHostname` (`namespace/hostname`), both
/// written with `collect_str` (`src/state/workload.rs`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GatewayAddress {
    destination: String,
    hbone_mtls_port: u16,
}

/// Every workload of the mesh, sorted by uid as ztunnel sorts them.
pub(super) fn sorted(workloads: &[Arc<Workload>]) -> Vec<ZtunnelWorkload> {
    let mut workloads: Vec<ZtunnelWorkload> = workloads.iter().map(|w| workload(w)).collect();
    workloads.sort_by(|a, b| a.uid.cmp(&b.uid));
    workloads
}

/// ztunnel `TryFrom<XdsWorkload> for Workload` defaults an empty cluster
/// id to `Kubernetes`; trust domain and service account are defaulted
/// the same way by our translation already.
const DEFAULT_CLUSTER_ID: &str = "Kubernetes";

fn workload(w: &Workload) -> ZtunnelWorkload {
    let known = w.locality();
    let locality = (!known.is_empty()).then(|| Locality {
        region: known.region.to_string(),
        zone: known.zone.to_string(),
        subzone: known.subzone.to_string(),
    });
    let mut services: Vec<String> = w.services.keys().map(str::to_owned).collect();
    services.sort();
    ZtunnelWorkload {
        workload_ips: w.workload_ips.to_vec(),
        waypoint: w.waypoint.as_deref().and_then(gateway),
        network_gateway: w.network_gateway.as_deref().and_then(gateway),
        protocol: w.protocol,
        // ztunnel's `NetworkMode` variant names.
        network_mode: if w.host_network {
            "HostNetwork"
        } else {
            "Standard"
        },
        uid: w.uid.to_string(),
        name: w.name.clone(),
        namespace: w.namespace.to_string(),
        trust_domain: w.trust_domain.to_string(),
        service_account: w.service_account.to_string(),
        network: w.network.to_string(),
        workload_name: w.workload_name.to_string(),
        canonical_name: w.canonical_name.to_string(),
        canonical_revision: w.canonical_revision.to_string(),
        hostname: w.hostname.to_string(),
        node: w.node.to_string(),
        application_tunnel: w.application_tunnel,
        authorization_policies: w.authorization_policies.to_vec(),
        status: w.status,
        cluster_id: match &*w.cluster_id {
            "" => DEFAULT_CLUSTER_ID.to_owned(),
            id => id.to_owned(),
        },
        locality,
        services,
        // `capacity: resource.capacity.unwrap_or(1)`.
        capacity: w.weight(),
    }
}

/// `network/ip` (the network empty when not given), or
/// `namespace/hostname` as we already hold it; none if the waypoint
/// names neither.
pub(super) fn gateway(w: &Waypoint) -> Option<GatewayAddress> {
    let destination = match (&w.address, &w.hostname) {
        (Some(ip), _) => format!("{}/{ip}", w.network.as_deref().unwrap_or_default()),
        (None, Some(hostname)) => hostname.clone(),
        (None, None) => return None,
    };
    Some(GatewayAddress {
        destination,
        hbone_mtls_port: w.hbone_port,
    })
}
