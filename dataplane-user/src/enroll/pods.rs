//! The enrolled pods of one agent instance and every step that puts a pod
//! in the mesh or takes it out. Only the enrollment actor
//! ([`super::actor`]) holds an [`Enrollments`]; its methods block (key
//! generation, namespace entry, map writes, file writes) and never run on
//! the engine's async worker threads.

use std::{
    collections::{HashMap, VecDeque},
    os::fd::AsFd as _,
    path::Path,
    sync::Arc,
};

use tracing::{info, warn};

use super::{
    DepartedPod, EnrollError, PodSpec, PodStatus, StateFile,
    external::{ExternalEngine, external_status},
    netns_checks::{netns_still_there, refuse_host_netns},
    serving::Serving,
    spec::{DEPARTED_KEPT, validate},
};
use crate::{
    dns::{DnsSettings, PodDns},
    identity::Identity,
    mesh::MeshContext,
    proxy::{
        PodListeners, PodNetns,
        original_source::{OriginalSource, PodOriginalSource},
    },
    redirect::{PinLayout, PodCapture, RedirectError, Redirector},
};

mod restart;

/// One pod in the mesh.
pub(super) struct EnrolledPod {
    pub(super) spec: PodSpec,
    pub(super) cookie: u64,
    pub(super) netns: PodNetns,
    /// This agent's engine or an external proxy.
    pub(super) serving: Serving,
    /// Its DNS resolver, when its DNS is captured.
    pub(super) dns: Option<PodDns>,
    pub(super) original: PodOriginalSource,
}

/// Engine settings every enrolled pod shares.
#[derive(Debug)]
pub struct EngineSettings {
    /// Socket mark of the engine's own sockets.
    pub proxy_mark: u32,
    /// Connect to apps from their clients' addresses; `None` = off.
    pub original_source: Option<OriginalSource>,
    /// Mesh-wide state (workloads, certificates, TLS).
    pub mesh: Arc<MeshContext>,
    /// DNS capture settings; `None` when pods' DNS is never captured
    /// (iptables capture).
    pub dns: Option<Arc<DnsSettings>>,
    /// `--engine ztunnel`: a stock ztunnel serves the pods, fed over ZDS.
    pub external: Option<ExternalEngine>,
    /// The threads pods' connections run on.
    pub workers: Arc<crate::workers::Workers>,
    /// Whether pods' listeners use IPv6 (`--ipv6-enabled`): see
    /// [`PodListeners::create`].
    pub ipv6: bool,
}

/// Every pod this agent instance has enrolled, and the kernel programs
/// that capture them.
pub struct Enrollments {
    /// `None` under iptables capture (`--capture iptables`): pods get their
    /// listeners but nothing is registered with kernel programs.
    pub(super) redirector: Option<Redirector>,
    pub(super) pins: PinLayout,
    pub(super) settings: EngineSettings,
    state: StateFile,
    pub(super) pods: HashMap<String, EnrolledPod>,
    /// Pods recently unenrolled or refused, newest last, for `status`.
    departed: VecDeque<DepartedPod>,
    /// Listening sockets a previous agent handed over, by pod uid, with
    /// the cookie of the namespace they live in: used (instead of new
    /// ones) when that pod is re-adopted.
    handed: HashMap<String, (u64, PodListeners)>,
}

/// A pod's listening sockets, offered to a new agent taking over.
#[derive(Debug)]
pub struct OfferedPod {
    /// The pod as enrolled.
    pub status: PodStatus,
    /// `(device, inode)` of its network namespace.
    pub netns_identity: (u64, u64),
    /// Duplicates of the sockets its engine serves.
    pub listeners: PodListeners,
}

/// A pod received from the agent this one takes over from.
#[derive(Debug)]
pub struct HandedPod {
    /// The pod as the previous agent enrolled it.
    pub status: PodStatus,
    /// Its listening sockets, when every one passed the checks; `None`
    /// makes re-adoption create new ones.
    pub listeners: Option<PodListeners>,
}

impl std::fmt::Debug for Enrollments {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Enrollments")
            .field("pods", &self.pods.keys().collect::<Vec<_>>())
            .finish()
    }
}

/// A pod's new engine, built and serving, before the kernel is pointed at
/// it.
pub(super) struct Prepared {
    pub(super) cookie: u64,
    pub(super) netns: PodNetns,
    pub(super) serving: Serving,
    pub(super) dns: Option<PodDns>,
    pub(super) original: PodOriginalSource,
}

