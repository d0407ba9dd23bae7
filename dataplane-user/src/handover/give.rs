//! The running agent's side: answer a `handOver` request with the lock
//! and every pod's listening sockets, then wait for the new agent to serve
//! them.

use std::{os::fd::AsFd as _, sync::Arc, time::Instant};

use tokio::{io::AsyncWriteExt as _, sync::watch};
use tracing::{info, warn};

use super::{HANDOVER_TIMEOUT, HandoverError, Message, channel, channel::Channel, sockets};
use crate::{
    control::Response,
    enroll::{Enroller, OfferedPod},
    instance::InstanceLock,
    logging::Chain,
};

/// Where the running agent is with hand-overs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Serving its pods; a new agent may ask.
    Serving,
    /// A hand-over is under way.
    HandingOver,
    /// The new agent (this pid) serves every pod.
    HandedOver(u32),
    /// Shutting down without a hand-over: no new one starts.
    Stopping,
}

/// What a running agent needs to hand its pods over.
#[derive(Debug)]
pub struct Giver {
    lock: InstanceLock,
    enroller: Enroller,
    phase: watch::Sender<Phase>,
}

impl Giver {
    /// A giver holding the agent's instance lock.
    pub fn new(lock: InstanceLock, enroller: Enroller) -> Arc<Self> {
        Arc::new(Self {
            lock,
            enroller,
            phase: watch::channel(Phase::Serving).0,
        })
    }

    /// Resolves once a new agent serves every pod: its pid.
    pub async fn handed_over(&self) -> u32 {
        let mut phase = self.phase.subscribe();
        match phase.wait_for(|p| matches!(p, Phase::HandedOver(_))).await {
            Ok(p) => match *p {
                Phase::HandedOver(pid) => pid,
                _ => 0,
            },
            // The sender lives as long as `self`.
            Err(_) => std::future::pending().await,
        }
    }

    /// The agent is shutting down: no hand-over starts from now on, and
    /// one under way is waited for (it ends within the hand-over timeout).
    /// Returns the new agent's pid if the pods were handed over: then the
    /// kernel state, the state file and the lock are its, not this
    /// agent's to keep or remove.
    pub async fn settle(&self) -> Option<u32> {
        let mut phase = self.phase.subscribe();
        loop {
            let mut outcome = None;
            let decided = self.phase.send_if_modified(|p| match *p {
                Phase::Serving => {
                    *p = Phase::Stopping;
                    true
                }
                Phase::HandedOver(pid) => {
                    outcome = Some(Some(pid));
                    false
                }
                Phase::Stopping => {
                    outcome = Some(None);
                    false
                }
                Phase::HandingOver => false,
            });
            if decided {
                return None;
            }
            if let Some(outcome) = outcome {
                return outcome;
            }
            info!("waiting for the hand-over under way before shutting down");
            if phase.changed().await.is_err() {
                return None;
            }
        }
    }

    /// Answers the `handOver` request of the agent `new_pid` on `stream`.
    pub async fn give(self: Arc<Self>, mut stream: tokio::net::UnixStream, new_pid: u32) {
        let mut now = Phase::Serving;
        let start = self.phase.send_if_modified(|p| {
            now = *p;
            let start = *p == Phase::Serving;
            if start {
                *p = Phase::HandingOver;
            }
            start
        });
        if !start {
            let reason = match now {
                Phase::HandingOver => "a hand-over is already under way".to_owned(),
                Phase::HandedOver(pid) => format!("the pods were handed over to pid {pid} already"),
                _ => "the agent is shutting down".to_owned(),
            };
            refuse(&mut stream, &reason).await;
            return;
        }
        info!(
            new_pid,
            "a new agent asks to take over; enrollment changes wait until it does"
        );
        let started = Instant::now();
        let offered = match self.enroller.freeze().await {
            Ok(offered) => offered,
            Err(err) => {
                self.phase.send_replace(Phase::Serving);
                let reason = Chain(&err).to_string();
                refuse(&mut stream, &reason).await;
                return;
            }
        };
        let (pods, sockets) = (
            offered.len(),
            offered
                .iter()
                .map(|p| sockets::roles_of(&p.listeners).len())
                .sum::<usize>(),
        );
        let this = Arc::clone(&self);
        let exchange = move || {
            let stream = stream.into_std()?;
            stream.set_nonblocking(false)?;
            Ok(this.exchange(stream, offered))
        };
        let outcome = match tokio::task::spawn_blocking(exchange).await {
            Ok(Ok(outcome)) => outcome,
            Ok(Err(source)) => Err(HandoverError::Channel {
                step: "the reply",
                source,
            }),
            Err(join) => Err(HandoverError::Channel {
                step: "the hand-over thread",
                source: std::io::Error::other(join),
            }),
        };
        match outcome {
            Ok(pid) => {
                info!(
                    new_pid = pid,
                    pods,
                    sockets,
                    duration_ms = started.elapsed().as_millis() as u64,
                    "handed over; no longer accepting, draining what this agent accepted"
                );
                self.phase.send_replace(Phase::HandedOver(pid));
            }
            Err(err) => {
                warn!(new_pid, error = %Chain(&err), "hand-over failed; this agent goes on serving its pods");
                if let Err(err) = self.lock.reclaim() {
                    warn!(error = %err, "cannot write this agent's pid into the instance lock again");
                }
                if let Err(err) = self.enroller.thaw().await {
                    warn!(error = %Chain(&err), "cannot resume enrollment after the failed hand-over");
                }
                self.phase.send_replace(Phase::Serving);
            }
        }
    }

