//! Upgrading the agent without refusing a connection: a new agent started
//! with `dataplane run --takeover` takes the running agent's in-pod
//! listening sockets over, as Envoy's hot restart passes its listeners.
//!
//! The in-pod listeners (15001, 15006, 15008 in each enrolled pod's network
//! namespace) are what the kernel side points at: `connect4` sends captured
//! outbound connections to the pod's `127.0.0.1:15001`, and `sk_lookup`
//! picks 15006/15008 from the `LISTENERS` socket map. An agent that stops
//! closes them, and until a new agent has bound new ones every captured
//! connection is refused or reset. Handing the *same* sockets over keeps
//! every kernel reference valid and every queued connection queued: the
//! new agent accepts from the same queue.
//!
//! The exchange, over the instance's control socket:
//!
//! 1. The new agent finds the instance lock held and sends
//!    `{"op":"handOver","pid":N}`.
//! 2. The running agent freezes its pod set (enrollment changes are
//!    refused with a retry hint until the end) and answers `ok` with one
//!    end of a `SOCK_SEQPACKET` pair attached (`SCM_RIGHTS`); the rest goes
//!    over that pair ([`channel`]).
//! 3. It sends `offer` with a descriptor of its open instance lock file
//!    (the `flock` belongs to the open file, so the new agent then holds it
//!    too), one `pod` message per pod (its status, its namespace's device
//!    and inode, and one descriptor per listener role), and `end`.
//! 4. The new agent checks every descriptor ([`sockets`]), loads its
//!    programs against the pinned maps, re-adopts every pod on the
//!    sockets it received (the kernel's entries are rewritten with the
//!    same sockets) and serves them: both agents now accept from the same
//!    queues.
//! 5. The new agent sends `takenOver` and moves its control socket onto
//!    the path. The running agent stops accepting, drains what it
//!    accepted until its drain deadline, and exits 0 without touching
//!    kernel state, the state file or the lock.
//!
//! Every step is bounded by [`HANDOVER_TIMEOUT`]. If the new agent dies or
//! gives up (`abort`) before step 5, the running agent thaws and goes on.
//! If the running agent dies mid-way, the new agent drops what it received
//! and starts as after a crash (waits for the lock, re-adopts the pods
//! from the state file with new listeners).

mod channel;
mod give;
mod sockets;
mod take;

use std::{path::PathBuf, time::Duration};

use serde::{Deserialize, Serialize};

pub use give::Giver;
pub use take::{Incoming, acquire, readopt};

use crate::enroll::PodStatus;
use sockets::Role;

/// Bound on every step of a hand-over, including the new agent's whole
/// start between receiving the sockets and confirming (loading programs,
/// issuing each pod's certificate).
pub const HANDOVER_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a new agent waits for the running agent to release the port
/// of an HTTP endpoint (readiness, metrics, admin): its drain, then its
/// exit.
pub const ENDPOINT_WAIT: Duration = Duration::from_secs(600);

/// How often a held endpoint port is tried again.
const ENDPOINT_RETRY: Duration = Duration::from_millis(100);

/// Binds `addr` for the endpoint `name` once the agent taken over from has
/// released it (within [`ENDPOINT_WAIT`]); `None`, logged, if it never is.
pub async fn bind_when_free(
    name: &'static str,
    addr: std::net::SocketAddr,
) -> Option<tokio::net::TcpListener> {
    let deadline = tokio::time::Instant::now() + ENDPOINT_WAIT;
    loop {
        tokio::time::sleep(ENDPOINT_RETRY).await;
        match crate::httpd::bind(addr).await {
            Ok(listener) => {
                tracing::info!(%addr, "{name} endpoint listening (released by the agent taken over from)");
                return Some(listener);
            }
            Err(err)
                if err.kind() == std::io::ErrorKind::AddrInUse
                    && tokio::time::Instant::now() < deadline => {}
            Err(err) => {
                tracing::warn!(%addr, error = %err, "cannot serve the {name} endpoint; set --{name}-addr");
                return None;
            }
        }
    }
}

