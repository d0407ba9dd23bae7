//! The node agent's life cycle: check the host, read the config, attach the
//! kernel programs, serve until SIGINT/SIGTERM, then keep or remove kernel
//! state as `--on-exit` says.

use tokio::signal::unix::{SignalKind, signal};
use tracing::info;

use crate::{
    cli::RunArgs,
    config::{ConfigError, LocalConfig},
    preflight::{self, PreflightError, PreflightInput},
    redirect::{PinLayout, RedirectError, Redirector, RedirectorOptions},
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
    /// Installing signal handlers failed.
    #[error("cannot install the SIGTERM handler: {0}")]
    Signal(#[source] std::io::Error),
}

/// Runs the agent until SIGINT or SIGTERM.
pub async fn run(args: RunArgs) -> Result<(), AgentError> {
    // Installed first: a SIGTERM that arrives while programs are being
    // attached must still lead to an orderly shutdown, not the default kill.
    let mut sigterm = signal(SignalKind::terminate()).map_err(AgentError::Signal)?;
    let mut sigint = signal(SignalKind::interrupt()).map_err(AgentError::Signal)?;
    let config = match &args.config {
        Some(path) => LocalConfig::from_file(path)?,
        None => LocalConfig::embedded()?,
    };
    info!(origin = %config.origin, workloads = config.workloads.len(), "configuration loaded");

    let cgroup = preflight::check(&PreflightInput {
        bpffs: &args.state.bpffs,
        cgroup: args.cgroup.as_deref(),
    })?;
    let mut options = RedirectorOptions::new(
        cgroup,
        PinLayout::new(&args.state.bpffs, &args.state.instance),
    );
    options.config.proxy_mark = args.proxy_mark;
    let redirector = Redirector::attach(&options)?;

    info!(instance = %args.state.instance, on_exit = ?args.on_exit, "agent ready");
    tokio::select! {
        _ = sigterm.recv() => info!("SIGTERM received, stopping"),
        _ = sigint.recv() => info!("SIGINT received, stopping"),
    }
    redirector.shutdown(args.on_exit)?;
    info!("agent stopped");
    Ok(())
}
