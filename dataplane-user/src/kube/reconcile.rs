//! The reconciler's decisions: which of this node's pods must be enrolled
//! and which enrolled pods must go, from the latest view of the Kubernetes
//! API. No I/O of its own: it acts through a [`PodEnroller`] and finds
//! namespaces through a [`NetnsLocator`], so it runs the same against the
//! agent's enrollments and against a test's recorder.
//!
//! Rules:
//! - Nothing is decided before the first complete list of both pods and
//!   namespaces (a partial view would unenroll pods that are merely unseen).
//! - Which pods opted in is Istio's rule ([`optin`]: enablement
//!   selectors, sidecars, host network, excluded namespaces).
//! - An opted-in, running pod with IPs that is not enrolled is enrolled
//!   (its namespace found by the locator; retried at the next resync when
//!   the sandbox is not there yet). A pod already enrolled is left alone,
//!   whoever enrolled it (the CNI plugin's spec has details this view lacks,
//!   and re-enrolling would cut its connections), but for its capture
//!   exclusions: when those its annotations ask for differ from those in
//!   force, they are changed in place ([`super::exclusions`]).
//! - An enrolled pod that opted out, finished, or was deleted from the API
//!   is unenrolled at once. A pod being deleted (`deletionTimestamp`) keeps
//!   its capture until it is gone.
//! - An enrolled uid the API does not know is unenrolled only after it has
//!   stayed unknown for a grace period: the CNI plugin may enroll a pod a
//!   moment before the watch delivers it.
//! - Pods the agent's own configuration enrolls (`keep`) are never touched.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    net::IpAddr,
    path::PathBuf,
    sync::Arc,
    time::{Duration, Instant},
};

use k8s_openapi::api::core::v1::{Namespace, Pod};
use tracing::{debug, info, warn};

use super::{
    exclusions::{AnnotationReports, IgnoredAnnotationsMetric},
    netns::NetnsLocator,
    optin::{self, OptIn, OptInInput},
};
use crate::enroll::PodSpec;

/// Enrolls and unenrolls pods (the agent's [`crate::enroll::Enrollments`],
/// or a test's recorder).
pub trait PodEnroller: Send + Sync {
    /// Uids of the pods enrolled now.
    fn enrolled(&self) -> Vec<String>;
    /// Enrolls a pod; returns only once its traffic is captured.
    fn enroll(&self, spec: PodSpec) -> Result<(), String>;
    /// Unenrolls the pod with this uid (nothing when it is not enrolled).
    fn unenroll(&self, uid: &str) -> Result<(), String>;
    /// The spec the pod with this uid is enrolled with, if it is.
    fn enrolled_spec(&self, uid: &str) -> Option<PodSpec>;
}

/// What the reconciler keeps of a pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodView {
    /// `metadata.uid`.
    pub uid: String,
    /// `metadata.name`.
    pub name: String,
    /// `metadata.namespace`.
    pub namespace: String,
    /// `spec.serviceAccountName` (`default` when unset).
    pub service_account: String,
    /// `status.podIPs` (or `status.podIP`).
    pub ips: Vec<IpAddr>,
    /// `metadata.labels`.
    pub labels: BTreeMap<String, String>,
    /// `metadata.annotations`.
    pub annotations: BTreeMap<String, String>,
    /// `spec.hostNetwork`.
    pub host_network: bool,
    /// `status.phase` is `Succeeded` or `Failed`: its sandbox is gone.
    pub finished: bool,
    /// `metadata.deletionTimestamp` is set.
    pub deleting: bool,
}

