//! One copy of each identity and telemetry peer the workloads share.
//!
//! Replicas of a Deployment share their SPIFFE identity and, as telemetry
//! names them (the owning workload, not the pod), their peer: built per
//! workload they took about 450 bytes each (`benches/mesh_memory.rs`), held
//! once per distinct value they take that much per Deployment. Entries no
//! state refers to any more are dropped as [`Interner`] sweeps.

use std::sync::{Arc, Mutex, PoisonError};

use dataplane_core::intern::Interner;

use super::Peer;
use crate::{config::SharedStr, identity::Identity};

/// Smallest table size swept (below it sweeping is not worth a pass).
const MIN_SWEEP: usize = 64;

/// The shared identities and peers, behind a lock taken only while a state
/// is built (never on the connection path).
#[derive(Debug)]
pub(super) struct Interned(Mutex<Tables>);

#[derive(Debug)]
struct Tables {
    identities: Interner<Identity>,
    peers: Interner<Arc<Peer>>,
    /// The strings of peers that workloads repeat (identity URIs,
    /// revisions, localities).
    texts: Interner<SharedStr>,
}

impl Default for Interned {
    fn default() -> Self {
        Interned(Mutex::new(Tables {
            identities: Interner::new(MIN_SWEEP),
            peers: Interner::new(MIN_SWEEP),
            texts: Interner::new(MIN_SWEEP),
        }))
    }
}

impl Interned {
    fn tables(&self) -> std::sync::MutexGuard<'_, Tables> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The held identity equal to `identity` (holding it if none is).
    pub(super) fn identity(&self, identity: Identity) -> Identity {
        self.tables().identities.intern(identity)
    }

    /// The held string equal to `text` (holding it if none is); empty
    /// strings are never held (a `SharedStr` holds nothing for them).
    pub(super) fn text(&self, text: &str) -> SharedStr {
        if text.is_empty() {
            return SharedStr::default();
        }
        let mut tables = self.tables();
        match tables.texts.get(text) {
            Some(held) => held,
            None => tables.texts.intern(SharedStr::from(text)),
        }
    }

    /// The held peer equal to `peer` (holding it if none is).
    pub(super) fn peer(&self, peer: Peer) -> Arc<Peer> {
        let mut tables = self.tables();
        match tables.peers.get(&peer) {
            Some(held) => held,
            None => tables.peers.intern(Arc::new(peer)),
        }
    }

    /// Entries held (identities, peers).
    #[cfg(test)]
    pub(super) fn len(&self) -> (usize, usize) {
        let tables = self.tables();
        (tables.identities.len(), tables.peers.len())
    }
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "tests fail loudly on unexpected errors")]
mod tests {
    use super::*;

    fn peer(name: &str) -> Peer {
        Peer {
            workload: Some(name.into()),
            namespace: Some("shop".into()),
            ..Peer::default()
        }
    }

    #[test]
    fn equal_values_share_one_copy() {
        let interned = Interned::default();
        let id = |sa: &str| Identity::new("cluster.local", "shop", sa).unwrap();
        let (a, b) = (interned.identity(id("web")), interned.identity(id("web")));
        assert!(std::ptr::eq(&*a, &*b));
        assert!(!std::ptr::eq(&*a, &*interned.identity(id("db"))));
        let (p, q) = (interned.peer(peer("web")), interned.peer(peer("web")));
        assert!(Arc::ptr_eq(&p, &q));
        assert!(!Arc::ptr_eq(&p, &interned.peer(peer("db"))));
        assert_eq!(interned.len(), (2, 2));
    }

    #[test]
    fn pods_of_no_deployment_share_the_strings_their_peers_repeat() {
        use crate::config::{SharedStr, Workload};
        let interned = Interned::default();
        // As translation shares them (`config::interned::Strings`).
        let (namespace, cluster) = (SharedStr::from("shop"), SharedStr::from("east"));
        let pod = |name: &str| Workload {
            name: name.to_owned(),
            namespace: namespace.clone(),
            service_account: "web".into(),
            trust_domain: "cluster.local".into(),
            cluster_id: cluster.clone(),
            ..Workload::default()
        };
        let peers: Vec<Arc<Peer>> = ["web-1", "web-2"]
            .into_iter()
            .map(|name| {
                let workload = pod(name);
                let identity = interned.identity(
                    Identity::new(
                        &*workload.trust_domain,
                        &*workload.namespace,
                        &*workload.service_account,
                    )
                    .unwrap(),
                );
                interned.peer(super::super::workload_peer(&workload, &identity, &interned))
            })
            .collect();
        let (a, b) = (&peers[0], &peers[1]);
        // Two peers (the pods' names differ), as before.
        assert!(!Arc::ptr_eq(a, b));
        assert_eq!(a.workload.as_deref(), Some("web-1"));
        assert_eq!(
            a.principal.as_deref(),
            Some("spiffe://cluster.local/ns/shop/sa/web")
        );
        assert_eq!(a.canonical_revision.as_deref(), Some("latest"));
        let same = |x: &Option<SharedStr>, y: &Option<SharedStr>| {
            SharedStr::ptr_eq(x.as_ref().unwrap(), y.as_ref().unwrap())
        };
        assert!(same(&a.principal, &b.principal), "the identity URI");
        assert!(
            same(&a.canonical_revision, &b.canonical_revision),
            "`latest`"
        );
        assert!(same(&a.namespace, &b.namespace) && same(&a.cluster, &b.cluster));
    }

    #[test]
    fn values_no_one_holds_are_swept_once_the_table_doubled() {
        let interned = Interned::default();
        let kept: Vec<Arc<Peer>> = (0..10)
            .map(|i| interned.peer(peer(&format!("k{i}"))))
            .collect();
        for i in 0..(MIN_SWEEP - 11) {
            drop(interned.peer(peer(&format!("gone{i}"))));
        }
        assert_eq!(
            interned.len(),
            (0, MIN_SWEEP - 1),
            "not swept before the threshold"
        );
        drop(interned.peer(peer("last")));
        // The one being inserted is held by its caller while the sweep runs.
        assert_eq!(interned.len(), (0, 11), "only the held ones stay");
        for (i, held) in kept.iter().enumerate() {
            assert!(Arc::ptr_eq(held, &interned.peer(peer(&format!("k{i}")))));
        }
    }
}
