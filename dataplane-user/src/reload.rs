//! Applying the local config file live.
//!
//! The file is polled (content compared every half second) rather than
//! watched with inotify: Kubernetes ConfigMap volumes and editors that
//! replace files swap inodes or symlinks under a watcher, and a poll sees
//! every such change the same way, for the cost of one small read.
//!
//! A file that does not parse or does not validate never replaces the last
//! good state: the error is logged and shown in status, and traffic keeps
//! flowing on what was in force.

use std::{path::PathBuf, sync::Arc, time::Duration};

use tracing::{info, warn};

use crate::{
    config::LocalConfig, engine::MeshContext, enroll::Enroller, logging::Chain, state::MeshState,
};

/// How often the config file is read.
pub const POLL_INTERVAL: Duration = Duration::from_millis(500);

/// Polls `path` and applies every new good version.
pub async fn watch(path: PathBuf, mesh: Arc<MeshContext>, enroller: Enroller) {
    let mut last = std::fs::read(&path).ok();
    let mut ticker = tokio::time::interval(POLL_INTERVAL);
    loop {
        ticker.tick().await;
        let current = match std::fs::read(&path) {
            Ok(bytes) => bytes,
            Err(err) => {
                let message = format!("cannot read config file {}: {err}", path.display());
                if last.is_some() {
                    warn!(error = %message, "keeping the last good configuration");
                    mesh.reject_config(message);
                    last = None;
                }
                continue;
            }
        };
        if last.as_deref() == Some(current.as_slice()) {
            continue;
        }
        last = Some(current.clone());
        // Parsing and validating a large file is CPU work: off the traffic
        // threads.
        let name = path.display().to_string();
        let result = tokio::task::spawn_blocking(move || parse(&current, &name))
            .await
            .unwrap_or_else(|e| Err(format!("configuration parser failed: {e}")));
        match result {
            Ok((config, state)) => {
                let closed = mesh.install(state);
                let config = Arc::new(config);
                if let Err(err) = enroller.apply_config(Arc::clone(&config)).await {
                    warn!(error = %Chain(&err), "cannot apply the configured workloads");
                }
                info!(
                    origin = %config.origin,
                    workloads = config.workloads.len(),
                    services = config.services.len(),
                    policies = config.policies.len(),
                    connections_closed = closed,
                    "configuration applied"
                );
            }
            Err(message) => {
                warn!(error = %message, "configuration rejected; keeping the last good one");
                mesh.reject_config(message);
            }
        }
    }
}

/// Parses and validates a config file's bytes.
fn parse(bytes: &[u8], name: &str) -> Result<(LocalConfig, MeshState), String> {
    let text = String::from_utf8_lossy(bytes);
    let config = LocalConfig::parse(&text, name).map_err(|e| Chain(&e).to_string())?;
    let state = MeshState::from_config(&config).map_err(|e| Chain(&e).to_string())?;
    Ok((config, state))
}
