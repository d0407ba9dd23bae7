//! istiod's resources in the mesh model, kept up to date one push at a
//! time: a push brings in only the resources it changed (named by the
//! resources' journal, [`super::journal`], or when it cannot vouch for the
//! copy held, found by comparing the held maps, which share every node a
//! push does not touch; each resource was translated once, when it arrived, and the entries
//! share that translation) and resolves again only the addresses those
//! resources claim or claimed. What it keeps ([`XdsEntries`]) is persistent, so the sources
//! can compare the entries in force with the new ones at the cost of
//! what changed.
//!
//! Conflicts between resources, which istiod's eventual consistency makes
//! normal for a moment (a service VIP reassigned to a pod), are resolved
//! the same way whatever the order the pushes came in: of a workload and
//! a service claiming an address (a network address: pods of two
//! networks at one IP claim two), the workload keeps it; the service
//! leaves it out until the workload goes, and says so. Entries of one
//! kind sharing an address are no conflict: workloads at one IP (a pod
//! replaced under it, a pod and its WorkloadEntry) are all held and the
//! state finds the best (ztunnel `WorkloadByAddr`), services sharing a
//! VIP each keep it and a lookup picks one per client.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Arc;

use tracing::warn;

use super::journal::changed_resources;
use super::resources::XdsResources;
use super::translate::{AddressEntry, Translated};
use crate::config::{
    self, LocalConfig, SharedStr,
    entries::{DropKey, Dropped, EntryKind, XdsEntry},
};

/// The entries claiming one address, in claim order (the first keeps it
/// from entries of the other kind).
/// Nearly always one, held inline: a one-element `Vec` allocated its
/// element besides (and a `BTreeSet` an eleven-slot node, about 350 bytes
/// per workload IP; `benches/mesh_memory.rs`). Several (a conflict) is
/// rare, so boxed: the enum is then the size of one entry (24 bytes, not
/// 32), and so is every slot of the claims table.
#[derive(Debug, Clone)]
#[expect(
    clippy::box_collection,
    reason = "boxed to keep the common one-claimant case one entry wide"
)]
enum Claimants {
    /// One claimant.
    One(XdsEntry),
    /// Several (or, only while being emptied, none), sorted.
    Many(Box<Vec<XdsEntry>>),
}

impl Default for Claimants {
    fn default() -> Self {
        Self::Many(Box::default())
    }
}

impl Claimants {
    fn insert(&mut self, entry: XdsEntry) {
        match self {
            Self::One(held) if *held == entry => {}
            Self::One(held) => {
                let mut many = vec![held.clone(), entry];
                many.sort();
                *self = Self::Many(Box::new(many));
            }
            Self::Many(many) if many.is_empty() => *self = Self::One(entry),
            Self::Many(many) => {
                if let Err(at) = many.binary_search(&entry) {
                    many.insert(at, entry);
                }
            }
        }
    }

    fn remove(&mut self, entry: &XdsEntry) {
        match self {
            Self::One(held) if held == entry => *self = Self::default(),
            Self::One(_) => {}
            Self::Many(many) => {
                if let Ok(at) = many.binary_search(entry) {
                    many.remove(at);
                }
                if let [last] = many.as_slice() {
                    *self = Self::One(last.clone());
                }
            }
        }
    }

    fn is_empty(&self) -> bool {
        matches!(self, Self::Many(many) if many.is_empty())
    }

    fn first(&self) -> Option<&XdsEntry> {
        match self {
            Self::One(held) => Some(held),
            Self::Many(many) => many.first(),
        }
    }

    fn iter(&self) -> impl Iterator<Item = &XdsEntry> {
        match self {
            Self::One(held) => std::slice::from_ref(held).iter(),
            Self::Many(many) => many.iter(),
        }
    }
}

/// Who claims each address of one network: IPv4 and IPv6 addresses
/// apart, so that a slot of the (nearly all IPv4) table is 32 bytes where
/// one keyed by `IpAddr` (17 bytes, padded to 24) took 56: 92 bytes a
/// workload at 10k workloads (`benches/mesh_memory.rs`).
#[derive(Debug, Default)]
struct ClaimsOnNetwork {
    v4: HashMap<Ipv4Addr, Claimants, foldhash::fast::RandomState>,
    v6: HashMap<Ipv6Addr, Claimants, foldhash::fast::RandomState>,
}

