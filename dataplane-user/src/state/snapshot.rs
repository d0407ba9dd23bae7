//! One consistent view of the mesh, built from one version of the config.

use std::{
    net::{IpAddr, SocketAddr},
    sync::Arc,
};

use tracing::info;

use super::{Endpoint, MeshWorkload, ServiceIndex, StateError, WorkloadIndex, canonical_ip};
use crate::{
    config::LocalConfig,
    hbone::AuthzRequest,
    identity::Identity,
    policy::{PolicySet, Request, Target},
    state::DeadEndpoints,
};

/// Where a captured outbound connection goes.
#[derive(Debug, Clone)]
pub enum Route {
    /// To a service VIP: endpoint candidates in the order to try, and the
    /// identities the service's servers may present besides each
    /// endpoint's own.
    Service {
        /// The service's `namespace/hostname`.
        service: String,
        /// Endpoints to try, in order.
        candidates: Vec<Endpoint>,
        /// The service's subjectAltNames.
        alt_identities: Vec<Identity>,
    },
    /// Straight to a known workload.
    Workload(Arc<MeshWorkload>),
    /// Not in the mesh: plain passthrough.
    Unknown,
}

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
        })
    }

    /// Where a connection to `dst` goes.
    pub fn route(&self, dst: SocketAddr, dead: &DeadEndpoints) -> Route {
        if let Some(entry) = self.services.by_vip(dst.ip()) {
            return Route::Service {
                service: entry.service.key(),
                candidates: entry.candidates(dst.port(), dead),
                alt_identities: entry.alt_identities.clone(),
            };
        }
        match self.workloads.by_ip(dst.ip()) {
            Some(workload) => Route::Workload(Arc::clone(workload)),
            None => Route::Unknown,
        }
    }

    /// For an HBONE authority `hostname:port` arriving at `local` (a pod
    /// IP): the pod's address for that service port.
    pub fn resolve_hostname(&self, authority: &str, local: IpAddr) -> Option<SocketAddr> {
        let (host, port) = authority.rsplit_once(':')?;
        let port: u16 = port.parse().ok()?;
        let entry = self.services.by_hostname(host)?;
        let local = canonical_ip(local);
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

    /// Applies the policies of the destination workload. Unknown
    /// destinations (not in the config) have only Global policies.
    pub fn authorize(&self, request: &AuthzRequest<'_>) -> Result<(), String> {
        let peer = request
            .peer_identity
            .and_then(|uri| Identity::parse(uri).ok());
        let target = self.workloads.by_ip(request.dst.ip());
        let (namespace, listed): (&str, &[String]) = match target {
            Some(w) => (&w.workload.namespace, &w.workload.authorization_policies),
            None => ("", &[]),
        };
        let evaluation = self.policies.evaluate(
            &Request {
                peer: peer.as_ref(),
                src_ip: request.src.ip(),
                dst: request.dst,
            },
            &Target {
                namespace,
                policies: listed,
            },
        );
        for (policy, matched) in &evaluation.dry_run {
            info!(
                target: "policy",
                policy,
                matched,
                src = %request.src,
                dst = %request.dst,
                peer = request.peer_identity.unwrap_or("-"),
                "dry-run policy evaluated"
            );
        }
        match evaluation.decision {
            crate::policy::Decision::Allow => Ok(()),
            crate::policy::Decision::Deny { reason } => Err(reason),
        }
    }
}