/// One message on the hand-over channel.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "msg", rename_all = "camelCase", deny_unknown_fields)]
enum Message {
    /// Running agent → new: what follows. Carries the lock descriptor.
    Offer {
        /// The running agent's pid.
        pid: u32,
        /// How many `pod` messages follow.
        pods: usize,
    },
    /// Running agent → new: one pod. Carries one descriptor per role.
    Pod {
        /// The pod as enrolled.
        status: Box<PodStatus>,
        /// Device of its network namespace.
        netns_dev: u64,
        /// Inode of its network namespace.
        netns_ino: u64,
        /// What each descriptor is, in order.
        roles: Vec<Role>,
    },
    /// Running agent → new: every pod was sent.
    End,
    /// New → running agent: every pod is served by the new agent; stop
    /// accepting, drain, exit.
    TakenOver {
        /// The new agent's pid.
        pid: u32,
    },
    /// New → running agent: the new agent gives up; go on as before.
    Abort {
        /// Why.
        reason: String,
    },
}

/// Errors of a hand-over.
#[derive(Debug, thiserror::Error)]
pub enum HandoverError {
    /// The running agent's control socket cannot be reached.
    #[error("cannot reach the running agent at {path} to take over from it")]
    Connect {
        /// The control socket.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The running agent refused (an older version without hand-over, or
    /// one already handing over).
    #[error(
        "the running agent refused to hand over: {reason} (retry, or stop it and start this one without --takeover)"
    )]
    Refused {
        /// Its reason.
        reason: String,
    },
    /// Talking to the other agent failed (including a step that took
    /// longer than the hand-over timeout).
    #[error("the hand-over failed at {step}")]
    Channel {
        /// What was under way.
        step: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The other agent closed the channel (it died or gave up).
    #[error("the other agent closed the hand-over channel during {step}")]
    Closed {
        /// What was under way.
        step: &'static str,
    },
    /// The other agent sent something out of turn.
    #[error("unexpected hand-over message during {step}: {got}")]
    Protocol {
        /// What was under way.
        step: &'static str,
        /// What came.
        got: String,
    },
    /// The new agent gave up before serving every pod.
    #[error("the new agent gave up: {reason}")]
    Abandoned {
        /// Its reason.
        reason: String,
    },
    /// Re-adopting the received pods failed.
    #[error("re-adopting the handed-over pods failed; the running agent keeps them")]
    Readopt(#[source] crate::enroll::EnrollError),
    /// The new agent could not take every pod over.
    #[error(
        "the new agent could take over {adopted} of {offered} pods; the running agent keeps them"
    )]
    Incomplete {
        /// Pods re-adopted.
        adopted: usize,
        /// Pods offered.
        offered: usize,
    },
    /// The running agent's listeners are of another IP family than this
    /// agent's `--ipv6-enabled` makes: a hand-over passes the very sockets,
    /// whose family cannot change, and new ones could not bind beside them.
    #[error(
        "the running agent's listener is bound to {bound}, and this agent runs with \
         --ipv6-enabled {ours}: start it with the running agent's --ipv6-enabled, or stop \
         the running agent first (its pods then get new listeners); the running agent keeps its pods"
    )]
    Ipv6Mismatch {
        /// Where one of the running agent's listeners is bound.
        bound: std::net::SocketAddr,
        /// This agent's `--ipv6-enabled`.
        ours: bool,
    },
    /// The lock could not be taken or adopted.
    #[error(transparent)]
    Instance(#[from] crate::instance::InstanceError),
}

impl HandoverError {
    /// Whether the failure may mean the running agent is gone (then
    /// starting as after a crash is right), rather than that it refused or
    /// is stuck.
    fn peer_may_be_gone(&self) -> bool {
        match self {
            Self::Connect { .. } | Self::Closed { .. } => true,
            Self::Channel { source, .. } => !matches!(
                source.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ),
            _ => false,
        }
    }
}
