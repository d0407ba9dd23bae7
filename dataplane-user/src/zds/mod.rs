//! ZDS server: the agent as the node agent a stock Istio ztunnel expects,
//! handing it each enrolled pod's network namespace.
//!
//! # The protocol (Istio's `zds.proto`, messages in [`crate::istio_api::zds`])
//!
//! - Transport: a unix `SOCK_SEQPACKET` socket, one protobuf message per
//!   datagram. Both sides read into 1,024-byte buffers and treat a
//!   truncated datagram (`MSG_TRUNC`) as an error, so no message may be
//!   longer ([`MAX_DATAGRAM`]). The node agent listens, by default at
//!   [`DEFAULT_SOCKET`], after removing a stale socket file; ztunnel
//!   connects and reconnects with backoff.
//! - ztunnel speaks first: `ZdsHello{version: V1}`. Then only the server
//!   talks, one `WorkloadRequest` at a time, each answered by one
//!   `WorkloadResponse{ack{error}}` (empty error = success). Acks carry no
//!   id; they match requests by order alone, so a request whose answer did
//!   not come in time leaves the stream unusable and the connection is
//!   dropped (ztunnel reconnects and is sent a snapshot).
//! - On every connection the server first sends a snapshot: an
//!   `AddWorkload{uid, workload_info{name, namespace, service_account}}`
//!   per registered pod, then `SnapshotSent`. ztunnel then drops any pod it
//!   was not sent, so a pod must be registered before ztunnel connects to
//!   survive an agent restart ([`ZdsServer::start`] takes the initial pods).
//!   Later pods go to the newest connection; `DelWorkload{uid}` goes to
//!   every connection (during a ztunnel upgrade two may be connected).
//! - An `AddWorkload` carries exactly one descriptor (`SCM_RIGHTS`): the
//!   pod's network namespace, which ztunnel keys the pod by (its inode).
//!   ztunnel opens its listeners inside that namespace and acks once they
//!   are bound, so an ack means the sockets exist; it nacks when they could
//!   not be opened (and retries itself without telling us, so the server
//!   re-sends the Add with backoff to learn the outcome). ztunnel exits on
//!   a protocol error: an Add without `workload_info`, `KeepWorkload` after
//!   the snapshot, a second `SnapshotSent`. This server never sends
//!   `KeepWorkload` (it always has the namespace).
//! - Liveness: ztunnel never sends unprompted, so Istio's agent probes an
//!   idle connection every 5 s with a 10 ms read (nothing = alive, end of
//!   file = gone, a datagram = protocol error). This server watches an idle
//!   connection's readability the whole time instead, which sees the same
//!   three cases at once.
//!
//! # What the kernel side gets
//!
//! The peer credentials (`SO_PEERCRED`: pid, uid, gid) of each connected
//! ztunnel ([`ZtunnelPeer`]). A [`ZdsObserver`] is told after every
//! successful Add (live, in a snapshot, or on a retry), which is when
//! ztunnel's listeners in the pod exist and can be found through that pid,
//! and when a connection ends.
//!
//! # Bounds
//!
//! A peer cannot hold the server: every read and write has a timeout
//! ([`ZdsConfig::io_timeout`]); a peer that sends garbage, an oversized or
//! truncated datagram, descriptors, or anything while it should be silent
//! is dropped with a log naming its pid; at most
//! [`ZdsConfig::max_connections`] connections exist at once.
//!
//! ```no_run
//! # async fn example() -> Result<(), dataplane_user::zds::ZdsError> {
//! use std::sync::Arc;
//! use dataplane_user::zds::{ZdsConfig, ZdsServer, ZdsPod, NoObserver};
//!
//! let server = ZdsServer::start(ZdsConfig::default(), Arc::new(NoObserver), Vec::new())?;
//! let handle = server.handle();
//! let netns = std::fs::File::open("/var/run/netns/pod-a").expect("netns").into();
//! let pod = ZdsPod {
//!     uid: "3f1c...".into(),
//!     name: "pod-a".into(),
//!     namespace: "default".into(),
//!     service_account: "default".into(),
//!     ips: vec![],
//!     netns,
//! };
//! let outcome = handle.add(pod).await?;
//! # Ok(()) }
//! ```

