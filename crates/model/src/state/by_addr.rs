//! Workloads by network address: a network's name and an IP, as ztunnel
//! keys them (`src/state/workload.rs`: `WorkloadStore::by_addr`, a map
//! from `NetworkAddress { network, address }`), so that two networks
//! whose pod ranges overlap (a multi-network mesh) each keep the pod at
//! an address instead of one replacing the other.
//!
//! Several workloads may claim one network address (a pod and a
//! WorkloadEntry for it, or a pod replaced under its IP for a moment):
//! every claimant is held, as ztunnel's `WorkloadByAddr::Many` holds them,
//! one is found ([`pick`]), and when it goes another is found in its
//! place.
//!
//! One B-tree of IPs per network, in a B-tree of networks: a lookup is a
//! search among the few networks (string comparisons of the name it is
//! handed, nothing built) and then the IP search it was before networks
//! counted. The entries of the IP trees stay 16 bytes (see [`ByIp`]),
//! where a key holding the network beside each IP would have doubled
//! them; the rare addresses of several claimants are listed apart.

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    sync::Arc,
};

use super::{EntryKey, MeshWorkload};
use crate::config::{Protocol, SharedStr};

/// Workloads by IP: IPv4 and IPv6 addresses apart, so that an entry of
/// the (nearly all IPv4) tree is 16 bytes where one keyed by `IpAddr` (17
/// bytes, padded to 24) took 32 (`benches/mesh_memory.rs`). Each address
/// holds the workload found there; one that several claim has them all
/// in `crowded` too (a list per address would have cost every entry a
/// pointer and a tag).
#[derive(Debug, Clone, Default)]
struct ByIp {
    v4: imbl::OrdMap<Ipv4Addr, Arc<MeshWorkload>>,
    v6: imbl::OrdMap<Ipv6Addr, Arc<MeshWorkload>>,
    /// Every claimant of an address two or more claim, in entry order.
    crowded: imbl::OrdMap<IpAddr, Vec<Arc<MeshWorkload>>>,
}

impl ByIp {
    fn get(&self, ip: &IpAddr) -> Option<&Arc<MeshWorkload>> {
        match ip {
            IpAddr::V4(ip) => self.v4.get(ip),
            IpAddr::V6(ip) => self.v6.get(ip),
        }
    }

    fn set(&mut self, ip: IpAddr, workload: Arc<MeshWorkload>) {
        match ip {
            IpAddr::V4(ip) => self.v4.insert(ip, workload),
            IpAddr::V6(ip) => self.v6.insert(ip, workload),
        };
    }

    fn unset(&mut self, ip: &IpAddr) {
        match ip {
            IpAddr::V4(ip) => self.v4.remove(ip),
            IpAddr::V6(ip) => self.v6.remove(ip),
        };
    }

    /// Adds `workload` to the claimants of `ip`, in place of the one of
    /// its entry if that entry already claims it.
    fn insert(&mut self, ip: IpAddr, workload: Arc<MeshWorkload>) {
        if !self.crowded.contains_key(&ip) {
            match self.get(&ip) {
                // The common case: the address is free, or its one
                // claimant is this entry (a changed workload).
                None => return self.set(ip, workload),
                Some(held) if held.key == workload.key => return self.set(ip, workload),
                Some(held) => {
                    let held = Arc::clone(held);
                    self.crowded.insert(ip, vec![held]);
                }
            }
        }
        let Some(claimants) = self.crowded.get_mut(&ip) else {
            return;
        };
        match claimants.binary_search_by(|held| held.key.cmp(&workload.key)) {
            Ok(at) => claimants[at] = workload,
            Err(at) => claimants.insert(at, workload),
        }
        if let Some(found) = pick(claimants).cloned() {
            self.set(ip, found);
        }
    }

