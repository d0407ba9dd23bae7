//! Who a workload and a service are as telemetry names them: the labels
//! of Istio's metrics and access records. The state builds one per
//! workload (shared by its replicas, [`super::interned`]) and per service,
//! so a connection's telemetry takes them by pointer. Its strings are
//! [`SharedStr`]s: a peer per pod (pods no Deployment owns) repeats its
//! namespace, cluster, revision and its identity's URI, which are then
//! one allocation each, not one per peer (`dp-scale` at 100k such pods:
//! 19 MB less RSS).

use crate::config::SharedStr;

/// One end of a connection, as far as the agent knows it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Peer {
    /// Workload name (the owner, e.g. a Deployment, when known; else the
    /// pod).
    pub workload: Option<SharedStr>,
    /// Kubernetes namespace.
    pub namespace: Option<SharedStr>,
    /// SPIFFE identity URI.
    pub principal: Option<SharedStr>,
    /// Canonical service (also Istio's `app` label).
    pub canonical_service: Option<SharedStr>,
    /// Canonical revision (also Istio's `version` label).
    pub canonical_revision: Option<SharedStr>,
    /// Cluster id.
    pub cluster: Option<SharedStr>,
    /// Region.
    pub region: Option<SharedStr>,
    /// Zone.
    pub zone: Option<SharedStr>,
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
