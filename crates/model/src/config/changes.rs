//! A change to the merged configuration, entry by entry: what
//! [`crate::state::MeshState::apply`] turns into the next state.

use std::sync::Arc;

use super::{LocalConfig, Policy, Service, Workload, entries::EntryKey};

/// Each changed entry's new value, `None` when it left. An entry not
/// named keeps what the state holds.
#[derive(Debug, Clone, Default)]
pub struct Changes {
    /// Workloads.
    pub workloads: Vec<(EntryKey, Option<Arc<Workload>>)>,
    /// Services.
    pub services: Vec<(EntryKey, Option<Arc<Service>>)>,
    /// Authorization policies.
    pub policies: Vec<(EntryKey, Option<Arc<Policy>>)>,
}

impl Changes {
    /// Every entry of `config` (a file) added, keyed by its position.
    pub fn of_file(config: &LocalConfig) -> Self {
        Self {
            workloads: config
                .workloads
                .iter()
                .enumerate()
                .map(|(i, w)| (EntryKey::file(i), Some(Arc::clone(w))))
                .collect(),
            services: config
                .services
                .iter()
                .enumerate()
                .map(|(i, s)| (EntryKey::file(i), Some(Arc::new(s.clone()))))
                .collect(),
            policies: config
                .policies
                .iter()
                .enumerate()
                .map(|(i, p)| (EntryKey::file(i), Some(Arc::new(p.clone()))))
                .collect(),
        }
    }

    /// Whether nothing changed.
    pub fn is_empty(&self) -> bool {
        self.workloads.is_empty() && self.services.is_empty() && self.policies.is_empty()
    }

    /// How many entries changed.
    pub fn len(&self) -> usize {
        self.workloads.len() + self.services.len() + self.policies.len()
    }

    /// `other`'s changes after these.
    pub fn extend(&mut self, other: Self) {
        self.workloads.extend(other.workloads);
        self.services.extend(other.services);
        self.policies.extend(other.policies);
    }
}
