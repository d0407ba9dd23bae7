//! The re-check of open connections: inbound connections (plaintext and
//! HBONE streams) register here while they are open, so that a policy
//! change can close the ones the new policies deny, and only those.

use std::{
    collections::HashMap,
    net::{IpAddr, SocketAddr},
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
};

use tokio::sync::Notify;
use tracing::info;

use super::Request;
use crate::identity::Identity;

struct LiveEntry {
    peer: Option<Identity>,
    src: SocketAddr,
    dst: SocketAddr,
    kill: Arc<Notify>,
}

/// Open inbound connections, each with what its authorization was decided
/// on.
#[derive(Default)]
pub struct LiveConnections {
    next: AtomicU64,
    open: Mutex<HashMap<u64, LiveEntry>>,
}

impl std::fmt::Debug for LiveConnections {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LiveConnections")
            .field("open", &self.count())
            .finish()
    }
}

/// Removes its connection from the registry when dropped.
#[derive(Debug)]
pub struct LiveGuard {
    id: u64,
    registry: Arc<LiveConnections>,
}

impl Drop for LiveGuard {
    fn drop(&mut self) {
        if let Ok(mut open) = self.registry.open.lock() {
            open.remove(&self.id);
        }
    }
}

impl LiveConnections {
    /// Records an open inbound connection; await the returned `Notify` to
    /// learn that policy now denies it.
    pub fn register(
        self: &Arc<Self>,
        peer: Option<&Identity>,
        src: SocketAddr,
        dst: SocketAddr,
    ) -> (LiveGuard, Arc<Notify>) {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let kill = Arc::new(Notify::new());
        if let Ok(mut open) = self.open.lock() {
            open.insert(
                id,
                LiveEntry {
                    peer: peer.cloned(),
                    src,
                    dst,
                    kill: Arc::clone(&kill),
                },
            );
        }
        (
            LiveGuard {
                id,
                registry: Arc::clone(self),
            },
            kill,
        )
    }

    /// Open connections.
    pub fn count(&self) -> usize {
        self.open.lock().map(|o| o.len()).unwrap_or(0)
    }

    /// Re-decides with `decide` (the new policies) every open connection
    /// whose destination `concerned` names; closes and logs the ones now
    /// denied. Returns how many were closed.
    pub fn enforce(
        &self,
        concerned: impl Fn(IpAddr) -> bool,
        decide: impl Fn(&Request<'_>) -> Result<(), String>,
    ) -> usize {
        let Ok(open) = self.open.lock() else {
            return 0;
        };
        let mut closed = 0;
        for entry in open.values().filter(|entry| concerned(entry.dst.ip())) {
            let request = Request {
                peer: entry.peer.as_ref(),
                src: entry.src,
                dst: entry.dst,
            };
            if let Err(reason) = decide(&request) {
                info!(
                    target: "access",
                    src = %entry.src,
                    dst = %entry.dst,
                    peer_identity = entry.peer.as_ref().map_or("-", Identity::as_uri),
                    reason,
                    "open connection closed: policy now denies it"
                );
                // notify_one keeps a permit if the task is not waiting yet.
                entry.kill.notify_one();
                closed += 1;
            }
        }
        closed
    }
}