impl ClaimsOnNetwork {
    fn is_empty(&self) -> bool {
        self.v4.is_empty() && self.v6.is_empty()
    }
}

/// Who claims each network address (network and IP), as the mesh state
/// keys workloads (ztunnel `src/state/workload.rs` `WorkloadStore::by_addr`):
/// pods of two networks at one IP are no conflict, nor are two networks'
/// services at one VIP (ztunnel `ServiceStore::by_vip`, keyed by
/// `NetworkAddress`; see [`AddressEntry::claimed`]). A network nobody
/// claims on is dropped.
#[derive(Debug, Default)]
struct Claims {
    networks: HashMap<SharedStr, ClaimsOnNetwork, foldhash::fast::RandomState>,
}

impl Claims {
    fn get(&self, network: &str, ip: &IpAddr) -> Option<&Claimants> {
        let on = self.networks.get(network)?;
        match ip {
            IpAddr::V4(ip) => on.v4.get(ip),
            IpAddr::V6(ip) => on.v6.get(ip),
        }
    }

    fn get_mut(&mut self, network: &str, ip: &IpAddr) -> Option<&mut Claimants> {
        let on = self.networks.get_mut(network)?;
        match ip {
            IpAddr::V4(ip) => on.v4.get_mut(ip),
            IpAddr::V6(ip) => on.v6.get_mut(ip),
        }
    }

    fn remove(&mut self, network: &str, ip: &IpAddr) {
        let Some(on) = self.networks.get_mut(network) else {
            return;
        };
        match ip {
            IpAddr::V4(ip) => on.v4.remove(ip),
            IpAddr::V6(ip) => on.v6.remove(ip),
        };
        if on.is_empty() {
            self.networks.remove(network);
        }
    }

    /// The claimants of `ip` on `network`, none yet if it had none.
    fn entry(&mut self, network: &SharedStr, ip: IpAddr) -> &mut Claimants {
        let on = self.networks.entry(network.clone()).or_default();
        match ip {
            IpAddr::V4(ip) => on.v4.entry(ip).or_default(),
            IpAddr::V6(ip) => on.v6.entry(ip).or_default(),
        }
    }
}

/// istiod's entries as the mesh model holds them, conflicts resolved.
/// Cloning is cheap (persistent maps).
#[derive(Debug, Clone, Default)]
pub struct XdsEntries {
    /// Workloads by resource name.
    pub workloads: imbl::OrdMap<Arc<str>, Arc<config::Workload>>,
    /// Services by resource name.
    pub services: imbl::OrdMap<Arc<str>, Arc<config::Service>>,
    /// Authorization policies by resource name.
    pub policies: imbl::OrdMap<Arc<str>, Arc<config::Policy>>,
    /// What was left out, and why.
    pub dropped: Dropped,
}

impl XdsEntries {
    /// `config`'s entries as istiod's, named as istiod names them
    /// (a workload by uid, a service `namespace/hostname`, a policy
    /// `namespace/name`), with no conflict to resolve (as a parsed file
    /// has none): what tests and benchmarks feed the merge.
    pub fn of_config(config: &LocalConfig) -> Self {
        Self {
            workloads: config
                .workloads
                .iter()
                .map(|w| (w.uid.clone(), Arc::clone(w)))
                .collect(),
            services: config
                .services
                .iter()
                .map(|s| (s.key(), Arc::new(s.clone())))
                .collect(),
            policies: config
                .policies
                .iter()
                .map(|p| (p.key(), Arc::new(p.clone())))
                .collect(),
            dropped: Dropped::new(),
        }
    }

    /// Every entry as one configuration (workloads, services and policies
    /// in resource-name order) and what was left out.
    pub fn translated(&self, origin: &str) -> Translated {
        Translated {
            config: LocalConfig {
                origin: origin.to_owned(),
                workloads: self.workloads.values().cloned().collect(),
                services: self.services.values().map(|s| (**s).clone()).collect(),
                policies: self.policies.values().map(|p| (**p).clone()).collect(),
            },
            dropped: self
                .dropped
                .values()
                .flat_map(|notes| notes.iter().cloned())
                .collect(),
        }
    }
}

