//! What a change of the state can change for a connection, so that the
//! work after an install (re-checking open connections, voiding fast-path
//! verdicts) costs what the change touched rather than what the node holds.
//!
//! A connection's authorization depends on its destination's workload
//! (namespace and the selector policies it lists) and on the policies of
//! that scope ([`MeshState::authorize`]); a fast-path verdict also on the
//! two workloads' settings and, for a service, on its endpoints. So a
//! change concerns a destination when its address belongs to a workload
//! or service the change rebuilt, or when a policy of its scope changed.

use std::collections::HashSet;
use std::net::IpAddr;

use super::MeshState;
use crate::config::{Policy, Scope};

/// The reach of one change of the state.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Affected {
    /// Everything may have changed: a state built whole, or a mesh-wide
    /// policy changed.
    pub all: bool,
    /// Addresses (canonical) of the workloads and service VIPs the change
    /// rebuilt, as they were and as they are.
    pub addrs: HashSet<IpAddr>,
    /// Namespaces whose namespace-scoped policies changed.
    pub namespaces: HashSet<String>,
    /// Keys (`namespace/name`) of the workload-selector policies that
    /// changed.
    pub selected: HashSet<String>,
}

impl Affected {
    /// A change that may have changed anything.
    pub fn everything() -> Self {
        Self {
            all: true,
            ..Self::default()
        }
    }

    /// Whether the change touched nothing a connection depends on.
    pub fn is_empty(&self) -> bool {
        !self.all && self.addrs.is_empty() && !self.policies_changed()
    }

    /// Whether policies changed (a scope of them, or all).
    pub fn policies_changed(&self) -> bool {
        self.all || !self.namespaces.is_empty() || !self.selected.is_empty()
    }

    /// Whether `ip` is (or was) an address of something the change
    /// rebuilt: a workload's own change (its identity, say) that a
    /// destination-side check alone does not see.
    pub fn touches(&self, ip: IpAddr) -> bool {
        self.addrs.contains(&ip.to_canonical())
    }

    /// Records that `ip` is (or was) an address of something rebuilt.
    pub fn addr(&mut self, ip: IpAddr) {
        self.addrs.insert(ip.to_canonical());
    }

    /// Records that `policy` changed (as it was, or as it is).
    pub fn policy(&mut self, policy: &Policy) {
        match policy.scope {
            Scope::Global => self.all = true,
            Scope::Namespace => {
                self.namespaces.insert(policy.namespace.clone());
            }
            Scope::WorkloadSelector => {
                self.selected.insert(policy.key());
            }
        }
    }

    /// Whether a connection to `dst` may be decided otherwise in `state`
    /// (the state after the change) than before it. A destination whose
    /// workload changed namespace or policy list has its address in
    /// [`Self::addrs`], so `state`'s view of it is enough for the rest.
    pub fn concerns(&self, state: &MeshState, dst: IpAddr) -> bool {
        if self.all || self.touches(dst) {
            return true;
        }
        if !self.policies_changed() {
            return false;
        }
        match state.workloads.by_ip(dst) {
            Some(w) => {
                self.namespaces.contains(&*w.workload.namespace)
                    || w.workload
                        .authorization_policies
                        .iter()
                        .any(|key| self.selected.contains(key))
            }
            // An unknown destination is decided with the empty namespace.
            None => self.namespaces.contains(""),
        }
    }
}
