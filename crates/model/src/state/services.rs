//! Services: VIP -> the workloads that list the service, with endpoint
//! choice per connection and port mapping.

use std::{
    collections::HashMap,
    net::{IpAddr, SocketAddr},
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
};

use super::{
    EndpointSet, EntryKey, MeshWorkload, Multi, ServiceRef, Values,
    dead::random_index,
    text_key::{TextKey, TextProbe},
};
use crate::{
    config::{
        HealthPolicy, LoadBalancing, RoutingMode, Service, SharedStr, VipRange, Waypoint,
        WorkloadStatus,
    },
    identity::Identity,
};

/// A service with its endpoints.
#[derive(Debug)]
pub struct ServiceEntry {
    /// The service as configured (shared with the definition it was
    /// built from and with every rebuild of it for a change of members).
    pub service: Arc<Service>,
    /// Identities its servers may present besides the endpoint's own
    /// (shared by every connection's pool key).
    pub alt_identities: Arc<[Identity]>,
    /// It in telemetry (shared by every connection attributed to it).
    pub label: Arc<ServiceRef>,
    endpoints: EndpointSet,
    next: AtomicUsize,
}

/// One endpoint chosen for one connection.
#[derive(Debug, Clone)]
pub struct Endpoint {
    /// The workload.
    pub workload: Arc<MeshWorkload>,
    /// Its address for this connection.
    pub addr: EndpointAddr,
}

/// Where an endpoint is reached.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EndpointAddr {
    /// The workload's IP and the target port.
    Ip(SocketAddr),
    /// A workload without IPs but with a DNS name (a ServiceEntry endpoint
    /// with `resolution: DNS`), resolved when the connection is made, and
    /// the target port.
    Hostname(Arc<str>, u16),
    /// A workload on another network than the client's, reached by double
    /// HBONE through this network gateway of its (ztunnel
    /// `src/proxy/outbound.rs` `build_request_through_gateway`).
    Gateway(Box<Waypoint>),
}

impl EndpointAddr {
    /// The IP, when the endpoint has one (no DNS name to resolve).
    pub fn ip(&self) -> Option<IpAddr> {
        match self {
            Self::Ip(addr) => Some(addr.ip()),
            Self::Hostname(..) | Self::Gateway(_) => None,
        }
    }
}

impl Endpoint {
    /// Whether the endpoint's node is marked dead (an endpoint reached by
    /// DNS name has no node to mark).
    fn dead(&self, is_dead: &impl Fn(IpAddr) -> bool) -> bool {
        self.addr.ip().is_some_and(is_dead)
    }
}

impl ServiceEntry {
    /// Where load balancing starts for the next connection: the
    /// round-robin counter's next value (which this advances), or a random
    /// endpoint; each endpoint's share in proportion to its weight (its
    /// workload's capacity, as ztunnel's `load_balance` draws with
    /// `choose_weighted`: round robin then takes `weight` turns of each in
    /// every round).
    pub fn next_start(&self) -> usize {
        let n = self.endpoints.len().max(1);
        let Some(sums) = self.endpoints.sums() else {
            return match self.service.load_balancing {
                LoadBalancing::RoundRobin => self.next.fetch_add(1, Ordering::Relaxed) % n,
                LoadBalancing::Random => random_index(n),
            };
        };
        let total = sums.last().copied().unwrap_or(1).max(1);
        let draw = match self.service.load_balancing {
            LoadBalancing::RoundRobin => self.next.fetch_add(1, Ordering::Relaxed) as u64 % total,
            LoadBalancing::Random => {
                random_index(usize::try_from(total).unwrap_or(usize::MAX)) as u64
            }
        };
        // The first endpoint whose running sum passes the draw.
        sums.partition_point(|sum| *sum <= draw).min(n - 1)
    }

    /// Endpoint candidates for a connection from `source` (the client's
    /// workload, when the mesh knows it) to `port`, in the order to try:
    /// rotated to begin at `start` (the load-balancing choice), then
    /// narrowed (`strict`) or ordered (`failover`) by how many of the
    /// service's locality preferences each endpoint shares with the client,
    /// live endpoints before the ones `is_dead` names; ties keep the
    /// rotation order. Pure: the same inputs give the same order.
    pub fn candidates(
        &self,
        port: u16,
        start: usize,
        source: Option<&MeshWorkload>,
        local_network: &str,
        is_dead: impl Fn(IpAddr) -> bool,
    ) -> Vec<Endpoint> {
        let mut ordered = self.ranked(port, start, source, local_network);
        // Stable: live ones first, then the best locality, keeping the
        // rotation order among equals.
        ordered.sort_by_key(|(rank, e)| (e.dead(&is_dead), std::cmp::Reverse(*rank)));
        ordered.into_iter().map(|(_, e)| e).collect()
    }

    /// The candidates for a connection from `source` to `port` when the
    /// engine's choice among them is even: every one equally close to the
    /// client and none dead, so any of them is as likely to be first as
    /// another. `None` when locality or a dead endpoint would order them,
    /// or there is none, or one is reached by DNS name (only the proxy
    /// resolves names), or their weights differ.
    pub fn even_candidates(
        &self,
        port: u16,
        source: Option<&MeshWorkload>,
        local_network: &str,
        is_dead: impl Fn(IpAddr) -> bool,
    ) -> Option<Vec<Endpoint>> {
        if self.endpoints.sums().is_some() {
            return None;
        }
        let ranked = self.ranked(port, 0, source, local_network);
        let first = ranked.first()?.0;
        ranked
            .into_iter()
            .map(|(rank, e)| {
                (rank == first && !e.dead(&is_dead) && e.addr.ip().is_some()).then_some(e)
            })
            .collect()
    }

