//! What callers hand the ZDS server and what it reports back.

use std::{net::IpAddr, os::fd::OwnedFd, path::PathBuf, time::Duration};

use serde::Serialize;

use super::DEFAULT_SOCKET;

/// Settings of a [`super::ZdsServer`].
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ZdsConfig {
    /// Where to listen ([`DEFAULT_SOCKET`] by default). A stale socket
    /// file is removed first; the parent directory is created if missing.
    pub socket: PathBuf,
    /// Bound on each wait for the peer: the hello after it connects, each
    /// write, and each ack (Istio's node agent uses 5 s). A peer that
    /// misses it is dropped.
    pub io_timeout: Duration,
    /// Bound on [`super::ZdsHandle::add`] and [`super::ZdsHandle::del`]
    /// as a whole, including waiting behind other requests (a snapshot in
    /// progress). Past it the call answers [`AddOutcome::TimedOut`]; the
    /// request still goes out when its turn comes.
    pub request_timeout: Duration,
    /// Connections held at once; more are closed at accept.
    pub max_connections: usize,
    /// First delay before re-sending an Add ztunnel nacked; it doubles per
    /// attempt up to [`Self::retry_max`] and continues while the pod is
    /// registered and the connection is the newest.
    pub retry_first: Duration,
    /// Longest delay between re-sends of a nacked Add.
    pub retry_max: Duration,
}

impl Default for ZdsConfig {
    fn default() -> Self {
        Self {
            socket: PathBuf::from(DEFAULT_SOCKET),
            io_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(15),
            max_connections: 8,
            retry_first: Duration::from_secs(1),
            retry_max: Duration::from_secs(30),
        }
    }
}

/// A pod to hand to ztunnel.
#[derive(Debug)]
pub struct ZdsPod {
    /// Opaque to ztunnel: the key of later `DelWorkload` (the Kubernetes
    /// pod uid).
    pub uid: String,
    /// Pod name; with `namespace` and `service_account`, how ztunnel finds
    /// the pod's workload among those on its node.
    pub name: String,
    /// Kubernetes namespace.
    pub namespace: String,
    /// Service account.
    pub service_account: String,
    /// The pod's addresses (not sent to ztunnel; kept for status and for
    /// the kernel side).
    pub ips: Vec<IpAddr>,
    /// The pod's network namespace (an open `/proc/PID/ns/net` or
    /// `/var/run/netns/NAME`); the kernel duplicates it into ztunnel with
    /// every Add.
    pub netns: OwnedFd,
}

/// The process at the other end of a connection (`SO_PEERCRED`, taken when
/// it connected).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ZtunnelPeer {
    /// This server's number for the connection, unique while it runs (one
    /// ztunnel process may reconnect several times).
    pub connection: u64,
    /// Its process id, in the agent's pid namespace: 0 when ztunnel's
    /// process is not visible there (run the agent with `hostPID: true` so
    /// the kernel side can reach ztunnel's sockets through it).
    pub pid: i32,
    /// Its user id.
    pub uid: u32,
    /// Its group id.
    pub gid: u32,
}

/// How [`super::ZdsHandle::add`] ended. In every case the pod stays
/// registered and is in every later snapshot until
/// [`super::ZdsHandle::del`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AddOutcome {
    /// ztunnel acked: its listeners in the pod are bound.
    Acked {
        /// The ztunnel that acked.
        peer: ZtunnelPeer,
    },
    /// ztunnel answered with an error; the Add is re-sent with backoff and
    /// the status shows the error until an ack.
    Nacked {
        /// ztunnel's error text.
        error: String,
    },
    /// No ztunnel is connected (or none has said hello yet); the pod goes
    /// in the snapshot when one does.
    NoZtunnel,
    /// No answer within [`ZdsConfig::request_timeout`] (or the connection
    /// missed [`ZdsConfig::io_timeout`] and was dropped).
    TimedOut,
    /// The connection ended before ztunnel answered.
    ConnectionLost {
        /// Why it ended.
        reason: String,
    },
}

/// How [`super::ZdsHandle::del`] ended. The pod is forgotten in every case.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DelOutcome {
    /// Connections the Del was sent to (those past their hello).
    pub connections: usize,
    /// Of those, how many acked without error.
    pub acked: usize,
    /// Errors of the others (nack texts, lost connections, timeouts).
    pub errors: Vec<String>,
}

/// Told what happens on ztunnel connections, from the server's task: it
/// must return quickly (hand the event to a channel).
pub trait ZdsObserver: Send + Sync + 'static {
    /// ztunnel acked an Add: its listeners in pod `uid`'s namespace exist.
    /// Called for live adds, snapshot re-adds after a reconnect, and
    /// successful retries alike.
    fn acked(&self, uid: &str, peer: &ZtunnelPeer);
    /// A connection that had said hello ended (its listeners may be gone).
    fn disconnected(&self, peer: &ZtunnelPeer);
    /// ztunnel answered an Add of pod `uid` with `error` (`attempts` in a
    /// row); the Add is retried with backoff.
    fn refused(&self, _uid: &str, _peer: &ZtunnelPeer, _error: &str, _attempts: u32) {}
}

/// An observer that ignores everything.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoObserver;

impl ZdsObserver for NoObserver {
    fn acked(&self, _uid: &str, _peer: &ZtunnelPeer) {}
    fn disconnected(&self, _peer: &ZtunnelPeer) {}
}

/// The server's state, for `status` and the admin page.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ZdsStatus {
    /// The listening socket.
    pub socket: PathBuf,
    /// Current connections, oldest first (adds go to the last that said
    /// hello).
    pub connections: Vec<ConnectionStatus>,
    /// Registered pods, by uid.
    pub pods: Vec<PodZdsStatus>,
}

/// One ztunnel connection.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ConnectionStatus {
    /// Who is connected.
    pub peer: ZtunnelPeer,
    /// When it connected, in seconds since the Unix epoch.
    pub connected_at: u64,
    /// It said hello (it is a ztunnel speaking V1).
    pub hello: bool,
}

/// One registered pod.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PodZdsStatus {
    /// The pod's uid.
    pub uid: String,
    /// Pod name.
    pub name: String,
    /// Kubernetes namespace.
    pub namespace: String,
    /// Where it stands with ztunnel.
    pub state: PodZdsState,
}

/// Where a pod stands with ztunnel.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase", tag = "state")]
pub enum PodZdsState {
    /// Not acked by any current connection yet (none connected, or its
    /// Add is on the way).
    Waiting,
    /// Acked by a connection that is still up: ztunnel captures it.
    Acked {
        /// The ztunnel that acked.
        peer: ZtunnelPeer,
        /// When, in seconds since the Unix epoch.
        at: u64,
    },
    /// ztunnel nacked it (or the attempt failed); being retried.
    Failed {
        /// The last error.
        error: String,
        /// Attempts that failed since the last ack.
        attempts: u32,
        /// When the last failed, in seconds since the Unix epoch.
        at: u64,
    },
}
