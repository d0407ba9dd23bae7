//! Pods served by a stock Istio ztunnel (`--engine ztunnel`): this agent
//! plays istio-cni's node agent. It captures the pod with its kernel
//! programs (no iptables), installs the in-pod routing that ztunnel's
//! transparent connections to the app need, and hands the pod's network
//! namespace to ztunnel over ZDS ([`crate::zds`]). Once ztunnel
//! acknowledges (its listeners in the pod are bound), the agent copies
//! ztunnel's inbound listeners out of its process and points `sk_lookup`
//! at them ([`crate::redirect::ExternalListeners`]).
//!
//! The acknowledgement of a live enrollment is awaited on the enrollment
//! thread (as istio-cni's CNI ADD waits for it), bounded by the ack
//! timeout; acknowledgements that come later (a snapshot after ztunnel
//! restarts, a retry after ztunnel refused) arrive as events from the ZDS
//! server ([`ZtunnelEvents`]) and are handled on the same thread.
//!
//! Failure semantics: until ztunnel serves a pod, and from the moment a
//! ztunnel connection ends, the pod's inbound connections meet the agent's
//! fail-open/fail-closed setting and its outbound connections are refused
//! (fail-closed) or let through (fail-open). While the agent is down the
//! kernel keeps pointing at ztunnel's sockets: nothing changes for traffic.

use std::{
    os::fd::AsFd as _,
    sync::{Arc, OnceLock},
};

use tracing::{info, warn};

use super::{
    EnrollError, Enroller, ExternalStatus, PodSpec,
    pods::{EnrolledPod, Enrollments, Prepared},
    serving::{ExternalPod, Serving},
};
use crate::{
    logging::Chain,
    proxy::{PodNetns, original_source::PodOriginalSource},
    redirect::{ExternalListeners, ExternalPodCapture},
    zds::{
        AddOutcome, ZdsConfig, ZdsError, ZdsHandle, ZdsObserver, ZdsPod, ZdsServer, ZtunnelPeer,
    },
};

/// What happened on a ztunnel connection, for the enrollment thread.
#[derive(Debug, Clone)]
pub enum ZtunnelEvent {
    /// ztunnel acknowledged pod `uid`: its listeners there exist.
    Acked {
        /// The pod.
        uid: String,
        /// The ztunnel that acknowledged.
        peer: ZtunnelPeer,
    },
    /// A ztunnel connection ended: its listeners may be gone.
    Disconnected(ZtunnelPeer),
    /// ztunnel refused pod `uid` (it is retried).
    Refused {
        /// The pod.
        uid: String,
        /// What ztunnel said, with the attempts so far.
        problem: String,
    },
}

/// Forwards the ZDS server's events to the enrollment actor.
#[derive(Debug, Default)]
pub struct ZtunnelEvents {
    enroller: OnceLock<Enroller>,
    /// The ZDS server's handle, once it runs (for its status on scrapes).
    server: OnceLock<ZdsHandle>,
}

impl ZtunnelEvents {
    /// Events go to `enroller` from now on (before: dropped, as no pod can
    /// be acknowledged before the server starts).
    pub fn connect(&self, enroller: Enroller) {
        let _ = self.enroller.set(enroller);
    }

    /// The ZDS server's pods and connections, once it runs.
    pub fn status(&self) -> Option<crate::zds::ZdsStatus> {
        self.server.get().map(ZdsHandle::status)
    }

    fn forward(&self, event: ZtunnelEvent) {
        if let Some(enroller) = self.enroller.get() {
            enroller.notify_ztunnel(event);
        }
    }
}

impl ZdsObserver for ZtunnelEvents {
    fn acked(&self, uid: &str, peer: &ZtunnelPeer) {
        self.forward(ZtunnelEvent::Acked {
            uid: uid.to_owned(),
            peer: *peer,
        });
    }

    fn disconnected(&self, peer: &ZtunnelPeer) {
        self.forward(ZtunnelEvent::Disconnected(*peer));
    }