    /// Takes `key`'s claim on `ip` away; the address is then another
    /// claimant's, if it has one.
    fn remove(&mut self, ip: &IpAddr, key: &EntryKey) {
        let Some(claimants) = self.crowded.get_mut(ip) else {
            if self.get(ip).is_some_and(|held| held.key == *key) {
                self.unset(ip);
            }
            return;
        };
        if let Ok(at) = claimants.binary_search_by(|held| held.key.cmp(key)) {
            claimants.remove(at);
        }
        let found = pick(claimants).cloned();
        if claimants.len() < 2 {
            self.crowded.remove(ip);
        }
        match found {
            Some(found) => self.set(*ip, found),
            None => self.unset(ip),
        }
    }

    /// Every claimant of `ip`, in entry order.
    fn all(&self, ip: &IpAddr) -> &[Arc<MeshWorkload>] {
        match self.crowded.get(ip) {
            Some(claimants) => claimants,
            None => self.get(ip).map(std::slice::from_ref).unwrap_or_default(),
        }
    }

    fn is_empty(&self) -> bool {
        self.v4.is_empty() && self.v6.is_empty()
    }
}

/// Of the workloads claiming one network address, the one found there,
/// as ztunnel's `WorkloadByAddr::get` (`src/state/workload.rs`) ranks
/// them: a pod (its uid holds `//Pod/`: not spoofable, the likeliest to be
/// what a service has behind it) before anything else, then one that
/// speaks HBONE (in the mesh: more context) before one that does not.
/// Among equals ztunnel's `max_by_key` takes the one last in its list,
/// the one inserted (or updated) last; ours is the last in entry order
/// (the file's, then istiod's by resource name), so that the same
/// resources give the same answer whatever the order their pushes came
/// in (a state made push by push equals the state built whole).
fn pick(claimants: &[Arc<MeshWorkload>]) -> Option<&Arc<MeshWorkload>> {
    claimants.iter().max_by_key(|w| {
        let is_pod = w.workload.uid.contains("//Pod/");
        let is_hbone = w.workload.protocol == Protocol::Hbone;
        (is_pod, is_hbone)
    })
}

/// Workloads by (network, IP). IPs are held as looked up: canonical (an
/// IPv4-mapped address is its IPv4), which the caller sees to.
#[derive(Debug, Clone, Default)]
pub(super) struct ByAddr {
    /// A network without workloads is dropped, so the networks held are
    /// those some workload names (no name sent once stays for ever).
    networks: imbl::OrdMap<SharedStr, ByIp>,
}

impl ByAddr {
    /// The workload found at `ip` on `network` (ztunnel
    /// `WorkloadStore::find_address`): of several claimants, the one
    /// [`pick`] ranks first.
    pub(super) fn get(&self, network: &str, ip: &IpAddr) -> Option<&Arc<MeshWorkload>> {
        self.networks.get(network)?.get(ip)
    }

    /// Every workload claiming `ip` on `network`, in entry order.
    pub(super) fn all(&self, network: &str, ip: &IpAddr) -> &[Arc<MeshWorkload>] {
        self.networks
            .get(network)
            .map(|held| held.all(ip))
            .unwrap_or_default()
    }

    /// Adds `workload` to the claimants of `ip` on `network`, replacing
    /// the claim its entry had there.
    pub(super) fn insert(&mut self, network: &SharedStr, ip: IpAddr, workload: Arc<MeshWorkload>) {
        match self.networks.get_mut(&**network) {
            Some(held) => held.insert(ip, workload),
            None => {
                let mut by_ip = ByIp::default();
                by_ip.insert(ip, workload);
                self.networks.insert(network.clone(), by_ip);
            }
        }
    }

    /// Takes the claim of the workload held under `key` on `ip` on
    /// `network` away, leaving the other claimants'.
    pub(super) fn remove(&mut self, network: &str, ip: &IpAddr, key: &EntryKey) {
        let Some(held) = self.networks.get_mut(network) else {
            return;
        };
        held.remove(ip, key);
        if held.is_empty() {
            self.networks.remove(network);
        }
    }

    /// How many networks hold a workload.
    #[cfg(test)]
    pub(super) fn network_count(&self) -> usize {
        self.networks.len()
    }

    /// How many addresses of all networks have several claimants.
    #[cfg(test)]
    pub(super) fn crowded_count(&self) -> usize {
        self.networks.values().map(|held| held.crowded.len()).sum()
    }
}
