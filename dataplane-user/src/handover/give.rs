//! The running agent's side: answer a `handOver` request with the lock
//! and every pod's listening sockets, then wait for the new agent to serve
//! them.

use std::{
    os::fd::AsFd as _,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Instant,
};

use tokio::{io::AsyncWriteExt as _, sync::watch};
use tracing::{info, warn};

use super::{HANDOVER_TIMEOUT, HandoverError, Message, channel, channel::Channel, sockets};
use crate::{
    control::Response,
    enroll::{Enroller, OfferedPod},
    instance::InstanceLock,
    logging::Chain,
};

/// What a running agent needs to hand its pods over.
#[derive(Debug)]
pub struct Giver {
    lock: InstanceLock,
    enroller: Enroller,
    /// Set while a hand-over is under way, and for good once one succeeded.
    busy: AtomicBool,
    /// The new agent's pid, once it serves every pod.
    handed_over: watch::Sender<Option<u32>>,
}

impl Giver {
    /// A giver holding the agent's instance lock.
    pub fn new(lock: InstanceLock, enroller: Enroller) -> Arc<Self> {
        Arc::new(Self {
            lock,
            enroller,
            busy: AtomicBool::new(false),
            handed_over: watch::channel(None).0,
        })
    }

    /// Resolves once a new agent serves every pod: its pid.
    pub async fn handed_over(&self) -> u32 {
        let mut done = self.handed_over.subscribe();
        match done.wait_for(Option::is_some).await {
            Ok(pid) => pid.unwrap_or_default(),
            // The sender lives as long as `self`.
            Err(_) => std::future::pending().await,
        }
    }

    /// Answers the `handOver` request of the agent `new_pid` on `stream`.
    pub async fn give(self: Arc<Self>, mut stream: tokio::net::UnixStream, new_pid: u32) {
        if self.busy.swap(true, Ordering::AcqRel) {
            refuse(&mut stream, "a hand-over is already under way or done").await;
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
                self.busy.store(false, Ordering::Release);
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
                self.handed_over.send_replace(Some(pid));
            }
            Err(err) => {
                warn!(new_pid, error = %Chain(&err), "hand-over failed; this agent goes on serving its pods");
                if let Err(err) = self.lock.reclaim() {
                    warn!(error = %err, "cannot write this agent's pid into the instance lock again");
                }
                if let Err(err) = self.enroller.thaw().await {
                    warn!(error = %Chain(&err), "cannot resume enrollment after the failed hand-over");
                }
                self.busy.store(false, Ordering::Release);
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