impl PodView {
    /// Reads a pod object; `None` when it lacks a uid, name or namespace.
    pub fn from_pod(pod: &Pod) -> Option<Self> {
        let meta = &pod.metadata;
        let spec = pod.spec.as_ref();
        let status = pod.status.as_ref();
        let mut ips: Vec<IpAddr> = status
            .and_then(|s| s.pod_ips.as_ref())
            .map(|ips| ips.iter().filter_map(|ip| ip.ip.parse().ok()).collect())
            .unwrap_or_default();
        if ips.is_empty()
            && let Some(ip) = status
                .and_then(|s| s.pod_ip.as_ref())
                .and_then(|ip| ip.parse().ok())
        {
            ips.push(ip);
        }
        let phase = status.and_then(|s| s.phase.as_deref());
        Some(Self {
            uid: meta.uid.clone()?,
            name: meta.name.clone()?,
            namespace: meta.namespace.clone()?,
            service_account: spec
                .and_then(|s| s.service_account_name.clone())
                .filter(|sa| !sa.is_empty())
                .unwrap_or_else(|| "default".to_owned()),
            ips,
            labels: meta.labels.clone().unwrap_or_default(),
            annotations: meta.annotations.clone().unwrap_or_default(),
            host_network: spec.and_then(|s| s.host_network).unwrap_or(false),
            finished: matches!(phase, Some("Succeeded" | "Failed")),
            deleting: meta.deletion_timestamp.is_some(),
        })
    }
}

/// A namespace's name and labels.
pub fn namespace_labels(ns: &Namespace) -> Option<(String, BTreeMap<String, String>)> {
    Some((
        ns.metadata.name.clone()?,
        ns.metadata.labels.clone().unwrap_or_default(),
    ))
}

/// Settings of a [`Reconciler`].
#[derive(Debug, Clone)]
pub struct ReconcilerSettings {
    /// Trust domain of enrolled pods' identities.
    pub trust_domain: String,
    /// Uids never unenrolled (the agent's configured workloads).
    pub keep: HashSet<String>,
    /// How long an enrolled uid unknown to the API is kept.
    pub unknown_grace: Duration,
    /// Which pods belong in the mesh (Istio's enablement selectors and
    /// excluded namespaces).
    pub rule: Arc<optin::EnrollmentRule>,
    /// Counts pods' exclusion annotations ignored.
    pub ignored_annotations: IgnoredAnnotationsMetric,
}

/// What one pass changed.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Changes {
    /// Uids enrolled.
    pub enrolled: Vec<String>,
    /// Uids unenrolled.
    pub unenrolled: Vec<String>,
}

/// What the reconciler wants for one pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Want {
    /// In the mesh.
    Enrolled,
    /// Out of the mesh.
    Unenrolled,
    /// Leave whatever is there (not decidable yet, or being deleted).
    Untouched,
}

/// The reconciler's view and decisions.
pub struct Reconciler {
    enroller: Arc<dyn PodEnroller>,
    locator: Arc<dyn NetnsLocator>,
    settings: ReconcilerSettings,
    pods: HashMap<String, PodView>,
    namespaces: HashMap<String, BTreeMap<String, String>>,
    pods_synced: bool,
    namespaces_synced: bool,
    unknown_since: HashMap<String, Instant>,
    reports: AnnotationReports,
}

impl std::fmt::Debug for Reconciler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reconciler")
            .field("pods", &self.pods.len())
            .field("namespaces", &self.namespaces.len())
            .field("pods_synced", &self.pods_synced)
            .field("namespaces_synced", &self.namespaces_synced)
            .finish()
    }
}

impl Reconciler {
    /// A reconciler with an empty, unsynced view.
    pub fn new(
        enroller: Arc<dyn PodEnroller>,
        locator: Arc<dyn NetnsLocator>,
        settings: ReconcilerSettings,
    ) -> Self {
        Self {
            enroller,
            locator,
            settings,
            pods: HashMap::new(),
            namespaces: HashMap::new(),
            pods_synced: false,
            namespaces_synced: false,
            unknown_since: HashMap::new(),
            reports: AnnotationReports::default(),
        }
    }

    /// A complete list of this node's pods (initial list or relist).
    pub fn pods_listed(&mut self, pods: Vec<PodView>) -> Changes {
        self.pods = pods.into_iter().map(|p| (p.uid.clone(), p)).collect();
        self.reports.keep_only(|uid| self.pods.contains_key(uid));
        self.pods_synced = true;
        self.reconcile_all()
    }

