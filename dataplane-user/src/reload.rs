//! Applying the local config file live.
//!
//! The file is polled (its metadata every half second, its content when
//! that changed) rather than watched with inotify: Kubernetes ConfigMap
//! volumes and editors that replace files swap inodes or symlinks under a
//! watcher, and a poll sees every such change the same way, for the cost
//! of one `stat`. A change is
//! applied once two consecutive reads agree on it, so a file caught
//! half-written is never applied; an empty file never is (it would take
//! every workload out of the mesh at once).
//!
//! A file that does not parse or does not validate never replaces the last
//! good state: the error is logged and shown in status, and traffic keeps
//! flowing on what was in force.

use std::{
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use tracing::warn;

use crate::{
    config::{LocalConfig, MAX_CONFIG_BYTES},
    logging::Chain,
    mesh::MeshContext,
    sources::ConfigSources,
    state::MeshState,
};

/// How often the config file is read.
pub const POLL_INTERVAL: Duration = Duration::from_millis(500);

/// Polls `path` and applies every new good version once two consecutive
/// reads agree on it.
pub async fn watch(path: PathBuf, mesh: Arc<MeshContext>, sources: Arc<ConfigSources>) {
    // The content last decided on (applied or rejected), as read at start.
    let mut decided = read_bounded(&path).ok();
    let mut seen = stamp(&path);
    // Content that differs from `decided`, seen by one read so far.
    let mut pending: Option<Vec<u8>> = None;
    let mut ticker = tokio::time::interval(POLL_INTERVAL);
    loop {
        ticker.tick().await;
        let now = stamp(&path);
        if pending.is_none() && now.is_some() && now == seen {
            continue;
        }
        seen = now;
        let current = match read_bounded(&path) {
            Ok(bytes) => bytes,
            Err(message) => {
                if decided.is_some() {
                    warn!(error = %message, "keeping the last good configuration");
                    mesh.reject_config(message);
                    decided = None;
                }
                pending = None;
                continue;
            }
        };
        if decided.as_ref() == Some(&current) {
            pending = None;
            continue;
        }
        // A file being written, or a volume being swapped, can be read
        // half-way: act only on what two reads in a row agree on.
        if pending.as_ref() != Some(&current) {
            pending = Some(current);
            continue;
        }
        pending = None;
        decided = Some(current.clone());
        // Parsing and validating a large file is CPU work: off the traffic
        // threads.
        let name = path.display().to_string();
        let result = tokio::task::spawn_blocking(move || parse(&current, &name))
            .await
            .unwrap_or_else(|e| Err(format!("configuration parser failed: {e}")));
        let applied = match result {
            Ok(config) => sources.file_changed(config).await,
            Err(message) => Err(message),
        };
        if let Err(message) = applied {
            warn!(error = %message, "configuration rejected; keeping the last good one");
            mesh.reject_config(message);
        }
    }
}

/// What identifies a version of the file without reading it: device,
/// inode (a ConfigMap volume swaps the file), size and modification time.
type Stamp = (u64, u64, u64, i64, i64);

fn stamp(path: &Path) -> Option<Stamp> {
    use std::os::unix::fs::MetadataExt as _;
    std::fs::metadata(path)
        .ok()
        .map(|m| (m.dev(), m.ino(), m.len(), m.mtime(), m.mtime_nsec()))
}

/// Reads the file, refusing one larger than [`MAX_CONFIG_BYTES`] without
/// reading it all.
fn read_bounded(path: &Path) -> Result<Vec<u8>, String> {
    let (bytes, more) = dataplane_core::fs::read_at_most(path, MAX_CONFIG_BYTES)
        .map_err(|err| format!("cannot read config file {}: {err}", path.display()))?;
    if more {
        return Err(format!(
            "config file {} is larger than the {MAX_CONFIG_BYTES} bytes accepted",
            path.display()
        ));
    }
    Ok(bytes)
}

/// Parses and validates a config file's bytes (on its own: the merge
/// with istiod's state is checked when it is installed).
fn parse(bytes: &[u8], name: &str) -> Result<LocalConfig, String> {
    let text = String::from_utf8_lossy(bytes);
    let config = LocalConfig::parse(&text, name).map_err(|e| Chain(&e).to_string())?;
    MeshState::from_config(&config).map_err(|e| Chain(&e).to_string())?;
    Ok(config)
}