impl AddressEntry {
    fn kind(&self) -> Option<EntryKind> {
        match self {
            Self::Workload(Some(_)) => Some(EntryKind::Workload),
            Self::Service(_) => Some(EntryKind::Service),
            Self::Workload(None) | Self::Neither => None,
        }
    }

    /// The network addresses it claims: a workload's IPs on its network,
    /// a service's VIPs each on its own (istiod merges one service's
    /// VIPs from several clusters' networks: `multicluster.go`).
    fn claimed(&self) -> impl Iterator<Item = (&SharedStr, IpAddr)> {
        let (ips, network): (&[IpAddr], Option<&SharedStr>) = match self {
            // A host-network pod claims none: its IPs are its node's.
            Self::Workload(Some(w)) => (w.own_ips(), Some(&w.network)),
            _ => (&[], None),
        };
        let vips = match self {
            Self::Service(s) => &s.vips[..],
            _ => &[],
        };
        network
            .into_iter()
            .flat_map(move |network| ips.iter().map(move |ip| (network, *ip)))
            .chain(vips.iter().map(|vip| (&vip.network, vip.ip)))
    }

    /// It as named in a conflict note.
    fn label(&self) -> String {
        match self {
            Self::Workload(Some(w)) => format!("workload {}", w.uid),
            Self::Service(s) => format!("service {}", s.key()),
            Self::Workload(None) | Self::Neither => String::new(),
        }
    }
}

/// The names of the entries that changed (were added, replaced or
/// removed) in a run of updates: what the merge brings into the state,
/// looking each up in the entries instead of comparing the entries held
/// before with the new ones (a walk that compared every name of each
/// changed leaf, cold in the caches).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ChangedEntries {
    /// Every entry (a first state): the names are not kept, the merge
    /// takes every entry there is (keeping 55k names sorted at 50k
    /// workloads is work a first state does not need).
    everything: bool,
    workloads: BTreeSet<Arc<str>>,
    services: BTreeSet<Arc<str>>,
    policies: BTreeSet<Arc<str>>,
}

impl ChangedEntries {
    /// Every entry: what a state built whole takes in.
    pub fn everything() -> Self {
        Self {
            everything: true,
            ..Self::default()
        }
    }

    /// Whether nothing changed.
    pub fn is_empty(&self) -> bool {
        !self.everything
            && self.workloads.is_empty()
            && self.services.is_empty()
            && self.policies.is_empty()
    }

    /// The changed workloads' names, in name order (of `entries`, the
    /// entries as they stand, when everything changed).
    pub fn workloads<'a>(&'a self, entries: &'a XdsEntries) -> Names<'a> {
        self.names(&self.workloads, || Box::new(entries.workloads.keys()))
    }

    /// The changed services' names, as [`Self::workloads`].
    pub fn services<'a>(&'a self, entries: &'a XdsEntries) -> Names<'a> {
        self.names(&self.services, || Box::new(entries.services.keys()))
    }

    /// The changed policies' names, as [`Self::workloads`].
    pub fn policies<'a>(&'a self, entries: &'a XdsEntries) -> Names<'a> {
        self.names(&self.policies, || Box::new(entries.policies.keys()))
    }

    fn names<'a>(
        &'a self,
        noted: &'a BTreeSet<Arc<str>>,
        all: impl FnOnce() -> Names<'a>,
    ) -> Names<'a> {
        if self.everything {
            all()
        } else {
            Box::new(noted.iter())
        }
    }

    fn note(&mut self, entry: &XdsEntry) {
        if self.everything {
            return;
        }
        let names = match entry.kind {
            EntryKind::Workload => &mut self.workloads,
            EntryKind::Service => &mut self.services,
            EntryKind::Policy => &mut self.policies,
        };
        names.insert(Arc::clone(&entry.name));
    }
}

/// Names of changed entries, in name order.
pub type Names<'a> = Box<dyn Iterator<Item = &'a Arc<str>> + 'a>;

/// istiod's resources translated, kept from one push to the next.
#[derive(Debug, Default)]
pub struct XdsModel {
    /// The resources the entries were made from (each address resource
    /// as translated when it arrived).
    held: XdsResources,
    /// Who claims each address.
    claims: Claims,
    entries: XdsEntries,
    /// The entries changed since the state last took them in
    /// ([`Self::taken_in`]): kept across updates whose state was refused,
    /// so the next state takes their changes in too.
    pending: ChangedEntries,
}

