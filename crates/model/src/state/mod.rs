//! What the agent knows about the mesh: workloads by network and IP
//! ([`WorkloadIndex::by_ip`] on this node's network; each with its
//! SPIFFE identity and protocol), services by VIP and hostname, and the
//! authorization policies, as one immutable snapshot ([`MeshState`])
//! that connections read while the next is made. The next one is the
//! previous with the entries a change names replaced ([`Changes`],
//! [`MeshState::apply`]), in persistent maps that share everything else
//! (see [`crate::config::entries`]), so a push costs what it changes, not what the mesh
//! holds. A lookup is a B-tree search among the few networks, then one
//! by IP (about 50 ns at 10k
//! workloads: a hash trie's 10 ns cost 70-130 bytes a workload in its
//! sparse nodes, `benches/mesh_memory.rs`).

mod affected;
mod by_addr;
mod by_vip;
mod dead;
mod endpoints;
mod interned;
mod peer;
mod provenance;
mod routing;
mod service_entry;
mod services;
mod snapshot;
mod spare;
mod text_key;
mod waypoints;

use std::{net::IpAddr, sync::Arc};

pub use crate::config::{
    changes::Changes,
    entries::{EntryKey, Multi, Values},
};

pub use affected::Affected;
pub use dead::{DEAD_ENDPOINT_HOLD, DeadEndpoints, random_index};
pub use endpoints::EndpointSet;
pub use peer::{Peer, ServiceRef};
pub use provenance::Provenance;
pub use routing::{on_reachable_network, pick_address};
pub use service_entry::{Endpoint, EndpointAddr, ServiceEntry};
pub use services::ServiceIndex;
pub use snapshot::MeshState;
pub use spare::Spare;
pub use waypoints::WaypointTarget;

use crate::{
    config::{LocalConfig, Protocol, SharedStr, Workload},
    identity::{Identity, IdentityError},
};

/// Errors building the index.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    /// A workload's identity fields do not form a valid SPIFFE identity.
    #[error("workload {uid} has an invalid identity")]
    Identity {
        /// The workload's uid.
        uid: String,
        /// What is wrong.
        #[source]
        source: IdentityError,
    },
}

/// A workload with its identity resolved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MeshWorkload {
    /// The workload as configured (shared with the config it came from).
    pub workload: Arc<Workload>,
    /// Its SPIFFE identity.
    pub identity: Identity,
    /// It as a connection end in metrics and access records (built once,
    /// shared by every connection to or from it).
    pub peer: Arc<Peer>,
    /// Where it is held in the merged configuration.
    pub key: EntryKey,
}

impl MeshWorkload {
    /// Whether traffic to it goes through HBONE.
    pub fn speaks_hbone(&self) -> bool {
        self.workload.protocol == Protocol::Hbone
    }
}

/// A workload as a connection end in telemetry, named as Istio names it:
/// the owning workload (a Deployment) when known, else the pod; the
/// canonical service defaulting to that name and the revision to `latest`,
/// as Istio defaults them. The strings other peers repeat are shared
/// (`interned`, the workload's own namespace and cluster).
fn workload_peer(workload: &Workload, identity: &Identity, interned: &interned::Interned) -> Peer {
    let known = |value: &SharedStr| (!value.is_empty()).then(|| value.clone());
    let name = known(&workload.workload_name).unwrap_or_else(|| SharedStr::from(&workload.name));
    let shared = |value: &str| (!value.is_empty()).then(|| interned.text(value));
    Peer {
        canonical_service: Some(known(&workload.canonical_name).unwrap_or_else(|| name.clone())),
        canonical_revision: Some(
            known(&workload.canonical_revision).unwrap_or_else(|| interned.text("latest")),
        ),
        workload: Some(name),
        namespace: Some(workload.namespace.clone()),
        principal: Some(interned.text(identity.as_uri())),
        cluster: known(&workload.cluster_id),
        region: shared(&workload.locality().region),
        zone: shared(&workload.locality().zone),
    }
}

