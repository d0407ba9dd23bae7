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

use super::PodNetns;
use crate::{
    hbone::{Dialer, PoolKey},
    identity::{CertStore, Identity},
    state::WorkloadIndex,
    tls::ClientConfigCache,
};

/// How long a TCP connect plus TLS handshake to a peer may take.
const DIAL_TIMEOUT: Duration = Duration::from_secs(10);

/// Mesh-wide state every pod's engine reads.
pub struct MeshContext {
    /// Workloads by IP (replaced as a whole when the config changes).
    pub workloads: RwLock<Arc<WorkloadIndex>>,
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
    /// The policy hook both inbound paths ask: `(peer identity, destination)`;
    /// plaintext inbound has no peer identity.
    pub authorize: crate::hbone::Authorizer,
}

impl std::fmt::Debug for MeshContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MeshContext")
            .field("trust_domain", &self.trust_domain)
            .field("workloads", &self.workloads().len())
            .finish()
    }
}

impl MeshContext {
    /// The current workload index.
    pub fn workloads(&self) -> Arc<WorkloadIndex> {
        match self.workloads.read() {
            Ok(guard) => Arc::clone(&guard),
            Err(poisoned) => Arc::clone(&poisoned.into_inner()),
        }
    }
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
        let config = parse_pair(key).and_then(|(src, dst)| {
            self.mesh
                .client_configs
                .get(&src, &[dst])
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

fn parse_pair(key: &PoolKey) -> std::io::Result<(Identity, Identity)> {
    let parse = |uri: &str| {
        Identity::parse(uri)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string()))
    };
    Ok((parse(&key.src_identity)?, parse(&key.dst_identity)?))
}

/// The HBONE address of a destination IP.
pub fn hbone_addr(dst: SocketAddr) -> SocketAddr {
    SocketAddr::new(dst.ip(), dataplane_common::HBONE_PORT)
}
