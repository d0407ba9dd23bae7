//! One consistent view of the mesh, built from one version of the config.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use super::{
    Affected, Changes, Provenance, ServiceIndex, ServiceRef, StateError, WorkloadIndex,
    text_key::TextKey,
};
use crate::{
    config::LocalConfig,
    policy::{PolicySet, Request, Target},
};

/// Workloads, services and policies of one config version.
///
/// Cloning one is cheap (persistent maps): [`Self::apply`] makes the next
/// state from a clone of this one.
#[derive(Debug, Clone, Default)]
pub struct MeshState {
    /// Where the config came from.
    pub origin: String,
    /// Workloads by network address (network and IP).
    pub workloads: WorkloadIndex,
    /// Services by VIP and hostname.
    pub services: ServiceIndex,
    /// Authorization policies.
    pub policies: PolicySet,
    /// Which source each entry came from, when istiod is one.
    pub provenance: Provenance,
}

impl MeshState {
    /// The state of `config` alone (its entries keyed by position).
    pub fn from_config(config: &LocalConfig) -> Result<Self, StateError> {
        let empty = Self {
            origin: config.origin.clone(),
            ..Self::default()
        };
        empty.apply(&Changes::of_file(config))
    }

    /// This state with `changes` made: only the entries they name and the
    /// indexes that point at them are built again; everything else is
    /// shared with this state. An error leaves this state as it was.
    pub fn apply(&self, changes: &Changes) -> Result<Self, StateError> {
        self.apply_tracked(changes).map(|(next, _)| next)
    }

    /// [`Self::apply`], also saying what the change can have changed for
    /// a connection (what an install re-checks and voids).
    pub fn apply_tracked(&self, changes: &Changes) -> Result<(Self, Affected), StateError> {
        let mut next = self.clone();
        let affected = next.apply_in_place(changes)?;
        Ok((next, affected))
    }

    /// [`Self::apply_tracked`] made to this state: where no other state
    /// shares a node of its indexes, the nodes on a change's paths are
    /// changed where they are instead of copied. An error can leave the
    /// state half changed: throw it away then.
    pub fn apply_in_place(&mut self, changes: &Changes) -> Result<Affected, StateError> {
        self.apply_with(changes, None)
    }

    /// [`Self::apply_in_place`]; an entry built again takes `donor`'s
    /// when `donor` holds one built from the same definition (a state the
    /// same change was made to), so that two states brought up to date by
    /// the same changes share what they hold.
    pub(super) fn apply_with(
        &mut self,
        changes: &Changes,
        donor: Option<&MeshState>,
    ) -> Result<Affected, StateError> {
        let mut affected = Affected::default();
        for (entry, new) in &changes.workloads {
            let old = self.workloads.by_key(entry).map(|w| &w.workload);
            for workload in old.into_iter().chain(new) {
                for ip in &workload.workload_ips {
                    affected.addr(*ip);
                }
            }
        }
        for (entry, new) in &changes.policies {
            for policy in self.policies.get(entry).into_iter().chain(new) {
                affected.policy(policy);
            }
        }
        let mut members = Vec::new();
        self.workloads.apply(
            &changes.workloads,
            donor.map(|d| &d.workloads),
            &mut |service, entry| {
                members.push((TextKey::new(service), entry.clone()));
            },
        )?;
        let rebuilt = self.services.apply(
            &changes.services,
            &members,
            &self.workloads,
            donor.map(|d| &d.services),
            &mut |vip| affected.addr(vip),
        );
        for key in &rebuilt {
            for vip in self.services.vips(key) {
                affected.addr(vip);
            }
        }
        self.policies.apply(&changes.policies);
        Ok(affected)
    }

    /// This state with `network` as this node's (`--network`, ztunnel's
    /// `NETWORK`): the network addresses of captured traffic are looked
    /// up on (see [`WorkloadIndex::by_ip`]). States made from it by
    /// [`Self::apply`] keep it.
    #[must_use]
    pub fn on_network(mut self, network: &str) -> Self {
        self.workloads.set_network(network);
        self.services.set_network(network);
        self
    }

    /// The merged configuration this state holds, in the file's shape
    /// (what `config_dump` shows); built on each call.
    pub fn config(&self) -> LocalConfig {
        LocalConfig {
            origin: self.origin.clone(),
            workloads: self
                .workloads
                .iter()
                .map(|w| Arc::clone(&w.workload))
                .collect(),
            services: self
                .services
                .definitions()
                .map(|s| s.as_ref().clone())
                .collect(),
            policies: self.policies.iter().map(|p| p.as_ref().clone()).collect(),
        }
    }

