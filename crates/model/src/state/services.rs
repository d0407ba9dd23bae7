//! Services by VIP, VIP range and hostname: which service a client gets
//! at an address or name, with the index a change brings up to date.
//! (One service's endpoints and their choice: [`super::service_entry`].)

use std::{collections::HashMap, net::IpAddr, sync::Arc};

use super::{
    EntryKey, MeshWorkload, Multi, ServiceEntry, Values,
    text_key::{TextKey, TextProbe},
};
use crate::config::{Service, SharedStr, VipRange};

/// Services by VIP and by hostname, with their endpoints.
///
/// Each workload names its services (`namespace/hostname` keys), so the
/// index keeps, per service key, the workloads that name it; a change
/// builds again only the services whose definition or members it touched
/// (at 10,000 workloads and 1,000 services a scan of every workload for
/// every service took two thirds of a whole state's 159 ms build; see
/// `benches/mesh_state.rs`).
#[derive(Debug, Clone, Default)]
pub struct ServiceIndex {
    /// Definitions by service key (`namespace/hostname`).
    defs: Multi<TextKey, Arc<Service>>,
    /// Where each definition is, by entry (to find its key when it goes).
    def_keys: imbl::OrdMap<EntryKey, TextKey>,
    /// Workloads naming each service key.
    members: Multi<TextKey, Arc<MeshWorkload>>,
    /// Built entries by service key.
    entries: Multi<TextKey, Arc<ServiceEntry>>,
    /// Built entries by network and VIP (services of several namespaces,
    /// or of several networks, may share one).
    pub(super) by_vip: super::by_vip::ByVip,
    /// This node's network: the one a lookup for no client workload in
    /// particular ([`Self::by_vip`], [`Self::by_vip_for`]) is made on.
    network: SharedStr,
    /// Built entries by VIP range on its network (few services have one:
    /// looked up by a scan, as ztunnel's `by_cidr_vip`).
    by_cidr: Multi<VipRange, Arc<ServiceEntry>>,
    by_hostname: Multi<TextKey, Arc<ServiceEntry>>,
}