/// Workloads by network address (network and IP) and by entry.
#[derive(Debug, Clone, Default)]
pub struct WorkloadIndex {
    /// By network and IP, in B-trees (see [`Multi`] for why not a hash
    /// trie).
    by_addr: by_addr::ByAddr,
    /// This node's network (`--network`, ztunnel's `NETWORK`): the one
    /// [`Self::by_ip`] looks an address up on.
    network: SharedStr,
    by_key: imbl::OrdMap<EntryKey, Arc<MeshWorkload>>,
    /// Identities and peers shared by the workloads of this index and of
    /// every index made from it.
    interned: Arc<interned::Interned>,
}

impl WorkloadIndex {
    /// Indexes the config's workloads.
    pub fn from_config(config: &LocalConfig) -> Result<Self, StateError> {
        let mut index = Self::default();
        let changes = Changes::of_file(config);
        index.apply(&changes.workloads, None, &mut |_, _| {})?;
        Ok(index)
    }

    /// Replaces the workloads `changes` name (`None`: removes it): every
    /// removal first, so an address may move from one entry to another in
    /// one change. `touched` hears of each service key whose endpoints
    /// may have changed, with the workload entry concerned. An entry whose
    /// workload did not change keeps its identity and telemetry peer, and
    /// so does one `donor` (an index the same change was made to) holds
    /// built from the same workload.
    pub(crate) fn apply(
        &mut self,
        changes: &[(EntryKey, Option<Arc<Workload>>)],
        donor: Option<&WorkloadIndex>,
        touched: &mut dyn FnMut(&str, &EntryKey),
    ) -> Result<(), StateError> {
        let mut removed: Vec<Arc<MeshWorkload>> = Vec::new();
        for (key, new) in changes {
            // A workload that keeps its addresses is replaced where it is
            // (below): each index is walked once, in place on a state no
            // reader holds, instead of a removal and an insertion that
            // each walk it and may move its nodes.
            let Some(old) = self.by_key.get(key).cloned() else {
                continue;
            };
            let stays = new.as_ref().is_some_and(|new| {
                old.workload.own_ips() == new.own_ips() && old.workload.network == new.network
            });
            if !stays {
                self.by_key.remove(key);
                let network = &*old.workload.network;
                for ip in old.workload.own_ips() {
                    // Its claim only: another claimant of the address is
                    // found there next (ztunnel `WorkloadByAddr::remove_uid`).
                    self.by_addr.remove(network, &ip.to_canonical(), key);
                }
            }
            for service in old.workload.services.keys() {
                touched(service, key);
            }
            removed.push(old);
        }
        for (key, new) in changes {
            let Some(workload) = new else {
                continue;
            };
            let unchanged = removed.iter().find(|old| {
                old.key == *key
                    && (Arc::ptr_eq(&old.workload, workload) || old.workload == *workload)
            });
            let donated = || {
                donor
                    .and_then(|d| d.by_key(key))
                    .filter(|built| Arc::ptr_eq(&built.workload, workload))
            };
            let entry = match unchanged.or_else(donated) {
                Some(built) => Arc::clone(built),
                None => Arc::new(self.entry(key.clone(), workload)?),
            };
            // Keyed by its network too (ztunnel `WorkloadStore::insert`:
            // `network_addr(w.network, ip)`): the same IP on two networks
            // is two pods. Another workload at the same network address
            // is no error: both are held (ztunnel `WorkloadByAddr::Many`)
            // and one found, as `by_addr` picks.
            let network = &workload.network;
            for ip in workload.own_ips() {
                // Keyed as looked up: an IPv4-mapped address is its IPv4.
                self.by_addr
                    .insert(network, ip.to_canonical(), Arc::clone(&entry));
            }
            for service in workload.services.keys() {
                touched(service, key);
            }
            self.by_key.insert(key.clone(), entry);
        }
        Ok(())
    }

    /// A workload with its identity and telemetry peer.
    fn entry(&self, key: EntryKey, workload: &Arc<Workload>) -> Result<MeshWorkload, StateError> {
        let identity = Identity::new(
            &*workload.trust_domain,
            &*workload.namespace,
            &*workload.service_account,
        )
        .map_err(|source| StateError::Identity {
            uid: workload.uid.to_string(),
            source,
        })?;
        let identity = self.interned.identity(identity);
        let peer = self
            .interned
            .peer(workload_peer(workload, &identity, &self.interned));
        Ok(MeshWorkload {
            workload: Arc::clone(workload),
            identity,
            peer,
            key,
        })
    }