    /// For an HBONE authority `hostname:port` arriving at `local` (a pod
    /// IP): the pod's address for that service port.
    pub fn resolve_hostname(&self, authority: &str, local: IpAddr) -> Option<SocketAddr> {
        let (host, port) = authority.rsplit_once(':')?;
        let port: u16 = port.parse().ok()?;
        let local = local.to_canonical();
        let me = self.workloads.by_ip(local)?;
        // Among services sharing the hostname, the local workload's
        // namespace's first (ztunnel `proxy/inbound.rs` passes the local
        // workload's namespace to `get_best_by_host`).
        let entry = self
            .services
            .by_hostname_for(host, &me.workload.namespace)?;
        let target = me
            .workload
            .services
            .get(&entry.service.key())?
            .target(port)
            .or_else(|| entry.service.ports.get(&port).copied().filter(|p| *p != 0))
            .unwrap_or(port);
        Some(SocketAddr::new(local, target))
    }

    /// The address a hostname authority (`host`, `port`) arriving at
    /// `local` stands for where an address is needed (a PROXY protocol
    /// header): the VIP of the service [`Self::resolve_hostname`] picks,
    /// IPv4 first, with the port asked for (ztunnel `src/proxy/inbound.rs`
    /// `find_inbound_upstream`: PROXY cannot name a hostname; among the
    /// VIPs on the local network it takes IPv4 first). `None` when that
    /// service has no VIP.
    pub fn hostname_vip(&self, host: &str, port: u16, local: IpAddr) -> Option<SocketAddr> {
        let me = self.workloads.by_ip(local.to_canonical())?;
        let entry = self
            .services
            .by_hostname_for(host, &me.workload.namespace)?;
        // ztunnel ranks the VIPs on the destination's network, IPv4 over
        // IPv6, over any other network's.
        let vips = &entry.service.vips;
        let local = |vip: &&crate::config::Vip| vip.network == me.workload.network;
        let vip = vips
            .iter()
            .filter(local)
            .find(|vip| vip.ip.is_ipv4())
            .or_else(|| vips.iter().find(local))
            .or_else(|| vips.first())?;
        Some(SocketAddr::new(vip.ip, port))
    }

    /// Who is at `ip`, as far as this state says (an unknown address gives
    /// an empty peer).
    pub fn peer_at(&self, ip: IpAddr) -> Arc<super::Peer> {
        self.workloads
            .by_ip(ip)
            .map(|w| Arc::clone(&w.peer))
            .unwrap_or_default()
    }

    /// The service an inbound connection to `dst` (a workload's address and
    /// the app's port) is attributed to: among the services the workload
    /// is an endpoint of, the one the client named (`named`, a hostname),
    /// else the first whose port maps to `dst`'s port. Only services that
    /// select the workload count, so a client cannot attribute its
    /// connection to any service it likes.
    pub fn attribute_service(
        &self,
        named: Option<&str>,
        dst: SocketAddr,
    ) -> Option<Arc<ServiceRef>> {
        let workload = self.workloads.by_ip(dst.ip())?;
        let selecting = || {
            workload
                .workload
                .services
                .iter()
                .filter_map(|(key, ports)| {
                    let entry = self.services.by_key(key)?;
                    Some((entry, ports))
                })
        };
        if let Some(named) = named
            && let Some((entry, _)) = selecting().find(|(e, _)| e.service.hostname == named)
        {
            return Some(Arc::clone(&entry.label));
        }
        selecting()
            .find(|(entry, ports)| {
                ports.iter().any(|(_, target)| target == dst.port())
                    || entry
                        .service
                        .ports
                        .values()
                        .any(|target| *target == dst.port())
            })
            .map(|(entry, _)| Arc::clone(&entry.label))
    }

    /// Decides a connection under the policies of its destination
    /// workload (the decision is [`PolicySet::authorize`]'s). Unknown
    /// destinations (not in the config) have only Global policies. A
    /// workload behind a waypoint gets no other rule (as in ztunnel: see
    /// [`super::waypoints`]).
    pub fn authorize(&self, request: &Request<'_>) -> Result<(), String> {
        let target = self.workloads.by_ip(request.dst.ip());
        let (namespace, listed): (&str, &[String]) = match target {
            Some(w) => (&w.workload.namespace, &w.workload.authorization_policies),
            None => ("", &[]),
        };
        self.policies.authorize(
            request,
            &Target {
                namespace,
                policies: listed,
            },
        )
    }
}

#[cfg(test)]
#[expect(
    clippy::unwrap_used,
    reason = "a bad fixture should fail the test loudly"
)]
mod tests {
    use super::*;

