//! Waiting for the agent's stop: SIGTERM, SIGINT, `/quitquitquit` (or
//! [`super::Bound::stop`]) or a hand-over of its pods to a new agent.

use tokio::signal::unix::{Signal, SignalKind, signal};
use tracing::info;

use super::Bound;

/// The process's SIGTERM and SIGINT, taken over from their default (kill)
/// by [`super::run`] before anything starts.
#[derive(Debug)]
pub struct Signals {
    sigterm: Signal,
    sigint: Signal,
}

impl Signals {
    /// Installs the handlers.
    pub fn install() -> std::io::Result<Self> {
        Ok(Self {
            sigterm: signal(SignalKind::terminate())?,
            sigint: signal(SignalKind::interrupt())?,
        })
    }

    /// The next signal's name.
    pub async fn recv(&mut self) -> &'static str {
        tokio::select! {
            _ = self.sigterm.recv() => "SIGTERM",
            _ = self.sigint.recv() => "SIGINT",
        }
    }
}

/// Why the agent stops.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// A signal, `/quitquitquit` or [`super::Bound::stop`].
    Asked,
    /// Its pods were handed over to a new agent: only then may the process
    /// have to outlive its drain.
    HandedOver,
}

impl Bound {
    /// Waits until the agent is asked to stop (`signals`, when given,
    /// `/quitquitquit`, [`Bound::stop`]) or has handed its pods over.
    pub async fn wait(&self, signals: Option<&mut Signals>) -> Stop {
        let signal = async {
            match signals {
                Some(signals) => signals.recv().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            name = signal => { info!("{name} received, draining"); Stop::Asked }
            () = self.quit.notified() => { info!("/quitquitquit received, draining"); Stop::Asked }
            pid = self.giver.handed_over() => {
                info!(new_pid = pid, "pods handed over to a new agent, draining");
                Stop::HandedOver
            }
        }
    }
}
