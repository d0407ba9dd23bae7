//! What the server knows, shared by the caller's handle and the
//! connection tasks: the registered pods (the next snapshot) with where
//! each stands, and the live connections with their request queues.
//!
//! One `std` mutex, never held across an await or a syscall.

use std::{
    collections::BTreeMap,
    path::PathBuf,
    sync::{Arc, Mutex, MutexGuard, PoisonError},
    time::{SystemTime, UNIX_EPOCH},
};

use tokio::sync::{mpsc, oneshot};

use super::{
    ZdsError, messages,
    types::{
        AddOutcome, ConnectionStatus, PodZdsState, PodZdsStatus, ZdsPod, ZdsStatus, ZtunnelPeer,
    },
};

/// Requests a connection may have queued before callers wait.
const QUEUE: usize = 64;

/// A registered pod as sent to ztunnel.
#[derive(Debug)]
pub(super) struct RegisteredPod {
    /// What the caller gave.
    pub(super) pod: ZdsPod,
    /// Distinguishes re-registrations of one uid (a new sandbox), so a late
    /// answer about an older one changes nothing.
    pub(super) generation: u64,
    /// The encoded `AddWorkload`.
    pub(super) request: Vec<u8>,
}

/// Work for a connection task, in the order callers asked.
#[derive(Debug)]
pub(super) enum Command {
    /// Send an Add and answer how it went.
    Add {
        /// The pod.
        pod: Arc<RegisteredPod>,
        /// Where the outcome goes (the caller may have given up).
        reply: oneshot::Sender<AddOutcome>,
    },
    /// Send a Del and answer with the ack's error text, if any.
    Del {
        /// The encoded `DelWorkload`.
        request: Vec<u8>,
        /// The pod's uid, for the log.
        uid: String,
        /// Where the outcome goes.
        reply: oneshot::Sender<Result<(), String>>,
    },
}

#[derive(Debug)]
struct PodEntry {
    pod: Arc<RegisteredPod>,
    state: PodZdsState,
}

#[derive(Debug)]
struct ConnEntry {
    peer: ZtunnelPeer,
    connected_at: u64,
    hello: bool,
    commands: mpsc::Sender<Command>,
}

#[derive(Debug, Default)]
struct Inner {
    stopped: bool,
    pods: BTreeMap<String, PodEntry>,
    /// Oldest first.
    conns: Vec<ConnEntry>,
    next_generation: u64,
}

impl Inner {
    /// The newest connection past its hello: where Adds go.
    fn newest(&self) -> Option<&ConnEntry> {
        self.conns.iter().rev().find(|c| c.hello)
    }
}

/// The shared state.
#[derive(Debug)]
pub(super) struct Registry {
    socket: PathBuf,
    max_connections: usize,
    inner: Mutex<Inner>,
}

