//! The shape of a workload (a pod) in the mesh model, as the local file
//! writes it and as istiod's `istio.workload.Workload` is translated into.

use std::{collections::BTreeMap, net::IpAddr, path::PathBuf};

use serde::{Deserialize, Serialize};

/// Whether a workload speaks HBONE or plain TCP.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Protocol {
    /// Mutual-TLS HTTP/2 CONNECT tunnels on port 15008.
    #[default]
    Hbone,
    /// Plain TCP (not in the mesh).
    Tcp,
}

/// Whether a workload should receive new connections through services.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
pub enum WorkloadStatus {
    /// Ready.
    #[default]
    Healthy,
    /// Not ready: left out of its services' endpoints unless a service's
    /// health policy is `allowAll`. Direct connections to its address still
    /// go through.
    Unhealthy,
}

impl WorkloadStatus {
    fn is_healthy(&self) -> bool {
        *self == Self::Healthy
    }
}

/// Where a workload's or service's waypoint is: an address, or a service
/// hostname (`namespace/hostname`), and its HBONE port.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Waypoint {
    /// The waypoint's IP.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address: Option<IpAddr>,
    /// The waypoint service, `namespace/hostname`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostname: Option<String>,
    /// Its HBONE port.
    #[serde(default = "default_hbone_port")]
    pub hbone_port: u16,
}

fn default_hbone_port() -> u16 {
    dataplane_common::HBONE_PORT
}

/// Where a workload runs, for locality-aware load balancing.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Locality {
    /// Region (`topology.kubernetes.io/region`).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub region: String,
    /// Zone (`topology.kubernetes.io/zone`).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub zone: String,
    /// Subzone (`topology.istio.io/subzone`).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub subzone: String,
}

impl Locality {
    fn is_empty(&self) -> bool {
        self.region.is_empty() && self.zone.is_empty() && self.subzone.is_empty()
    }
}

/// One workload (pod).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Workload {
    /// Unique id, e.g. `cluster1//v1/Pod/default/web-0`.
    pub uid: String,
    /// Pod name.
    pub name: String,
    /// Kubernetes namespace.
    pub namespace: String,
    /// Service account (the identity's last component).
    #[serde(default = "default_service_account")]
    pub service_account: String,
    /// SPIFFE trust domain.
    #[serde(default = "default_trust_domain")]
    pub trust_domain: String,
    /// Pod IPs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub workload_ips: Vec<IpAddr>,
    /// Protocol the workload accepts.
    #[serde(default)]
    pub protocol: Protocol,
    /// Node the workload runs on.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub node: String,
    /// Network namespace path, for workloads this agent enrolls at start
    /// (standalone mode).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub netns: Option<PathBuf>,
    /// Services this workload is an endpoint of: `namespace/hostname` ->
    /// service port -> target port.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub services: BTreeMap<String, BTreeMap<u16, u16>>,
    /// `namespace/name` of WorkloadSelector-scoped policies that apply.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub authorization_policies: Vec<String>,
    /// Readiness, as Kubernetes sees it.
    #[serde(default, skip_serializing_if = "WorkloadStatus::is_healthy")]
    pub status: WorkloadStatus,
    /// The waypoint in front of this workload, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waypoint: Option<Waypoint>,
    /// The network the workload's IPs belong to (empty: the default one).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub network: String,
    /// Canonical service (`service.istio.io/canonical-name`).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub canonical_name: String,
    /// Canonical revision (`service.istio.io/canonical-revision`).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub canonical_revision: String,
    /// The owning workload (e.g. the Deployment's name), named in
    /// telemetry in place of the pod name when set.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub workload_name: String,
    /// The cluster the workload runs in.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub cluster_id: String,
    /// Region, zone and subzone.
    #[serde(default, skip_serializing_if = "Locality::is_empty")]
    pub locality: Locality,
    /// Capture this workload's DNS when the agent enrolls it from the
    /// config (standalone mode); unset: the agent's `--dns-capture`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dns_capture: Option<bool>,
    /// Whether connections between this workload and another pod of the
    /// same node may take the kernel fast path (no proxy, no mutual TLS on
    /// the node-local hop); unset: the agent's `--fast-path`. Both ends
    /// must allow it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fast_path: Option<bool>,
}

fn default_service_account() -> String {
    "default".into()
}

fn default_trust_domain() -> String {
    "cluster.local".into()
}
