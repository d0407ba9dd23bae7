//! Reaching istiod, for everything the agent asks it (workloads over xDS,
//! certificates from its CA): gRPC over TLS (HTTP/2, ALPN `h2`) with
//! istiod's certificate verified against the mesh root(s) for the
//! configured name, and the agent's service-account token as the bearer
//! credential.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::TokioIo;
use rustls::RootCertStore;
use rustls::pki_types::ServerName;
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tonic::metadata::{
    AsciiMetadataKey, AsciiMetadataValue, MetadataMap, errors::InvalidMetadataValue,
};
use tonic::transport::{Channel, Endpoint, Uri};

/// How long TCP + TLS to istiod may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// HTTP/2 keepalive: a silently dead istiod is noticed within a minute.
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(30);
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(20);
/// Largest service-account token read (projected tokens are ~1 KiB).
const MAX_TOKEN: usize = 64 * 1024;

/// Where istiod is and how to trust and authenticate to it.
#[derive(Debug, Clone)]
pub struct IstiodEndpoint {
    /// `host:port`, e.g. `istiod.istio-system.svc:15012`.
    pub address: String,
    /// The name istiod's certificate must carry (normally the host of
    /// `address`).
    pub server_name: String,
    /// The mesh root(s) istiod's certificate chains to.
    pub roots: Arc<RootCertStore>,
    /// The agent's projected service-account token (audience `istio-ca`),
    /// re-read for every connection or request because kubelet rotates it.
    pub token_file: Option<PathBuf>,
    /// Extra gRPC metadata sent with every request (ztunnel's
    /// `XDS_HEADER_*` and `CA_HEADER_*`, `src/config.rs` `parse_headers`),
    /// e.g. for a gateway in front of istiod that routes or authenticates
    /// by header.
    pub headers: Vec<(AsciiMetadataKey, AsciiMetadataValue)>,
}

/// Why istiod could not be reached or authenticated to.
#[derive(Debug, thiserror::Error)]
pub enum IstiodError {
    /// The address or name is unusable.
    #[error("istiod address `{address}`: {reason}")]
    Address {
        /// The address configured.
        address: String,
        /// What is wrong.
        reason: String,
    },
    /// TCP or TLS to istiod failed.
    #[error("cannot connect to istiod at {address}: {source}")]
    Connect {
        /// The address dialled.
        address: String,
        /// The transport's error.
        #[source]
        source: tonic::transport::Error,
    },
    /// The service-account token could not be read.
    #[error(
        "cannot read the service-account token {path}: {reason}; is the projected token volume (audience istio-ca) mounted?"
    )]
    Token {
        /// The token file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
}

impl IstiodEndpoint {
    /// `Bearer <token>` from the token file, if one is configured.
    pub fn bearer_token(&self) -> Result<Option<AsciiMetadataValue>, IstiodError> {
        let Some(path) = &self.token_file else {
            return Ok(None);
        };
        let token_error = |reason: String| IstiodError::Token {
            path: path.clone(),
            reason,
        };
        let (bytes, more) = dataplane_core::fs::read_at_most(path, MAX_TOKEN)
            .map_err(|err| token_error(err.to_string()))?;
        if more {
            return Err(token_error(format!("longer than {MAX_TOKEN} bytes")));
        }
        let text = String::from_utf8(bytes).map_err(|_| token_error("not UTF-8".into()))?;
        let token = text.trim();
        if token.is_empty() {
            return Err(token_error("the file is empty".into()));
        }
        format!("Bearer {token}")
            .parse()
            .map(Some)
            .map_err(|err: InvalidMetadataValue| token_error(err.to_string()))
    }

    /// Adds the request metadata: `authorization` from the token file, if
    /// one is configured, and the extra headers.
    pub fn add_metadata(&self, metadata: &mut MetadataMap) -> Result<(), IstiodError> {
        if let Some(token) = self.bearer_token()? {
            metadata.insert("authorization", token);
        }
        for (key, value) in &self.headers {
            metadata.append(key.clone(), value.clone());
        }
        Ok(())
    }

    /// Opens a channel (one HTTP/2 connection, TLS-verified).
    pub async fn connect(&self) -> Result<Channel, IstiodError> {
        let address = self.address.clone();
        let server_name =
            ServerName::try_from(self.server_name.clone()).map_err(|err| IstiodError::Address {
                address: address.clone(),
                reason: format!("`{}` is not a valid TLS name: {err}", self.server_name),
            })?;
        let mut tls = rustls::ClientConfig::builder_with_provider(crate::crypto::provider())
            .with_safe_default_protocol_versions()
            .map_err(|err| IstiodError::Address {
                address: address.clone(),
                reason: format!("TLS provider: {err}"),
            })?
            .with_root_certificates(Arc::clone(&self.roots))
            .with_no_client_auth();
        tls.alpn_protocols = vec![b"h2".to_vec()];
        let connector = TlsConnector::from(Arc::new(tls));
        // The URI only carries the authority; the connector dials it.
        let endpoint = Endpoint::from_shared(format!("https://{address}"))
            .map_err(|err| IstiodError::Address {
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
                let timed_out = |what: &str| {
                    std::io::Error::new(std::io::ErrorKind::TimedOut, format!("{what} timed out"))
                };
                let tcp = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect((host, port)))
                    .await
                    .map_err(|_| timed_out("TCP connect"))??;
                tcp.set_nodelay(true)?;
                let tls =
                    tokio::time::timeout(CONNECT_TIMEOUT, connector.connect(server_name, tcp))
                        .await
                        .map_err(|_| timed_out("TLS handshake"))??;
                Ok::<_, std::io::Error>(TokioIo::new(tls))
            }
        });
        endpoint
            .connect_with_connector(dial)
            .await
            .map_err(|source| IstiodError::Connect { address, source })
    }
}

#[cfg(test)]
#[expect(
    clippy::unwrap_used,
    reason = "a bad fixture should fail the test loudly"
)]
mod tests {
    use super::*;

    #[test]
    fn the_token_is_read_bounded_and_refused_when_unusable() {
        let dir = std::env::temp_dir().join(format!("dp-istiod-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let endpoint = |file: &str| IstiodEndpoint {
            address: "istiod.istio-system.svc:15012".into(),
            server_name: "istiod.istio-system.svc".into(),
            roots: Arc::new(RootCertStore::empty()),
            token_file: Some(dir.join(file)),
            headers: Vec::new(),
        };
        std::fs::write(dir.join("good"), "abc.def\n").unwrap();
        std::fs::write(dir.join("empty"), " \n").unwrap();
        std::fs::write(dir.join("huge"), vec![b'a'; MAX_TOKEN + 1]).unwrap();
        let good = endpoint("good").bearer_token().unwrap().unwrap();
        let errors: Vec<String> = ["empty", "huge", "missing"]
            .map(|f| endpoint(f).bearer_token().unwrap_err().to_string())
            .to_vec();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(good, "Bearer abc.def");
        assert!(errors[0].contains("empty"), "{}", errors[0]);
        assert!(errors[1].contains("longer than"), "{}", errors[1]);
        assert!(
            errors[2].contains("missing") && errors[2].contains("projected token"),
            "{}",
            errors[2]
        );
        let none = IstiodEndpoint {
            token_file: None,
            ..endpoint("good")
        };
        assert!(none.bearer_token().unwrap().is_none());
    }
}