    /// The endpoints for `port` with their locality rank for `source`,
    /// rotated to begin at `start`; `strict` routing drops the ones that
    /// do not share every preference, and none on a network the client
    /// cannot reach is kept (see [`on_reachable_network`]). The client's
    /// network is its workload's, else `local_network` (the node's,
    /// `--network`).
    fn ranked(
        &self,
        port: u16,
        start: usize,
        source: Option<&MeshWorkload>,
        local_network: &str,
    ) -> Vec<(usize, Endpoint)> {
        if self.endpoints.is_empty() {
            return Vec::new();
        }
        let network = source.map_or(local_network, |s| &*s.workload.network);
        let key = self.service.key();
        let routing = &self.service.routing;
        let wanted = routing.preferences.len();
        self.endpoints
            .rotated(start)
            .filter_map(|workload| {
                let (matched, rank) = match (routing.mode, source) {
                    (RoutingMode::Strict | RoutingMode::Failover, Some(source)) => {
                        super::routing::locality_rank(&routing.preferences, source, workload)
                    }
                    // Without a known client nothing can be compared:
                    // strict keeps nothing, failover everything.
                    (RoutingMode::Strict, None) => (0, 0),
                    _ => (wanted, wanted),
                };
                if routing.mode == RoutingMode::Strict && matched < wanted {
                    return None;
                }
                let target = workload
                    .workload
                    .services
                    .get(&key)
                    .and_then(|ports| ports.target(port))
                    .or_else(|| self.service.ports.get(&port).copied().filter(|p| *p != 0))
                    .unwrap_or(port);
                // ztunnel `load_balance`: an endpoint needs an IP or a
                // hostname, or, on another network, a gateway (through
                // which it goes whatever its addresses: `build_request`).
                let addr = if super::on_reachable_network(&workload.workload, network) {
                    match workload.workload.workload_ips.first() {
                        Some(ip) => EndpointAddr::Ip(SocketAddr::new(*ip, target)),
                        None if !workload.workload.hostname.is_empty() => {
                            EndpointAddr::Hostname(Arc::from(&workload.workload.hostname), target)
                        }
                        None => return None,
                    }
                } else {
                    EndpointAddr::Gateway(workload.workload.network_gateway.clone()?)
                };
                let endpoint = Endpoint {
                    workload: Arc::clone(workload),
                    addr,
                };
                Some((rank, endpoint))
            })
            .collect()
    }

    /// Its endpoints (healthy ones, unless its health policy allows all),
    /// in entry order.
    pub fn endpoints(&self) -> &EndpointSet {
        &self.endpoints
    }

    /// Number of endpoints.
    pub fn endpoint_count(&self) -> usize {
        self.endpoints.len()
    }
}

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
    /// ([`EndpointSet::changed`]). Returns the keys of the services built
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

impl ServiceEntry {
    /// `service` with its endpoints among `members` (the workloads that
    /// name it, in entry order): the ones it [`serves`]. `previous`, the
    /// entry this one replaces (of another definition: the same one
    /// changes members only, [`Self::with_members`]), lends its
    /// round-robin position, so a change of endpoints does not send the
    /// next connections back to the first one.
    fn new(
        service: &Arc<Service>,
        members: Option<&Values<Arc<MeshWorkload>>>,
        previous: Option<&Arc<ServiceEntry>>,
    ) -> Self {
        let endpoints = EndpointSet::of(members, |w| serves(service, w));
        let next = AtomicUsize::new(previous.map_or(0, |p| p.next.load(Ordering::Relaxed)));
        let alt_identities = service
            .subject_alt_names
            .iter()
            .filter_map(|san| {
                let uri = if san.starts_with("spiffe://") {
                    san.clone()
                } else {
                    format!("spiffe://{san}")
                };
                Identity::parse(&uri).ok()
            })
            .collect();
        Self {
            label: Arc::new(ServiceRef {
                hostname: service.hostname.clone(),
                name: service.name.clone(),
                namespace: service.namespace.clone(),
            }),
            service: Arc::clone(service),
            alt_identities,
            endpoints,
            next,
        }
    }

    /// This entry with the members `touched` names brought up to
    /// `members` (its definition unchanged); the other endpoints, what the
    /// definition decides and the round-robin position carried over.
    fn with_members(
        &self,
        touched: &[EntryKey],
        members: Option<&Values<Arc<MeshWorkload>>>,
    ) -> Self {
        let service = &self.service;
        Self {
            service: Arc::clone(service),
            alt_identities: Arc::clone(&self.alt_identities),
            label: Arc::clone(&self.label),
            endpoints: self
                .endpoints
                .changed(touched, members, |w| serves(service, w)),
            next: AtomicUsize::new(self.next.load(Ordering::Relaxed)),
        }
    }
}

/// Whether `service` takes `member` as an endpoint: when healthy, or
/// whatever its health when its health policy allows all.
fn serves(service: &Service, member: &MeshWorkload) -> bool {
    service.health_policy == HealthPolicy::AllowAll
        || member.workload.status == WorkloadStatus::Healthy
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
