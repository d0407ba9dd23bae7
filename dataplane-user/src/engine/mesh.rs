//! What the engine shares across pods for HBONE (workloads, certificates,
//! TLS configurations), and the per-pod TLS dialer the HBONE pool uses.

use std::{
    future::Future,
    net::SocketAddr,
    pin::Pin,
    sync::{Arc, RwLock},
    time::Duration,
};

use rustls::{RootCertStore, pki_types::ServerName};
use tokio::{net::TcpStream, sync::watch};
use tokio_rustls::{TlsConnector, client::TlsStream};

use super::{LiveConnections, PodNetns};
use crate::{
    hbone::{Dialer, PoolKey},
    identity::{CertStore, Identity},
    state::{DeadEndpoints, MeshState, MeshWorkload},
    telemetry::{Metrics, Peer},
    tls::ClientConfigCache,
};

/// How long a TCP connect plus TLS handshake to a peer may take.
const DIAL_TIMEOUT: Duration = Duration::from_secs(10);

/// Mesh-wide state every pod's engine reads.
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
    /// The mesh's root(s).
    pub roots: Arc<RootCertStore>,
    /// Client TLS configurations by (source, expected destination).
    pub client_configs: ClientConfigCache,
    /// Trust domain whose clients the HBONE servers accept.
    pub trust_domain: String,
    /// Flips to `true` when the agent drains.
    pub shutdown: watch::Receiver<bool>,
    /// How long an unused pooled HBONE connection is kept.
    pub pool_idle_timeout: Duration,
    /// Connection metrics (and the rest of `/metrics`).
    pub metrics: Arc<Metrics>,
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

    /// Installs a new snapshot (a configuration file read after start-up:
    /// counted as applied) and closes open connections its policies deny.
    /// Returns how many were closed.
    pub fn install(&self, state: MeshState) -> usize {
        let state = Arc::new(state);
        match self.state.write() {
            Ok(mut guard) => *guard = Arc::clone(&state),
            Err(poisoned) => *poisoned.into_inner() = Arc::clone(&state),
        }
        self.set_config_error(None);
        self.metrics.config_reloaded(true);
        self.live.enforce(&state)
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
        self.state()
            .workloads
            .by_ip(ip)
            .map(|w| workload_peer(w))
            .unwrap_or_default()
    }

    /// Decides a connection under the current policies.
    pub fn authorize(&self, request: &crate::hbone::AuthzRequest<'_>) -> Result<(), String> {
        self.state().authorize(request)
    }
}

/// A configured workload as a connection end.
pub fn workload_peer(workload: &MeshWorkload) -> Arc<Peer> {
    Arc::clone(&workload.peer)
}

/// Dials HBONE peers for one pod: TCP from inside the pod's network
/// namespace (with the proxy mark, so capture leaves it alone), then TLS
/// presenting the pod's identity and expecting the destination's.
pub struct PodTlsDialer {
    /// The pod's namespace.
    pub netns: PodNetns,
    /// The proxy mark.
    pub mark: u32,
    /// Shared mesh state.
    pub mesh: Arc<MeshContext>,
}

impl Dialer for PodTlsDialer {
    type Io = TlsStream<TcpStream>;

    fn dial(
        &self,
        key: &PoolKey,
    ) -> Pin<Box<dyn Future<Output = std::io::Result<Self::Io>> + Send>> {
        let socket = self.netns.connector(key.dst_addr, self.mark);
        let config = parse_pair(key).and_then(|(src, expected)| {
            self.mesh
                .client_configs
                .get(&src, &expected)
                .map_err(|e| std::io::Error::other(crate::logging::Chain(&e).to_string()))
        });
        let addr = key.dst_addr;
        Box::pin(async move {
            let socket = socket?;
            let config = config?;
            let dial = async {
                let tcp = socket.connect(addr).await?;
                tcp.set_nodelay(true)?;
                TlsConnector::from(config)
                    .connect(ServerName::IpAddress(addr.ip().into()), tcp)
                    .await
            };
            tokio::time::timeout(DIAL_TIMEOUT, dial)
                .await
                .map_err(|_| {
                    std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        format!("dialing {addr} timed out"),
                    )
                })?
        })
    }
}

/// The source identity and every identity the server may present.
fn parse_pair(key: &PoolKey) -> std::io::Result<(Identity, Vec<Identity>)> {
    let parse = |uri: &str| {
        Identity::parse(uri)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string()))
    };
    let mut expected = vec![parse(&key.dst_identity)?];
    for alt in &key.alt_identities {
        expected.push(parse(alt)?);
    }
    Ok((parse(&key.src_identity)?, expected))
}

/// The HBONE address of a destination IP.
pub fn hbone_addr(dst: SocketAddr) -> SocketAddr {
    SocketAddr::new(dst.ip(), dataplane_common::HBONE_PORT)
}
