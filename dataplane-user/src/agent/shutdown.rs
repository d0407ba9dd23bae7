//! Shutting down: drain the connections, stop every task, remove the
//! control socket, then keep or remove kernel state (`--on-exit`), or leave
//! it to the agent the pods were handed over to.

use std::time::{Duration, Instant};

use tokio::sync::watch;
use tracing::{info, warn};

use super::{AgentError, Bound, Signals, Stop, config::AfterHandover};
use crate::mesh::MeshContext;

/// How long GOAWAY frames get to leave before connections are closed.
const GOAWAY_GRACE: Duration = Duration::from_millis(100);

/// How often the drain checks whether connections are still open.
const DRAIN_POLL: Duration = Duration::from_millis(50);

impl Bound {
    /// Drains and stops the agent that stopped for `stop`; `signals`, when
    /// given, end the idle wait of `--after-handover wait`.
    pub async fn shut_down(
        self,
        stop: Stop,
        signals: Option<&mut Signals>,
    ) -> Result<(), AgentError> {
        let Self {
            config: args,
            readiness,
            mesh,
            shutdown_tx,
            rotation,
            endpoint_tasks,
            admin_task,
            control_task,
            kube_task,
            source_tasks,
            socket,
            socket_identity,
            enroller,
            giver,
            quit: _,
            endpoints: _,
        } = self;
        // A signal during a hand-over waits for its outcome: once handed
        // over, kernel state is the new agent's, whatever --on-exit says.
        let handed_over = giver.settle().await.is_some();
        readiness.start_draining();
        drain(&mesh, &shutdown_tx, args.mesh.drain_timeout).await;
        rotation.abort();
        for task in endpoint_tasks.into_iter().chain(admin_task) {
            task.abort();
            let _ = task.await;
        }
        control_task.abort();
        if let Some(tasks) = kube_task {
            for task in [tasks.reconcile, tasks.annotate] {
                task.abort();
                let _ = task.await;
            }
        }
        for task in source_tasks {
            task.abort();
            let _ = task.await;
        }
        let _ = control_task.await;
        // Only the socket this agent created: a path replaced since belongs
        // to someone else.
        if socket_identity.is_some() && super::file_identity(&socket) == socket_identity {
            let _ = std::fs::remove_file(&socket);
        }
        if handed_over {
            // Kernel state, the state file and the lock are the new agent's.
            enroller.release().await?;
        } else {
            enroller.shutdown(args.redirect.on_exit).await?;
        }
        if stop == Stop::HandedOver
            && args.after_handover == AfterHandover::Wait
            && let Some(signals) = signals
        {
            // A pod's container that exits is restarted by the kubelet, and
            // the restarted agent (run with --takeover) would take the pods
            // back from the new pod's. Holding nothing now, wait for the
            // pod's deletion (SIGTERM); a signal that came during the drain
            // is still pending and ends this at once.
            info!(
                "handed over and drained; idle until SIGTERM (--after-handover wait), holding no lock, socket, port or kernel state"
            );
            let name = signals.recv().await;
            info!("{name} received");
        }
        info!("agent stopped");
        Ok(())
    }
}

/// Stops accepting (in-pod listeners close, HBONE servers send GOAWAY),
/// then waits until every open connection has finished or `deadline` has
/// passed; the caller then closes what is left.
async fn drain(mesh: &MeshContext, shutdown_tx: &watch::Sender<bool>, deadline: Duration) {
    let _ = shutdown_tx.send(true);
    let until = Instant::now() + deadline;
    info!(
        open_connections = mesh.metrics.open_connections(),
        deadline_ms = deadline.as_millis() as u64,
        "draining: listeners closed, HBONE peers told GOAWAY"
    );
    loop {
        let open = mesh.metrics.open_connections();
        if open <= 0 {
            info!("drained: every connection finished");
            break;
        }
        if Instant::now() >= until {
            warn!(
                open_connections = open,
                "drain deadline passed; closing the connections still open"
            );
            break;
        }
        tokio::time::sleep(DRAIN_POLL).await;
    }
    // GOAWAY frames need a moment to leave even when nothing was open.
    tokio::time::sleep(GOAWAY_GRACE).await;
}
