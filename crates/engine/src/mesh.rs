//! What every pod's proxy shares: the mesh state in force (swapped whole
//! when the configuration changes), endpoints found dead, open inbound
//! connections for policy re-checks, certificates and TLS configurations,
//! metrics, and the drain signal. One [`MeshContext`] per agent; the
//! agent builds it, enrollment hands it to each pod's proxy, reload
//! installs new states into it, status and config dumps read it.

use std::{
    sync::{Arc, RwLock},
    time::Duration,
};

use tokio::sync::watch;

use crate::{
    identity::{CertStore, TrustBundle},
    policy::{LiveConnections, Request},
    proxy::handshakes::PendingHandshakes,
    state::{Affected, DeadEndpoints, MeshState},
    telemetry::{Metrics, Peer},
    tls::ClientConfigCache,
};

/// Mesh-wide state every pod's proxy reads.
pub struct MeshContext {
    /// Workloads, services and policies (replaced as a whole when the config
    /// changes).
    pub state: RwLock<Arc<MeshState>>,
    /// Service endpoints recently found unreachable.
    pub dead: DeadEndpoints,
    /// Open inbound connections, re-checked when policies change.
    pub live: Arc<LiveConnections>,
    /// The last config error, while the last good config stays in force.
    pub config_error: RwLock<Option<String>>,
    /// Certificates of local identities.
    pub certs: Arc<CertStore>,
    /// The mesh's roots (a bundle the certificate source updates; TLS
    /// verifiers read it at each handshake).
    pub roots: Arc<TrustBundle>,
    /// Client TLS configurations by (source, expected destination).
    pub client_configs: ClientConfigCache,
    /// Trust domain whose clients the HBONE servers accept.
    pub trust_domain: String,
    /// Flips to `true` when the agent drains.
    pub shutdown: watch::Receiver<bool>,
    /// How long open connections get to finish once their listeners stop
    /// accepting: when the agent drains, and when a re-enrolled pod's
    /// previous engine hands over to its new one (`--drain-timeout`).
    pub drain_timeout: Duration,
    /// How long an unused pooled HBONE connection is kept.
    pub pool_idle_timeout: Duration,
    /// How pools spread streams over connections to one destination.
    pub pool_spread: crate::hbone::pool::PoolSpread,
    /// The HTTP/2 windows and frame size both HBONE ends announce.
    pub h2: crate::hbone::wire::H2Settings,
    /// Whether a client's first bytes go with its tunnel's CONNECT request
    /// (`--hbone-early-data`).
    pub early_data: bool,
    /// Whether an outbound connection to an address the mesh does not know
    /// goes through or is refused (MeshConfig `outboundTrafficPolicy`,
    /// `--outbound-traffic-policy`).
    pub outbound_traffic_policy: crate::proxy::outbound::OutboundTrafficPolicy,
    /// Inbound HBONE connections still in their handshake, within bounds.
    pub handshakes: Arc<PendingHandshakes>,
    /// An inbound HBONE connection without an open stream this long is
    /// closed.
    pub hbone_idle_timeout: Duration,
    /// Whether a PROXY application tunnel is dialled over loopback
    /// (`--localhost-app-tunnel`, ztunnel's `LOCALHOST_APP_TUNNEL`) rather
    /// than at the pod's address ([`crate::hbone::app_tunnel`]).
    pub localhost_app_tunnel: bool,
    /// Whether an enrolled pod the mesh state does not list is refused
    /// (with a control plane, `--xds`, as ztunnel does) rather than served
    /// in plaintext.
    pub require_known_workloads: bool,
    /// The node's network (`--network`): a client the mesh does not know
    /// is on it when a service's endpoints are chosen.
    pub network: Arc<str>,
    /// TCP keepalive of every proxied socket (`--keepalive`); `None` when
    /// off.
    pub keepalive: Option<crate::proxy::keepalive::Keepalive>,
    /// Connection metrics (and the rest of `/metrics`).
    pub metrics: Arc<Metrics>,
    /// The same-node fast path, once the kernel programs are loaded (never
    /// under iptables capture or an external engine).
    pub fast_path: std::sync::OnceLock<Arc<crate::fast_path::FastPath>>,
    /// What resolves the DNS names of endpoints known by name only: the
    /// pods' upstream DNS forwarder, once DNS settings are made (never
    /// under iptables capture, where such endpoints are refused).
    pub resolver: std::sync::OnceLock<Arc<crate::dns::Forwarder>>,
}

impl std::fmt::Debug for MeshContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MeshContext")
            .field("trust_domain", &self.trust_domain)
            .field("workloads", &self.state().workloads.len())
            .finish()
    }
}

impl MeshContext {
    /// The current snapshot.
    pub fn state(&self) -> Arc<MeshState> {
        match self.state.read() {
            Ok(guard) => Arc::clone(&guard),
            Err(poisoned) => Arc::clone(&poisoned.into_inner()),
        }
    }

    /// Installs a new snapshot and closes the open connections its
    /// policies deny, re-checking only those the change (`affected`) can
    /// concern. Returns how many were closed, and the snapshot it
    /// replaced.
    pub fn install(&self, state: Arc<MeshState>, affected: &Affected) -> (usize, Arc<MeshState>) {
        let replaced = match self.state.write() {
            Ok(mut guard) => std::mem::replace(&mut *guard, Arc::clone(&state)),
            Err(poisoned) => std::mem::replace(&mut *poisoned.into_inner(), Arc::clone(&state)),
        };
        if affected.is_empty() {
            return (0, replaced);
        }
        let closed = self.live.enforce(
            |dst| affected.concerns(&state, dst),
            |request| state.authorize(request),
        );
        let reset = self
            .fast_path
            .get()
            .map_or(0, |fast| fast.revoke(&state, affected));
        (closed + reset, replaced)
    }

    /// Whether `state` is the snapshot in force (a decision made on an
    /// older one must not be cached).
    pub fn is_current(&self, state: &MeshState) -> bool {
        let current = match self.state.read() {
            Ok(guard) => Arc::clone(&guard),
            Err(poisoned) => Arc::clone(&poisoned.into_inner()),
        };
        std::ptr::eq(Arc::as_ptr(&current), state)
    }

    /// A configuration file read after start-up is in force: status and
    /// metrics say so.
    pub fn accept_config(&self) {
        self.set_config_error(None);
        self.metrics.config_reloaded(true);
    }

    /// Why the last configuration file read was rejected, while the
    /// previous configuration stays in force.
    pub fn config_error(&self) -> Option<String> {
        match self.config_error.read() {
            Ok(guard) => guard.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// A configuration file read after start-up was rejected: the previous
    /// configuration stays in force; status and metrics say why and that.
    pub fn reject_config(&self, error: String) {
        self.set_config_error(Some(error));
        self.metrics.config_reloaded(false);
    }

    /// Records (or clears) the config error shown in status.
    pub fn set_config_error(&self, error: Option<String>) {
        match self.config_error.write() {
            Ok(mut guard) => *guard = error,
            Err(poisoned) => *poisoned.into_inner() = error,
        }
    }

    /// Who is at `ip`, as far as the configuration says (an unknown
    /// address gives an empty peer).
    pub fn peer_at(&self, ip: std::net::IpAddr) -> Arc<Peer> {
        self.state().peer_at(ip)
    }

    /// Decides a connection under the current policies.
    pub fn authorize(&self, request: &Request<'_>) -> Result<(), String> {
        self.state().authorize(request)
    }
}