    fn refused(&self, uid: &str, peer: &ZtunnelPeer, error: &str, attempts: u32) {
        self.forward(ZtunnelEvent::Refused {
            uid: uid.to_owned(),
            problem: format!(
                "ztunnel (pid {}) refused the pod: {error} ({attempts} attempts; retrying)",
                peer.pid
            ),
        });
    }
}

/// The ZDS side of `--engine ztunnel`.
pub struct ExternalEngine {
    config: ZdsConfig,
    events: Arc<ZtunnelEvents>,
    /// `None` until [`Enrollments::start_ztunnel_server`]: pods enrolled
    /// before (re-adopted at start) go into the first snapshot.
    server: Option<ZdsServer>,
}

impl std::fmt::Debug for ExternalEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExternalEngine")
            .field("socket", &self.config.socket)
            .field("serving", &self.server.is_some())
            .finish()
    }
}

impl ExternalEngine {
    /// The ZDS server to start on `config`, telling `events`.
    pub fn new(config: ZdsConfig, events: Arc<ZtunnelEvents>) -> Self {
        Self {
            config,
            events,
            server: None,
        }
    }

    fn handle(&self) -> Option<ZdsHandle> {
        self.server.as_ref().map(ZdsServer::handle)
    }
}

/// The pod as ztunnel is told of it.
fn zds_pod(spec: &PodSpec, netns: &PodNetns) -> Result<ZdsPod, EnrollError> {
    let netns_fd = netns
        .fd()
        .try_clone_to_owned()
        .map_err(|source| EnrollError::Netns {
            uid: spec.uid.clone(),
            path: spec.netns.clone(),
            source,
        })?;
    Ok(ZdsPod {
        uid: spec.uid.clone(),
        name: spec.name.clone(),
        namespace: spec.namespace.clone(),
        service_account: spec.service_account.clone(),
        ips: spec.ips.clone(),
        netns: netns_fd,
    })
}

impl Enrollments {
    /// The in-pod routing ztunnel's transparent connections to the app
    /// need; nothing else is created in the pod (ztunnel opens its own
    /// listeners).
    pub(super) fn prepare_external(
        &self,
        spec: &PodSpec,
        netns: PodNetns,
        cookie: u64,
    ) -> Result<Prepared, EnrollError> {
        let original = PodOriginalSource::set_up(self.settings.original_source.as_ref(), &netns)
            .map_err(|source| EnrollError::OriginalSource {
                uid: spec.uid.clone(),
                source,
            })?;
        Ok(Prepared {
            cookie,
            netns,
            serving: Serving::External(ExternalPod::default()),
            dns: None,
            original,
        })
    }

    /// Captures the pod for ztunnel: everything but the inbound listeners,
    /// which come from ztunnel once it acknowledges.
    pub(super) fn capture_external(
        &mut self,
        spec: &PodSpec,
        prepared: &Prepared,
    ) -> Result<(), EnrollError> {
        let dns_capture = self
            .settings
            .dns
            .as_ref()
            .is_some_and(|dns| dns.captures(spec.dns_capture));
        let capture = ExternalPodCapture {
            netns_cookie: prepared.cookie,
            netns: prepared.netns.fd(),
            ips: &spec.ips,
            node_addr: spec.node_addr,
            exclusions: &spec.exclusions,
            dns_capture,
        };
        Ok(self.with_redirector(|r| r.enroll_external_pod(&capture))?)
    }