impl Enrollments {
    /// A manager with no pods yet; call [`Enrollments::readopt`] next.
    /// Without a redirector (iptables capture) enrolling only creates and
    /// serves the in-pod listeners.
    pub fn new(
        redirector: Option<Redirector>,
        pins: PinLayout,
        settings: EngineSettings,
        state: StateFile,
    ) -> Self {
        Self {
            redirector,
            pins,
            settings,
            state,
            pods: HashMap::new(),
            departed: VecDeque::new(),
            handed: HashMap::new(),
        }
    }

    /// Enrolls `spec`. Enrolling the same pod again is a no-op; enrolling a
    /// changed spec under the same uid re-enrolls it make-before-break (the
    /// new certificate, listeners and engine are ready before the old
    /// engine stops), except a change of exclusions alone, applied to the
    /// kernel in place (`enroll/exclusions.rs`). A failure is remembered
    /// for `status`.
    pub fn add(&mut self, spec: PodSpec) -> Result<PodStatus, EnrollError> {
        let who = (spec.uid.clone(), spec.name.clone(), spec.namespace.clone());
        let result = self.add_inner(spec);
        match &result {
            Ok(_) => self.departed.retain(|d| d.uid != who.0),
            Err(err) => {
                let reason = format!("enrollment failed: {}", crate::logging::Chain(err));
                self.note_departed(who, reason);
            }
        }
        result
    }

    /// Pods recently unenrolled or refused (oldest first) and why, except
    /// those enrolled again since.
    pub fn departed(&self) -> Vec<DepartedPod> {
        self.departed.iter().cloned().collect()
    }

    fn note_departed(&mut self, (uid, name, namespace): (String, String, String), reason: String) {
        self.departed.retain(|d| d.uid != uid);
        if self.departed.len() == DEPARTED_KEPT {
            self.departed.pop_front();
        }
        let at = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        self.departed.push_back(DepartedPod {
            uid,
            name,
            namespace,
            reason,
            at,
        });
    }

