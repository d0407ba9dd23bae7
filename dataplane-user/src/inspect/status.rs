//! `dataplane status`: the agent's state, each program's attachment, and
//! each pod's capture state checked against the kernel's maps.

use serde::{Deserialize, Serialize};

use dataplane_core::timestamp::rfc3339;

use super::{AgentView, Endpoints, list_dir};
use crate::{
    enroll::PodStatus,
    identity::CertSourceStatus,
    logging::{RecentError, recent},
};

/// How many recent warnings `status` lists (all are counted).
const RECENT_SHOWN: usize = 10;

/// What the kernel's maps say about captured pods.
struct KernelCapture {
    /// Enrolled network-namespace cookies.
    cookies: Vec<u64>,
    /// Pod IP -> network-namespace cookie its inbound connections go to.
    inbound: std::collections::HashMap<std::net::IpAddr, u64>,
}

/// `dataplane status`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StatusReport {
    /// The instance name.
    pub instance: String,
    /// The agent's process id (after a `--takeover`, the new agent's).
    #[serde(default)]
    pub pid: u32,
    /// The agent's version.
    pub version: String,
    /// Seconds since start.
    pub uptime_secs: u64,
    /// Whether readiness answers 200.
    pub ready: bool,
    /// What start-up still waits for, or `draining`.
    pub pending: Vec<String>,
    /// `ebpf` or `iptables`.
    pub capture: String,
    /// Fail-open while no agent serves.
    pub fail_open: bool,
    /// Where the HTTP endpoints listen.
    #[serde(default)]
    pub endpoints: Endpoints,
    /// The cgroup the programs are attached to.
    pub cgroup: Option<String>,
    /// Attached cgroup programs.
    pub programs: Vec<ProgramStatus>,
    /// Pods enrolled, and pods recently unenrolled or refused.
    pub pods: Vec<PodCaptureState>,
    /// Connections open now.
    pub connections_open: i64,
    /// Where the configuration in force came from.
    pub config_origin: String,
    /// Why the last configuration file read was rejected, if it was.
    pub config_error: Option<String>,
    /// Warnings and errors logged in the last minute.
    pub errors_last_minute: usize,
    /// The latest of them (up to ten).
    pub recent_errors: Vec<RecentError>,
    /// Where workload certificates come from and how that goes.
    #[serde(default)]
    pub certificates: Option<CertSourceStatus>,
    /// The stream to istiod, with `--xds`.
    #[serde(default)]
    pub xds: Option<XdsView>,
    /// Whether istiod has been told which pods are captured (the
    /// `ambient.istio.io/redirection` annotation), with `--kube`.
    #[serde(default)]
    pub redirection_annotations: Option<crate::kube::annotate::AnnotationStatus>,
}

/// The stream to istiod as `status` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct XdsView {
    /// istiod's address.
    pub address: String,
    /// Since when the current stream is up (RFC 3339); none while
    /// disconnected.
    pub connected_since: Option<String>,
    /// Why the last stream ended or could not start.
    pub last_error: Option<String>,
    /// Streams opened since start (1 + reconnects).
    pub streams: u64,
    /// Per resource type.
    pub types: Vec<XdsTypeView>,
}

/// One resource type's state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct XdsTypeView {
    /// The type URL.
    pub type_url: String,
    /// Resources held.
    pub held: usize,
    /// When the last response was ACKed (RFC 3339).
    pub last_ack: Option<String>,
    /// When the last response was NACKed (RFC 3339).
    pub last_nack: Option<String>,
    /// Why it was NACKed.
    pub last_nack_reason: Option<String>,
}

impl XdsView {
    fn of(status: &crate::xds::XdsStatus) -> Self {
        Self {
            address: status.address.clone(),
            connected_since: status.connected_since.map(rfc3339),
            last_error: status.last_error.clone(),
            streams: status.streams,
            types: status
                .types
                .iter()
                .map(|t| XdsTypeView {
                    type_url: t.type_url.clone(),
                    held: t.held,
                    last_ack: t.last_ack.map(rfc3339),
                    last_nack: t.last_nack.as_ref().map(|(at, _)| rfc3339(*at)),
                    last_nack_reason: t.last_nack.as_ref().map(|(_, why)| why.clone()),
                })
                .collect(),
        }
    }
}

impl StatusReport {
    /// Whether anything needs an operator: not ready, a pod not captured,
    /// a rejected configuration, or a program not attached.
    pub fn healthy(&self) -> bool {
        self.ready
            && self.config_error.is_none()
            && self
                .xds
                .as_ref()
                .is_none_or(|x| x.connected_since.is_some())
            && self.pods.iter().all(|p| p.captured)
            && self.programs.iter().all(|p| p.attached)
    }
}

