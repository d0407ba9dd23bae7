//! Services by network address: a VIP's network and its IP, as ztunnel
//! keys them (`src/state/service.rs`: `ServiceStore::by_vip`, a map from
//! `NetworkAddress`), so that two networks whose services share a VIP
//! (overlapping service ranges in a multi-network mesh) each keep theirs,
//! and a client resolves a VIP on its own network only (ztunnel
//! `src/state.rs` `find_upstream`: `network_addr(network, addr.ip())`
//! with the source workload's network).
//!
//! One tree of VIPs per network in a tree of networks, as
//! [`super::by_addr`] holds workloads: a lookup is a search among the few
//! networks by the name it is handed (nothing built), then the VIP search
//! it was before networks counted.

use std::{net::IpAddr, sync::Arc};

use super::{EntryKey, Multi, ServiceEntry, Values};
use crate::config::{SharedStr, Vip};

/// Built service entries by (network, VIP); several on one network
/// address when services of several namespaces share it.
#[derive(Debug, Clone, Default)]
pub(super) struct ByVip {
    /// A network without a VIP is dropped, so the networks held are those
    /// some service's VIP names.
    networks: imbl::OrdMap<SharedStr, Multi<IpAddr, Arc<ServiceEntry>>>,
}

impl ByVip {
    /// The entries at `ip` on `network` (the IP canonical, as
    /// [`Vip::ip`] is).
    pub(super) fn all(&self, network: &str, ip: &IpAddr) -> Option<&Values<Arc<ServiceEntry>>> {
        self.networks.get(network)?.all(ip)
    }

    /// Puts `built` at `vip` under `entry`, replacing what that entry had
    /// there.
    pub(super) fn insert(&mut self, vip: &Vip, entry: EntryKey, built: Arc<ServiceEntry>) {
        match self.networks.get_mut(&*vip.network) {
            Some(held) => held.insert(vip.ip, entry, built),
            None => {
                let mut by_ip = Multi::default();
                by_ip.insert(vip.ip, entry, built);
                self.networks.insert(vip.network.clone(), by_ip);
            }
        }
    }

    /// Takes `entry`'s service away from `vip`.
    pub(super) fn remove(&mut self, vip: &Vip, entry: &EntryKey) {
        let Some(held) = self.networks.get_mut(&*vip.network) else {
            return;
        };
        held.remove(&vip.ip, entry);
        if held.is_empty() {
            self.networks.remove(&*vip.network);
        }
    }

    /// How many networks hold a VIP.
    #[cfg(test)]
    pub(super) fn network_count(&self) -> usize {
        self.networks.len()
    }
}