impl ServiceIndex {
    /// Replaces the service definitions `changes` names and builds again
    /// every service whose definition changed or whose members
    /// (`members_touched`: service key and workload entry, from
    /// [`super::WorkloadIndex::apply`]) did, with endpoints from
    /// `workloads` (which already holds the change): a service whose
    /// definition stayed changes only the members touched, one at a time
    /// ([`super::EndpointSet::changed`]). Returns the keys of the services built
    /// again; `old_vip` hears of each VIP the services built again had
    /// before. A service `donor` (an index the same change was made to)
    /// holds built from the same definition is taken from it.
    pub(crate) fn apply(
        &mut self,
        changes: &[(EntryKey, Option<Arc<Service>>)],
        members_touched: &[(TextKey, EntryKey)],
        workloads: &super::WorkloadIndex,
        donor: Option<&ServiceIndex>,
        old_vip: &mut dyn FnMut(IpAddr),
    ) -> std::collections::BTreeSet<TextKey> {
        let mut rebuild: std::collections::BTreeSet<TextKey> = std::collections::BTreeSet::new();
        let mut touched: HashMap<&TextKey, Vec<EntryKey>> = HashMap::new();
        for (service, entry) in members_touched {
            match workloads
                .by_key(entry)
                .filter(|w| w.workload.services.contains_key(service.as_str()))
            {
                Some(w) => self
                    .members
                    .insert(service.clone(), entry.clone(), Arc::clone(w)),
                None => self.members.remove(service, entry),
            }
            rebuild.insert(service.clone());
            touched.entry(service).or_default().push(entry.clone());
        }
        for (entry, new) in changes {
            if let Some(old) = self.def_keys.remove(entry) {
                self.defs.remove(&old, entry);
                rebuild.insert(old);
            }
            if let Some(service) = new {
                let key = TextKey::new(&service.key());
                self.defs
                    .insert(key.clone(), entry.clone(), Arc::clone(service));
                self.def_keys.insert(entry.clone(), key.clone());
                rebuild.insert(key);
            }
        }
        // Every stale entry goes before any is built: a definition that
        // moved from one key to another is under both. Each is kept until
        // its successor is built, which reuses what the definition
        // decides when that did not change.
        let mut previous: HashMap<EntryKey, Arc<ServiceEntry>> = HashMap::new();
        for key in &rebuild {
            let Some(stale) = self.entries.all(key).cloned() else {
                continue;
            };
            let defs = self.defs.all(key);
            for (entry, built) in stale.iter() {
                previous.insert(entry.clone(), Arc::clone(built));
                // The same definition is indexed under the same VIPs,
                // ranges, hostname and key: its successor replaces it
                // where it is (below), one walk of each index, in place on
                // a state no reader holds.
                let stays = defs
                    .and_then(|defs| defs.get(entry))
                    .is_some_and(|service| Arc::ptr_eq(service, &built.service));
                for vip in &built.service.vips {
                    old_vip(vip.ip);
                    if !stays {
                        self.by_vip.remove(vip, entry);
                    }
                }
                if stays {
                    continue;
                }
                for range in &built.service.cidr_vips {
                    self.by_cidr.remove(range, entry);
                }
                self.by_hostname
                    .remove(TextProbe::new(&built.service.hostname).as_key(), entry);
                self.entries.remove(key, entry);
            }
        }
        for key in &rebuild {
            let Some(defs) = self.defs.all(key).cloned() else {
                continue;
            };
            let members = self.members.all(key).cloned();
            let donated = donor.and_then(|d| d.entries.all(key));
            let touched = touched.get(key).map_or(&[][..], Vec::as_slice);
            for (entry, service) in defs.iter() {
                let built = match donated
                    .and_then(|all| all.get(entry))
                    .filter(|built| Arc::ptr_eq(&built.service, service))
                {
                    Some(built) => Arc::clone(built),
                    None => Arc::new(match previous.get(entry) {
                        // The same definition: only members changed.
                        Some(previous) if Arc::ptr_eq(&previous.service, service) => {
                            previous.with_members(touched, members.as_ref())
                        }
                        previous => ServiceEntry::new(service, members.as_ref(), previous),
                    }),
                };
                for vip in &service.vips {
                    self.by_vip.insert(vip, entry.clone(), Arc::clone(&built));
                }
                for range in &service.cidr_vips {
                    self.by_cidr
                        .insert(range.clone(), entry.clone(), Arc::clone(&built));
                }
                self.by_hostname.insert(
                    TextKey::new(&service.hostname),
                    entry.clone(),
                    Arc::clone(&built),
                );
                self.entries.insert(key.clone(), entry.clone(), built);
            }
        }
        rebuild
    }

