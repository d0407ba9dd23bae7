//! The new agent's side: take the instance lock, from the running agent
//! when there is one and `--takeover` asks for it.

use std::{
    io::Write as _,
    os::{fd::AsFd as _, unix::net::UnixStream},
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use tracing::{info, warn};

use super::{HANDOVER_TIMEOUT, HandoverError, Message, channel::Channel, sockets};
use crate::{
    control::{self, Request, Response},
    enroll::{Enroller, HandedPod, PodStatus},
    instance::{InstanceError, InstanceLock},
    logging::Chain,
};

/// Most pods one offer may announce (a bound on what is read, far above
/// any node's pod count).
const MAX_PODS: usize = 65_536;

/// How often the lock is tried again while a running agent that may have
/// died releases it.
const LOCK_RETRY: Duration = Duration::from_millis(50);

/// What a new agent received from the running one; dropping it (the new
/// agent fails to start) closes the channel and the running agent goes on.
#[derive(Debug)]
pub struct Incoming {
    channel: Channel,
    old_pid: u32,
    pods: Vec<HandedPod>,
    offered: usize,
    sockets: usize,
    started: Instant,
}

impl Incoming {
    /// The pods and their sockets, for re-adoption (once).
    pub fn take_pods(&mut self) -> Vec<HandedPod> {
        std::mem::take(&mut self.pods)
    }

    /// How many pods the running agent offered.
    pub fn offered(&self) -> usize {
        self.offered
    }

    /// Tells the running agent that this one serves every pod: it stops
    /// accepting, drains and exits.
    pub fn confirm(self) -> Result<(), HandoverError> {
        self.channel
            .send(
                &Message::TakenOver {
                    pid: std::process::id(),
                },
                &[],
            )
            .map_err(|source| HandoverError::Channel {
                step: "the confirmation",
                source,
            })?;
        info!(
            from_pid = self.old_pid,
            pods = self.offered,
            sockets = self.sockets,
            duration_ms = self.started.elapsed().as_millis() as u64,
            "took over from the running agent; it drains what it accepted and exits"
        );
        Ok(())
    }

    /// Tells the running agent that this one gives up (best effort: the
    /// channel closing says the same).
    fn abort(&self, reason: &str) {
        let _ = self.channel.send(
            &Message::Abort {
                reason: reason.to_owned(),
            },
            &[],
        );
    }
}

/// Re-adopts the pods received, on their sockets. Every offered pod must
/// be adopted; otherwise the hand-over is abandoned and the running agent
/// keeps them.
pub async fn readopt(incoming: &mut Incoming, enroller: &Enroller) -> Result<usize, HandoverError> {
    let offered = incoming.offered;
    let adopted = match enroller.readopt_handed(incoming.take_pods()).await {
        Ok(adopted) => adopted,
        Err(err) => {
            incoming.abort(&Chain(&err).to_string());
            return Err(HandoverError::Readopt(err));
        }
    };
    if adopted < offered {
        let err = HandoverError::Incomplete { adopted, offered };
        incoming.abort(&err.to_string());
        return Err(err);
    }
    Ok(adopted)
}

/// Takes the lock of `instance`: at once when no agent of it runs; with
/// `takeover`, from the running agent together with its pods' listening
/// sockets. If the running agent disappears mid-way, this agent waits for
/// its lock and starts as after a crash (`None`). `ipv6`
/// (`--ipv6-enabled`) says where the sockets received must be bound:
/// listeners of an agent whose IPv6 setting differs are not served.
pub async fn acquire(
    state_dir: PathBuf,
    instance: String,
    takeover: bool,
    ipv6: bool,
) -> Result<(InstanceLock, Option<Incoming>), HandoverError> {
    let blocking = move || acquire_blocking(&state_dir, &instance, takeover, ipv6);
    tokio::task::spawn_blocking(blocking)
        .await
        .map_err(|e| HandoverError::Channel {
            step: "the hand-over thread",
            source: std::io::Error::other(e),
        })?
}

fn acquire_blocking(
    state_dir: &Path,
    instance: &str,
    takeover: bool,
    ipv6: bool,
) -> Result<(InstanceLock, Option<Incoming>), HandoverError> {
    match InstanceLock::take(state_dir, instance) {
        Ok(lock) => return Ok((lock, None)),
        Err(InstanceError::Running { holder, .. }) if takeover => {
            info!(running = %holder, "an agent of this instance is running; taking over from it");
        }
        Err(err) => return Err(err.into()),
    }
    match request(state_dir, instance, ipv6) {
        Ok((lock, incoming)) => Ok((lock, Some(incoming))),
        Err(failure) if failure.peer_may_be_gone() => {
            warn!(error = %Chain(&failure), "hand-over failed and the running agent may be gone; starting as after a crash once its lock is free");
            wait_for_lock(state_dir, instance).map(|lock| (lock, None))
        }
        Err(failure) => Err(failure),
    }
}

/// The lock, once a running agent that may have died releases it.
fn wait_for_lock(state_dir: &Path, instance: &str) -> Result<InstanceLock, HandoverError> {
    let deadline = Instant::now() + HANDOVER_TIMEOUT;
    loop {
        match InstanceLock::take(state_dir, instance) {
            Ok(lock) => return Ok(lock),
            Err(InstanceError::Running { .. }) if Instant::now() < deadline => {
                std::thread::sleep(LOCK_RETRY);
            }
            Err(err) => return Err(err.into()),
        }
    }
}

/// Asks the running agent to hand over and receives the lock and every
/// pod's sockets.
fn request(
    state_dir: &Path,
    instance: &str,
    ipv6: bool,
) -> Result<(InstanceLock, Incoming), HandoverError> {
    let started = Instant::now();
    let path = control::socket_path(state_dir, instance);
    let io = |step| move |source| HandoverError::Channel { step, source };
    let mut stream = UnixStream::connect(&path).map_err(|source| HandoverError::Connect {
        path: path.clone(),
        source,
    })?;
    stream
        .set_read_timeout(Some(HANDOVER_TIMEOUT))
        .and_then(|()| stream.set_write_timeout(Some(HANDOVER_TIMEOUT)))
        .map_err(io("the request"))?;
    let request = Request::HandOver {
        pid: std::process::id(),
    };
    let body = serde_json::to_vec(&request).map_err(|e| io("the request")(e.into()))?;
    stream.write_all(&body).map_err(io("the request"))?;
    stream
        .shutdown(std::net::Shutdown::Write)
        .map_err(io("the request"))?;
    let (reply, mut fds) =
        super::channel::recv_reply(stream.as_fd()).map_err(io("the running agent's reply"))?;
    let response: Response =
        serde_json::from_slice(&reply).map_err(|e| HandoverError::Protocol {
            step: "the running agent's reply",
            got: e.to_string(),
        })?;
    if !response.ok {
        return Err(HandoverError::Refused {
            reason: response.error.unwrap_or_else(|| "no reason given".into()),
        });
    }
    let channel = match (fds.pop(), fds.is_empty()) {
        (Some(fd), true) => Channel::from_fd(fd).map_err(io("the running agent's reply"))?,
        _ => {
            return Err(HandoverError::Protocol {
                step: "the running agent's reply",
                got: "not exactly one descriptor".into(),
            });
        }
    };
    channel
        .set_timeout(HANDOVER_TIMEOUT)
        .map_err(io("the channel"))?;
    let recv = |step| match channel.recv() {
        Ok(Some(message)) => Ok(message),
        Ok(None) => Err(HandoverError::Closed { step }),
        Err(source) => Err(HandoverError::Channel { step, source }),
    };
    let unexpected = |step, got: &Message| HandoverError::Protocol {
        step,
        got: format!("{got:?}"),
    };

    let step = "the offer";
    let (offer, mut fds) = recv(step)?;
    let (old_pid, offered) = match offer {
        Message::Offer { pid, pods } if pods <= MAX_PODS && fds.len() == 1 => (pid, pods),
        other => return Err(unexpected(step, &other)),
    };
    let lock_fd = fds.pop().ok_or_else(|| unexpected(step, &Message::End))?;
    let lock = InstanceLock::adopt(lock_fd, state_dir, instance)?;

    let mut pods = Vec::new();
    let mut sockets = 0;
    for _ in 0..offered {
        let step = "a pod's sockets";
        let (message, fds) = recv(step)?;
        let Message::Pod {
            status,
            netns_dev,
            netns_ino,
            roles,
        } = message
        else {
            return Err(unexpected(step, &message));
        };
        // Sockets of the other family are no case for new listeners: the
        // running agent's would keep the ports, so the hand-over stops here
        // and the running agent goes on.
        if let Some(bound) = sockets::family_mismatch(&roles, &fds, ipv6) {
            return Err(HandoverError::Ipv6Mismatch { bound, ours: ipv6 });
        }
        let count = fds.len();
        let listeners = same_netns(&status, (netns_dev, netns_ino))
            .and_then(|()| sockets::listeners_from(&roles, fds, status.netns_cookie, ipv6));
        let listeners = match listeners {
            Ok(listeners) => {
                sockets += count;
                Some(listeners)
            }
            Err(reason) => {
                warn!(pod = %status.spec.uid, reason, "handed-over sockets unusable; the pod gets new listeners");
                None
            }
        };
        pods.push(HandedPod {
            status: *status,
            listeners,
        });
    }
    let step = "the end of the offer";
    match recv(step)? {
        (Message::End, fds) if fds.is_empty() => {}
        (other, _) => return Err(unexpected(step, &other)),
    }
    info!(
        from_pid = old_pid,
        pods = offered,
        sockets,
        "received the running agent's instance lock and listening sockets"
    );
    Ok((
        lock,
        Incoming {
            channel,
            old_pid,
            pods,
            offered,
            sockets,
            started,
        },
    ))
}

/// Whether the pod's namespace path still names the namespace the running
/// agent enrolled.
fn same_netns(status: &PodStatus, sent: (u64, u64)) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt as _;
    let meta = std::fs::metadata(&status.spec.netns)
        .map_err(|e| format!("network namespace {}: {e}", status.spec.netns.display()))?;
    if (meta.dev(), meta.ino()) == sent {
        Ok(())
    } else {
        Err(format!(
            "{} now names another network namespace",
            status.spec.netns.display()
        ))
    }
}
