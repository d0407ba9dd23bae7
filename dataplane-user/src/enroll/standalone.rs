//! Standalone mode: the configured workloads of this node that carry a
//! network namespace path are enrolled from the config itself, re-enrolled
//! when their entry changes and unenrolled when it goes.

use std::collections::HashSet;

use tracing::{info, warn};

use super::{Enrollments, PodSpec};
use crate::{config::LocalConfig, logging::Chain};

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
            .filter(|w| self.node.as_ref().is_none_or(|node| **node == *w.node))
            .filter_map(|w| {
                Some(PodSpec {
                    uid: w.uid.to_string(),
                    name: w.name.clone(),
                    namespace: w.namespace.to_string(),
                    service_account: w.service_account.to_string(),
                    trust_domain: w.trust_domain.to_string(),
                    netns: std::path::PathBuf::clone(w.netns.as_deref()?),
                    ips: w.workload_ips.to_vec(),
                    node_addr: None,
                    exclusions: Default::default(),
                    dns_capture: w.dns_capture,
                    // The workload's `fastPath` decides, through the mesh.
                    fast_path: None,
                })
            })
            .collect()
    }
}