mod messages;
mod registry;
mod seqpacket;
mod server;
mod session;
mod types;

use std::{io, path::PathBuf, time::Duration};

pub use seqpacket::MAX_DATAGRAM;
pub use server::{ZdsHandle, ZdsServer};
pub use types::{
    AddOutcome, ConnectionStatus, DelOutcome, NoObserver, PodZdsState, PodZdsStatus, ZdsConfig,
    ZdsObserver, ZdsPod, ZdsStatus, ZtunnelPeer,
};

/// Where Istio's node agent listens and ztunnel connects (ztunnel's
/// `INPOD_UDS` default).
pub const DEFAULT_SOCKET: &str = "/var/run/ztunnel/ztunnel.sock";

/// Errors of the ZDS server: starting it, calling it, and the reasons a
/// ztunnel connection is dropped (those reach the log and the pods'
/// status, not the caller).
#[derive(Debug, thiserror::Error)]
pub enum ZdsError {
    /// The socket path exists and is not a socket, so it is not a stale
    /// socket file this server may remove.
    #[error(
        "cannot listen for ztunnel at {path}: it exists and is not a socket; remove it or choose another path"
    )]
    NotASocket {
        /// The configured socket path.
        path: PathBuf,
    },
    /// Creating, removing or binding the listening socket failed.
    #[error(
        "cannot listen for ztunnel at {path} ({step}); check the directory exists and is writable by the agent (the hostPath ztunnel mounts)"
    )]
    Listen {
        /// The configured socket path.
        path: PathBuf,
        /// Which step failed (e.g. "remove stale socket", "bind").
        step: &'static str,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The server was started outside a tokio runtime, or a blocking call
    /// was made from async code.
    #[error("ZDS server: {what}")]
    Runtime {
        /// What was wrong, and what to call instead.
        what: &'static str,
    },
    /// The server has stopped; nothing more can be sent to ztunnel.
    #[error("the ZDS server has stopped; restart the agent's ztunnel engine")]
    Stopped,
    /// The pod cannot be described to ztunnel.
    #[error("cannot send pod {uid} to ztunnel: {reason}")]
    InvalidPod {
        /// The pod's uid.
        uid: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A read or write on a ztunnel connection failed.
    #[error("{step} with ztunnel (pid {peer_pid}) failed")]
    Io {
        /// What was being done (e.g. "reading the hello").
        step: &'static str,
        /// The connected process.
        peer_pid: i32,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// ztunnel did not answer, or its socket did not drain, in time.
    #[error(
        "ztunnel (pid {peer_pid}) did not finish {step} within {after:?}; dropping the connection"
    )]
    Timeout {
        /// What was being waited for.
        step: &'static str,
        /// The connected process.
        peer_pid: i32,
        /// The bound that passed.
        after: Duration,
    },
    /// ztunnel closed the connection.
    #[error("ztunnel (pid {peer_pid}) closed the connection while {step}")]
    Closed {
        /// What the server was doing.
        step: &'static str,
        /// The connected process.
        peer_pid: i32,
    },
    /// The peer broke the protocol: a datagram over [`MAX_DATAGRAM`]
    /// bytes, one that does not decode, one with descriptors, or one when
    /// it should have been silent.
    #[error(
        "ztunnel (pid {peer_pid}) broke the ZDS protocol while {step}: {what}; dropping the connection"
    )]
    Protocol {
        /// What the server was doing.
        step: &'static str,
        /// The connected process.
        peer_pid: i32,
        /// What it sent.
        what: String,
    },
    /// The peer's hello names a protocol version this server does not
    /// speak.
    #[error(
        "ztunnel (pid {peer_pid}) speaks ZDS version {version}, this agent only V1 (1); use a ztunnel release that matches the agent"
    )]
    UnsupportedVersion {
        /// The connected process.
        peer_pid: i32,
        /// The version it announced.
        version: i32,
    },
}