    /// Hands the enrolled pod `uid` to ztunnel and, once it acknowledges,
    /// points the kernel at its listeners. ztunnel's refusal, its absence
    /// or its silence leave the pod enrolled and not served, with the
    /// reason in `status`; the ZDS server retries and sends it again to
    /// the next ztunnel that connects.
    pub(super) fn hand_to_ztunnel(&mut self, uid: &str) {
        let Some(zds) = self
            .settings
            .external
            .as_ref()
            .and_then(ExternalEngine::handle)
        else {
            return;
        };
        let Some(pod) = self.pods.get(uid) else {
            return;
        };
        let outcome = zds_pod(&pod.spec, &pod.netns).and_then(|pod| {
            on_runtime(async move { zds.add(pod).await }).map_err(|source| EnrollError::Ztunnel {
                what: "hand the pod to ztunnel",
                source,
            })
        });
        let problem = match outcome {
            Ok(AddOutcome::Acked { peer }) => return self.ztunnel_acked(uid, peer),
            Ok(AddOutcome::NoZtunnel) => {
                "no ztunnel is connected to the ZDS socket; it gets the pod when it connects"
                    .to_owned()
            }
            Ok(AddOutcome::Nacked { error }) => {
                format!("ztunnel refused the pod: {error} (retrying)")
            }
            Ok(AddOutcome::TimedOut) => {
                "ztunnel did not acknowledge the pod in time (retrying)".to_owned()
            }
            Ok(AddOutcome::ConnectionLost { reason }) => {
                format!("the ztunnel connection ended: {reason}")
            }
            Err(err) => Chain(&err).to_string(),
        };
        warn!(uid, problem, "pod enrolled but not served by ztunnel yet");
        self.set_external(uid, None, Some(problem));
    }

    /// ztunnel (`peer`) acknowledged pod `uid`: copy its listeners there
    /// and point the kernel at them. An acknowledgement from the
    /// connection whose listeners are already in place changes nothing.
    pub(super) fn ztunnel_acked(&mut self, uid: &str, peer: ZtunnelPeer) {
        let Some(pod) = self.pods.get(uid) else {
            return;
        };
        if let Serving::External(ext) = &pod.serving
            && ext.served_by == Some(peer)
        {
            return;
        }
        let (cookie, netns) = (pod.cookie, pod.netns.clone());
        let Some(redirector) = self.redirector.as_mut() else {
            return;
        };
        let (inbound_port, hbone_port) = redirector.role_ports();
        let pid = u32::try_from(peer.pid).unwrap_or(0);
        let result = ExternalListeners::harvest(pid, netns.fd().as_fd(), inbound_port, hbone_port)
            .map_err(|e| {
                format!(
                    "cannot take ztunnel's listeners (pid {}): {}",
                    peer.pid,
                    Chain(&e)
                )
            })
            .and_then(|listeners| {
                redirector
                    .set_pod_listeners(cookie, listeners)
                    .map_err(|e| format!("cannot register ztunnel's listeners: {}", Chain(&e)))
            });
        match result {
            Ok(()) => {
                info!(uid, ztunnel_pid = peer.pid, "pod served by ztunnel");
                self.set_external(uid, Some(peer), None);
            }
            Err(problem) => {
                warn!(
                    uid,
                    problem, "pod acknowledged by ztunnel but not captured into it"
                );
                self.set_external(uid, None, Some(problem));
            }
        }
    }

    /// A ztunnel connection ended: pods it served meet the fail-open or
    /// fail-closed setting until a ztunnel acknowledges them again.
    pub(super) fn ztunnel_disconnected(&mut self, peer: ZtunnelPeer) {
        let served: Vec<(String, u64)> = self
            .pods
            .values()
            .filter(|p| matches!(&p.serving, Serving::External(e) if e.served_by == Some(peer)))
            .map(|p| (p.spec.uid.clone(), p.cookie))
            .collect();
        for (uid, cookie) in served {
            if let Err(err) = self.with_redirector(|r| r.clear_pod_listeners(cookie)) {
                warn!(uid, error = %Chain(&err), "cannot clear ztunnel's listeners of the pod");
            }
            let problem = format!(
                "ztunnel (pid {}) disconnected; waiting for a ztunnel to take the pod again",
                peer.pid
            );
            self.set_external(&uid, None, Some(problem));
        }
    }