impl XdsModel {
    /// Brings the entries up to `resources` (istiod's resources as now
    /// held), translating only what changed since the last call.
    pub fn update(&mut self, resources: &XdsResources) -> &XdsEntries {
        let held = std::mem::replace(&mut self.held, resources.clone());
        if held.addresses.is_empty() && held.authorizations.is_empty() && self.pending.is_empty() {
            // Every entry will be new.
            self.pending = ChangedEntries::everything();
        }
        // The journal names what the responses since `held` touched; a
        // copy it cannot vouch for is compared whole.
        let (touched_addresses, touched_policies) = match resources.touched_since(&held) {
            Some(touched) => (Some(touched.addresses), Some(touched.authorizations)),
            None => (None, None),
        };
        let mut touched: BTreeSet<XdsEntry> = BTreeSet::new();
        let mut addresses: HashSet<(SharedStr, IpAddr)> = HashSet::new();
        for (name, old, new) in
            changed_resources(&held.addresses, &resources.addresses, touched_addresses)
        {
            let mut noted = None;
            if let Some(old) = old {
                let old = &old.model().entry;
                if let Some(kind) = old.kind() {
                    let claimant = XdsEntry::new(kind, Arc::clone(name));
                    for (network, ip) in old.claimed() {
                        if let Some(set) = self.claims.get_mut(network, &ip) {
                            set.remove(&claimant);
                            if set.is_empty() {
                                self.claims.remove(network, &ip);
                            }
                        }
                        addresses.insert((network.clone(), ip));
                    }
                    touched.insert(claimant);
                }
                noted = self
                    .entries
                    .dropped
                    .remove(&DropKey::Translation(name.to_string()));
            }
            let Some(new) = new else {
                continue;
            };
            let translated = new.model();
            if let Some(kind) = translated.entry.kind() {
                let claimant = XdsEntry::new(kind, Arc::clone(name));
                for (network, ip) in translated.entry.claimed() {
                    self.claims.entry(network, ip).insert(claimant.clone());
                    addresses.insert((network.clone(), ip));
                }
                touched.insert(claimant);
            }
            if !translated.notes.is_empty() {
                let notes: Arc<[String]> = translated.notes.iter().cloned().collect();
                if noted.as_ref() != Some(&notes) {
                    warn_left_out(&notes);
                }
                self.entries
                    .dropped
                    .insert(DropKey::Translation(name.to_string()), notes);
            }
        }
        // Whoever else claims a changed address may have won or lost it.
        for (network, ip) in &addresses {
            if let Some(set) = self.claims.get(network, ip) {
                touched.extend(set.iter().cloned());
            }
        }
        for entry in &touched {
            self.resolve(entry);
        }
        let policies = changed_resources(
            &held.authorizations,
            &resources.authorizations,
            touched_policies,
        );
        for (name, _, new) in policies {
            match new {
                Some(new) => {
                    self.entries
                        .policies
                        .insert(name.clone(), Arc::clone(new.model()));
                }
                None => {
                    self.entries.policies.remove(name);
                }
            }
            self.pending
                .note(&XdsEntry::new(EntryKind::Policy, Arc::clone(name)));
        }
        &self.entries
    }

    /// The entries as they stand.
    pub fn entries(&self) -> &XdsEntries {
        &self.entries
    }

    /// The entries changed since the state last took them in.
    pub fn pending(&self) -> &ChangedEntries {
        &self.pending
    }

    /// The state in force now holds every entry as it stands: the
    /// changes pending are taken in.
    pub fn taken_in(&mut self) {
        self.pending = ChangedEntries::default();
    }

