//! Enrollment: putting a pod in the mesh and taking it out again.
//!
//! Enrolling = create the engine's listeners inside the pod's network
//! namespace, register them and the pod's addresses and exclusions with the
//! kernel programs (which attaches the per-namespace `sk_lookup` program and
//! marks the namespace enrolled), start serving, and record the pod in the
//! instance's state file so a restarted agent re-adopts it. Unenrolling undoes
//! all of it. Both are idempotent.
//!
//! [`Enroller`] is the only way in: it sends commands to the actor thread
//! that owns the [`Enrollments`] and the kernel programs ([`actor`]), so
//! the blocking work never runs on the traffic threads. [`PodsView`] reads
//! the pod list without waiting.

mod actor;
pub mod annotations;
mod builtin;
mod exclusions;
mod external;
mod metrics;
mod netns_checks;
mod pods;
mod serving;
mod spec;
mod standalone;
mod state;

use std::path::PathBuf;

pub use actor::{EnrolledSnapshot, Enroller, PodsView, REAP_INTERVAL};
pub use annotations::{annotation_exclusions, parse_exclusions};
pub use external::{ExternalEngine, ZtunnelEvent, ZtunnelEvents};
pub use metrics::NodeCollector;
pub use pods::{EngineSettings, Enrollments, HandedPod, OfferedPod};
pub use spec::{
    BYPASS_INBOUND_CAPTURE_ANNOTATION, DepartedPod, ExternalStatus, FAST_PATH_ANNOTATION, PodSpec,
    PodStatus, annotation_flag, exclusions_summary,
};
pub use standalone::Standalone;
pub use state::{StateFile, StateFileError};

use crate::{proxy::EngineError, redirect::RedirectError};

/// Errors enrolling or unenrolling a pod.
#[derive(Debug, thiserror::Error)]
pub enum EnrollError {
    /// The request is malformed.
    #[error("invalid pod {uid}: {reason}")]
    Invalid {
        /// The pod's uid.
        uid: String,
        /// What is wrong.
        reason: String,
    },
    /// The pod's network namespace cannot be used.
    #[error("cannot use network namespace {path} of pod {uid}")]
    Netns {
        /// The pod's uid.
        uid: String,
        /// The namespace path.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// Another pod already owns this network namespace.
    #[error("network namespace {path} is already enrolled as pod {other}; remove that pod first")]
    NetnsTaken {
        /// The namespace path.
        path: PathBuf,
        /// The uid of the pod that owns it.
        other: String,
    },
    /// The namespace is the node's own (the agent's or the init
    /// process's): enrolling it would capture the node's traffic.
    #[error(
        "network namespace {path} of pod {uid} is the {whose} network namespace: host-network pods cannot be enrolled"
    )]
    HostNetns {
        /// The pod's uid.
        uid: String,
        /// The namespace path as given.
        path: PathBuf,
        /// `agent's` or `node's (init process)`.
        whose: &'static str,
    },
    /// Another enrolled pod already owns one of the pod's IPs.
    #[error(
        "pod {uid} claims IP {ip}, which enrolled pod {owner} owns; remove {owner} first (or fix the pod's IPs)"
    )]
    IpTaken {
        /// The pod's uid.
        uid: String,
        /// The contested address.
        ip: std::net::IpAddr,
        /// The uid of the pod that owns it.
        owner: String,
    },
    /// The in-pod listeners could not be created.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// The kernel programs refused the registration.
    #[error(transparent)]
    Redirect(#[from] RedirectError),
    /// The state file could not be written.
    #[error(transparent)]
    State(#[from] state::StateFileError),
    /// The pod's certificate or TLS configuration could not be made.
    #[error("cannot set up the identity of pod {uid}")]
    Identity {
        /// The pod's uid.
        uid: String,
        /// What failed.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The enrollment actor's thread could not be started.
    #[error("cannot start the enrollment thread")]
    Actor(#[source] std::io::Error),
    /// The agent is handing its pods over to a new agent: enrollment
    /// changes wait for the new one.
    #[error(
        "the agent is handing its pods over to a new agent; retry in a moment (the new agent answers then)"
    )]
    HandingOver,
    /// The enrollment actor has stopped (the agent is shutting down).
    #[error("the agent is shutting down; enrollment is no longer possible")]
    ActorGone,
    /// Original source is required (`--original-source on`) and the pod's
    /// routing for it could not be installed.
    #[error("cannot set up original source in pod {uid}")]
    OriginalSource {
        /// The pod's uid.
        uid: String,
        /// What failed.
        #[source]
        source: crate::proxy::original_source::OriginalSourceError,
    },
    /// The ZDS server for ztunnel failed.
    #[error("cannot {what} (ZDS, --engine ztunnel)")]
    Ztunnel {
        /// What was being done.
        what: &'static str,
        /// Why it failed.
        #[source]
        source: crate::zds::ZdsError,
    },
    /// Starting the listeners' tasks failed.
    #[error("cannot start serving pod {uid}")]
    Serve {
        /// The pod's uid.
        uid: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}