    /// The workload owning `ip` on this node's network ([`Self::network`]),
    /// if any: how the address of captured traffic (a source, an original
    /// destination, a connection arriving here) is looked up, as ztunnel
    /// looks it up on its `NETWORK` (`src/proxy/inbound.rs` and
    /// `src/proxy/outbound.rs`: `NetworkAddress { network:
    /// pi.cfg.network, .. }` handed to `src/state.rs`
    /// `fetch_workload_by_address`, `fetch_address`). A workload of
    /// another network at the same IP is not it.
    pub fn by_ip(&self, ip: IpAddr) -> Option<&Arc<MeshWorkload>> {
        self.by_addr(&self.network, ip)
    }

    /// The workload owning `ip` on `network` (empty: the default one), if
    /// any (ztunnel `WorkloadStore::find_address`): of several claiming
    /// it, a pod first, then one speaking HBONE, as ztunnel's
    /// `WorkloadByAddr::get` (see `by_addr::pick`). Builds nothing: the
    /// hot paths call it once or twice a connection.
    pub fn by_addr(&self, network: &str, ip: IpAddr) -> Option<&Arc<MeshWorkload>> {
        self.by_addr.get(network, &ip.to_canonical())
    }

    /// Every workload claiming `ip` on `network`, in entry order (the
    /// one [`Self::by_addr`] finds among them).
    pub fn claimants(&self, network: &str, ip: IpAddr) -> &[Arc<MeshWorkload>] {
        self.by_addr.all(network, &ip.to_canonical())
    }

    /// Makes `network` this node's: the one [`Self::by_ip`] looks up on.
    /// Nothing is indexed again: entries are keyed by their own network.
    pub fn set_network(&mut self, network: &str) {
        self.network = SharedStr::from(network);
    }

    /// This node's network, the one [`Self::by_ip`] looks up on.
    pub fn network(&self) -> &str {
        &self.network
    }

    /// The workload held under `key`.
    pub fn by_key(&self, key: &EntryKey) -> Option<&Arc<MeshWorkload>> {
        self.by_key.get(key)
    }

    /// Number of workloads.
    pub fn len(&self) -> usize {
        self.by_key.len()
    }

    /// Whether no workload is known.
    pub fn is_empty(&self) -> bool {
        self.by_key.is_empty()
    }

    /// Every workload, in config order (the file's, then istiod's by
    /// resource name).
    pub fn iter(&self) -> impl Iterator<Item = &Arc<MeshWorkload>> {
        self.by_key.values()
    }
}

#[cfg(test)]
mod network_tests;

#[cfg(test)]
mod network_addr_tests;

#[cfg(test)]
mod network_vip_tests;

#[cfg(test)]
mod claimants_tests;

#[cfg(test)]
mod family_tests;

#[cfg(test)]
#[expect(
    clippy::unwrap_used,
    reason = "a bad fixture should fail the test loudly"
)]
mod tests {
    use super::*;

    fn config(text: &str) -> LocalConfig {
        LocalConfig::parse(text, "t").unwrap()
    }

    #[test]
    fn looks_up_by_v4_v6_and_mapped() {
        let index = WorkloadIndex::from_config(&config(
            "workloads:\n- uid: a\n  name: a\n  namespace: ns\n  serviceAccount: sa\n  workloadIps: [10.0.0.1, 'fd00::1']\n",
        ))
        .unwrap();
        let w = index.by_ip("10.0.0.1".parse().unwrap()).unwrap();
        assert_eq!(w.identity.to_uri(), "spiffe://cluster.local/ns/ns/sa/sa");
        assert!(index.by_ip("fd00::1".parse().unwrap()).is_some());
        assert!(index.by_ip("::ffff:10.0.0.1".parse().unwrap()).is_some());
        assert!(index.by_ip("10.0.0.2".parse().unwrap()).is_none());
    }