    /// A complete list of namespaces.
    pub fn namespaces_listed(
        &mut self,
        namespaces: Vec<(String, BTreeMap<String, String>)>,
    ) -> Changes {
        self.namespaces = namespaces.into_iter().collect();
        self.namespaces_synced = true;
        self.reconcile_all()
    }

    /// A pod was added or changed.
    pub fn pod_applied(&mut self, pod: PodView) -> Changes {
        let uid = pod.uid.clone();
        self.pods.insert(uid.clone(), pod);
        let mut changes = Changes::default();
        let enrolled: HashSet<String> = self.enroller.enrolled().into_iter().collect();
        self.reconcile_pod(&uid, &enrolled, &mut changes);
        changes
    }

    /// A pod was deleted from the API.
    pub fn pod_deleted(&mut self, uid: &str) -> Changes {
        self.pods.remove(uid);
        self.reports.forget(uid);
        let mut changes = Changes::default();
        if self.enroller.enrolled().iter().any(|u| u == uid) && !self.settings.keep.contains(uid) {
            self.unenroll(uid, "deleted from the API", &mut changes);
        }
        changes
    }

    /// A namespace was added or its labels changed.
    pub fn namespace_applied(&mut self, name: String, labels: BTreeMap<String, String>) -> Changes {
        if self.namespaces.get(&name) == Some(&labels) {
            return Changes::default();
        }
        self.namespaces.insert(name.clone(), labels);
        self.reconcile_namespace(&name)
    }

    /// A namespace was deleted.
    pub fn namespace_deleted(&mut self, name: &str) -> Changes {
        self.namespaces.remove(name);
        self.reconcile_namespace(name)
    }

    /// Applies the rules to every pod and every enrolled uid.
    pub fn reconcile_all(&mut self) -> Changes {
        let mut changes = Changes::default();
        if !self.synced() {
            return changes;
        }
        let enrolled: HashSet<String> = self.enroller.enrolled().into_iter().collect();
        let mut uids: Vec<String> = self.pods.keys().cloned().collect();
        uids.sort();
        for uid in &uids {
            self.reconcile_pod(uid, &enrolled, &mut changes);
        }
        let now = Instant::now();
        self.unknown_since.retain(|uid, _| enrolled.contains(uid));
        let mut unknown: Vec<&String> = enrolled
            .iter()
            .filter(|uid| !self.pods.contains_key(*uid) && !self.settings.keep.contains(*uid))
            .collect();
        unknown.sort();
        for uid in unknown {
            let since = *self.unknown_since.entry(uid.clone()).or_insert(now);
            if now.duration_since(since) >= self.settings.unknown_grace {
                self.unknown_since.remove(uid);
                self.unenroll(uid, "unknown to the API on this node", &mut changes);
            }
        }
        changes
    }

    fn synced(&self) -> bool {
        self.pods_synced && self.namespaces_synced
    }

    fn reconcile_namespace(&mut self, name: &str) -> Changes {
        let mut changes = Changes::default();
        if !self.synced() {
            return changes;
        }
        let enrolled: HashSet<String> = self.enroller.enrolled().into_iter().collect();
        let mut uids: Vec<String> = self
            .pods
            .values()
            .filter(|p| p.namespace == name)
            .map(|p| p.uid.clone())
            .collect();
        uids.sort();
        for uid in &uids {
            self.reconcile_pod(uid, &enrolled, &mut changes);
        }
        changes
    }

    fn want(&self, pod: &PodView) -> Want {
        if !self.synced() || pod.deleting {
            return Want::Untouched;
        }
        if pod.finished {
            return Want::Unenrolled;
        }
        let empty = BTreeMap::new();
        let decision = self.settings.rule.decide(OptInInput {
            namespace: &pod.namespace,
            pod_labels: &pod.labels,
            pod_annotations: &pod.annotations,
            host_network: pod.host_network,
            namespace_labels: self.namespaces.get(&pod.namespace).unwrap_or(&empty),
        });
        match decision {
            OptIn::Enroll { .. } => Want::Enrolled,
            OptIn::Skip(_) => Want::Unenrolled,
        }
    }