    fn add_inner(&mut self, spec: PodSpec) -> Result<PodStatus, EnrollError> {
        validate(&spec)?;
        if let Some(existing) = self.pods.get(&spec.uid)
            && existing.spec == spec
        {
            return Ok(status_of(existing));
        }
        if let Some(status) = self.update_exclusions(&spec)? {
            return Ok(status);
        }
        let previous = self.pods.get(&spec.uid);
        let netns_err = |source| EnrollError::Netns {
            uid: spec.uid.clone(),
            path: spec.netns.clone(),
            source,
        };
        if let Some((ip, owner)) = self.ip_owner(&spec) {
            return Err(EnrollError::IpTaken {
                uid: spec.uid.clone(),
                ip,
                owner,
            });
        }
        let netns = PodNetns::open(&spec.netns).map_err(netns_err)?;
        refuse_host_netns(&spec, &netns)?;
        let cookie = netns.cookie().map_err(netns_err)?;
        if let Some(other) = self
            .pods
            .values()
            .find(|p| p.cookie == cookie && p.spec.uid != spec.uid)
        {
            return Err(EnrollError::NetnsTaken {
                path: spec.netns.clone(),
                other: other.spec.uid.clone(),
            });
        }
        // The same namespace keeps its listening sockets: the new engine
        // serves duplicates of them, so the ports never close.
        let handed = self
            .handed
            .remove(&spec.uid)
            .filter(|(handed_cookie, _)| *handed_cookie == cookie);
        let mut prepared = if self.settings.external.is_some() {
            self.prepare_external(&spec, netns, cookie)?
        } else {
            let kept = previous
                .filter(|old| old.cookie == cookie)
                .and_then(|old| old.serving.listeners());
            let listeners = match (kept, handed) {
                (Some(kept), _) => kept.try_clone().map_err(netns_err)?,
                (None, Some((_, listeners))) => listeners,
                (None, None) => PodListeners::create(&netns, self.settings.ipv6)?,
            };
            self.prepare(&spec, netns, cookie, listeners)?
        };
        if let Some(old) = previous
            && old.cookie == cookie
        {
            // Only the first installation in a namespace saw the setting
            // as it was before us.
            prepared.original.installed.set_sysctls |= old.original.installed.set_sysctls;
        }
        let old = self.pods.remove(&spec.uid);
        if let Some(old) = &old
            && old.cookie != cookie
        {
            // Another namespace under the same uid: the old one's kernel
            // state goes first, as it may hold the same pod IPs.
            self.with_redirector(|r| r.unenroll_pod(old.cookie))?;
        }
        if let Err(err) = self.capture(&spec, &prepared) {
            // The new engine goes with `prepared`. In the same namespace the
            // old engine still serves the same sockets and stays enrolled;
            // an old namespace was already released above.
            match old {
                Some(old) if old.cookie == cookie => {
                    self.pods.insert(old.spec.uid.clone(), old);
                }
                Some(old) => {
                    prepared.original.tear_down(&prepared.netns);
                    old.original.tear_down(&old.netns);
                    let old_identity = old.serving.identity().cloned();
                    old.serving.stop();
                    self.forget_identity_if_unused(old_identity.as_ref(), None);
                    self.persist()?;
                }
                None => prepared.original.tear_down(&prepared.netns),
            }
            return Err(err);
        }
        if let Some(old) = old {
            let old_identity = old.serving.identity().cloned();
            if old.cookie == cookie {
                // The new engine serves the same sockets: the old one only
                // stops accepting, and what it accepted (even mid-handshake)
                // finishes on it instead of being reset.
                info!(pod = %spec.name, namespace = %spec.namespace, uid = %spec.uid, "pod re-enrolled; previous engine hands over and drains");
                let retired = old.serving.retire(self.settings.mesh.drain_timeout);
                prepared.serving.keep_retired(retired);
            } else {
                info!(pod = %spec.name, namespace = %spec.namespace, uid = %spec.uid, "pod re-enrolled in another namespace; previous engine stopped");
                old.original.tear_down(&old.netns);
                old.serving.stop();
            }
            self.forget_identity_if_unused(old_identity.as_ref(), prepared.serving.identity());
        }
        info!(pod = %spec.name, namespace = %spec.namespace, uid = %spec.uid, netns_cookie = cookie, ips = ?spec.ips, "pod enrolled");
        let pod = EnrolledPod {
            spec,
            cookie,
            netns: prepared.netns,
            serving: prepared.serving,
            dns: prepared.dns,
            original: prepared.original,
        };
        let uid = pod.spec.uid.clone();
        let external = matches!(pod.serving, Serving::External(_));
        self.pods.insert(uid.clone(), pod);
        self.persist()?;
        if external {
            self.hand_to_ztunnel(&uid);
        }
        self.pods
            .get(&uid)
            .map(status_of)
            .ok_or(EnrollError::Invalid {
                uid,
                reason: "the pod vanished while it was being enrolled".into(),
            })
    }

    /// An IP of `spec` that another enrolled pod already owns, and that
    /// pod's uid.
    fn ip_owner(&self, spec: &PodSpec) -> Option<(std::net::IpAddr, String)> {
        let wanted: Vec<_> = spec.ips.iter().map(|ip| ip.to_canonical()).collect();
        self.pods
            .values()
            .filter(|p| p.spec.uid != spec.uid)
            .find_map(|p| {
                p.spec
                    .ips
                    .iter()
                    .map(|ip| ip.to_canonical())
                    .find(|ip| wanted.contains(ip))
                    .map(|ip| (ip, p.spec.uid.clone()))
            })
    }

    /// Points the kernel programs at the prepared engine's listeners.
    fn capture(&mut self, spec: &PodSpec, prepared: &Prepared) -> Result<(), EnrollError> {
        let listeners = match &prepared.serving {
            Serving::Builtin(pod) => &pod.listeners,
            Serving::External(_) => return self.capture_external(spec, prepared),
        };
        let capture = PodCapture {
            netns_cookie: prepared.cookie,
            netns: prepared.netns.fd(),
            ips: &spec.ips,
            node_addr: spec.node_addr,
            exclusions: &spec.exclusions,
            inbound_listener: listeners.inbound.as_fd(),
            hbone_listener: listeners.hbone.as_fd(),
            dns_capture: prepared.dns.is_some(),
        };
        Ok(self.with_redirector(|r| r.enroll_pod(&capture))?)
    }

    /// Unenrolls the pod with this uid. Returns whether it was enrolled.
    pub fn remove(&mut self, uid: &str) -> Result<bool, EnrollError> {
        self.remove_because(
            uid,
            "unenrolled on request (CNI DEL, `dataplane pod remove` or the Kubernetes reconciler)",
        )
    }

