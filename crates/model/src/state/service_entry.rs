//! One service with its endpoints: the endpoint a connection goes to
//! (load balancing, locality, networks) and the port it is reached at.

use std::{
    net::{IpAddr, SocketAddr},
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
};

use super::{EndpointSet, EntryKey, MeshWorkload, ServiceRef, Values, dead::random_index};
use crate::{
    config::{HealthPolicy, LoadBalancing, RoutingMode, Service, Waypoint, WorkloadStatus},
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
    /// workload, when the mesh knows it) to `dst` (the service's address
    /// as dialled: its port, and the family an endpoint is reached in, see
    /// [`super::pick_address`]), in the order to try:
    /// rotated to begin at `start` (the load-balancing choice), then
    /// narrowed (`strict`) or ordered (`failover`) by how many of the
    /// service's locality preferences each endpoint shares with the client,
    /// live endpoints before the ones `is_dead` names; ties keep the
    /// rotation order. Pure: the same inputs give the same order.
    pub fn candidates(
        &self,
        dst: SocketAddr,
        start: usize,
        source: Option<&MeshWorkload>,
        local_network: &str,
        is_dead: impl Fn(IpAddr) -> bool,
    ) -> Vec<Endpoint> {
        let mut ordered = self.ranked(dst, start, source, local_network);
        // Stable: live ones first, then the best locality, keeping the
        // rotation order among equals.
        ordered.sort_by_key(|(rank, e)| (e.dead(&is_dead), std::cmp::Reverse(*rank)));
        ordered.into_iter().map(|(_, e)| e).collect()
    }

    /// The candidates for a connection from `source` to `dst` when the
    /// engine's choice among them is even: every one equally close to the
    /// client and none dead, so any of them is as likely to be first as
    /// another. `None` when locality or a dead endpoint would order them,
    /// or there is none, or one is reached by DNS name (only the proxy
    /// resolves names), or their weights differ.
    pub fn even_candidates(
        &self,
        dst: SocketAddr,
        source: Option<&MeshWorkload>,
        local_network: &str,
        is_dead: impl Fn(IpAddr) -> bool,
    ) -> Option<Vec<Endpoint>> {
        if self.endpoints.sums().is_some() {
            return None;
        }
        let ranked = self.ranked(dst, 0, source, local_network);
        let first = ranked.first()?.0;
        ranked
            .into_iter()
            .map(|(rank, e)| {
                (rank == first && !e.dead(&is_dead) && e.addr.ip().is_some()).then_some(e)
            })
            .collect()
    }

    /// The endpoints for `dst` with their locality rank for `source`,
    /// rotated to begin at `start`; `strict` routing drops the ones that
    /// do not share every preference, and none on a network the client
    /// cannot reach is kept (see [`super::on_reachable_network`]). The client's
    /// network is its workload's, else `local_network` (the node's,
    /// `--network`).
    fn ranked(
        &self,
        dst: SocketAddr,
        start: usize,
        source: Option<&MeshWorkload>,
        local_network: &str,
    ) -> Vec<(usize, Endpoint)> {
        if self.endpoints.is_empty() {
            return Vec::new();
        }
        let network = source.map_or(local_network, |s| &*s.workload.network);
        let port = dst.port();
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
                // Its address of the destination's family, among the
                // service's families, else its hostname resolved
                // (`pick_workload_destination_or_resolve`); one with
                // neither is left out (ztunnel would pick it and fail:
                // `NoValidDestination`).
                let ips = &workload.workload.workload_ips;
                let addr = if super::on_reachable_network(&workload.workload, network) {
                    match super::pick_address(ips, dst.ip(), self.service.ip_families) {
                        Some(ip) => EndpointAddr::Ip(SocketAddr::new(ip, target)),
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

impl ServiceEntry {
    /// `service` with its endpoints among `members` (the workloads that
    /// name it, in entry order): the ones it [`serves`]. `previous`, the
    /// entry this one replaces (of another definition: the same one
    /// changes members only, [`Self::with_members`]), lends its
    /// round-robin position, so a change of endpoints does not send the
    /// next connections back to the first one.
    pub(super) fn new(
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
    pub(super) fn with_members(
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
