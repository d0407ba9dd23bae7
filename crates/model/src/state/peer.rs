//! Who a workload and a service are as telemetry names them: the labels
//! of Istio's metrics and access records. The state builds one per
//! workload (shared by its replicas, [`super::interned`]) and per service,
//! so a connection's telemetry takes them by pointer.

/// One end of a connection, as far as the agent knows it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Peer {
    /// Workload name (the owner, e.g. a Deployment, when known; else the
    /// pod).
    pub workload: Option<String>,
    /// Kubernetes namespace.
    pub namespace: Option<String>,
    /// SPIFFE identity URI.
    pub principal: Option<String>,
    /// Canonical service (also Istio's `app` label).
    pub canonical_service: Option<String>,
    /// Canonical revision (also Istio's `version` label).
    pub canonical_revision: Option<String>,
    /// Cluster id.
    pub cluster: Option<String>,
    /// Region.
    pub region: Option<String>,
    /// Zone.
    pub zone: Option<String>,
}

/// The service a connection is attributed to.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct ServiceRef {
    /// Its hostname (`web.shop.svc.cluster.local`).
    pub hostname: String,
    /// Its name.
    pub name: String,
    /// Its namespace.
    pub namespace: String,
}
