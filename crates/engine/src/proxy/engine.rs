//! A pod's running engine: its accept loops, the connections they
//! accepted, and the upkeep of its HBONE pool, all on the pod's worker.
//!
//! An engine ends in one of two ways. [`PodEngine::stop`] (the pod left)
//! closes everything at once. [`PodEngine::retire`] (the pod was
//! re-enrolled in the same namespace, and a new engine serves the same
//! listening sockets) only stops accepting: the connections it already
//! accepted, including ones still in their handshake, finish on it, and
//! its inbound HBONE peers get GOAWAY so that their next streams go to the
//! new engine.

use std::{sync::Arc, time::Duration};

use tokio::task::JoinSet;
use tracing::{debug, info, warn};

use super::{PodContext, PodListeners, inbound, inbound_hbone, orig_dst, outbound};
use crate::{redirect::OrigDstTable, workers::Placement};

/// A pod's running listeners and their connections; dropping it (or
/// calling [`PodEngine::stop`]) closes every listener and connection.
#[derive(Debug)]
pub struct PodEngine {
    /// The accept loops. Once told to stop, each closes its listener and
    /// ends when the connections it accepted have finished.
    serving: JoinSet<()>,
    /// What runs for as long as the engine does: pool eviction, and the
    /// task that passes the agent's drain on to the pod.
    upkeep: JoinSet<()>,
    /// The worker the pod's tasks run on (counted there until dropped).
    placement: Placement,
    /// The pod's context: its stop signal, and its pool, which is closed
    /// with the engine (its connections would otherwise live on in their
    /// own tasks).
    ctx: Arc<PodContext>,
}

impl PodEngine {
    /// Starts serving on the runtime of `placement` (its listeners are
    /// registered there, and every task of the pod runs there). `orig_dst`
    /// is the kernel programs' record; without it (iptables capture, for
    /// the benchmarks' baseline) original destinations come from netfilter,
    /// for every connection of the pod ([`orig_dst::OrigDst`]).
    pub fn start(
        ctx: Arc<PodContext>,
        listeners: PodListeners,
        orig_dst: Option<OrigDstTable>,
        placement: Placement,
    ) -> std::io::Result<Self> {
        let runtime = placement.handle().clone();
        let _registered_there = runtime.enter();
        let (mut serving, mut upkeep) = (JoinSet::new(), JoinSet::new());
        let to_tokio = |l: std::net::TcpListener| {
            l.set_nonblocking(true)?;
            tokio::net::TcpListener::from_std(l)
        };
        let mut outbound = vec![to_tokio(listeners.outbound_v4)?];
        if let Some(v6) = listeners.outbound_v6 {
            outbound.push(to_tokio(v6)?);
        }
        let orig_dst = Arc::new(orig_dst::OrigDst::new(orig_dst));
        for listener in outbound {
            serving.spawn_on(
                outbound::serve(listener, Arc::clone(&ctx), Arc::clone(&orig_dst)),
                &runtime,
            );
        }
        serving.spawn_on(
            inbound::serve(to_tokio(listeners.inbound)?, Arc::clone(&ctx), orig_dst),
            &runtime,
        );
        serving.spawn_on(
            inbound_hbone::serve(to_tokio(listeners.hbone)?, Arc::clone(&ctx)),
            &runtime,
        );
        upkeep.spawn_on(ctx.pool.eviction(), &runtime);
        let drain = Arc::clone(&ctx);
        upkeep.spawn_on(
            async move {
                // A closed channel (the agent is going away) stops too.
                let _ = drain.mesh.shutdown.clone().wait_for(|d| *d).await;
                drain.stopping.send_replace(true);
            },
            &runtime,
        );
        info!(pod = %ctx.identity.name, namespace = %ctx.identity.namespace, worker = ?placement.worker(), "in-pod listeners serving");
        // Counted as stopped in `drop`, whichever way the engine ends.
        ctx.mesh.metrics.proxy_started();
        Ok(Self {
            serving,
            upkeep,
            placement,
            ctx,
        })
    }

    /// Closes every listener and connection of the pod: accepted ones,
    /// inbound HBONE connections with their streams, and the pooled
    /// outbound HBONE connections. Each connection's access record says
    /// the agent closed it.
    pub fn stop(self) {
        // Drop does it.
    }

    /// Stops accepting and returns at once; what the engine already
    /// accepted finishes on it, for up to `deadline`, and is then closed
    /// as [`PodEngine::stop`] would. For an engine replaced by another
    /// serving the same listening sockets: connections still queued in
    /// the kernel go to the new engine, none is refused or cut. Dropping
    /// the returned handle closes what is left at once (the pod left).
    pub fn retire(mut self, deadline: Duration) -> RetiredEngine {
        self.ctx.stopping.send_replace(true);
        let runtime = self.placement.handle().clone();
        let draining = runtime.spawn(async move {
            let serving = &mut self.serving;
            let drained = tokio::time::timeout(deadline, async {
                while serving.join_next().await.is_some() {}
            })
            .await;
            let pod = &self.ctx.identity;
            match drained {
                Ok(()) => {
                    debug!(pod = %pod.name, namespace = %pod.namespace, "previous engine drained")
                }
                Err(_) => warn!(
                    pod = %pod.name,
                    namespace = %pod.namespace,
                    deadline_ms = deadline.as_millis() as u64,
                    "previous engine's drain deadline passed; closing its connections still open"
                ),
            }
            drop(self);
        });
        RetiredEngine(draining.abort_handle())
    }

    /// Closes the pod's pooled outbound HBONE connections and marks the
    /// pool closed (its tunnels' records then say the agent closed them);
    /// listeners keep running until [`PodEngine::stop`].
    pub fn close_pool(&self) -> usize {
        self.ctx.pool.close()
    }

    /// The pinned worker serving the pod, `None` under `--threading
    /// shared`.
    pub fn worker(&self) -> Option<usize> {
        self.placement.worker()
    }
}

impl Drop for PodEngine {
    fn drop(&mut self) {
        self.serving.abort_all();
        self.upkeep.abort_all();
        let closed = self.ctx.pool.close();
        if closed > 0 {
            debug!(connections = closed, "pooled HBONE connections closed");
        }
        self.ctx.mesh.metrics.proxy_stopped();
    }
}

/// An engine finishing what it accepted after [`PodEngine::retire`];
/// dropping this closes what is left of it at once.
#[derive(Debug)]
pub struct RetiredEngine(tokio::task::AbortHandle);

impl RetiredEngine {
    /// Whether it has finished (drained, or its deadline passed).
    pub fn is_finished(&self) -> bool {
        self.0.is_finished()
    }
}

impl Drop for RetiredEngine {
    fn drop(&mut self) {
        self.0.abort();
    }
}
