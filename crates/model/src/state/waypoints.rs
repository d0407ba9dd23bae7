//! Waypoints: the L7 proxies of Istio ambient that a service or workload
//! may name (`waypoint: {address | hostname, hbonePort}`). A client's node
//! sends such traffic to the waypoint (an HBONE tunnel to the waypoint,
//! whose `:authority` is still the original destination).
//!
//! As in ztunnel, the workload's own node adds no rule of its own: who may
//! reach a workload other than through its waypoint is for authorization
//! policy to say (istio/ztunnel `src/proxy/inbound.rs` checks nothing
//! waypoint-related but `validate_destination`'s sandwich case; `rbac.rs`
//! does the rest). An ALLOW policy naming the waypoint's principal keeps
//! everyone else out.
//!
//! A waypoint named by address is the endpoints of the service whose VIP
//! it is, or the workload at that address; named by hostname
//! (`namespace/hostname`), the endpoints of that service, or else the
//! workload of that hostname (ztunnel `src/state.rs` `find_upstream`,
//! `find_hostname`). A service's instances take HBONE at the port the
//! waypoint's HBONE port maps to, as a port of that service; a workload
//! at the HBONE port as given (`fetch_waypoint`). An instance is dialled
//! at its address of the family of the waypoint's address, or, for a
//! waypoint named by hostname, of the connection's original destination
//! (`finalize_upstream`'s `target_address`), within its service's
//! families.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;

use super::{MeshState, MeshWorkload, ServiceEntry};
use crate::config::{Service, Waypoint, Workload};
use crate::identity::Identity;

/// A waypoint's instances, in the order to try, and who they may be.
#[derive(Debug, Clone)]
pub struct WaypointTarget {
    /// The waypoint's workloads, each with its HBONE address.
    pub instances: Vec<(Arc<MeshWorkload>, SocketAddr)>,
    /// Identities its service lets it present besides each instance's own.
    pub alt_identities: Arc<[Identity]>,
}

impl MeshState {
    /// The service `waypoint` names (by VIP or hostname), if it names one.
    pub fn waypoint_service(&self, waypoint: &Waypoint) -> Option<&Arc<ServiceEntry>> {
        if let Some(ip) = waypoint.address {
            // On the waypoint's network when it names one, else this
            // node's (as its workload is looked up: ztunnel's
            // `GatewayAddress` carries its network).
            let network = waypoint
                .network
                .as_deref()
                .unwrap_or(self.workloads.network());
            return self.services.by_vip_at(network, ip);
        }
        // `namespace/hostname`: the service of that key, whoever else
        // shares the hostname (ztunnel `find_hostname` ->
        // `get_by_namespaced_host`).
        let key = waypoint.hostname.as_deref()?;
        key.split_once('/')?;
        self.services.by_key(key)
    }

    /// The instances of `waypoint` for a connection to `original`,
    /// rotated to begin at `start` (the load-balancing choice); `None`
    /// when it names nothing the mesh knows. An address without a network
    /// is on this node's.
    pub fn waypoint(
        &self,
        waypoint: &Waypoint,
        original: IpAddr,
        start: usize,
    ) -> Option<WaypointTarget> {
        let network = self.workloads.network();
        self.waypoint_on(waypoint, (network, original), start, true)
    }

    /// [`Self::waypoint`] for the network gateway `gateway` of `behind`: an
    /// address without a network is on `behind`'s (where istiod puts it:
    /// a gateway of another network's pod is on that network).
    pub fn network_gateway(
        &self,
        gateway: &Waypoint,
        behind: &Workload,
        original: IpAddr,
        start: usize,
    ) -> Option<WaypointTarget> {
        self.waypoint_on(gateway, (&behind.network, original), start, false)
    }

    /// The instances of `waypoint` for a connection to `original`, an
    /// address of which is looked up on its own network, else on `network`
    /// (ztunnel `src/state.rs` `fetch_network_gateway` and
    /// `fetch_waypoint`: `find_upstream` on `Destination::Address`'s
    /// network). A service's instances are dialled at the port its HBONE
    /// port maps to ([`service_hbone_port`]); a workload's at the HBONE
    /// port as given. The address family followed is the waypoint
    /// address's, else `original`'s (`finalize_upstream`'s
    /// `target_address`).
    fn waypoint_on(
        &self,
        waypoint: &Waypoint,
        (network, original): (&str, IpAddr),
        start: usize,
        as_waypoint: bool,
    ) -> Option<WaypointTarget> {
        let port = waypoint.hbone_port;
        let toward = waypoint.address.unwrap_or(original);
        let of_service = |entry: &ServiceEntry| {
            let key = entry.service.key();
            let instances = entry
                .endpoints()
                .rotated(start)
                .filter_map(|w| {
                    let families = entry.service.ip_families;
                    let ip = super::pick_address(&w.workload.workload_ips, toward, families)?;
                    let target =
                        service_hbone_port(&entry.service, &key, &w.workload, port, as_waypoint)?;
                    Some((Arc::clone(w), SocketAddr::new(ip, target)))
                })
                .collect();
            WaypointTarget {
                instances,
                alt_identities: Arc::clone(&entry.alt_identities),
            }
        };
        if let Some(entry) = self.waypoint_service(waypoint) {
            return Some(of_service(entry));
        }
        let workload = match waypoint.address {
            Some(ip) => {
                let network = waypoint.network.as_deref().unwrap_or(network);
                self.workloads.by_addr(network, ip)?
            }
            None => self.workload_by_hostname(waypoint.hostname.as_deref()?)?,
        };
        // A workload is dialled at the HBONE port as given, whatever
        // services it is in (ztunnel `fetch_waypoint` and
        // `fetch_network_gateway`, `Address::Workload`, and `find_upstream`
        // for a workload's address: `UpstreamParts(wl, hbone_mtls_port,
        // None)`), and with no service's subjectAltNames.
        let ip = match waypoint.address {
            Some(ip) => ip,
            // By hostname: its address of `original`'s family. ztunnel
            // would resolve the hostname of a workload without one
            // (`finalize_upstream` -> `pick_workload_destination_or_resolve`);
            // such a waypoint has no instance here.
            None => super::pick_address(&workload.workload.workload_ips, original, None)?,
        };
        Some(WaypointTarget {
            instances: vec![(Arc::clone(workload), SocketAddr::new(ip, port))],
            alt_identities: Arc::default(),
        })
    }

