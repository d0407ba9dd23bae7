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
//!   and re-enrolling would cut its connections).
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
        }
    }

    /// A complete list of this node's pods (initial list or relist).
    pub fn pods_listed(&mut self, pods: Vec<PodView>) -> Changes {
        self.pods = pods.into_iter().map(|p| (p.uid.clone(), p)).collect();
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
            Want::Enrolled if is_enrolled => {}
            Want::Enrolled => {
                if pod.ips.is_empty() {
                    debug!(pod = %pod.name, namespace = %pod.namespace, "opted in but has no IP yet");
                    return;
                }
                let Some(netns) = self.locator.locate(uid) else {
                    debug!(pod = %pod.name, namespace = %pod.namespace, uid, "opted in but its network namespace is not found on this node yet");
                    return;
                };
                let spec = spec_of(pod, &self.settings.trust_domain, netns);
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
#[expect(clippy::unwrap_used, reason = "tests fail loudly on unexpected errors")]
mod tests {
    use std::sync::Mutex;

    use super::*;

    #[derive(Default)]
    struct Fake(Mutex<Vec<String>>);

    impl PodEnroller for Fake {
        fn enrolled(&self) -> Vec<String> {
            self.0.lock().unwrap().clone()
        }
        fn enroll(&self, spec: PodSpec) -> Result<(), String> {
            self.0.lock().unwrap().push(spec.uid);
            Ok(())
        }
        fn unenroll(&self, uid: &str) -> Result<(), String> {
            self.0.lock().unwrap().retain(|u| u != uid);
            Ok(())
        }
    }

    struct Everywhere;

    impl NetnsLocator for Everywhere {
        fn locate(&self, uid: &str) -> Option<PathBuf> {
            Some(PathBuf::from(format!("/var/run/netns/{uid}")))
        }
    }

    fn pod(uid: &str, ns: &str) -> PodView {
        PodView {
            uid: uid.into(),
            name: uid.into(),
            namespace: ns.into(),
            service_account: "default".into(),
            ips: vec![IpAddr::from([10, 0, 0, 1])],
            labels: BTreeMap::new(),
            annotations: BTreeMap::new(),
            host_network: false,
            finished: false,
            deleting: false,
        }
    }

    #[test]
    fn the_istio_dns_capture_annotation_reaches_the_pod_spec() {
        let mut view = pod("u1", "shop");
        assert_eq!(
            spec_of(&view, "cluster.local", "/x".into()).dns_capture,
            None
        );
        view.annotations.insert(
            crate::dns::DNS_CAPTURE_ANNOTATION.to_owned(),
            "false".to_owned(),
        );
        assert_eq!(
            spec_of(&view, "cluster.local", "/x".into()).dns_capture,
            Some(false)
        );
    }

    #[test]
    fn the_istio_bypass_inbound_capture_annotation_reaches_the_pod_spec() {
        let mut view = pod("u1", "shop");
        let spec = |view: &PodView| spec_of(view, "cluster.local", "/x".into());
        assert!(!spec(&view).exclusions.bypass_inbound);
        for (value, bypass) in [
            ("true", true),
            ("1", true),
            ("false", false),
            ("yes", false),
        ] {
            view.annotations.insert(
                crate::enroll::BYPASS_INBOUND_CAPTURE_ANNOTATION.to_owned(),
                value.to_owned(),
            );
            assert_eq!(spec(&view).exclusions.bypass_inbound, bypass, "{value}");
        }
    }

    #[test]
    fn the_fast_path_annotation_reaches_the_pod_spec() {
        let mut view = pod("u1", "shop");
        assert_eq!(spec_of(&view, "cluster.local", "/x".into()).fast_path, None);
        for (value, setting) in [("false", Some(false)), ("1", Some(true)), ("maybe", None)] {
            view.annotations.insert(
                crate::enroll::FAST_PATH_ANNOTATION.to_owned(),
                value.to_owned(),
            );
            assert_eq!(
                spec_of(&view, "cluster.local", "/x".into()).fast_path,
                setting,
                "{value}"
            );
        }
    }

    fn ambient() -> BTreeMap<String, String> {
        BTreeMap::from([(optin::DATAPLANE_MODE.to_owned(), "ambient".to_owned())])
    }

    fn reconciler(fake: &Arc<Fake>, grace: Duration) -> Reconciler {
        Reconciler::new(
            Arc::clone(fake) as Arc<dyn PodEnroller>,
            Arc::new(Everywhere),
            ReconcilerSettings {
                trust_domain: "cluster.local".into(),
                keep: HashSet::from(["kept".to_owned()]),
                unknown_grace: grace,
                rule: Arc::default(),
            },
        )
    }

    #[test]
    fn nothing_happens_before_both_lists() {
        let fake = Arc::new(Fake::default());
        fake.0.lock().unwrap().push("stale".into());
        let mut r = reconciler(&fake, Duration::ZERO);
        assert_eq!(r.pods_listed(vec![pod("a", "mesh")]), Changes::default());
        assert_eq!(fake.enrolled(), ["stale"]);
        let changes = r.namespaces_listed(vec![("mesh".into(), ambient())]);
        assert_eq!(changes.enrolled, ["a"]);
        assert_eq!(changes.unenrolled, ["stale"]);
    }

    #[test]
    fn unknown_pods_wait_out_the_grace_and_kept_ones_stay() {
        let fake = Arc::new(Fake::default());
        fake.0
            .lock()
            .unwrap()
            .extend(["fresh".to_owned(), "kept".to_owned()]);
        let mut r = reconciler(&fake, Duration::from_secs(3600));
        r.namespaces_listed(vec![]);
        r.pods_listed(vec![]);
        assert_eq!(r.reconcile_all(), Changes::default());
        assert_eq!(fake.enrolled(), ["fresh", "kept"]);
    }

    #[test]
    fn sidecar_pods_and_excluded_namespaces_are_left_out_or_taken_out() {
        let fake = Arc::new(Fake::default());
        let mut r = reconciler(&fake, Duration::ZERO);
        r.namespaces_listed(vec![
            ("mesh".into(), ambient()),
            ("kube-system".into(), ambient()),
        ]);
        let mut sidecar = pod("s", "mesh");
        sidecar
            .annotations
            .insert(optin::SIDECAR_STATUS.to_owned(), "{}".to_owned());
        let changes = r.pods_listed(vec![pod("a", "mesh"), sidecar, pod("k", "kube-system")]);
        assert_eq!(changes.enrolled, ["a"]);
        // One enrolled before it was injected (by hand, or an older rule)
        // is taken out.
        fake.0.lock().unwrap().push("k".into());
        assert_eq!(r.reconcile_all().unenrolled, ["k"]);
    }

    #[test]
    fn terminating_pods_keep_their_capture_and_finished_ones_lose_it() {
        let fake = Arc::new(Fake::default());
        let mut r = reconciler(&fake, Duration::ZERO);
        r.namespaces_listed(vec![("mesh".into(), ambient())]);
        r.pods_listed(vec![pod("a", "mesh"), pod("b", "mesh")]);
        let mut deleting = pod("a", "mesh");
        deleting.deleting = true;
        assert_eq!(r.pod_applied(deleting), Changes::default());
        let mut done = pod("b", "mesh");
        done.finished = true;
        assert_eq!(r.pod_applied(done).unenrolled, ["b"]);
        assert_eq!(fake.enrolled(), ["a"]);
        // The namespace opting out takes its pods out.
        assert_eq!(
            r.namespace_applied("mesh".into(), BTreeMap::new()),
            Changes::default(),
            "a deleting pod is left alone"
        );
    }
}
