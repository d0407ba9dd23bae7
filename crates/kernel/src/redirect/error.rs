//! Errors of the redirector.

use std::{io, net::IpAddr, path::PathBuf};

use aya::{
    maps::MapError,
    pin::PinError,
    programs::{ProgramError, links::LinkError},
};

/// Errors of the redirector.
#[derive(Debug, thiserror::Error)]
pub enum RedirectError {
    /// A directory for pins could not be created.
    #[error("cannot create pin directory {path} (is bpffs mounted there and writable?)")]
    PinDir {
        /// The directory.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The kernel refused the object (maps or BTF).
    #[error("loading the kernel object failed")]
    Load {
        /// aya's error, which carries the verifier log when there is one.
        #[source]
        source: Box<aya::EbpfError>,
    },
    /// The embedded object could not be read.
    #[error("cannot read the embedded kernel object")]
    Object {
        /// What went wrong.
        #[source]
        source: super::ObjectError,
    },
    /// A map pinned by an earlier agent has another definition than the one
    /// this agent's object declares: adopting it would run the new programs
    /// against state laid out for the old ones.
    #[error(
        "the pinned map `{name}` at {path} does not match this agent's definition \
         (pinned vs this agent: {differences}); it was made by an agent with another map \
         layout. Stop that agent with `dataplane run --on-exit detach`, or remove \
         {pins_dir} (pods enrolled there lose capture until re-enrolled), then start again"
    )]
    PinnedMapMismatch {
        /// Map name in the object.
        name: &'static str,
        /// The pin.
        path: PathBuf,
        /// Each differing field, `<field> <pinned> vs <this agent's>`.
        differences: String,
        /// The instance's pin directory, to remove by hand.
        pins_dir: PathBuf,
    },
    /// A pinned map could not be opened or described.
    #[error(
        "cannot inspect the pinned map `{name}` at {path} (is it a map? remove it if it is \
         left over from something else)"
    )]
    InspectPinnedMap {
        /// Map name in the object.
        name: &'static str,
        /// The pin.
        path: PathBuf,
        /// aya's error.
        #[source]
        source: MapError,
    },
    /// The object lacks a program the agent expects.
    #[error(
        "the embedded object has no program `{name}`; agent and object are out of step (rebuild)"
    )]
    MissingProgram {
        /// Program name.
        name: &'static str,
    },
    /// The object lacks a map the agent expects.
    #[error("the embedded object has no map `{name}`; agent and object are out of step (rebuild)")]
    MissingMap {
        /// Map name.
        name: &'static str,
    },
    /// A program was rejected by the verifier or has the wrong type.
    #[error("program `{name}` failed to load or attach")]
    Program {
        /// Program name.
        name: &'static str,
        /// aya's error (with the verifier log when it is a verifier error).
        #[source]
        source: ProgramError,
    },
    /// The attach cgroup could not be opened.
    #[error("cannot open cgroup {path} (pass an existing cgroup v2 directory with --cgroup)")]
    OpenCgroup {
        /// The cgroup directory.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// A link could not be turned into a pinnable fd link.
    #[error("program `{name}` was attached without a BPF link (kernel >= 5.7 is required)")]
    NotALink {
        /// Program name.
        name: &'static str,
        /// aya's error.
        #[source]
        source: LinkError,
    },
    /// Pinning a link failed.
    #[error("cannot pin the link of `{name}` at {path}")]
    PinLink {
        /// Program name.
        name: &'static str,
        /// Pin path.
        path: PathBuf,
        /// aya's error.
        #[source]
        source: PinError,
    },
    /// Attaching `dp_sk_lookup` to a pod's network namespace failed.
    #[error(
        "cannot attach the inbound program to the network namespace with cookie {netns_cookie} \
         (sk_lookup needs kernel >= 5.9)"
    )]
    AttachNetns {
        /// Cookie of the pod's network namespace.
        netns_cookie: u64,
        /// aya's error.
        #[source]
        source: ProgramError,
    },
    /// Attaching or detaching `dp_proxy_syn` on a pod's `lo` failed.
    #[error(
        "cannot {action} the external proxy's SYN program on lo in the network namespace with \
         cookie {netns_cookie} (needs CAP_NET_ADMIN and CAP_SYS_ADMIN to enter the namespace)"
    )]
    ProxySyn {
        /// Cookie of the pod's network namespace.
        netns_cookie: u64,
        /// What was being done (`attach`, `detach`, ...).
        action: &'static str,
        /// The underlying error (aya's, or the OS's).
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// Listeners were given for a pod that is not enrolled.
    #[error(
        "the pod with network namespace cookie {netns_cookie} is not enrolled; enroll it \
         (enroll_external_pod) before registering its listeners"
    )]
    NotEnrolled {
        /// Cookie of the pod's network namespace.
        netns_cookie: u64,
    },
    /// The kernel refused an engine listener for `LISTENERS`.
    #[error(
        "cannot register the listener for {pod_addr} port {port} \
         (it must be a listening TCP socket)"
    )]
    Listener {
        /// The pod IP the listener serves.
        pod_addr: IpAddr,
        /// The listener's role port.
        port: u16,
        /// aya's error.
        #[source]
        source: MapError,
    },
    /// An engine listener cannot take the pod's connections.
    #[error("the listener for port {port} cannot serve the pod: {reason}")]
    UnusableListener {
        /// The listener's role port.
        port: u16,
        /// What is wrong with the socket.
        reason: &'static str,
    },
    /// Reading an engine listener's socket options failed.
    #[error("cannot inspect the listener for port {port} (is it a socket?)")]
    InspectListener {
        /// The listener's role port.
        port: u16,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// A map operation failed.
    #[error("operation on map `{name}` failed")]
    Map {
        /// Map name.
        name: &'static str,
        /// aya's error.
        #[source]
        source: MapError,
    },
    /// Removing pinned state failed.
    #[error("cannot remove pinned state {path}")]
    Unpin {
        /// The path that could not be removed.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
}

/// Whether a map error means "no such key" (aya reports a delete of a
/// missing key as a raw `ENOENT` syscall error).
pub(crate) fn is_not_found(err: &MapError) -> bool {
    match err {
        MapError::KeyNotFound => true,
        MapError::SyscallError(e) => e.io_error.raw_os_error() == Some(libc::ENOENT),
        _ => false,
    }
}

/// A closure turning a [`MapError`] on map `name` into a [`RedirectError`].
pub(crate) fn map_err(name: &'static str) -> impl Fn(MapError) -> RedirectError {
    move |source| RedirectError::Map { name, source }
}