    /// Starts serving ZDS; every pod enrolled so far is in the first
    /// snapshot. Once.
    pub(super) fn start_ztunnel_server(&mut self) -> Result<(), EnrollError> {
        let initial = self
            .pods
            .values()
            .map(|p| zds_pod(&p.spec, &p.netns))
            .collect::<Result<Vec<_>, _>>()?;
        let Some(external) = self.settings.external.as_mut() else {
            return Ok(());
        };
        if external.server.is_some() {
            return Ok(());
        }
        let observer: Arc<dyn ZdsObserver> = external.events.clone();
        let server =
            ZdsServer::start(external.config.clone(), observer, initial).map_err(|source| {
                EnrollError::Ztunnel {
                    what: "serve the ZDS socket",
                    source,
                }
            })?;
        let _ = external.events.server.set(server.handle());
        external.server = Some(server);
        let waiting: Vec<String> = self.pods.keys().cloned().collect();
        for uid in waiting {
            self.set_external(
                &uid,
                None,
                Some("waiting for ztunnel to connect to the ZDS socket".into()),
            );
        }
        Ok(())
    }

    /// Takes the pod `uid` away from ztunnel (`DelWorkload` to every
    /// connection) and its capture out of the kernel.
    pub(super) fn release_external(&mut self, pod: &EnrolledPod) -> Result<(), EnrollError> {
        if let Some(zds) = self
            .settings
            .external
            .as_ref()
            .and_then(ExternalEngine::handle)
        {
            let uid = pod.spec.uid.clone();
            match on_runtime(async move { zds.del(&uid).await }) {
                Ok(outcome) if outcome.errors.is_empty() => {}
                Ok(outcome) => {
                    warn!(uid = pod.spec.uid, errors = ?outcome.errors, "not every ztunnel confirmed the pod's removal")
                }
                Err(err) => {
                    warn!(uid = pod.spec.uid, error = %Chain(&err), "cannot tell ztunnel the pod is gone")
                }
            }
        }
        let netns = pod.netns.fd();
        Ok(self.with_redirector(|r| r.unenroll_external_pod(pod.cookie, Some(netns)))?)
    }

    /// ztunnel refused pod `uid`: shown in `status` unless another
    /// connection's listeners serve it meanwhile.
    pub(super) fn ztunnel_refused(&mut self, uid: &str, problem: String) {
        if let Some(pod) = self.pods.get_mut(uid)
            && let Serving::External(ext) = &mut pod.serving
            && ext.served_by.is_none()
        {
            ext.problem = Some(problem);
        }
    }

    fn set_external(&mut self, uid: &str, served_by: Option<ZtunnelPeer>, problem: Option<String>) {
        if let Some(pod) = self.pods.get_mut(uid)
            && let Serving::External(ext) = &mut pod.serving
        {
            ext.served_by = served_by;
            ext.problem = problem;
        }
    }
}

/// Runs `work` (bounded by the ZDS server's own timeouts) on the agent's
/// runtime and waits for it on this thread: the enrollment thread has
/// entered the runtime (for the engines it spawns), which the ZDS
/// handle's blocking calls take for async code and refuse.
fn on_runtime<T: Send + 'static>(
    work: impl std::future::Future<Output = Result<T, ZdsError>> + Send + 'static,
) -> Result<T, ZdsError> {
    let runtime = tokio::runtime::Handle::try_current().map_err(|_| ZdsError::Runtime {
        what: "the enrollment thread has no runtime",
    })?;
    let (done, result) = std::sync::mpsc::channel();
    runtime.spawn(async move {
        let _ = done.send(work.await);
    });
    result.recv().map_err(|_| ZdsError::Runtime {
        what: "the runtime stopped before ZDS answered",
    })?
}

/// `status` of a pod served by ztunnel.
pub(super) fn external_status(ext: &ExternalPod) -> ExternalStatus {
    match (&ext.served_by, &ext.problem) {
        (Some(peer), _) => ExternalStatus {
            served: true,
            detail: format!(
                "served by ztunnel (pid {}, ZDS connection {})",
                peer.pid, peer.connection
            ),
        },
        (None, Some(problem)) => ExternalStatus {
            served: false,
            detail: problem.clone(),
        },
        (None, None) => ExternalStatus {
            served: false,
            detail: "waiting for ztunnel".into(),
        },
    }
}