pub(super) fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl Registry {
    pub(super) fn new(socket: PathBuf, max_connections: usize) -> Self {
        Self {
            socket,
            max_connections,
            inner: Mutex::default(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic elsewhere leaves plain data behind; keep serving.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Records a new connection and returns its queue, or `None` when the
    /// cap is reached or the server stopped.
    pub(super) fn open_connection(&self, peer: ZtunnelPeer) -> Option<mpsc::Receiver<Command>> {
        let mut inner = self.lock();
        if inner.stopped || inner.conns.len() >= self.max_connections {
            return None;
        }
        let (commands, queue) = mpsc::channel(QUEUE);
        inner.conns.push(ConnEntry {
            peer,
            connected_at: unix_now(),
            hello: false,
            commands,
        });
        Some(queue)
    }

    /// The connection said hello: from now on it gets Dels (and Adds if
    /// newest). Returns the snapshot to send it, in one step with that so
    /// a pod registered meanwhile is either in it or queued to it.
    pub(super) fn hello(&self, connection: u64) -> Vec<Arc<RegisteredPod>> {
        let mut inner = self.lock();
        if let Some(conn) = inner
            .conns
            .iter_mut()
            .find(|c| c.peer.connection == connection)
        {
            conn.hello = true;
        }
        inner.pods.values().map(|e| Arc::clone(&e.pod)).collect()
    }

    /// Forgets a connection; pods it had acked are waiting again. Returns
    /// whether it had said hello.
    pub(super) fn close_connection(&self, connection: u64) -> bool {
        let mut inner = self.lock();
        let Some(index) = inner
            .conns
            .iter()
            .position(|c| c.peer.connection == connection)
        else {
            return false;
        };
        let conn = inner.conns.remove(index);
        for entry in inner.pods.values_mut() {
            if matches!(&entry.state, PodZdsState::Acked { peer, .. } if peer.connection == connection)
            {
                entry.state = PodZdsState::Waiting;
            }
        }
        conn.hello
    }

    /// Registers (or replaces) a pod; returns it with the queue of the
    /// connection to send it to, if any.
    pub(super) fn register(
        &self,
        pod: ZdsPod,
    ) -> Result<(Arc<RegisteredPod>, Option<mpsc::Sender<Command>>), ZdsError> {
        let request = messages::add(&pod)?;
        let mut inner = self.lock();
        if inner.stopped {
            return Err(ZdsError::Stopped);
        }
        inner.next_generation += 1;
        let registered = Arc::new(RegisteredPod {
            pod,
            generation: inner.next_generation,
            request,
        });
        inner.pods.insert(
            registered.pod.uid.clone(),
            PodEntry {
                pod: Arc::clone(&registered),
                state: PodZdsState::Waiting,
            },
        );
        let target = inner.newest().map(|c| c.commands.clone());
        Ok((registered, target))
    }

    /// Forgets a pod; returns the queues of every connection past its
    /// hello, which must all be told.
    pub(super) fn forget(&self, uid: &str) -> Result<Vec<mpsc::Sender<Command>>, ZdsError> {
        let mut inner = self.lock();
        if inner.stopped {
            return Err(ZdsError::Stopped);
        }
        inner.pods.remove(uid);
        Ok(inner
            .conns
            .iter()
            .filter(|c| c.hello)
            .map(|c| c.commands.clone())
            .collect())
    }

    /// ztunnel acked this registration of the pod; false if it is no
    /// longer registered (deleted or replaced meanwhile).
    pub(super) fn acked(&self, pod: &RegisteredPod, peer: ZtunnelPeer) -> bool {
        let mut inner = self.lock();
        match inner.pods.get_mut(&pod.pod.uid) {
            Some(entry) if entry.pod.generation == pod.generation => {
                entry.state = PodZdsState::Acked {
                    peer,
                    at: unix_now(),
                };
                true
            }
            _ => false,
        }
    }

    /// Sending this registration failed with `error`; returns the failed
    /// attempts so far, or `None` if it is no longer registered.
    pub(super) fn failed(&self, pod: &RegisteredPod, error: &str) -> Option<u32> {
        let mut inner = self.lock();
        let entry = inner
            .pods
            .get_mut(&pod.pod.uid)
            .filter(|e| e.pod.generation == pod.generation)?;
        let attempts = match &entry.state {
            PodZdsState::Failed { attempts, .. } => attempts.saturating_add(1),
            _ => 1,
        };
        entry.state = PodZdsState::Failed {
            error: error.to_owned(),
            attempts,
            at: unix_now(),
        };
        Some(attempts)
    }

    /// Whether `connection` should still retry this registration: it is
    /// current and the connection is the one Adds go to.
    pub(super) fn should_retry(&self, pod: &RegisteredPod, connection: u64) -> bool {
        let inner = self.lock();
        let current = inner
            .pods
            .get(&pod.pod.uid)
            .is_some_and(|e| e.pod.generation == pod.generation);
        current
            && inner
                .newest()
                .is_some_and(|c| c.peer.connection == connection)
    }

    /// Refuses everything from now on and drops the connections' queues.
    pub(super) fn stop(&self) {
        let mut inner = self.lock();
        inner.stopped = true;
        inner.conns.clear();
    }

    /// A copy of the state.
    pub(super) fn status(&self) -> ZdsStatus {
        let inner = self.lock();
        ZdsStatus {
            socket: self.socket.clone(),
            connections: inner
                .conns
                .iter()
                .map(|c| ConnectionStatus {
                    peer: c.peer,
                    connected_at: c.connected_at,
                    hello: c.hello,
                })
                .collect(),
            pods: inner
                .pods
                .values()
                .map(|e| PodZdsStatus {
                    uid: e.pod.pod.uid.clone(),
                    name: e.pod.pod.name.clone(),
                    namespace: e.pod.pod.namespace.clone(),
                    state: e.state.clone(),
                })
                .collect(),
        }
    }
}
