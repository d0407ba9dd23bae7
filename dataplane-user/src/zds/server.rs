//! The listening side: [`ZdsServer`] accepts ztunnel connections on the
//! agent's runtime; [`ZdsHandle`] is how the rest of the agent registers
//! and forgets pods, from async code or from a plain thread.

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use tokio::{sync::oneshot, task::JoinSet, time::timeout};
use tracing::{info, warn};

use super::{
    ZdsError, messages,
    registry::{Command, Registry},
    seqpacket::SeqpacketListener,
    session,
    types::{AddOutcome, DelOutcome, ZdsConfig, ZdsObserver, ZdsPod, ZdsStatus},
};

/// Pause after a failed accept (e.g. out of descriptors) before the next.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(100);

/// The running server. Dropping it (or [`Self::shutdown`]) stops
/// accepting, closes every connection and removes the socket file if it
/// is still ours; ztunnel keeps its pods until it reconnects to a server
/// and receives a snapshot.
#[derive(Debug)]
pub struct ZdsServer {
    handle: ZdsHandle,
    /// `None` once shut down.
    accept: Option<tokio::task::JoinHandle<()>>,
}

impl ZdsServer {
    /// Binds the socket (removing a stale socket file), registers
    /// `initial` pods so the first snapshot carries them, and starts
    /// accepting on the current tokio runtime. Returns at once.
    ///
    /// Register every pod the agent already captures here (or before
    /// ztunnel can connect): ztunnel drops the pods a snapshot leaves out.
    ///
    /// # Errors
    ///
    /// [`ZdsError::Runtime`] outside a tokio runtime; [`ZdsError::NotASocket`]
    /// or [`ZdsError::Listen`] when the socket cannot be bound;
    /// [`ZdsError::InvalidPod`] for an initial pod ztunnel could not read.
    pub fn start(
        config: ZdsConfig,
        observer: Arc<dyn ZdsObserver>,
        initial: Vec<ZdsPod>,
    ) -> Result<Self, ZdsError> {
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| ZdsError::Runtime {
            what: "start needs a tokio runtime; call it from the agent's runtime",
        })?;
        let registry = Arc::new(Registry::new(config.socket.clone(), config.max_connections));
        for pod in initial {
            registry.register(pod)?;
        }
        let listener = {
            // AsyncFd registers with the runtime's reactor.
            let _entered = runtime.enter();
            let backlog = i32::try_from(config.max_connections)
                .unwrap_or(i32::MAX)
                .max(1);
            SeqpacketListener::bind(&config.socket, backlog)?
        };
        info!(socket = %config.socket.display(), "ZDS server listening for ztunnel");
        let config = Arc::new(config);
        let accept = runtime.spawn(accept_loop(
            listener,
            Arc::clone(&registry),
            observer,
            Arc::clone(&config),
        ));
        Ok(Self {
            handle: ZdsHandle {
                registry,
                config,
                runtime,
            },
            accept: Some(accept),
        })
    }

    /// A handle for registering and forgetting pods; clone it freely.
    pub fn handle(&self) -> ZdsHandle {
        self.handle.clone()
    }

    /// Stops the server and waits until its socket is closed.
    pub async fn shutdown(mut self) {
        self.handle.registry.stop();
        if let Some(accept) = self.accept.take() {
            accept.abort();
            let _ = accept.await;
        }
    }
}

impl Drop for ZdsServer {
    fn drop(&mut self) {
        self.handle.registry.stop();
        if let Some(accept) = &self.accept {
            accept.abort();
        }
    }
}

async fn accept_loop(
    listener: SeqpacketListener,
    registry: Arc<Registry>,
    observer: Arc<dyn ZdsObserver>,
    config: Arc<ZdsConfig>,
) {
    static NEXT_CONNECTION: AtomicU64 = AtomicU64::new(1);
    // Sessions live in the set, so aborting this task ends them all.
    let mut sessions = JoinSet::new();
    loop {
        while sessions.try_join_next().is_some() {}
        let connection = NEXT_CONNECTION.fetch_add(1, Ordering::Relaxed);
        let conn = match listener.accept(connection).await {
            Ok(conn) => conn,
            Err(error) => {
                warn!(%error, "cannot accept a ztunnel connection");
                tokio::time::sleep(ACCEPT_ERROR_PAUSE).await;
                continue;
            }
        };
        let peer = conn.peer();
        let Some(queue) = registry.open_connection(peer) else {
            warn!(
                peer_pid = peer.pid,
                peer_uid = peer.uid,
                max = config.max_connections,
                "refusing a ztunnel connection: too many connections"
            );
            continue;
        };
        info!(
            peer_pid = peer.pid,
            peer_uid = peer.uid,
            connection,
            "ztunnel connected"
        );
        sessions.spawn(session::run(
            conn,
            queue,
            Arc::clone(&registry),
            Arc::clone(&observer),
            Arc::clone(&config),
        ));
    }
}

