//! What a captured outbound connection does, decided before anything is
//! dialled: [`plan`] maps (mesh state, source pod, original destination)
//! to an [`OutboundPlan`] and touches no socket, clock or counter, so every
//! routing rule is a table-driven unit test here. The async side
//! (`super`) only executes the plan.
//!
//! - a workload speaking HBONE: a tunnel to its pod's 15008, expecting its
//!   identity;
//! - a workload speaking plain TCP, or an address outside the mesh: a
//!   direct connection from inside the pod (passthrough);
//! - a service VIP: its endpoints in the order to try (the load-balancing
//!   choice first, endpoints recently found dead last), each a tunnel or a
//!   direct hop, with the service's subjectAltNames accepted besides each
//!   endpoint's identity (an endpoint known by DNS name only, a
//!   ServiceEntry's with `resolution: DNS`, is a hop to resolve when it is
//!   tried); when the kernel's fast path takes some endpoints
//!   of it for this client, the connection is one it left to the proxy,
//!   which then takes turns among the others;
//! - refused: a capture port of the engine (dialling it would loop), a
//!   service without endpoints, and, under
//!   [`OutboundTrafficPolicy::RegistryOnly`], an address the mesh does not
//!   know.
//!
//! Excluded ports and CIDRs never reach the proxy: the kernel programs let
//! such connections through uncaptured (and the iptables baseline's rules
//! do the same), so the plan has no exclusion input.

use std::{
    net::{IpAddr, SocketAddr},
    sync::Arc,
};

use dataplane_common::HBONE_PORT;

use crate::{
    addr::{canonical, is_capture_port},
    config::{RoutingMode, Waypoint},
    identity::Identity,
    state::{Endpoint, EndpointAddr, MeshState, MeshWorkload, ServiceEntry},
    telemetry::{FailReason, ServiceRef},
};

/// What the plan may consult besides the configuration: both change from
/// one connection to the next, so they are inputs rather than state the
/// plan reads behind the caller's back.
pub trait EndpointChoice {
    /// Whether `ip`'s node recently did not answer (tried last).
    fn is_dead(&self, ip: IpAddr) -> bool;
    /// Which of `service`'s endpoints load balancing starts at (any
    /// number: it is taken modulo the endpoint count).
    fn start(&self, service: &ServiceEntry) -> usize;
    /// A number below `below` (at least 1), at random for a live
    /// connection: which of a weighted set of waypoints it takes.
    fn draw(&self, below: u64) -> u64;
    /// The endpoints of the service at `vip` (as the plan addresses them)
    /// that the kernel's fast path takes for this client, leaving the
    /// others to the proxy; `None` when it takes none.
    fn taken_by_kernel(&self, vip: SocketAddr) -> Option<Arc<[IpAddr]>> {
        let _ = vip;
        None
    }
    /// The node's network (`--network`): the client's when the mesh does
    /// not know its workload.
    fn network(&self) -> &str {
        ""
    }
}

/// What happens to a connection to an address the mesh does not know (no
/// workload, service or ServiceEntry has it): Istio's MeshConfig
/// `outboundTrafficPolicy.mode` (istio/api `mesh/v1alpha1/config.proto`,
/// `OutboundTrafficPolicy.Mode`; default `ALLOW_ANY`, istio
/// `pkg/config/mesh/mesh.go` `DefaultMeshConfig`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum OutboundTrafficPolicy {
    /// `ALLOW_ANY`: it goes straight to its destination from the pod (what
    /// ztunnel always does, and sidecars' `PassthroughCluster`).
    #[default]
    AllowAny,
    /// `REGISTRY_ONLY`: it is refused with a reset, as a sidecar sends
    /// such traffic to its `BlackHoleCluster` (istio
    /// `pilot/pkg/networking/core/listener_builder.go`
    /// `buildOutboundCatchAllNetworkFilterChains`); ztunnel has no such
    /// mode (istio/istio#54281).
    RegistryOnly,
}

/// What to do with one outbound connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboundPlan {
    /// The service, when the destination is a VIP.
    pub service: Option<Arc<ServiceRef>>,
    /// The destination as the application asked for it (canonical).
    pub dst: SocketAddr,
    /// What happens.
    pub action: Action,
}

/// How the connection travels, or why it does not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// One hop: a workload or an address outside the mesh.
    Hop(Hop),
    /// A service's endpoints in the order to try: a tunnel whose node does
    /// not answer is skipped for the next (and marked dead); a direct hop
    /// ends the walk.
    Failover(Vec<Hop>),
    /// Refused before anything is dialled.
    Refuse {
        /// The failure metric's reason.
        reason: FailReason,
        /// The access record's detail.
        detail: String,
    },
}