    /// Sends the channel, the lock and the sockets, and waits for the new
    /// agent's verdict: its pid once it serves every pod.
    fn exchange(
        &self,
        stream: std::os::unix::net::UnixStream,
        offered: Vec<OfferedPod>,
    ) -> Result<u32, HandoverError> {
        let io = |step| move |source| HandoverError::Channel { step, source };
        stream
            .set_write_timeout(Some(HANDOVER_TIMEOUT))
            .map_err(io("the reply"))?;
        let (channel, theirs) = Channel::pair().map_err(io("the reply"))?;
        let ok = serde_json::to_vec(&Response {
            ok: true,
            ..Response::default()
        })
        .map_err(|e| io("the reply")(e.into()))?;
        channel::send_reply(stream.as_fd(), &ok, &[theirs.as_fd()]).map_err(io("the reply"))?;
        // The new agent reads the reply to its end.
        drop(stream);
        drop(theirs);
        channel
            .set_timeout(HANDOVER_TIMEOUT)
            .map_err(io("the channel"))?;

        let lock = self.lock.share().map_err(io("the offer"))?;
        let offer = Message::Offer {
            pid: std::process::id(),
            pods: offered.len(),
        };
        channel
            .send(&offer, &[lock.as_fd()])
            .map_err(io("the offer"))?;
        drop(lock);
        for pod in &offered {
            let roles = sockets::roles_of(&pod.listeners);
            let message = Message::Pod {
                status: Box::new(pod.status.clone()),
                netns_dev: pod.netns_identity.0,
                netns_ino: pod.netns_identity.1,
                roles: roles.iter().map(|(role, _)| *role).collect(),
            };
            let fds: Vec<_> = roles.iter().map(|(_, fd)| *fd).collect();
            channel
                .send(&message, &fds)
                .map_err(io("a pod's sockets"))?;
        }
        channel
            .send(&Message::End, &[])
            .map_err(io("the end of the offer"))?;
        // Only duplicates: the engines keep serving their own descriptors
        // until the new agent confirms.
        drop(offered);

        let step = "the new agent's start";
        match channel.recv() {
            Ok(Some((Message::TakenOver { pid }, _))) => Ok(pid),
            Ok(Some((Message::Abort { reason }, _))) => Err(HandoverError::Abandoned { reason }),
            Ok(Some((other, _))) => Err(HandoverError::Protocol {
                step,
                got: format!("{other:?}"),
            }),
            Ok(None) => Err(HandoverError::Closed { step }),
            Err(source) => Err(HandoverError::Channel { step, source }),
        }
    }
}

/// Answers the request with a refusal.
async fn refuse(stream: &mut tokio::net::UnixStream, reason: &str) {
    let reply = Response {
        ok: false,
        error: Some(reason.to_owned()),
        ..Response::default()
    };
    if let Ok(bytes) = serde_json::to_vec(&reply) {
        let _ = stream.write_all(&bytes).await;
        let _ = stream.shutdown().await;
    }
}
