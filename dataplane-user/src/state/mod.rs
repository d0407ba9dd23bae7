//! What the agent knows about the mesh: workloads by IP (each with its
//! SPIFFE identity and protocol), services by VIP and hostname, and the
//! authorization policies, as one immutable snapshot ([`MeshState`]) built
//! from the local config and swapped whole when the config changes. Lookups
//! by IP are one hash probe.

mod services;
mod snapshot;
mod waypoints;

use std::{collections::HashMap, net::IpAddr, sync::Arc};

pub use services::{DEAD_ENDPOINT_HOLD, DeadEndpoints, Endpoint, ServiceEntry, ServiceIndex};
pub use snapshot::MeshState;
pub use waypoints::WaypointTarget;

use crate::{
    config::{LocalConfig, Protocol, Workload},
    identity::{Identity, IdentityError},
};

/// Errors building the index.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    /// Two workloads claim the same IP.
    #[error("workloads {first} and {second} both claim IP {ip}; every workload IP must be unique")]
    DuplicateIp {
        /// The IP.
        ip: IpAddr,
        /// The first workload's uid.
        first: String,
        /// The second workload's uid.
        second: String,
    },
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
    pub peer: Arc<crate::telemetry::Peer>,
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
/// as Istio defaults them.
fn workload_peer(workload: &Workload, identity: &Identity) -> crate::telemetry::Peer {
    let known = |value: &str| (!value.is_empty()).then(|| value.to_owned());
    let name = known(&workload.workload_name).unwrap_or_else(|| workload.name.clone());
    crate::telemetry::Peer {
        canonical_service: Some(known(&workload.canonical_name).unwrap_or_else(|| name.clone())),
        canonical_revision: Some(
            known(&workload.canonical_revision).unwrap_or_else(|| "latest".to_owned()),
        ),
        workload: Some(name),
        namespace: Some(workload.namespace.clone()),
        principal: Some(identity.to_uri()),
        cluster: known(&workload.cluster_id),
        region: known(&workload.locality.region),
        zone: known(&workload.locality.zone),
    }
}

/// Workloads by IP.
#[derive(Debug, Clone, Default)]
pub struct WorkloadIndex {
    /// foldhash rather than SipHash: the keys come from the operator's file
    /// and istiod, not from strangers, and every connection and every push
    /// hashes them (SipHash was a fifth of a push's CPU at 10k workloads).
    by_ip: HashMap<IpAddr, Arc<MeshWorkload>, foldhash::fast::RandomState>,
    all: Vec<Arc<MeshWorkload>>,
}

impl WorkloadIndex {
    /// Indexes the config's workloads.
    pub fn from_config(config: &LocalConfig) -> Result<Self, StateError> {
        Self::reusing(config, None)
    }

    /// Indexes the config's workloads, taking from `previous` (the index
    /// of the state in force) every entry whose workload did not change:
    /// one comparison instead of a copy, an identity and a telemetry peer
    /// per workload, so a state rebuilt for one changed workload allocates
    /// for that one.
    pub fn reusing(config: &LocalConfig, previous: Option<&Self>) -> Result<Self, StateError> {
        let mut by_ip: HashMap<IpAddr, Arc<MeshWorkload>, _> = HashMap::with_capacity_and_hasher(
            config.workloads.len(),
            foldhash::fast::RandomState::default(),
        );
        let mut all = Vec::with_capacity(config.workloads.len());
        for workload in &config.workloads {
            let unchanged = previous
                .zip(workload.workload_ips.first())
                .and_then(|(previous, ip)| previous.by_ip(*ip))
                .filter(|held| Arc::ptr_eq(&held.workload, workload) || held.workload == *workload);
            let entry = match unchanged {
                Some(held) => Arc::clone(held),
                None => Arc::new(Self::entry(workload)?),
            };
            all.push(Arc::clone(&entry));
            for ip in &workload.workload_ips {
                // Keyed as looked up: an IPv4-mapped address is its IPv4.
                if let Some(first) = by_ip.insert(ip.to_canonical(), Arc::clone(&entry)) {
                    return Err(StateError::DuplicateIp {
                        ip: *ip,
                        first: first.workload.uid.clone(),
                        second: workload.uid.clone(),
                    });
                }
            }
        }
        Ok(Self { by_ip, all })
    }

