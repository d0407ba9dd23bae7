//! What a pod is to enrollment: the request to enroll it, what an enrolled
//! pod looks like from outside, and why a pod is no longer captured.

use std::{net::IpAddr, path::PathBuf};

use serde::{Deserialize, Serialize};

use super::EnrollError;
use crate::{
    identity::{Identity, IdentityError},
    redirect::Exclusions,
};

/// How many departed pods `status` remembers.
pub(super) const DEPARTED_KEPT: usize = 64;

/// A pod to enroll, as the CNI plugin and `dataplane pod add` describe it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PodSpec {
    /// Unique id (e.g. the Kubernetes pod uid).
    pub uid: String,
    /// Pod name.
    pub name: String,
    /// Kubernetes namespace.
    pub namespace: String,
    /// Service account.
    #[serde(default = "default_service_account")]
    pub service_account: String,
    /// SPIFFE trust domain of the pod's identity.
    #[serde(default = "default_trust_domain")]
    pub trust_domain: String,
    /// Path of the pod's network namespace.
    pub netns: PathBuf,
    /// The pod's IPs.
    pub ips: Vec<IpAddr>,
    /// Node-side address toward the pod (kubelet probes come from it).
    #[serde(default)]
    pub node_addr: Option<IpAddr>,
    /// Ports and CIDRs never captured for this pod.
    #[serde(default)]
    pub exclusions: Exclusions,
    /// Capture the pod's DNS into the in-pod resolver (`None`: the agent's
    /// `--dns-capture` default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dns_capture: Option<bool>,
    /// Whether the pod's connections to and from other pods of this node
    /// may take the kernel fast path (`None`: its workload's `fastPath`,
    /// else the agent's `--fast-path`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fast_path: Option<bool>,
}

/// The pod annotation that turns the same-node fast path on or off for one
/// pod ([`PodSpec::fast_path`]). Istio has none: a user who requires mutual
/// TLS on every hop of one workload sets it to `"false"`.
pub const FAST_PATH_ANNOTATION: &str = "dataplane/fast-path";

/// The pod annotation that leaves a pod's inbound traffic uncaptured
/// (istio/api `annotation.AmbientBypassInboundCapture`; istio-cni's
/// `getPodLevelTrafficOverrides` reads it with `strconv.ParseBool`).
pub const BYPASS_INBOUND_CAPTURE_ANNOTATION: &str = "ambient.istio.io/bypass-inbound-capture";

pub use dataplane_core::parse::annotation_flag;

/// What a pod leaves uncaptured, in one word per exclusion for
/// `dataplane pod list`: `in:*` (no inbound capture), `in:PORT`,
/// `out:PORT`, `out:CIDR`; `-` for none.
pub fn exclusions_summary(exclusions: &Exclusions) -> String {
    let bypass = exclusions.bypass_inbound.then(|| "in:*".to_owned());
    let words: Vec<String> = bypass
        .into_iter()
        .chain(exclusions.inbound_ports.iter().map(|p| format!("in:{p}")))
        .chain(exclusions.outbound_ports.iter().map(|p| format!("out:{p}")))
        .chain(exclusions.outbound_cidrs.iter().map(|n| format!("out:{n}")))
        .collect();
    match words.is_empty() {
        true => "-".to_owned(),
        false => words.join(","),
    }
}

fn default_service_account() -> String {
    "default".into()
}

fn default_trust_domain() -> String {
    "cluster.local".into()
}

impl PodSpec {
    /// The pod's SPIFFE identity.
    pub fn identity(&self) -> Result<Identity, IdentityError> {
        Identity::new(&self.trust_domain, &self.namespace, &self.service_account)
    }
}

/// An enrolled pod, as `dataplane pod list` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PodStatus {
    /// The pod as enrolled.
    pub spec: PodSpec,
    /// Cookie of its network namespace.
    pub netns_cookie: u64,
    /// Whether its DNS is captured (the pod's setting or the agent's
    /// default, as applied).
    #[serde(default)]
    pub dns_capture: bool,
    /// Its apps see their clients' own addresses (original source).
    #[serde(default)]
    pub original_source: bool,
    /// Why original source is off for this pod although the agent has it
    /// on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub original_source_error: Option<String>,
    /// The connection worker serving it (`--threading pinned`, the
    /// built-in engine).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker: Option<usize>,
    /// How the external proxy serves it (`--engine ztunnel` only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub external: Option<ExternalStatus>,
}

/// Where a pod stands with the external proxy (ztunnel) that serves it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ExternalStatus {
    /// ztunnel acknowledged the pod and the kernel points its inbound at
    /// ztunnel's listeners in the pod.
    pub served: bool,
    /// Who serves it, or why it is not served.
    pub detail: String,
}

/// A pod this agent no longer captures, or could not enroll, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DepartedPod {
    /// The pod's uid.
    pub uid: String,
    /// Pod name.
    pub name: String,
    /// Kubernetes namespace.
    pub namespace: String,
    /// Why it is not captured.
    pub reason: String,
    /// When, in seconds since the Unix epoch.
    pub at: u64,
}

pub(super) fn validate(spec: &PodSpec) -> Result<(), EnrollError> {
    let invalid = |reason: &str| EnrollError::Invalid {
        uid: spec.uid.clone(),
        reason: reason.to_owned(),
    };
    if spec.uid.trim().is_empty() {
        return Err(invalid("uid is empty"));
    }
    if spec.name.trim().is_empty() || spec.namespace.trim().is_empty() {
        return Err(invalid("name and namespace are required"));
    }
    if spec.ips.is_empty() {
        return Err(invalid("at least one pod IP is required"));
    }
    if spec
        .ips
        .iter()
        .any(|ip| ip.is_unspecified() || ip.is_loopback() || ip.is_multicast())
    {
        return Err(invalid("pod IPs must be unicast, non-loopback addresses"));
    }
    if !spec.netns.is_absolute() {
        return Err(invalid("netns must be an absolute path"));
    }
    Ok(())
}
