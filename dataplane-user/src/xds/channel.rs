//! A gRPC channel to istiod over TLS: HTTP/2 (ALPN `h2`), istiod's
//! certificate verified against the mesh root(s) for the configured name.

use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::TokioIo;
use rustls::pki_types::ServerName;
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tonic::transport::{Channel, Endpoint, Uri};

use super::{XdsConfig, XdsError};

/// How long TCP + TLS to istiod may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// HTTP/2 keepalive: a silently dead istiod is noticed within a minute.
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(30);
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(20);

/// Opens the channel (one HTTP/2 connection, TLS-verified).
pub async fn connect(config: &XdsConfig) -> Result<Channel, XdsError> {
    let address = config.address.clone();
    let server_name =
        ServerName::try_from(config.server_name.clone()).map_err(|err| XdsError::Address {
            address: address.clone(),
            reason: format!("`{}` is not a valid TLS name: {err}", config.server_name),
        })?;
    let mut tls = rustls::ClientConfig::builder_with_provider(crate::tls::provider())
        .with_safe_default_protocol_versions()
        .map_err(|err| XdsError::Protocol(format!("TLS provider: {err}")))?
        .with_root_certificates(Arc::clone(&config.roots))
        .with_no_client_auth();
    tls.alpn_protocols = vec![b"h2".to_vec()];
    let connector = TlsConnector::from(Arc::new(tls));
    // The URI only carries the authority; the connector dials it.
    let endpoint = Endpoint::from_shared(format!("https://{address}"))
        .map_err(|err| XdsError::Address {
            address: address.clone(),
            reason: err.to_string(),
        })?
        .connect_timeout(CONNECT_TIMEOUT)
        .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
        .keep_alive_timeout(KEEPALIVE_TIMEOUT)
        .keep_alive_while_idle(true);
    let dial = tower::service_fn(move |uri: Uri| {
        let connector = connector.clone();
        let server_name = server_name.clone();
        async move {
            let host = uri
                .host()
                .unwrap_or_default()
                .trim_matches(['[', ']'])
                .to_owned();
            let port = uri.port_u16().unwrap_or(15012);
            let tcp = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect((host, port)))
                .await
                .map_err(|_| {
                    std::io::Error::new(std::io::ErrorKind::TimedOut, "TCP connect timed out")
                })??;
            tcp.set_nodelay(true)?;
            let tls = tokio::time::timeout(CONNECT_TIMEOUT, connector.connect(server_name, tcp))
                .await
                .map_err(|_| {
                    std::io::Error::new(std::io::ErrorKind::TimedOut, "TLS handshake timed out")
                })??;
            Ok::<_, std::io::Error>(TokioIo::new(tls))
        }
    });
    endpoint
        .connect_with_connector(dial)
        .await
        .map_err(|source| XdsError::Connect { address, source })
}
