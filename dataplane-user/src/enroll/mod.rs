//! Enrollment: putting a pod in the mesh and taking it out again.
//!
//! Enrolling = create the engine's listeners inside the pod's network
//! namespace, register them and the pod's addresses and exclusions with the
//! kernel programs (which attaches the per-namespace `sk_lookup` program and
//! marks the namespace enrolled), start serving, and record the pod in the
//! instance's state file so a restarted agent re-adopts it. Unenrolling undoes
//! all of it. Both are idempotent.

mod state;

use std::{
    collections::{HashMap, VecDeque},
    net::IpAddr,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
};

use serde::{Deserialize, Serialize};
use tracing::{info, warn};

pub use state::StateFile;

use crate::{
    hbone::HbonePool,
    identity::{Identity, IdentityError},
    mesh::MeshContext,
    proxy::{
        EngineError, PodContext, PodEngine, PodIdentity, PodListeners, PodNetns, PodTlsDialer,
    },
    redirect::{Exclusions, OrigDstTable, PinLayout, PodCapture, RedirectError, Redirector},
    tls,
};

/// Errors enrolling or unenrolling a pod.
#[derive(Debug, thiserror::Error)]
pub enum EnrollError {
    /// The request is malformed.
    #[error("invalid pod {uid}: {reason}")]
    Invalid {
        /// The pod's uid.
        uid: String,
        /// What is wrong.
        reason: String,
    },
    /// The pod's network namespace cannot be used.
    #[error("cannot use network namespace {path} of pod {uid}")]
    Netns {
        /// The pod's uid.
        uid: String,
        /// The namespace path.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// Another pod already owns this network namespace.
    #[error("network namespace {path} is already enrolled as pod {other}; remove that pod first")]
    NetnsTaken {
        /// The namespace path.
        path: PathBuf,
        /// The uid of the pod that owns it.
        other: String,
    },
    /// The in-pod listeners could not be created.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// The kernel programs refused the registration.
    #[error(transparent)]
    Redirect(#[from] RedirectError),
    /// The state file could not be written.
    #[error(transparent)]
    State(#[from] state::StateError),
    /// The pod's certificate or TLS configuration could not be made.
    #[error("cannot set up the identity of pod {uid}")]
    Identity {
        /// The pod's uid.
        uid: String,
        /// What failed.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// Starting the listeners' tasks failed.
    #[error("cannot start serving pod {uid}")]
    Serve {
        /// The pod's uid.
        uid: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

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
}

struct EnrolledPod {
    spec: PodSpec,
    cookie: u64,
    netns: PodNetns,
    engine: PodEngine,
}

/// Engine settings every enrolled pod shares.
#[derive(Debug, Clone)]
pub struct EngineSettings {
    /// Socket mark of the engine's own sockets.
    pub proxy_mark: u32,
    /// Mesh-wide state (workloads, certificates, TLS).
    pub mesh: Arc<MeshContext>,
}

/// Every pod this agent instance has enrolled.
pub struct Enrollments {
    /// `None` under iptables capture (`--capture iptables`): pods get their
    /// listeners but nothing is registered with kernel programs.
    redirector: Option<Arc<Mutex<Redirector>>>,
    pins: PinLayout,
    settings: EngineSettings,
    state: StateFile,
    pods: HashMap<String, EnrolledPod>,
    /// Pods recently unenrolled or refused, newest last, for `status`.
    departed: VecDeque<DepartedPod>,
}

/// How many departed pods `status` remembers.
const DEPARTED_KEPT: usize = 64;

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

impl std::fmt::Debug for Enrollments {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Enrollments")
            .field("pods", &self.pods.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl Enrollments {
    /// A manager with no pods yet; call [`Enrollments::readopt`] next.
    /// Without a redirector (iptables capture) enrolling only creates and
    /// serves the in-pod listeners.
    pub fn new(
        redirector: Option<Arc<Mutex<Redirector>>>,
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
        }
    }

    /// Re-adopts the pods a previous agent of this instance enrolled: those
    /// whose namespace still exists get listeners again; the kernel state of
    /// the others is removed. Returns how many pods were re-adopted.
    pub fn readopt(&mut self) -> Result<usize, EnrollError> {
        let recorded = self.state.load()?;
        let mut adopted = 0;
        for status in recorded {
            let uid = status.spec.uid.clone();
            let still_there = PodNetns::open(&status.spec.netns)
                .and_then(|ns| ns.cookie())
                .is_ok_and(|cookie| cookie == status.netns_cookie);
            if !still_there {
                info!(pod = %uid, netns = %status.spec.netns.display(), "network namespace gone while the agent was down; removing");
                self.with_redirector(|r| r.unenroll_pod(status.netns_cookie))?;
                continue;
            }
            match self.add(status.spec) {
                Ok(_) => adopted += 1,
                Err(err) => {
                    warn!(pod = %uid, error = %crate::logging::Chain(&err), "cannot re-adopt pod")
                }
            }
        }
        // Kernel entries no state file knows about belong to nobody.
        let known: Vec<u64> = self.pods.values().map(|p| p.cookie).collect();
        let enrolled = self.with_redirector(|r| r.enrolled_cookies())?;
        for cookie in enrolled.into_iter().filter(|c| !known.contains(c)) {
            info!(
                netns_cookie = cookie,
                "removing kernel state of an unknown pod"
            );
            self.with_redirector(|r| r.unenroll_pod(cookie))?;
        }
        self.persist()?;
        Ok(adopted)
    }

    /// Enrolls `spec`. Enrolling the same pod again is a no-op; enrolling a
    /// changed spec under the same uid re-enrolls it. A failure is
    /// remembered for `status`.
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
        if let Some(existing) = self.pods.get(&spec.uid) {
            if existing.spec == spec {
                return Ok(status_of(existing));
            }
            self.remove(&spec.uid)?;
        }
        let identity_err =
            |source: Box<dyn std::error::Error + Send + Sync>| EnrollError::Identity {
                uid: spec.uid.clone(),
                source,
            };
        let spiffe = spec.identity().map_err(|e| identity_err(Box::new(e)))?;
        let mesh = Arc::clone(&self.settings.mesh);
        // Issue now: a pod is only enrolled once it can prove who it is.
        mesh.certs
            .get_or_issue(&spiffe)
            .map_err(|e| identity_err(Box::new(e)))?;
        let server_tls = tls::server_config(
            mesh.certs.resolver(spiffe.clone()),
            Arc::clone(&mesh.roots),
            &mesh.trust_domain,
        )
        .map_err(|e| identity_err(Box::new(e)))?;
        let netns_err = |source| EnrollError::Netns {
            uid: spec.uid.clone(),
            path: spec.netns.clone(),
            source,
        };
        let netns = PodNetns::open(&spec.netns).map_err(netns_err)?;
        let cookie = netns.cookie().map_err(netns_err)?;
        if let Some(other) = self.pods.values().find(|p| p.cookie == cookie) {
            return Err(EnrollError::NetnsTaken {
                path: spec.netns.clone(),
                other: other.spec.uid.clone(),
            });
        }
        let listeners = PodListeners::create(&netns)?;
        {
            use std::os::fd::AsFd as _;
            let capture = PodCapture {
                netns_cookie: cookie,
                netns: netns.fd(),
                ips: &spec.ips,
                node_addr: spec.node_addr,
                exclusions: &spec.exclusions,
                inbound_listener: listeners.inbound.as_fd(),
                hbone_listener: listeners.hbone.as_fd(),
            };
            self.with_redirector(|r| r.enroll_pod(&capture))?;
        }
        let serve_err = |source| EnrollError::Serve {
            uid: spec.uid.clone(),
            source,
        };
        let table = match self.redirector {
            Some(_) => Some(OrigDstTable::open(&self.pins)?),
            None => None,
        };
        let pool = HbonePool::new(
            PodTlsDialer {
                netns: netns.clone(),
                mark: self.settings.proxy_mark,
                mesh: Arc::clone(&mesh),
            },
            mesh.pool_idle_timeout,
        );
        let ctx = Arc::new(PodContext {
            identity: PodIdentity {
                uid: spec.uid.clone(),
                name: spec.name.clone(),
                namespace: spec.namespace.clone(),
            },
            peer: Arc::new(crate::telemetry::Peer {
                workload: Some(spec.name.clone()),
                namespace: Some(spec.namespace.clone()),
                principal: Some(spiffe.to_uri()),
            }),
            spiffe,
            ips: spec.ips.clone(),
            netns: netns.clone(),
            mark: self.settings.proxy_mark,
            mesh,
            pool,
            server_tls,
        });
        let engine = match PodEngine::start(ctx, listeners, table) {
            Ok(engine) => engine,
            Err(err) => {
                let _ = self.with_redirector(|r| r.unenroll_pod(cookie));
                return Err(serve_err(err));
            }
        };
        info!(pod = %spec.name, namespace = %spec.namespace, uid = %spec.uid, netns_cookie = cookie, ips = ?spec.ips, "pod enrolled");
        let pod = EnrolledPod {
            spec,
            cookie,
            netns,
            engine,
        };
        let status = status_of(&pod);
        self.pods.insert(pod.spec.uid.clone(), pod);
        self.persist()?;
        Ok(status)
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
        pod.engine.stop();
        self.with_redirector(|r| r.unenroll_pod(pod.cookie))?;
        info!(pod = %pod.spec.name, namespace = %pod.spec.namespace, uid, "pod unenrolled");
        self.persist()?;
        Ok(true)
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

    /// Stops every pod's listeners (the agent is stopping). Kernel state is
    /// left to the redirector's exit mode; the state file keeps the pods so
    /// the next agent re-adopts them.
    pub fn stop_serving(&mut self) {
        for (_, pod) in self.pods.drain() {
            pod.engine.stop();
        }
    }

    /// Forgets the state file (kernel state is being removed too).
    pub fn clear_state(&self) -> Result<(), EnrollError> {
        Ok(self.state.remove()?)
    }

    fn persist(&self) -> Result<(), EnrollError> {
        Ok(self.state.save(&self.list())?)
    }

    /// Runs `f` on the redirector; without one (iptables capture) there is
    /// no kernel state, and the answer is `T::default()`.
    fn with_redirector<T: Default>(
        &self,
        f: impl FnOnce(&mut Redirector) -> Result<T, RedirectError>,
    ) -> Result<T, RedirectError> {
        let Some(redirector) = &self.redirector else {
            return Ok(T::default());
        };
        // A poisoned lock only means another thread panicked mid-update;
        // the maps themselves are consistent per syscall.
        let mut guard = match redirector.lock() {
            Ok(guard) => guard,
            Err(poisoned) => poisoned.into_inner(),
        };
        f(&mut guard)
    }
}

fn status_of(pod: &EnrolledPod) -> PodStatus {
    PodStatus {
        spec: pod.spec.clone(),
        netns_cookie: pod.cookie,
    }
}

fn validate(spec: &PodSpec) -> Result<(), EnrollError> {
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

/// Whether the path still names the namespace we hold open.
fn netns_still_there(netns: &PodNetns) -> bool {
    use std::os::unix::fs::MetadataExt as _;
    let Ok(held) = netns.identity() else {
        return false;
    };
    std::fs::metadata(netns.path()).is_ok_and(|m| (m.dev(), m.ino()) == held)
}