    #[test]
    fn a_change_builds_only_what_it_names_and_leaves_the_state_in_force_alone() {
        let before = config(
            "workloads:\n- {uid: a, name: a, namespace: n, workloadIps: [10.0.0.1]}\n- {uid: b, name: b, namespace: n, workloadIps: [10.0.0.2]}\n",
        );
        let old = MeshState::from_config(&before).unwrap();
        let changed = |list: Vec<(usize, Workload)>| Changes {
            workloads: list
                .into_iter()
                .map(|(i, w)| (EntryKey::file(i), Some(Arc::new(w))))
                .collect(),
            ..Changes::default()
        };
        let mut renamed = (*before.workloads[1]).clone();
        renamed.service_account = "renamed".into();
        let new = old.apply(&changed(vec![(1, renamed)])).unwrap();
        let at = |state: &MeshState, ip: &str| {
            Arc::clone(state.workloads.by_ip(ip.parse().unwrap()).unwrap())
        };
        assert!(Arc::ptr_eq(&at(&old, "10.0.0.1"), &at(&new, "10.0.0.1")));
        // The changed one is built again, identity and all.
        assert!(!Arc::ptr_eq(&at(&old, "10.0.0.2"), &at(&new, "10.0.0.2")));
        assert_eq!(
            at(&new, "10.0.0.2").identity.to_uri(),
            "spiffe://cluster.local/ns/n/sa/renamed"
        );
        assert_eq!(
            at(&old, "10.0.0.2").identity.to_uri(),
            "spiffe://cluster.local/ns/n/sa/default"
        );
        // An IP that moves to another workload in one change is that
        // workload's; the address left behind is nobody's.
        let mut a = (*before.workloads[0]).clone();
        a.workload_ips = vec!["10.0.0.3".parse().unwrap()].into();
        let mut b = (*before.workloads[1]).clone();
        b.workload_ips = vec!["10.0.0.1".parse().unwrap()].into();
        let new = old.apply(&changed(vec![(0, a), (1, b)])).unwrap();
        assert_eq!(&*at(&new, "10.0.0.1").workload.uid, "b");
        assert_eq!(&*at(&new, "10.0.0.3").workload.uid, "a");
        assert!(new.workloads.by_ip("10.0.0.2".parse().unwrap()).is_none());
        assert_eq!(&*at(&old, "10.0.0.1").workload.uid, "a");
        // Another entry's address taken too: both hold it (ztunnel
        // `WorkloadByAddr::Many`); of two alike, the last in entry order is
        // found, and the state in force is left as it was.
        let mut twin = (*before.workloads[1]).clone();
        twin.workload_ips = vec!["10.0.0.1".parse().unwrap()].into();
        let new = old.apply(&changed(vec![(1, twin)])).unwrap();
        assert_eq!(&*at(&new, "10.0.0.1").workload.uid, "b");
        assert_eq!(&*at(&old, "10.0.0.1").workload.uid, "a");
        // A removal.
        let gone = Changes {
            workloads: vec![(EntryKey::file(0), None)],
            ..Changes::default()
        };
        let new = old.apply(&gone).unwrap();
        assert_eq!(new.workloads.len(), 1);
        assert!(new.workloads.by_ip("10.0.0.1".parse().unwrap()).is_none());
    }

    #[test]
    fn duplicate_ips_are_held_by_the_index_and_refused_in_the_file() {
        // A config assembled in code (istiod's entries) may give two
        // workloads one address: the index holds both.
        let mut merged =
            config("workloads:\n- {uid: a, name: a, namespace: n, workloadIps: [10.0.0.1]}\n");
        let other =
            config("workloads:\n- {uid: b, name: b, namespace: n, workloadIps: [10.0.0.1]}\n");
        merged.workloads.extend(other.workloads);
        let index = WorkloadIndex::from_config(&merged).unwrap();
        let claimants: Vec<&str> = index
            .claimants("", "10.0.0.1".parse().unwrap())
            .iter()
            .map(|w| &*w.workload.uid)
            .collect();
        assert_eq!(claimants, ["a", "b"]);
        // The operator's file may not: one of them is a mistake.
        let text = "workloads:\n- {uid: a, name: a, namespace: n, workloadIps: [10.0.0.1]}\n- {uid: b, name: b, namespace: n, workloadIps: [10.0.0.1]}\n";
        let err = dataplane_core::error::Chain(&LocalConfig::parse(text, "cfg.yaml").unwrap_err())
            .to_string();
        assert!(
            err.contains("cfg.yaml:3:") && err.contains("workloads[1].workloadIps"),
            "{err}"
        );
    }
}