/// Registers and forgets pods; the calls work from async code or, in the
/// `_blocking` forms, from a plain thread (the enrollment actor).
#[derive(Debug, Clone)]
pub struct ZdsHandle {
    registry: Arc<Registry>,
    config: Arc<ZdsConfig>,
    runtime: tokio::runtime::Handle,
}

impl ZdsHandle {
    /// Registers `pod` (replacing one with the same uid) so every later
    /// snapshot carries it, and sends it to the newest connected ztunnel,
    /// waiting at most [`ZdsConfig::request_timeout`] for the answer.
    ///
    /// # Errors
    ///
    /// [`ZdsError::InvalidPod`] (empty uid, or an Add over 1,024 bytes)
    /// and [`ZdsError::Stopped`]; everything about ztunnel is an
    /// [`AddOutcome`].
    pub async fn add(&self, pod: ZdsPod) -> Result<AddOutcome, ZdsError> {
        let (pod, target) = self.registry.register(pod)?;
        let Some(target) = target else {
            info!(
                uid = pod.pod.uid,
                "no ztunnel connected; the pod waits for its snapshot"
            );
            return Ok(AddOutcome::NoZtunnel);
        };
        let (reply, answer) = oneshot::channel();
        let exchange = async {
            if target.send(Command::Add { pod, reply }).await.is_err() {
                return AddOutcome::ConnectionLost {
                    reason: "the connection ended before the Add was sent".into(),
                };
            }
            answer.await.unwrap_or_else(|_| AddOutcome::ConnectionLost {
                reason: "the connection ended before ztunnel answered".into(),
            })
        };
        Ok(timeout(self.config.request_timeout, exchange)
            .await
            .unwrap_or(AddOutcome::TimedOut))
    }

    /// Forgets the pod and sends `DelWorkload` to every connection past
    /// its hello, waiting at most [`ZdsConfig::request_timeout`] for all
    /// answers.
    ///
    /// # Errors
    ///
    /// [`ZdsError::InvalidPod`] for a uid too long to send and
    /// [`ZdsError::Stopped`].
    pub async fn del(&self, uid: &str) -> Result<DelOutcome, ZdsError> {
        let request = messages::del(uid)?;
        let targets = self.registry.forget(uid)?;
        let mut outcome = DelOutcome {
            connections: targets.len(),
            ..DelOutcome::default()
        };
        let mut answers = Vec::with_capacity(targets.len());
        for target in targets {
            let (reply, answer) = oneshot::channel();
            let command = Command::Del {
                request: request.clone(),
                uid: uid.to_owned(),
                reply,
            };
            answers.push(async move {
                target
                    .send(command)
                    .await
                    .map_err(|_| "the connection ended before the Del was sent".to_owned())?;
                answer
                    .await
                    .map_err(|_| "the connection ended before ztunnel answered".to_owned())?
            });
        }
        let all = futures::future::join_all(answers);
        match timeout(self.config.request_timeout, all).await {
            Ok(results) => {
                for result in results {
                    match result {
                        Ok(()) => outcome.acked += 1,
                        Err(error) => outcome.errors.push(error),
                    }
                }
            }
            Err(_) => outcome.errors.push(format!(
                "not every ztunnel answered within {:?}",
                self.config.request_timeout
            )),
        }
        Ok(outcome)
    }

    /// [`Self::add`] from a thread outside the runtime; blocks for at most
    /// [`ZdsConfig::request_timeout`]. Once the [`ZdsServer`] is dropped it
    /// answers [`ZdsError::Stopped`] without touching the runtime, so stop
    /// the server before the runtime shuts down.
    ///
    /// # Errors
    ///
    /// As [`Self::add`], and [`ZdsError::Runtime`] when called from async
    /// code (which must use [`Self::add`]).
    pub fn add_blocking(&self, pod: ZdsPod) -> Result<AddOutcome, ZdsError> {
        self.outside_runtime()?;
        self.runtime.block_on(self.add(pod))
    }

    /// [`Self::del`] from a thread outside the runtime; blocks for at most
    /// [`ZdsConfig::request_timeout`].
    ///
    /// # Errors
    ///
    /// As [`Self::del`], and [`ZdsError::Runtime`] when called from async
    /// code.
    pub fn del_blocking(&self, uid: &str) -> Result<DelOutcome, ZdsError> {
        self.outside_runtime()?;
        self.runtime.block_on(self.del(uid))
    }

    /// The pods and connections as they stand; never blocks on ztunnel.
    pub fn status(&self) -> ZdsStatus {
        self.registry.status()
    }

    fn outside_runtime(&self) -> Result<(), ZdsError> {
        if tokio::runtime::Handle::try_current().is_ok() {
            return Err(ZdsError::Runtime {
                what: "a blocking call was made from async code; use add or del instead",
            });
        }
        Ok(())
    }
}