/// One way to reach one destination.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Hop {
    /// Plain TCP from inside the pod, with the proxy mark.
    Direct {
        /// Where to connect.
        dst: SocketAddr,
        /// The workload there, if the mesh knows it (telemetry names it).
        workload: Option<Arc<MeshWorkload>>,
    },
    /// An HBONE tunnel.
    Tunnel(TunnelHop),
    /// A workload known by DNS name only: the name is resolved when the
    /// hop is tried, then it is a [`Hop::Direct`] or a [`Hop::Tunnel`] to
    /// the address found ([`ResolveHop::to`]).
    Resolve(ResolveHop),
}

/// A workload to reach at the address its DNS name resolves to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolveHop {
    /// The name to resolve.
    pub hostname: Arc<str>,
    /// The target port.
    pub port: u16,
    /// The identity this pod presents (if the workload speaks HBONE).
    pub src_identity: Identity,
    /// The service's subjectAltNames (if the workload speaks HBONE).
    pub alt_identities: Arc<[Identity]>,
    /// The workload.
    pub workload: Arc<MeshWorkload>,
}

impl ResolveHop {
    /// The hop to the workload at `ip`, one of the addresses its name
    /// resolved to.
    pub fn to(&self, ip: IpAddr) -> Hop {
        hop(
            &self.src_identity,
            &self.workload,
            SocketAddr::new(ip, self.port),
            &self.alt_identities,
        )
    }
}

/// A tunnel to a workload speaking HBONE.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TunnelHop {
    /// The CONNECT authority: the workload's address and port.
    pub dst: SocketAddr,
    /// The peer's HBONE listener (its IP, port 15008).
    pub via: SocketAddr,
    /// The identity this pod presents.
    pub src_identity: Identity,
    /// The identity the peer must present...
    pub dst_identity: Identity,
    /// ...or any of these (the service's subjectAltNames).
    pub alt_identities: Arc<[Identity]>,
    /// The workload.
    pub workload: Arc<MeshWorkload>,
    /// Set for a workload on another network: this tunnel (`via`, the
    /// identities) is the outer one, to the workload's network gateway,
    /// and carries a second one to the workload (double HBONE).
    pub through: Option<Arc<Through>>,
}

/// The inner tunnel of double HBONE, inside the outer one to a network
/// gateway (ztunnel `src/proxy/outbound.rs` `build_request_through_gateway`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Through {
    /// The CONNECT authority of both tunnels: the service's hostname and
    /// the port dialled (ztunnel `HboneAddress::SvcHostname`), which the
    /// gateway routes by.
    pub authority: String,
    /// The identities the inner tunnel's far end may present: the
    /// service's subjectAltNames alone (ztunnel `final_sans`:
    /// `upstream.service_sans()`).
    pub identities: Arc<[Identity]>,
}

impl Hop {
    /// Where this hop connects the client to (`None`: a name not yet
    /// resolved).
    pub fn dst(&self) -> Option<SocketAddr> {
        match self {
            Hop::Direct { dst, .. } => Some(*dst),
            Hop::Tunnel(tunnel) => Some(tunnel.dst),
            Hop::Resolve(_) => None,
        }
    }

    /// Whether the hop is (or, once resolved, will be) an HBONE tunnel.
    pub fn is_tunnel(&self) -> bool {
        match self {
            Hop::Direct { .. } => false,
            Hop::Tunnel(_) => true,
            Hop::Resolve(resolve) => resolve.workload.speaks_hbone(),
        }
    }
}