    /// Unenrolls the pod with this uid, remembering `reason` for `status`.
    pub fn remove_because(&mut self, uid: &str, reason: &str) -> Result<bool, EnrollError> {
        let Some(pod) = self.pods.remove(uid) else {
            return Ok(false);
        };
        let who = (
            pod.spec.uid.clone(),
            pod.spec.name.clone(),
            pod.spec.namespace.clone(),
        );
        self.note_departed(who, reason.to_owned());
        let identity = pod.serving.identity().cloned();
        if matches!(pod.serving, Serving::External(_)) {
            self.release_external(&pod)?;
        } else {
            self.with_redirector(|r| r.unenroll_pod(pod.cookie))?;
        }
        pod.serving.stop();
        pod.original.tear_down(&pod.netns);
        self.forget_identity_if_unused(identity.as_ref(), None);
        info!(pod = %pod.spec.name, namespace = %pod.spec.namespace, uid, "pod unenrolled");
        self.persist()?;
        Ok(true)
    }

    /// Stops rotating the certificate of `identity` when no enrolled pod
    /// (nor `keep`, the identity about to be used) has it any more.
    fn forget_identity_if_unused(&self, identity: Option<&Identity>, keep: Option<&Identity>) {
        let Some(identity) = identity else {
            return;
        };
        if keep == Some(identity)
            || self
                .pods
                .values()
                .any(|p| p.serving.identity() == Some(identity))
        {
            return;
        }
        if self.settings.mesh.certs.forget(identity) {
            info!(identity = %identity.to_uri(), "certificate no longer used; rotation stopped");
        }
    }

    /// Unenrolls the pod enrolled with this netns path, if any.
    pub fn remove_by_netns(&mut self, netns: &Path) -> Result<Option<String>, EnrollError> {
        let uid = self
            .pods
            .values()
            .find(|p| p.spec.netns == netns)
            .map(|p| p.spec.uid.clone());
        match uid {
            Some(uid) => self.remove(&uid).map(|_| Some(uid)),
            None => Ok(None),
        }
    }

    /// Every enrolled pod, by uid.
    pub fn list(&self) -> Vec<PodStatus> {
        let mut pods: Vec<PodStatus> = self.pods.values().map(status_of).collect();
        pods.sort_by(|a, b| a.spec.uid.cmp(&b.spec.uid));
        pods
    }

    /// Unenrolls pods whose network namespace is gone (its path removed, or
    /// now naming another namespace). Returns their uids.
    pub fn reap_vanished(&mut self) -> Vec<String> {
        let vanished: Vec<String> = self
            .pods
            .values()
            .filter(|p| !netns_still_there(&p.netns))
            .map(|p| p.spec.uid.clone())
            .collect();
        for uid in &vanished {
            info!(uid, "pod network namespace disappeared; unenrolling");
            if let Err(err) = self.remove_because(uid, "its network namespace is gone") {
                warn!(uid, error = %crate::logging::Chain(&err), "cleanup of a vanished pod failed");
            }
        }
        vanished
    }

    pub(super) fn persist(&self) -> Result<(), EnrollError> {
        Ok(self.state.save(&self.list())?)
    }

    /// Runs `f` on the redirector; without one (iptables capture) there is
    /// no kernel state, and the answer is `T::default()`.
    pub(super) fn with_redirector<T: Default>(
        &mut self,
        f: impl FnOnce(&mut Redirector) -> Result<T, RedirectError>,
    ) -> Result<T, RedirectError> {
        match self.redirector.as_mut() {
            Some(redirector) => f(redirector),
            None => Ok(T::default()),
        }
    }
}

pub(super) fn status_of(pod: &EnrolledPod) -> PodStatus {
    PodStatus {
        spec: pod.spec.clone(),
        netns_cookie: pod.cookie,
        dns_capture: pod.dns.is_some(),
        original_source: pod.original.routing.is_some(),
        original_source_error: pod.original.error.clone(),
        worker: match &pod.serving {
            Serving::Builtin(builtin) => builtin.engine.worker(),
            Serving::External(_) => None,
        },
        external: match &pod.serving {
            Serving::External(ext) => Some(external_status(ext)),
            Serving::Builtin(_) => None,
        },
    }
}