    fn reconcile_pod(&mut self, uid: &str, enrolled: &HashSet<String>, changes: &mut Changes) {
        let Some(pod) = self.pods.get(uid) else {
            return;
        };
        if self.settings.keep.contains(uid) {
            return;
        }
        let is_enrolled = enrolled.contains(uid);
        match self.want(pod) {
            Want::Untouched => {}
            Want::Enrolled if is_enrolled => {
                let wanted = self
                    .reports
                    .exclusions(pod, &self.settings.ignored_annotations);
                let Some(mut spec) = self.enroller.enrolled_spec(uid) else {
                    return;
                };
                if spec.exclusions == wanted {
                    return;
                }
                spec.exclusions = wanted;
                match self.enroller.enroll(spec) {
                    Ok(()) => {
                        info!(pod = %pod.name, namespace = %pod.namespace, uid, "capture exclusions changed by the pod's annotations")
                    }
                    Err(err) => {
                        warn!(pod = %pod.name, namespace = %pod.namespace, uid, error = %err, "cannot change the capture exclusions; retrying at the next resync")
                    }
                }
            }
            Want::Enrolled => {
                if pod.ips.is_empty() {
                    debug!(pod = %pod.name, namespace = %pod.namespace, "opted in but has no IP yet");
                    return;
                }
                let Some(netns) = self.locator.locate(uid) else {
                    debug!(pod = %pod.name, namespace = %pod.namespace, uid, "opted in but its network namespace is not found on this node yet");
                    return;
                };
                let mut spec = spec_of(pod, &self.settings.trust_domain, netns);
                spec.exclusions = self
                    .reports
                    .exclusions(pod, &self.settings.ignored_annotations);
                match self.enroller.enroll(spec) {
                    Ok(()) => {
                        info!(pod = %pod.name, namespace = %pod.namespace, uid, "enrolled from the Kubernetes API");
                        changes.enrolled.push(uid.to_owned());
                    }
                    Err(err) => {
                        warn!(pod = %pod.name, namespace = %pod.namespace, uid, error = %err, "cannot enroll; retrying at the next resync")
                    }
                }
            }
            Want::Unenrolled if is_enrolled => {
                self.unenroll(uid, "no longer opted in", changes);
            }
            Want::Unenrolled => {}
        }
    }

    fn unenroll(&self, uid: &str, why: &str, changes: &mut Changes) {
        match self.enroller.unenroll(uid) {
            Ok(()) => {
                info!(uid, reason = why, "unenrolled by the reconciler");
                changes.unenrolled.push(uid.to_owned());
            }
            Err(err) => warn!(uid, error = %err, "cannot unenroll; retrying at the next resync"),
        }
    }
}

/// The enrollment request for a pod found through the API.
pub fn spec_of(pod: &PodView, trust_domain: &str, netns: PathBuf) -> PodSpec {
    PodSpec {
        uid: pod.uid.clone(),
        name: pod.name.clone(),
        namespace: pod.namespace.clone(),
        service_account: pod.service_account.clone(),
        trust_domain: trust_domain.to_owned(),
        netns,
        ips: pod.ips.clone(),
        // Unknown from the API; kubelet probes from the configured probe
        // sources stay exempt.
        node_addr: None,
        exclusions: crate::enroll::annotation_exclusions(&pod.annotations),
        dns_capture: crate::dns::annotation_setting(&pod.annotations),
        fast_path: crate::enroll::annotation_flag(
            &pod.annotations,
            crate::enroll::FAST_PATH_ANNOTATION,
        ),
    }
}

#[cfg(test)]
#[path = "reconcile_tests.rs"]
mod tests;