/// Decides what a connection from the pod with identity `source` and
/// address `src` to the original destination `dst` does under `state`;
/// `policy` decides for an address the mesh does not know.
pub fn plan(
    state: &MeshState,
    source: &Identity,
    src: IpAddr,
    dst: SocketAddr,
    choice: &impl EndpointChoice,
    policy: OutboundTrafficPolicy,
) -> OutboundPlan {
    let dst = canonical(dst);
    let outcome = |service, action| OutboundPlan {
        service,
        dst,
        action,
    };
    if is_capture_port(dst.port()) {
        let detail = format!(
            "destination port {} is a capture port of the engine (dialling it would loop)",
            dst.port()
        );
        let action = Action::Refuse {
            reason: FailReason::EnginePort,
            detail,
        };
        return outcome(None, action);
    }
    // ztunnel looks a destination up on the client's network
    // (`src/proxy/outbound.rs` `build_request`: `fetch_upstream` with the
    // source workload's network; `src/state.rs` `find_upstream` then
    // `get_best_by_vip` with that network address): another network's
    // service or pod at the address is not it.
    let network = state
        .workloads
        .by_ip(src)
        .map_or(choice.network(), |client| &*client.workload.network);
    // The source pod's namespace picks among services sharing the VIP
    // and hides those not visible to it (ztunnel `find_upstream` passes
    // the source workload's; a pod's identity names that namespace).
    if let Some(entry) = state
        .services
        .by_vip_on(network, dst.ip(), &source.namespace)
    {
        let key = entry.service.key();
        let service = Some(Arc::clone(&entry.label));
        if entry.service.routing.mode == RoutingMode::Passthrough {
            // The service asks for no endpoint choice: the address dialled
            // is the destination (e.g. a ServiceEntry with resolution NONE).
            let action = Action::Hop(Hop::Direct {
                dst,
                workload: None,
            });
            return outcome(service, action);
        }
        // A waypoint's own connections go to the service, whichever of its
        // waypoints (the primary or a weighted one) the source is.
        let from_waypoint = entry
            .service
            .waypoints()
            .any(|waypoint| state.is_waypoint_peer(waypoint, source));
        if !from_waypoint
            && let Some(waypoint) = entry.service.waypoint_for(|below| choice.draw(below))
        {
            let what = format!("service {key}");
            return outcome(
                service,
                via_waypoint(state, source, waypoint, dst, choice, &what),
            );
        }
        let client = state.workloads.by_ip(src).map(Arc::as_ref);
        let start = choice.start(entry);
        let endpoints = match choice.taken_by_kernel(dst) {
            Some(taken) => others_first(entry, dst, start, client, choice, &taken),
            None => entry.candidates(dst, start, client, choice.network(), |ip| {
                choice.is_dead(ip)
            }),
        };
        if endpoints.is_empty() {
            let action = Action::Refuse {
                reason: FailReason::NoEndpoints,
                detail: format!("service {key} has no endpoints"),
            };
            return outcome(service, action);
        }
        let hops: Vec<Hop> = endpoints
            .into_iter()
            .filter_map(|e| match e.addr {
                EndpointAddr::Ip(addr) => {
                    Some(hop(source, &e.workload, addr, &entry.alt_identities))
                }
                EndpointAddr::Hostname(hostname, port) => Some(Hop::Resolve(ResolveHop {
                    hostname,
                    port,
                    src_identity: source.clone(),
                    alt_identities: Arc::clone(&entry.alt_identities),
                    workload: e.workload,
                })),
                EndpointAddr::Gateway(gateway) => {
                    through_gateway(state, source, (entry, dst), e.workload, &gateway, choice)
                }
            })
            .collect();
        if hops.is_empty() {
            let action = Action::Refuse {
                reason: FailReason::NoEndpoints,
                detail: format!("service {key} has no endpoint whose network gateway is known"),
            };
            return outcome(service, action);
        }
        return outcome(service, Action::Failover(hops));
    }
    // A pod of another network is no pod to the client either: the
    // connection goes out as dialled.
    let known = state.workloads.by_addr(network, dst.ip());
    let action = match known {
        Some(workload) => match &workload.workload.waypoint {
            Some(waypoint) if !state.is_waypoint_peer(waypoint, source) => {
                let what = format!("workload {}", workload.workload.uid);
                via_waypoint(state, source, waypoint, dst, choice, &what)
            }
            _ => Action::Hop(hop(source, workload, dst, &Arc::default())),
        },
        // Neither a VIP visible to the source (services and ServiceEntries,
        // those resolved by DNS included: their VIPs are in the registry)
        // nor a workload's address: outside the mesh's registry.
        None => match policy {
            OutboundTrafficPolicy::AllowAny => Action::Hop(Hop::Direct {
                dst,
                workload: None,
            }),
            OutboundTrafficPolicy::RegistryOnly => Action::Refuse {
                reason: FailReason::RegistryOnly,
                detail: format!(
                    "{} is no workload, service or ServiceEntry address of the mesh \
                     and the outbound traffic policy is REGISTRY_ONLY",
                    dst.ip()
                ),
            },
        },
    };
    outcome(None, action)
}