    /// The VIPs (any network's) of every service held under the service
    /// key `key`.
    pub fn vips<'a>(&'a self, key: &TextKey) -> impl Iterator<Item = IpAddr> + 'a {
        self.entries
            .all(key)
            .into_iter()
            .flat_map(|built| built.values())
            .flat_map(|entry| entry.service.vips.iter().map(|vip| vip.ip))
    }

    /// Makes `network` this node's: the one [`Self::by_vip`] and
    /// [`Self::by_vip_for`] look up on. Nothing is indexed again: VIPs are
    /// keyed by their own network.
    pub fn set_network(&mut self, network: &str) {
        self.network = SharedStr::from(network);
    }

    /// The service behind a VIP on this node's network, for no client in
    /// particular (of several, see [`best`]).
    pub fn by_vip(&self, ip: IpAddr) -> Option<&Arc<ServiceEntry>> {
        self.lookup_vip(&self.network, ip, None)
    }

    /// The service behind a VIP on `network`, for no client in
    /// particular (of several, see [`best`]).
    pub fn by_vip_at(&self, network: &str, ip: IpAddr) -> Option<&Arc<ServiceEntry>> {
        self.lookup_vip(network, ip, None)
    }

    /// The service behind a VIP on this node's network for a client in
    /// `namespace`: see [`Self::by_vip_on`].
    pub fn by_vip_for(&self, ip: IpAddr, namespace: &str) -> Option<&Arc<ServiceEntry>> {
        self.lookup_vip(&self.network, ip, Some(namespace))
    }

    /// The service behind a VIP on `network` (the client's: a VIP of
    /// another network at the same IP is not it, ztunnel `find_upstream`)
    /// for a client in `namespace`: one visible to it, its own
    /// namespace's first (ztunnel `ServiceStore::get_best_by_vip`).
    /// `None` when none is visible: the address is then no service's for
    /// this client.
    pub fn by_vip_on(
        &self,
        network: &str,
        ip: IpAddr,
        namespace: &str,
    ) -> Option<&Arc<ServiceEntry>> {
        self.lookup_vip(network, ip, Some(namespace))
    }

    /// A VIP's service on `network` for a client in `namespace` (any
    /// client: `None`): the best visible one at the network address, else
    /// the best visible one whose VIP range holds it, ranked by the
    /// client's namespace, then the longest prefix, then `canonical`
    /// (ztunnel `ServiceStore::get_best_by_vip`, `get_best_by_cidr_vip`);
    /// among equals the last in entry order, as [`best`]. A range is
    /// matched on its own network only, as a VIP is.
    fn lookup_vip(
        &self,
        network: &str,
        ip: IpAddr,
        namespace: Option<&str>,
    ) -> Option<&Arc<ServiceEntry>> {
        let ip = ip.to_canonical();
        if let Some(found) = self
            .by_vip
            .all(network, &ip)
            .and_then(|all| best(all, namespace))
        {
            return Some(found);
        }
        if self.by_cidr.is_empty() {
            return None;
        }
        self.by_cidr
            .iter()
            .filter(|(range, _)| range.contains(network, &ip))
            .flat_map(|(range, all)| all.values().map(move |e| (range.net.prefix_len(), e)))
            .filter(|(_, e)| namespace.is_none_or(|ns| e.service.visible_to(ns)))
            .max_by_key(|(prefix, e)| {
                (
                    namespace.is_some_and(|ns| e.service.namespace == ns),
                    *prefix,
                    e.service.canonical,
                )
            })
            .map(|(_, e)| e)
    }

    /// The service with this hostname, for no client in particular (of
    /// several, see [`best`]).
    pub fn by_hostname(&self, hostname: &str) -> Option<&Arc<ServiceEntry>> {
        best(
            self.by_hostname.all(TextProbe::new(hostname).as_key())?,
            None,
        )
    }

    /// The service with this hostname for a client (or, for an HBONE
    /// authority, a server) in `namespace`, as [`Self::by_vip_for`]
    /// chooses (ztunnel `ServiceStore::get_best_by_host`).
    pub fn by_hostname_for(&self, hostname: &str, namespace: &str) -> Option<&Arc<ServiceEntry>> {
        best(
            self.by_hostname.all(TextProbe::new(hostname).as_key())?,
            Some(namespace),
        )
    }

    /// The service with the key `namespace/hostname` (ztunnel
    /// `get_by_namespaced_host`).
    pub fn by_key(&self, key: &str) -> Option<&Arc<ServiceEntry>> {
        self.entries.last(TextProbe::new(key).as_key())
    }

    /// Number of service definitions.
    pub fn len(&self) -> usize {
        self.def_keys.len()
    }

    /// Whether there is none.
    pub fn is_empty(&self) -> bool {
        self.def_keys.is_empty()
    }

    /// Each definition held, in entry order (the file's, then istiod's by
    /// resource name), as the state holds it.
    pub fn definitions(&self) -> impl Iterator<Item = Arc<Service>> + '_ {
        self.def_keys
            .iter()
            .filter_map(|(entry, key)| self.defs.all(key).and_then(|defs| defs.get(entry)).cloned())
    }
}

/// Of the services sharing a VIP or hostname, the one a client in
/// `namespace` gets, as ztunnel's `ServiceMatch::find_best_match` ranks
/// them: only those visible to it; one of its own namespace first, then a
/// `canonical` one, then any. Without a namespace (no client in
/// particular) every one counts and the canonical one comes first. Among
/// equals the one that comes last in the merged configuration wins, as
/// when the state was a list built in that order.
fn best<'a>(
    services: &'a Values<Arc<ServiceEntry>>,
    namespace: Option<&str>,
) -> Option<&'a Arc<ServiceEntry>> {
    let visible = || {
        services
            .values()
            .filter(move |e| namespace.is_none_or(|ns| e.service.visible_to(ns)))
    };
    if let Some(ns) = namespace
        && let Some(own) = visible().filter(|e| e.service.namespace == ns).last()
    {
        return Some(own);
    }
    visible()
        .filter(|e| e.service.canonical)
        .last()
        .or_else(|| visible().last())
}
