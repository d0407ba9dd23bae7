//! One consistent view of the mesh, built from one version of the config.

use std::net::{IpAddr, SocketAddr};

use super::{ServiceIndex, StateError, WorkloadIndex};
use crate::{
    config::LocalConfig,
    policy::{PolicySet, Request, Target},
};

/// Workloads, services and policies of one config version.
#[derive(Debug, Default)]
pub struct MeshState {
    /// Where the config came from.
    pub origin: String,
    /// Workloads by IP.
    pub workloads: WorkloadIndex,
    /// Services by VIP and hostname.
    pub services: ServiceIndex,
    /// Authorization policies.
    pub policies: PolicySet,
    /// The config it was built from.
    pub config: LocalConfig,
    /// Which source each entry came from, when istiod is one.
    pub provenance: crate::sources::Provenance,
}

impl MeshState {
    /// Builds the snapshot.
    pub fn from_config(config: &LocalConfig) -> Result<Self, StateError> {
        let workloads = WorkloadIndex::from_config(config)?;
        let services = ServiceIndex::new(&config.services, workloads.all());
        Ok(Self {
            origin: config.origin.clone(),
            policies: PolicySet::from_config(config),
            workloads,
            services,
            config: config.clone(),
            provenance: Default::default(),
        })
    }

    /// For an HBONE authority `hostname:port` arriving at `local` (a pod
    /// IP): the pod's address for that service port.
    pub fn resolve_hostname(&self, authority: &str, local: IpAddr) -> Option<SocketAddr> {
        let (host, port) = authority.rsplit_once(':')?;
        let port: u16 = port.parse().ok()?;
        let entry = self.services.by_hostname(host)?;
        let local = local.to_canonical();
        let me = self.workloads.by_ip(local)?;
        let target = me
            .workload
            .services
            .get(&entry.service.key())?
            .get(&port)
            .copied()
            .or_else(|| entry.service.ports.get(&port).copied().filter(|p| *p != 0))
            .unwrap_or(port);
        Some(SocketAddr::new(local, target))
    }

    /// Decides a connection under the policies of its destination
    /// workload (the decision is [`PolicySet::authorize`]'s). Unknown
    /// destinations (not in the config) have only Global policies.
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