    /// A workload with its identity and telemetry peer.
    fn entry(workload: &Arc<Workload>) -> Result<MeshWorkload, StateError> {
        let identity = Identity::new(
            &workload.trust_domain,
            &workload.namespace,
            &workload.service_account,
        )
        .map_err(|source| StateError::Identity {
            uid: workload.uid.clone(),
            source,
        })?;
        let peer = Arc::new(workload_peer(workload, &identity));
        Ok(MeshWorkload {
            workload: Arc::clone(workload),
            identity,
            peer,
        })
    }

    /// The workload owning `ip`, if any.
    pub fn by_ip(&self, ip: IpAddr) -> Option<&Arc<MeshWorkload>> {
        self.by_ip.get(&ip.to_canonical())
    }

    /// Number of workloads.
    pub fn len(&self) -> usize {
        self.all.len()
    }

    /// Whether no workload is known.
    pub fn is_empty(&self) -> bool {
        self.all.is_empty()
    }

    /// Every workload, in config order.
    pub fn all(&self) -> &[Arc<MeshWorkload>] {
        &self.all
    }
}

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
    fn a_rebuild_takes_unchanged_workloads_from_the_state_in_force() {
        let before = config(
            "workloads:\n- {uid: a, name: a, namespace: n, workloadIps: [10.0.0.1]}\n- {uid: b, name: b, namespace: n, workloadIps: [10.0.0.2]}\n",
        );
        let mut after = before.clone();
        Arc::make_mut(&mut after.workloads[1]).service_account = "renamed".into();
        let old = WorkloadIndex::from_config(&before).unwrap();
        let new = WorkloadIndex::reusing(&after, Some(&old)).unwrap();
        let at =
            |index: &WorkloadIndex, ip: &str| Arc::clone(index.by_ip(ip.parse().unwrap()).unwrap());
        assert!(Arc::ptr_eq(&at(&old, "10.0.0.1"), &at(&new, "10.0.0.1")));
        // The changed one is built again, identity and all.
        assert!(!Arc::ptr_eq(&at(&old, "10.0.0.2"), &at(&new, "10.0.0.2")));
        assert_eq!(
            at(&new, "10.0.0.2").identity.to_uri(),
            "spiffe://cluster.local/ns/n/sa/renamed"
        );
        // An IP that moved to another workload is that workload's.
        let mut moved = before.clone();
        Arc::make_mut(&mut moved.workloads[0]).workload_ips = vec!["10.0.0.3".parse().unwrap()];
        Arc::make_mut(&mut moved.workloads[1]).workload_ips = vec!["10.0.0.1".parse().unwrap()];
        let new = WorkloadIndex::reusing(&moved, Some(&old)).unwrap();
        assert_eq!(at(&new, "10.0.0.1").workload.uid, "b");
        assert_eq!(at(&new, "10.0.0.3").workload.uid, "a");
    }

    #[test]
    fn duplicate_ips_are_rejected() {
        // The config parser rejects this first; the index must too, for
        // configs assembled in code.
        let mut merged =
            config("workloads:\n- {uid: a, name: a, namespace: n, workloadIps: [10.0.0.1]}\n");
        let other =
            config("workloads:\n- {uid: b, name: b, namespace: n, workloadIps: [10.0.0.1]}\n");
        merged.workloads.extend(other.workloads);
        let err = WorkloadIndex::from_config(&merged).unwrap_err();
        assert!(err.to_string().contains("both claim IP 10.0.0.1"), "{err}");
        let text = "workloads:\n- {uid: a, name: a, namespace: n, workloadIps: [10.0.0.1]}\n- {uid: b, name: b, namespace: n, workloadIps: [10.0.0.1]}\n";
        let err =
            crate::logging::Chain(&LocalConfig::parse(text, "cfg.yaml").unwrap_err()).to_string();
        assert!(
            err.contains("cfg.yaml:3:") && err.contains("workloads[1].workloadIps"),
            "{err}"
        );
    }
}
