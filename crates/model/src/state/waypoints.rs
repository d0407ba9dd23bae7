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
//! A waypoint named by address is the workload at that address, or the
//! endpoints of the service whose VIP it is; named by hostname
//! (`namespace/hostname`), the endpoints of that service.

use std::net::SocketAddr;
use std::sync::Arc;

use super::{MeshState, MeshWorkload, ServiceEntry};
use crate::config::{Waypoint, Workload};
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
            return self.services.by_vip(ip);
        }
        // `namespace/hostname`: the service of that key, whoever else
        // shares the hostname (ztunnel `find_hostname` ->
        // `get_by_namespaced_host`).
        let key = waypoint.hostname.as_deref()?;
        key.split_once('/')?;
        self.services.by_key(key)
    }

    /// The instances of `waypoint`, rotated to begin at `start` (the
    /// load-balancing choice); `None` when it names nothing the mesh
    /// knows. An address without a network is on this node's.
    pub fn waypoint(&self, waypoint: &Waypoint, start: usize) -> Option<WaypointTarget> {
        self.waypoint_on(waypoint, self.workloads.network(), start)
    }

    /// [`Self::waypoint`] for the network gateway `gateway` of `behind`: an
    /// address without a network is on `behind`'s (where istiod puts it:
    /// a gateway of another network's pod is on that network).
    pub fn network_gateway(
        &self,
        gateway: &Waypoint,
        behind: &Workload,
        start: usize,
    ) -> Option<WaypointTarget> {
        self.waypoint_on(gateway, &behind.network, start)
    }

    /// The instances of `waypoint`, an address of which is looked up on
    /// its own network, else on `network` (ztunnel `src/state.rs`
    /// `fetch_network_gateway` and `fetch_waypoint`: `find_upstream` on
    /// `Destination::Address`'s network).
    fn waypoint_on(
        &self,
        waypoint: &Waypoint,
        network: &str,
        start: usize,
    ) -> Option<WaypointTarget> {
        let port = waypoint.hbone_port;
        let of_service = |entry: &ServiceEntry| {
            let instances = entry
                .endpoints()
                .rotated(start)
                .filter_map(|w| {
                    let ip = *w.workload.workload_ips.first()?;
                    Some((Arc::clone(w), SocketAddr::new(ip, port)))
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
        let ip = waypoint.address?;
        let network = waypoint.network.as_deref().unwrap_or(network);
        let workload = self.workloads.by_addr(network, ip)?;
        Some(WaypointTarget {
            instances: vec![(Arc::clone(workload), SocketAddr::new(ip, port))],
            alt_identities: Arc::default(),
        })
    }

    /// Whether `peer` is one of `waypoint`'s instances (by identity).
    pub fn is_waypoint_peer(&self, waypoint: &Waypoint, peer: &Identity) -> bool {
        self.waypoint(waypoint, 0).is_some_and(|target| {
            target.instances.iter().any(|(w, _)| w.identity == *peer)
                || target.alt_identities.contains(peer)
        })
    }
}