    /// `web` is an endpoint of `web` (80 -> 8080) and `web-admin`
    /// (9000 -> 9090); `other` is a service that selects only `other`.
    const MESH: &str = r#"
workloads:
- {uid: web, name: web, namespace: shop, serviceAccount: web, workloadIps: [10.1.0.10],
   services: {'shop/web.shop.svc.cluster.local': {80: 8080},
              'shop/web-admin.shop.svc.cluster.local': {9000: 9090}}}
- {uid: other, name: other, namespace: shop, serviceAccount: other, workloadIps: [10.1.0.11],
   services: {'shop/other.shop.svc.cluster.local': {80: 8080}}}
services:
- {name: web, namespace: shop, hostname: web.shop.svc.cluster.local, vips: ['/10.96.0.10'], ports: {80: 8080}}
- {name: web-admin, namespace: shop, hostname: web-admin.shop.svc.cluster.local, vips: ['/10.96.0.11'], ports: {9000: 9090}}
- {name: other, namespace: shop, hostname: other.shop.svc.cluster.local, vips: ['/10.96.0.12'], ports: {80: 8080}}
"#;

    #[test]
    fn a_named_service_counts_only_if_it_selects_the_workload() {
        let state = MeshState::from_config(&LocalConfig::parse(MESH, "t").unwrap()).unwrap();
        let attribute = |named: Option<&str>, dst: &str| {
            state
                .attribute_service(named, dst.parse().unwrap())
                .map(|s| s.hostname.clone())
        };
        let (web, admin) = (
            Some("web.shop.svc.cluster.local".to_owned()),
            Some("web-admin.shop.svc.cluster.local".to_owned()),
        );
        // The client's `host=` wins over the port when the service
        // selects the workload.
        assert_eq!(
            attribute(Some("web-admin.shop.svc.cluster.local"), "10.1.0.10:8080"),
            admin
        );
        // A service that does not select the workload is not believed:
        // the port decides.
        assert_eq!(
            attribute(Some("other.shop.svc.cluster.local"), "10.1.0.10:8080"),
            web
        );
        assert_eq!(attribute(Some("nowhere.example"), "10.1.0.10:9090"), admin);
        assert_eq!(attribute(None, "10.1.0.10:8080"), web);
        // No service's port, or not a workload of the mesh: no service.
        assert_eq!(attribute(None, "10.1.0.10:7777"), None);
        assert_eq!(
            attribute(Some("web.shop.svc.cluster.local"), "10.1.0.99:8080"),
            None
        );
    }

    /// ztunnel `find_inbound_upstream`: a PROXY header names a hostname
    /// authority by its service's VIP, IPv4 first, with the asked port.
    #[test]
    fn a_hostname_is_named_by_its_services_vip_ipv4_first() {
        let dual = MESH.replace(
            "vips: ['/10.96.0.10']",
            "vips: ['/fd00::10', '/10.96.0.10']",
        );
        let state = MeshState::from_config(&LocalConfig::parse(&dual, "t").unwrap()).unwrap();
        let local = "10.1.0.10".parse().unwrap();
        assert_eq!(
            state.hostname_vip("web.shop.svc.cluster.local", 80, local),
            Some("10.96.0.10:80".parse().unwrap())
        );
        assert_eq!(
            state.hostname_vip("web-admin.shop.svc.cluster.local", 9000, local),
            Some("10.96.0.11:9000".parse().unwrap())
        );
        assert_eq!(state.hostname_vip("nowhere.example", 80, local), None);
        assert_eq!(
            state.hostname_vip(
                "web.shop.svc.cluster.local",
                80,
                "10.9.9.9".parse().unwrap()
            ),
            None,
            "not a workload of the mesh"
        );
    }

    /// A change of endpoints builds the service's entry again: it goes on
    /// taking turns where it was (else every change sent the next
    /// connection to the first endpoint) and keeps what only the
    /// definition decides.
    #[test]
    fn a_change_of_endpoints_keeps_the_round_robin_turn_and_the_label() {
        use crate::config::entries::EntryKey;
        let config = LocalConfig::parse(MESH, "t").unwrap();
        let state = MeshState::from_config(&config).unwrap();
        let vip = "10.96.0.12".parse().unwrap();
        let before = Arc::clone(state.services.by_vip(vip).unwrap());
        assert_eq!(before.next_start(), 0);
        let mut joining = (*config.workloads[1]).clone();
        joining.uid = "other-2".into();
        joining.workload_ips = vec!["10.1.0.13".parse().unwrap()].into();
        let changes = Changes {
            workloads: vec![(EntryKey::xds("other-2"), Some(Arc::new(joining)))],
            ..Changes::default()
        };
        let next = state.apply(&changes).unwrap();
        let after = next.services.by_vip(vip).unwrap();
        assert_eq!(after.endpoint_count(), 2);
        assert_eq!(after.next_start(), 1, "the turn went back to the first");
        assert!(Arc::ptr_eq(&after.label, &before.label));
        assert!(Arc::ptr_eq(&after.service, &before.service));
    }
}
