//! The TLS dialer of one pod's HBONE pool: TCP from inside the pod's
//! network namespace (with the proxy mark, so capture leaves it alone),
//! then mutual TLS presenting the pod's certificate and expecting the
//! destination's identity.

use std::{future::Future, pin::Pin, sync::Arc, time::Duration};

use rustls::pki_types::ServerName;
use tokio_rustls::TlsConnector;

use super::PodNetns;
use crate::{
    hbone::{Dialer, PoolKey},
    mesh::MeshContext,
};

/// How long a TCP connect plus TLS handshake to a peer may take.
const DIAL_TIMEOUT: Duration = Duration::from_secs(10);

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
    type Io = super::revocation::RevocableClient;

    fn dial(
        &self,
        key: &PoolKey,
    ) -> Pin<Box<dyn Future<Output = std::io::Result<Self::Io>> + Send>> {
        let socket = self
            .netns
            .connector(key.dst_addr, self.mark, self.mesh.keepalive);
        let mut expected = Vec::with_capacity(1 + key.alt_identities.len());
        expected.push(key.dst_identity.clone());
        expected.extend(key.alt_identities.iter().cloned());
        let config = self
            .mesh
            .client_configs
            .get(&key.src_identity, &expected)
            .map_err(|e| std::io::Error::other(crate::logging::Chain(&e).to_string()));
        let addr = key.dst_addr;
        let roots = Arc::clone(&self.mesh.roots);
        Box::pin(async move {
            let socket = socket?;
            let config = config?;
            let dial = async {
                let tcp = super::pod_netns::connect(socket, addr).await?;
                tcp.set_nodelay(true)?;
                TlsConnector::from(config)
                    .connect(ServerName::IpAddress(addr.ip().into()), tcp)
                    .await
            };
            let tls = tokio::time::timeout(DIAL_TIMEOUT, dial)
                .await
                .map_err(|_| {
                    std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        format!("dialing {addr} timed out"),
                    )
                })??;
            // With revocation lists, a server revoked later is reset.
            Ok(super::revocation::RevocableClient::server_of(&roots, tls))
        })
    }
}