    /// Sets `entry` in the entries from its translation and the claims:
    /// the addresses it is the first claimant of, each once.
    fn resolve(&mut self, entry: &XdsEntry) {
        let note_key = DropKey::Conflict(entry.clone());
        let noted = self.entries.dropped.remove(&note_key);
        let raw = self
            .held
            .addresses
            .get(&entry.name)
            .map(|held| &held.model().entry)
            .filter(|raw| raw.kind() == Some(entry.kind));
        let Some(raw) = raw else {
            // Gone, or now of another kind (resolved under that one).
            let gone = match entry.kind {
                EntryKind::Workload => self.entries.workloads.remove(&entry.name).is_some(),
                EntryKind::Service => self.entries.services.remove(&entry.name).is_some(),
                EntryKind::Policy => false,
            };
            if gone {
                self.pending.note(entry);
            }
            return;
        };
        let mut notes = Vec::new();
        let mut seen = HashSet::new();
        let mut kept = Vec::new();
        let mut claimed = 0;
        for (network, ip) in raw.claimed() {
            claimed += 1;
            let owner = self.claims.get(network, &ip).and_then(|set| set.first());
            match owner {
                // Entries of one kind may share an address: services in
                // several namespaces a VIP, each client given the best for
                // it (ztunnel `ServiceStore::get_best_by_vip`); workloads
                // an IP (a pod replaced under it, a pod and a
                // WorkloadEntry), the state holding them all and finding
                // the best (ztunnel `WorkloadByAddr::get`). A workload's
                // address is no service's.
                Some(owner) if owner != entry && owner.kind != entry.kind => {
                    let owner = self
                        .held
                        .addresses
                        .get(&owner.name)
                        .map(|held| held.model().entry.label())
                        .unwrap_or_default();
                    notes.push(conflict_note(&raw.label(), &ip, &owner));
                }
                _ if !seen.insert((network, ip)) => {
                    notes.push(conflict_note(&raw.label(), &ip, &raw.label()));
                }
                _ => kept.push((network, ip)),
            }
        }
        let all = kept.len() == claimed;
        match raw {
            AddressEntry::Workload(Some(w)) => {
                let w = if all {
                    Arc::clone(w)
                } else {
                    Arc::new(config::Workload {
                        workload_ips: kept.iter().map(|(_, ip)| *ip).collect(),
                        ..(**w).clone()
                    })
                };
                if self.pending.everything || changes(self.entries.workloads.get(&entry.name), &w) {
                    self.entries.workloads.insert(entry.name.clone(), w);
                    self.pending.note(entry);
                }
            }
            AddressEntry::Service(s) => {
                let s = if all {
                    Arc::clone(s)
                } else {
                    Arc::new(config::Service {
                        vips: kept
                            .iter()
                            .map(|(network, ip)| config::Vip::new((*network).clone(), *ip))
                            .collect(),
                        ..(**s).clone()
                    })
                };
                if self.pending.everything || changes(self.entries.services.get(&entry.name), &s) {
                    self.entries.services.insert(entry.name.clone(), s);
                    self.pending.note(entry);
                }
            }
            AddressEntry::Workload(None) | AddressEntry::Neither => {}
        }
        if !notes.is_empty() {
            let notes: Arc<[String]> = notes.into();
            if noted.as_ref() != Some(&notes) {
                warn_left_out(&notes);
            }
            self.entries.dropped.insert(note_key, notes);
        }
    }
}

/// Says what a translation or a conflict newly left out.
fn warn_left_out(notes: &[String]) {
    for note in notes {
        warn!(reason = %note, "left out of the mesh state");
    }
}

/// Whether `new` differs from the entry `held` (none: it is new). An equal
/// one is left as it is: the state keeps sharing it, and the merge is not
/// told of it. (Not asked in a first state, where every entry is new: it
/// would look up each of 55k names at 50k workloads for nothing.)
fn changes<T: Eq>(held: Option<&Arc<T>>, new: &Arc<T>) -> bool {
    held.is_none_or(|held| !Arc::ptr_eq(held, new) && **held != **new)
}

fn conflict_note(loser: &str, ip: &IpAddr, owner: &str) -> String {
    format!("{loser}: address {ip} is already {owner}'s; left off until that one goes")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_claim_is_one_entry_wide() {
        // Every workload IP is a slot of the claims table: a claimant set
        // growing back past one entry's size costs every workload
        // (`benches/mesh_memory.rs`).
        assert_eq!(size_of::<Claimants>(), size_of::<XdsEntry>());
        assert!(size_of::<(Ipv4Addr, Claimants)>() <= 32);
    }
}

#[cfg(test)]
#[path = "network_claims_tests.rs"]
mod network_claims_tests;