/// The order of a service's endpoints for a connection the kernel's fast
/// path left to the proxy: it drew an endpoint it does not take, so the
/// connection is for one of those, in turn from `start`, live ones first;
/// the kernel's (`taken`) come last, should every other fail.
fn others_first(
    entry: &ServiceEntry,
    dst: SocketAddr,
    start: usize,
    client: Option<&MeshWorkload>,
    choice: &impl EndpointChoice,
    taken: &[IpAddr],
) -> Vec<Endpoint> {
    // From the first endpoint, so the turn goes over the others alone
    // (rotating all of them first would favour whichever follows a run of
    // taken ones).
    let (mut others, kernels): (Vec<_>, Vec<_>) = entry
        .candidates(dst, 0, client, choice.network(), |ip| choice.is_dead(ip))
        .into_iter()
        .partition(|e| !e.addr.ip().is_some_and(|ip| taken.contains(&ip)));
    let live = others
        .iter()
        .take_while(|e| !e.addr.ip().is_some_and(|ip| choice.is_dead(ip)))
        .count();
    if live > 0 {
        others[..live].rotate_left(start % live);
    }
    others.extend(kernels);
    others
}

/// Tunnels to `waypoint`'s instances (live ones first, in load-balancing
/// order) carrying the connection to `dst`; refused when the waypoint has
/// no instance (`what` names whose waypoint it is).
fn via_waypoint(
    state: &MeshState,
    source: &Identity,
    waypoint: &Waypoint,
    dst: SocketAddr,
    choice: &impl EndpointChoice,
    what: &str,
) -> Action {
    let start = state
        .waypoint_service(waypoint)
        .map_or(0, |entry| choice.start(entry));
    let mut hops: Vec<(bool, Hop)> = state
        .waypoint(waypoint, dst.ip(), start)
        .map(|target| {
            target
                .instances
                .into_iter()
                .map(|(workload, via)| {
                    let hop = Hop::Tunnel(TunnelHop {
                        dst,
                        via,
                        src_identity: source.clone(),
                        dst_identity: workload.identity.clone(),
                        alt_identities: Arc::clone(&target.alt_identities),
                        workload,
                        through: None,
                    });
                    (choice.is_dead(via.ip()), hop)
                })
                .collect()
        })
        .unwrap_or_default();
    if hops.is_empty() {
        return Action::Refuse {
            reason: FailReason::NoEndpoints,
            detail: format!("the waypoint of {what} has no instance the mesh knows"),
        };
    }
    // Stable: live instances first, keeping the balancing order.
    hops.sort_by_key(|(dead, _)| *dead);
    Action::Failover(hops.into_iter().map(|(_, hop)| hop).collect())
}

/// The double-HBONE hop to `workload`, on another network, through its
/// network `gateway` for a connection to `service` at `dst`: the outer
/// tunnel to one of the gateway's instances (the workload at its address,
/// or the endpoints of the service it names; live ones first), expecting
/// its identity or its service's subjectAltNames, on the gateway's HBONE
/// port (ztunnel `src/state.rs` `fetch_network_gateway`; `upstream_sans`:
/// `workload_and_services_san`). `None` when the mesh knows no instance
/// (ztunnel: `UnknownNetworkGateway`).
fn through_gateway(
    state: &MeshState,
    source: &Identity,
    (service, dst): (&ServiceEntry, SocketAddr),
    workload: Arc<MeshWorkload>,
    gateway: &Waypoint,
    choice: &impl EndpointChoice,
) -> Option<Hop> {
    let start = state
        .waypoint_service(gateway)
        .map_or(0, |entry| choice.start(entry));
    let target = state.network_gateway(gateway, &workload.workload, dst.ip(), start)?;
    let (instance, via) = target
        .instances
        .iter()
        .find(|(_, via)| !choice.is_dead(via.ip()))
        .or_else(|| target.instances.first())?;
    let through = Through {
        authority: format!("{}:{}", service.service.hostname, dst.port()),
        identities: Arc::clone(&service.alt_identities),
    };
    Some(Hop::Tunnel(TunnelHop {
        dst,
        via: *via,
        src_identity: source.clone(),
        dst_identity: instance.identity.clone(),
        alt_identities: Arc::clone(&target.alt_identities),
        workload,
        through: Some(Arc::new(through)),
    }))
}

/// The hop to `workload` at `dst`.
fn hop(
    source: &Identity,
    workload: &Arc<MeshWorkload>,
    dst: SocketAddr,
    alt: &Arc<[Identity]>,
) -> Hop {
    if !workload.speaks_hbone() {
        return Hop::Direct {
            dst,
            workload: Some(Arc::clone(workload)),
        };
    }
    Hop::Tunnel(TunnelHop {
        dst,
        via: SocketAddr::new(dst.ip(), HBONE_PORT),
        src_identity: source.clone(),
        dst_identity: workload.identity.clone(),
        alt_identities: Arc::clone(alt),
        workload: Arc::clone(workload),
        through: None,
    })
}

#[cfg(test)]
mod network_tests;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod waypoint_port_tests;