/// A kernel program's attachment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ProgramStatus {
    /// The program (`dp_connect4`, ...).
    pub program: String,
    /// Its link's pin (`cgroup_connect4_dp_connect4`), when attached.
    pub link: Option<String>,
    /// Whether its link is pinned (attached) under bpffs.
    pub attached: bool,
}

/// A pod's capture state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PodCaptureState {
    /// The pod's uid.
    pub uid: String,
    /// Pod name.
    pub name: String,
    /// Kubernetes namespace.
    pub namespace: String,
    /// Whether its traffic is captured now.
    pub captured: bool,
    /// What was checked, or why it is not captured.
    pub reason: String,
    /// Whether its DNS is captured into the in-pod resolver: `None` for a
    /// pod no longer enrolled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dns_capture: Option<bool>,
    /// Whether its apps see their clients' own addresses: `None` for a pod
    /// no longer enrolled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub original_source: Option<bool>,
    /// Why original source is off for this pod although the agent has it
    /// on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub original_source_error: Option<String>,
    /// Whether connections between it and the node's other pods may take
    /// the same-node fast path (its workload's `fastPath`, else the
    /// agent's `--fast-path`): `None` where there is no fast path (iptables
    /// capture, an external proxy) or the pod is no longer enrolled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fast_path: Option<bool>,
    /// The connection worker thread serving it (`--threading pinned`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker: Option<usize>,
    /// What it leaves uncaptured, as `dataplane pod list` words it
    /// (`in:*`, `in:PORT`, `out:PORT`, `out:CIDR`): `None` for nothing or
    /// a pod no longer enrolled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_captured: Option<String>,
    /// With a control plane (`--xds`): it lists no workload for this pod,
    /// so its connections are refused.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub unknown_to_control_plane: bool,
}

impl AgentView {
    /// The `status` screen's data.
    pub fn status(&self) -> StatusReport {
        let mut pending: Vec<String> = self.readiness.blocking();
        if self.readiness.is_draining() {
            pending.push("draining".to_owned());
        }
        let (programs, cgroup, kernel_cookies) = match &self.kernel {
            Some(kernel) => {
                let (names, cgroup) = (kernel.programs.iter().copied(), &kernel.cgroup);
                let links = list_dir(&self.pins.links_dir());
                let programs = names
                    .map(|program| {
                        // Link pins are `<hook>_<program>`.
                        let link = links
                            .iter()
                            .find(|l| l.ends_with(&format!("_{program}")))
                            .cloned();
                        ProgramStatus {
                            program: program.to_owned(),
                            attached: link.is_some(),
                            link,
                        }
                    })
                    .collect();
                let cookies = crate::redirect::read_enrolled_cookies(&self.pins)
                    .map_err(|e| {
                        format!(
                            "cannot read the enrolled-netns map: {}",
                            crate::logging::Chain(&e)
                        )
                    })
                    .and_then(|cookies| {
                        let inbound =
                            crate::redirect::read_pod_inbound(&self.pins).map_err(|e| {
                                format!(
                                    "cannot read the pod-inbound map: {}",
                                    crate::logging::Chain(&e)
                                )
                            })?;
                        Ok(KernelCapture { cookies, inbound })
                    });
                (programs, Some(cgroup.display().to_string()), Some(cookies))
            }
            None => (Vec::new(), None, None),
        };
        let (enrolled, departed) = self.pods_and_departed();
        let state = self.mesh.state();
        let fast_path = self.mesh.fast_path.get();
        let mut pods: Vec<PodCaptureState> = enrolled
            .iter()
            .map(|pod| {
                let (captured, reason) = self.capture_state(pod, kernel_cookies.as_ref());
                PodCaptureState {
                    uid: pod.spec.uid.clone(),
                    name: pod.spec.name.clone(),
                    namespace: pod.spec.namespace.clone(),
                    captured,
                    reason,
                    dns_capture: Some(pod.dns_capture),
                    original_source: Some(pod.original_source),
                    original_source_error: pod.original_source_error.clone(),
                    fast_path: fast_path
                        .map(|fast| fast.allows_pod(&state, pod.spec.fast_path, &pod.spec.ips)),
                    worker: pod.worker,
                    not_captured: (pod.spec.exclusions != Default::default())
                        .then(|| crate::enroll::exclusions_summary(&pod.spec.exclusions)),
                    unknown_to_control_plane: self.mesh.require_known_workloads
                        && !listed(&state, &pod.spec),
                }
            })
            .collect();
        pods.extend(departed.into_iter().map(|d| PodCaptureState {
            uid: d.uid,
            name: d.name,
            namespace: d.namespace,
            captured: false,
            reason: d.reason,
            dns_capture: None,
            original_source: None,
            original_source_error: None,
            fast_path: None,
            worker: None,
            not_captured: None,
            unknown_to_control_plane: false,
        }));
        let errors = recent::global().last_minute();
        let config_error = self.mesh.config_error();
        StatusReport {
            pid: std::process::id(),
            instance: self.config.state.instance.clone(),
            version: env!("CARGO_PKG_VERSION").to_owned(),
            uptime_secs: self.started.elapsed().as_secs(),
            ready: pending.is_empty(),
            pending,
            capture: self.config.capture.name().to_owned(),
            fail_open: self.config.redirect.fail_open,
            endpoints: self.endpoints,
            cgroup,
            programs,
            pods,
            connections_open: self.mesh.metrics.open_connections(),
            config_origin: state.origin.clone(),
            config_error,
            errors_last_minute: errors.len(),
            recent_errors: errors
                .iter()
                .skip(errors.len().saturating_sub(RECENT_SHOWN))
                .cloned()
                .collect(),
            certificates: Some(self.mesh.certs.status()),
            xds: self.xds_view(),
            redirection_annotations: self
                .annotations
                .as_ref()
                .and_then(|a| a.lock().ok().map(|a| a.clone())),
        }
    }

