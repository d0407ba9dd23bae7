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

use std::{
    collections::HashSet,
    path::PathBuf,
    sync::{Arc, Mutex},
    time::Duration,
};

use tracing::{info, warn};

use crate::{
    config::LocalConfig,
    enroll::{Enrollments, PodSpec},
    logging::Chain,
    mesh::MeshContext,
    state::MeshState,
};

/// How often the config file is read.
pub const POLL_INTERVAL: Duration = Duration::from_millis(500);

/// Pods enrolled because the config lists them with a netns (standalone
/// mode), as opposed to ones the CNI plugin or the CLI enrolled.
#[derive(Debug, Default)]
pub struct Standalone {
    node: Option<String>,
    managed: HashSet<String>,
}

impl Standalone {
    /// Standalone enrollment for this node (every node when `None`).
    pub fn new(node: Option<String>) -> Self {
        Self {
            node,
            managed: HashSet::new(),
        }
    }

    /// Enrolls the config's workloads of this node that carry a netns,
    /// re-enrolls changed ones, and unenrolls the ones it enrolled earlier
    /// that the config no longer lists. A pod that cannot be enrolled is
    /// logged and skipped so one bad entry does not take the node's other
    /// pods down.
    pub fn apply(&mut self, enrollments: &mut Enrollments, config: &LocalConfig) {
        let wanted = self.specs(config);
        let wanted_uids: HashSet<String> = wanted.iter().map(|s| s.uid.clone()).collect();
        for gone in self
            .managed
            .difference(&wanted_uids)
            .cloned()
            .collect::<Vec<_>>()
        {
            match enrollments.remove(&gone) {
                Ok(_) => info!(uid = %gone, "workload left the config; unenrolled"),
                Err(err) => {
                    warn!(uid = %gone, error = %Chain(&err), "cannot unenroll a removed workload")
                }
            }
            self.managed.remove(&gone);
        }
        for spec in wanted {
            let uid = spec.uid.clone();
            match enrollments.add(spec) {
                Ok(_) => {
                    self.managed.insert(uid);
                }
                Err(err) => {
                    warn!(%uid, error = %Chain(&err), "cannot enroll a configured workload")
                }
            }
        }
    }

    fn specs(&self, config: &LocalConfig) -> Vec<PodSpec> {
        config
            .workloads
            .iter()
            .filter(|w| self.node.as_ref().is_none_or(|node| *node == w.node))
            .filter_map(|w| {
                Some(PodSpec {
                    uid: w.uid.clone(),
                    name: w.name.clone(),
                    namespace: w.namespace.clone(),
                    service_account: w.service_account.clone(),
                    trust_domain: w.trust_domain.clone(),
                    netns: w.netns.clone()?,
                    ips: w.workload_ips.clone(),
                    node_addr: None,
                    exclusions: Default::default(),
                })
            })
            .collect()
    }
}

/// Polls `path` and applies every new good version.
pub async fn watch(
    path: PathBuf,
    mesh: Arc<MeshContext>,
    enrollments: Arc<Mutex<Enrollments>>,
    mut standalone: Standalone,
) {
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
        let text = String::from_utf8_lossy(&current);
        let result = LocalConfig::parse(&text, &path.display().to_string())
            .map_err(|e| Chain(&e).to_string())
            .and_then(|config| {
                MeshState::from_config(&config)
                    .map(|state| (config, state))
                    .map_err(|e| Chain(&e).to_string())
            });
        match result {
            Ok((config, state)) => {
                let closed = mesh.install(state);
                let mut guard = match enrollments.lock() {
                    Ok(guard) => guard,
                    Err(poisoned) => poisoned.into_inner(),
                };
                standalone.apply(&mut guard, &config);
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
