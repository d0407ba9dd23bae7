//! The node agent's life cycle, in three steps: [`start`] checks the host,
//! reads the config, attaches the kernel programs, re-adopts the pods a
//! previous agent enrolled and serves the control socket, returning the
//! running parts ([`Bound`]); [`Bound::wait`] waits for SIGINT/SIGTERM,
//! `/quitquitquit` or a hand-over; [`Bound::shut_down`] drains and keeps
//! or removes kernel state as `--on-exit` says. With `--takeover` it takes
//! a running agent's pods and listening sockets over instead; an agent
//! whose pods were taken over drains and leaves everything to its
//! successor ([`crate::handover`]). Everything it runs with is one
//! [`config::AgentConfig`], built before anything starts.

pub mod config;
mod endpoints;
mod mesh;
mod shutdown;
mod start;
mod wait;

pub use start::{Bound, start};
pub use wait::{Signals, Stop};

use config::AgentConfig;

use crate::{
    config::ConfigError, enroll::EnrollError, preflight::PreflightError, redirect::RedirectError,
};

/// Why the agent stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// The host lacks something the agent needs.
    #[error(transparent)]
    Preflight(#[from] PreflightError),
    /// The configuration is unusable.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// Loading, attaching or pinning kernel programs failed.
    #[error(transparent)]
    Redirect(#[from] RedirectError),
    /// Re-adopting enrolled pods failed.
    #[error(transparent)]
    Enroll(#[from] EnrollError),
    /// The connection worker threads could not start.
    #[error(transparent)]
    Workers(#[from] crate::workers::WorkersError),
    /// The DNS settings are unusable.
    #[error(transparent)]
    Dns(#[from] crate::dns::DnsError),
    /// The control socket could not be bound.
    #[error("cannot bind the control socket {path}")]
    Control {
        /// The socket path.
        path: std::path::PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The workload state is unusable.
    #[error(transparent)]
    State(#[from] crate::state::StateError),
    /// The CA or certificates could not be set up.
    #[error(transparent)]
    Ca(#[from] crate::identity::CaError),
    /// Another agent of this instance is running.
    #[error(transparent)]
    Instance(#[from] crate::instance::InstanceError),
    /// Taking over from the running agent failed.
    #[error(transparent)]
    Handover(#[from] crate::handover::HandoverError),
    /// Installing signal handlers failed.
    #[error("cannot install signal handlers")]
    Signal(#[source] std::io::Error),
    /// The Kubernetes client for --kube could not be set up.
    #[error(transparent)]
    Kube(#[from] crate::kube::KubeError),
    /// istiod's root certificate file is unusable.
    #[error(transparent)]
    IstiodRoots(#[from] config::RootsError),
    /// `--original-source on` cannot work on this host.
    #[error(transparent)]
    OriginalSource(#[from] config::OriginalSourceError),
    /// The certificate source's roots cannot form a trust bundle.
    #[error("cannot trust the roots of {source_name}: {source}")]
    TrustBundle {
        /// The certificate source.
        source_name: String,
        /// Why.
        #[source]
        source: crate::identity::TrustBundleError,
    },
    /// The SPIFFE Workload API gave no trust bundle at start.
    #[error(transparent)]
    Spiffe(#[from] crate::identity::WorkloadApiError),
    /// The mounted certificate directory has no usable root bundle.
    #[error(transparent)]
    CertDir(#[from] crate::identity::CertDirError),
    /// The TLS policy differs from the one this process already uses (a
    /// second in-process agent with other TLS flags).
    #[error(transparent)]
    TlsPolicy(#[from] crate::tls::PolicyError),
    /// The revocation list file exists but is unusable.
    #[error(transparent)]
    Crl(#[from] crate::identity::CrlError),
}

/// Runs the agent until SIGINT, SIGTERM, the admin `/quitquitquit` or a
/// hand-over, then drains and shuts down.
pub async fn run(config: AgentConfig) -> Result<(), AgentError> {
    // Installed first: a SIGTERM that arrives while programs are being
    // attached must still lead to an orderly shutdown, not the default kill.
    let mut signals = Signals::install().map_err(AgentError::Signal)?;
    let bound = start(config).await?;
    let stop = bound.wait(Some(&mut signals)).await;
    bound.shut_down(stop, Some(&mut signals)).await
}

/// `(device, inode)` of the file at `path`, if there is one.
fn file_identity(path: &std::path::Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt as _;
    std::fs::symlink_metadata(path)
        .ok()
        .map(|m| (m.dev(), m.ino()))
}

/// Gives back to the kernel the heap that loading the kernel object (ELF,
/// BTF, relocations) and reading the configuration used and freed: glibc
/// keeps freed memory in its arenas otherwise, about 2.5 MiB of resident
/// memory for the agent's whole life.
fn release_startup_memory() {
    // SAFETY: malloc_trim only returns free heap pages to the kernel; it
    // takes no pointers and is safe to call at any time.
    #[cfg(target_env = "gnu")]
    unsafe {
        libc::malloc_trim(0);
    }
}
