//! The sections of ztunnel's admin `/config_dump` that `istioctl
//! ztunnel-config workloads|services|policies|certificates|all` decodes
//! (istio `istioctl/pkg/writer/ztunnel/configdump/api.go`, `ZtunnelDump`),
//! built from our mesh state with ztunnel's field names and value forms so
//! that Istio's tooling reads our dump unchanged. The agent's own sections
//! stay beside them under their own keys.
//!
//! Every form below is ztunnel's (commit 62d82653), cited where it is
//! made. What our model does not hold is either written as ztunnel
//! defaults it for istiod's usual input, or left out; the list is in
//! [`NOT_CARRIED`].

mod certs;
mod policies;
mod services;
mod workloads;

use std::{collections::BTreeMap, sync::Arc};

use rustls::pki_types::CertificateDer;
use serde::Serialize;

use crate::{config::LocalConfig, enroll::PodStatus, identity::IssuedCert};

pub use certs::{CertDump, CertsDump};
pub use policies::{RbacMatch, ServiceAccountMatch, StringMatch, ZtunnelPolicy};
pub use services::{LoadBalancer, NetworkCidr, WeightedWaypoint, ZtunnelEndpoint, ZtunnelService};
pub use workloads::{GatewayAddress, Locality, ZtunnelWorkload};

/// What ztunnel's dump carries that ours writes differently or not at all,
/// and why (our mesh model does not keep it). Said here so a reader of a
/// dump diff knows which differences are expected.
pub const NOT_CARRIED: &[&str] = &[
    "workloads[].workloadType: not kept from xDS, left out (ztunnel: `deployment`, `pod`, ...)",
    "workloads[].nativeTunnel: not kept, left out",
    "workloads[].capacity: not kept, written as ztunnel's default 1",
    "workloads[].networkMode: not kept, written as `Standard`",
    "workloads[].waypoint, networkGateway / services[].waypoint by address: the gateway's \
     network is written as istiod sent it; one from the config file without a network is \
     written empty (`/10.0.0.1`)",
    "services[].ipFamilies: not kept, left out",
    "services[].subjectAltNames: only the SANs that are SPIFFE identities (the rest are dropped \
     on arrival)",
    "services[].loadBalancer: written when any setting differs from the default (ztunnel: \
     whenever istiod sent one)",
    "policies[].rules: a StringMatch `Exact` value ending or starting with `*` reads back as \
     `Prefix`/`Suffix` (our model writes the wildcard form)",
    "certificates[]: only issued certificates (`Available`); identities still waiting are not \
     listed (ztunnel: `Initializing`)",
    "workloadState[].connections: not written (ztunnel: only with connection tracking)",
];

/// ztunnel's sections of the dump, flattened into its top level.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ZtunnelSections {
    /// `ProxyStateSerialization.workloads` (ztunnel `src/state.rs`,
    /// `impl Serialize for ProxyState`), sorted by uid as it sorts them.
    pub workloads: Vec<ZtunnelWorkload>,
    /// Sorted by hostname (same function).
    pub services: Vec<ZtunnelService>,
    /// Sorted by `namespace/name` (same function).
    pub policies: Vec<ZtunnelPolicy>,
    /// `ConfigDump.certificates` (ztunnel `src/admin.rs`, `dump_certs`),
    /// sorted by identity.
    pub certificates: Vec<CertsDump>,
    /// The node agent's per-pod state (ztunnel `src/inpod/admin.rs`,
    /// `WorkloadManagerAdminHandler`, key `workloadState`), by pod uid.
    pub workload_state: BTreeMap<String, PodProxyState>,
}

/// ztunnel's `inpod::admin::ProxyState` without `connections`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PodProxyState {
    /// `Up` once the pod is served (`State`).
    state: &'static str,
    info: PodInfo,
}

/// ztunnel's `state::WorkloadInfo`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PodInfo {
    name: String,
    namespace: String,
    service_account: String,
}

impl ZtunnelSections {
    /// ztunnel's sections for the mesh `config`, the certificates `issued`
    /// (chains checked against `roots`) and the enrolled `pods`.
    pub fn build(
        config: &LocalConfig,
        issued: &[Arc<IssuedCert>],
        roots: &[CertificateDer<'static>],
        pods: &[PodStatus],
    ) -> Self {
        let workloads = workloads::sorted(&config.workloads);
        let services = services::sorted(&config.services, &config.workloads);
        let policies = policies::sorted(&config.policies);
        let certificates = certs::sorted(issued, roots);
        let workload_state = pods
            .iter()
            .map(|pod| {
                let info = PodInfo {
                    name: pod.spec.name.clone(),
                    namespace: pod.spec.namespace.clone(),
                    service_account: pod.spec.service_account.clone(),
                };
                (pod.spec.uid.clone(), PodProxyState { state: "Up", info })
            })
            .collect();
        Self {
            workloads,
            services,
            policies,
            certificates,
            workload_state,
        }
    }
}

#[cfg(test)]
#[path = "ztunnel_dump_tests.rs"]
mod tests;