    /// The workload a waypoint's `namespace/hostname` names when no
    /// service has it: ztunnel `src/state.rs` `find_hostname` falls back
    /// to the workload of that hostname and namespace, by a scan of every
    /// workload (an uncommon path, there as here).
    fn workload_by_hostname(&self, key: &str) -> Option<&Arc<MeshWorkload>> {
        let (namespace, hostname) = key.split_once('/')?;
        self.workloads.iter().find(|w| {
            !w.workload.hostname.is_empty()
                && *w.workload.hostname == *hostname
                && *w.workload.namespace == *namespace
        })
    }

    /// Whether `local` (the workload a tunnel arrived at, on `local_ip`)
    /// is the waypoint of the workload or service at `target`: ztunnel
    /// `src/proxy/inbound.rs` `validate_destination`'s sandwich case
    /// without an application tunnel (its `lookup_is_destination_this_waypoint`).
    /// As there, `target` is looked up on `local`'s network, a workload
    /// before a service VIP (`src/state.rs` `find_address`); its
    /// `waypoint` (not the weighted ones) resolved, by address a workload
    /// before a service, by hostname the service, else the workload of
    /// that hostname; a service is `local`'s
    /// when `local` is one of its endpoints (`contains_endpoint`), a
    /// workload when it has `local_ip`.
    pub fn is_waypoint_of(&self, target: IpAddr, local: &MeshWorkload, local_ip: IpAddr) -> bool {
        let network = &local.workload.network;
        let waypoint = match self.workloads.by_addr(network, target) {
            Some(workload) => workload.workload.waypoint.as_deref(),
            None => self
                .services
                .by_vip_at(network, target)
                .and_then(|entry| entry.service.waypoint.as_ref()),
        };
        let Some(waypoint) = waypoint else {
            return false;
        };
        let has_local =
            |entry: &Arc<ServiceEntry>| entry.endpoints().iter().any(|w| w.key == local.key);
        match (waypoint.address, waypoint.hostname.as_deref()) {
            (Some(ip), _) => {
                let network = waypoint.network.as_deref().unwrap_or(network);
                match self.workloads.by_addr(network, ip) {
                    Some(workload) => workload.workload.workload_ips.contains(&local_ip),
                    None => self.services.by_vip_at(network, ip).is_some_and(has_local),
                }
            }
            // ztunnel `find_destination` -> `find_hostname`: the service,
            // else the workload of that hostname.
            (None, Some(key)) => match self.services.by_key(key) {
                Some(entry) => has_local(entry),
                None => self
                    .workload_by_hostname(key)
                    .is_some_and(|workload| workload.workload.workload_ips.contains(&local_ip)),
            },
            (None, None) => false,
        }
    }

    /// Whether `peer` is one of `waypoint`'s instances (by identity).
    pub fn is_waypoint_peer(&self, waypoint: &Waypoint, peer: &Identity) -> bool {
        // The instances' identities whatever the family they are dialled in.
        let any = waypoint
            .address
            .unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED));
        self.waypoint(waypoint, any, 0).is_some_and(|target| {
            target.instances.iter().any(|(w, _)| w.identity == *peer)
                || target.alt_identities.contains(peer)
        })
    }
}

/// The port a waypoint's (or network gateway's) service instance `workload`
/// takes HBONE at, for the waypoint's HBONE port `port` taken as a port of
/// `service` (keyed `key`); `None` when it is not one of the instances.
///
/// ztunnel `src/state.rs` `find_upstream_from_service` with
/// `svc_port = hbone_mtls_port`: the endpoint's own mapping of that port
/// (the workload's `services[key]`), else the service's target port when
/// not 0, else, for an instance with an application tunnel that has a
/// port, the HBONE port itself; otherwise none. Which instances it
/// considers is `load_balance`'s filter: for a waypoint
/// (`ServiceResolutionMode::Waypoint`) those of a service with the port
/// and those with an application tunnel; for a network gateway
/// (`Standard`) none unless the service has the port, and then those with
/// a target port for it, of the service's or their own. ztunnel draws
/// one of those it considers and fails the connection when that one has
/// no port; here such an instance is left out of the turn instead.
fn service_hbone_port(
    service: &Service,
    key: &str,
    workload: &Workload,
    port: u16,
    as_waypoint: bool,
) -> Option<u16> {
    let of_service = service.ports.get(&port).copied();
    let own = workload
        .services
        .get(key)
        .and_then(|ports| ports.target(port));
    let considered = if as_waypoint {
        of_service.is_some() || workload.application_tunnel.is_some()
    } else {
        of_service.is_some_and(|target| target != 0 || own.is_some())
    };
    if !considered {
        return None;
    }
    own.or(of_service.filter(|target| *target != 0))
        .or_else(|| {
            let tunnel_port = workload.application_tunnel.as_ref()?.port;
            tunnel_port.map(|_| port)
        })
}

#[cfg(test)]
#[path = "waypoints_tests.rs"]
mod tests;