    /// Whether the kernel captures `pod`: its netns is in the enrolled map
    /// and its sk_lookup program is attached.
    fn capture_state(
        &self,
        pod: &PodStatus,
        kernel: Option<&Result<KernelCapture, String>>,
    ) -> (bool, String) {
        let cookie = pod.netns_cookie;
        // Every pod IP must send inbound connections to this pod's
        // namespace, not to another's nor nowhere.
        let inbound_problem = |kernel: &KernelCapture| {
            pod.spec.ips.iter().find_map(|ip| {
                match kernel.inbound.get(&ip.to_canonical()) {
                    Some(owner) if *owner == cookie => None,
                    Some(owner) => Some(format!(
                        "inbound capture of {ip} points at network namespace {owner}, not this pod's ({cookie})"
                    )),
                    None => Some(format!("no inbound capture entry for {ip} in the kernel")),
                }
            })
        };
        // `--engine ztunnel`: captured only once ztunnel serves the pod.
        if let Some(external) = &pod.external
            && !external.served
        {
            return (false, external.detail.clone());
        }
        match kernel {
            None => (
                true,
                "iptables capture: listeners serving; the rules are not this agent's to check"
                    .to_owned(),
            ),
            Some(Err(err)) => (false, err.clone()),
            Some(Ok(kernel)) if !kernel.cookies.contains(&cookie) => (
                false,
                format!("network namespace {cookie} is missing from the kernel's enrolled map"),
            ),
            Some(Ok(_)) if !self.pins.sk_lookup_link(cookie).exists() => (
                false,
                format!("no sk_lookup program attached to network namespace {cookie}"),
            ),
            Some(Ok(kernel)) if let Some(problem) = inbound_problem(kernel) => (false, problem),
            Some(Ok(_)) => (
                true,
                match &pod.external {
                    Some(external) => format!(
                        "network namespace {cookie} enrolled in the kernel, sk_lookup attached, {}",
                        external.detail
                    ),
                    None => format!(
                        "network namespace {cookie} enrolled in the kernel, sk_lookup attached"
                    ),
                },
            ),
        }
    }

    /// The stream to istiod's state, with `--xds` (also in the configuration dump).
    pub(super) fn xds_view(&self) -> Option<XdsView> {
        let status = self.xds.as_ref()?;
        let status = status
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        Some(XdsView::of(&status))
    }
}

/// Whether the mesh state lists the pod `spec` describes: one of its IPs
/// under its identity (what [`crate::proxy::PodContext::known_in`] asks).
fn listed(state: &crate::state::MeshState, spec: &crate::enroll::PodSpec) -> bool {
    let Ok(identity) =
        crate::identity::Identity::new(&spec.trust_domain, &spec.namespace, &spec.service_account)
    else {
        return false;
    };
    spec.ips
        .iter()
        .filter_map(|ip| state.workloads.by_ip(*ip))
        .any(|w| w.identity == identity)
}
