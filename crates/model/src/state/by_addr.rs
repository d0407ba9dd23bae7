//! Workloads by network address: a network's name and an IP, as ztunnel
//! keys them (`src/state/workload.rs`: `WorkloadStore::by_addr`, a map
//! from `NetworkAddress { network, address }`), so that two networks
//! whose pod ranges overlap (a multi-network mesh) each keep the pod at
//! an address instead of one replacing the other.
//!
//! One B-tree of IPs per network, in a B-tree of networks: a lookup is a
//! search among the few networks (string comparisons of the name it is
//! handed, nothing built) and then the IP search it was before networks
//! counted. The entries of the IP trees stay 16 bytes (see [`ByIp`]),
//! where a key holding the network beside each IP would have doubled
//! them.

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    sync::Arc,
};

use super::MeshWorkload;
use crate::config::SharedStr;

/// Workloads by IP: IPv4 and IPv6 addresses apart, so that an entry of
/// the (nearly all IPv4) tree is 16 bytes where one keyed by `IpAddr` (17
/// bytes, padded to 24) took 32 (`benches/mesh_memory.rs`).
#[derive(Debug, Clone, Default)]
struct ByIp {
    v4: imbl::OrdMap<Ipv4Addr, Arc<MeshWorkload>>,
    v6: imbl::OrdMap<Ipv6Addr, Arc<MeshWorkload>>,
}

impl ByIp {
    fn get(&self, ip: &IpAddr) -> Option<&Arc<MeshWorkload>> {
        match ip {
            IpAddr::V4(ip) => self.v4.get(ip),
            IpAddr::V6(ip) => self.v6.get(ip),
        }
    }

    fn insert(&mut self, ip: IpAddr, workload: Arc<MeshWorkload>) {
        match ip {
            IpAddr::V4(ip) => self.v4.insert(ip, workload),
            IpAddr::V6(ip) => self.v6.insert(ip, workload),
        };
    }

    fn remove(&mut self, ip: &IpAddr) {
        match ip {
            IpAddr::V4(ip) => self.v4.remove(ip),
            IpAddr::V6(ip) => self.v6.remove(ip),
        };
    }

    fn is_empty(&self) -> bool {
        self.v4.is_empty() && self.v6.is_empty()
    }
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
    /// The workload at `ip` on `network` (ztunnel `WorkloadStore::find_address`).
    pub(super) fn get(&self, network: &str, ip: &IpAddr) -> Option<&Arc<MeshWorkload>> {
        self.networks.get(network)?.get(ip)
    }

    /// Puts `workload` at `ip` on `network`, replacing what was there.
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

    /// Takes whatever is at `ip` on `network` away.
    pub(super) fn remove(&mut self, network: &str, ip: &IpAddr) {
        let Some(held) = self.networks.get_mut(network) else {
            return;
        };
        held.remove(ip);
        if held.is_empty() {
            self.networks.remove(network);
        }
    }

    /// How many networks hold a workload.
    #[cfg(test)]
    pub(super) fn network_count(&self) -> usize {
        self.networks.len()
    }
}
