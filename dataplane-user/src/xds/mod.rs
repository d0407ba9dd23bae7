//! Istio's control plane as a config source: the workloads, services and
//! authorization policies istiod serves over delta xDS
//! (`envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources`
//! on `istiod.istio-system.svc:15012`), as Istio's node proxy receives them.
//!
//! [`node`] says who the agent is (istiod chooses what to send from it),
//! [`channel`] dials istiod over TLS verified against the mesh root,
//! [`resources`] holds what was received and decides ACK or NACK per
//! response, [`client`] runs the stream and reconnects.

pub mod channel;
pub mod client;
pub mod node;
pub mod resources;

use std::path::PathBuf;
use std::sync::Arc;

use rustls::RootCertStore;
use tonic::metadata::{AsciiMetadataValue, errors::InvalidMetadataValue};

pub use client::{XdsClient, XdsSnapshot, XdsStatus};
pub use node::NodeIdentity;
pub use resources::{Verdict, XdsResources};

/// Largest service-account token read (projected tokens are ~1 KiB).
const MAX_TOKEN: u64 = 64 * 1024;

/// Where istiod is and how to talk to it.
#[derive(Debug, Clone)]
pub struct XdsConfig {
    /// `host:port`, e.g. `istiod.istio-system.svc:15012`.
    pub address: String,
    /// The name istiod's certificate must carry (normally the host of
    /// `address`).
    pub server_name: String,
    /// The mesh root(s) istiod's certificate chains to.
    pub roots: Arc<RootCertStore>,
    /// The agent's projected service-account token (audience `istio-ca`),
    /// re-read on every connection because kubelet rotates it.
    pub token_file: Option<PathBuf>,
    /// Who the agent is.
    pub node: NodeIdentity,
}

impl XdsConfig {
    /// `Bearer <token>` from the token file, if one is configured.
    pub fn bearer_token(&self) -> Result<Option<AsciiMetadataValue>, XdsError> {
        let Some(path) = &self.token_file else {
            return Ok(None);
        };
        let token_error = |reason: String| XdsError::Token {
            path: path.clone(),
            reason,
        };
        let text = read_bounded(path, MAX_TOKEN).map_err(|err| token_error(err.to_string()))?;
        let token = text.trim();
        if token.is_empty() {
            return Err(token_error("the file is empty".into()));
        }
        format!("Bearer {token}")
            .parse()
            .map(Some)
            .map_err(|err: InvalidMetadataValue| token_error(err.to_string()))
    }
}

/// Reads at most `limit` bytes of a text file; more is an error.
fn read_bounded(path: &std::path::Path, limit: u64) -> std::io::Result<String> {
    use std::io::Read;
    let mut text = String::new();
    std::fs::File::open(path)?
        .take(limit + 1)
        .read_to_string(&mut text)?;
    if text.len() as u64 > limit {
        return Err(std::io::Error::other(format!("longer than {limit} bytes")));
    }
    Ok(text)
}

/// Why talking to istiod failed.
#[derive(Debug, thiserror::Error)]
pub enum XdsError {
    /// The address is not `host:port`.
    #[error("istiod address `{address}` is not host:port: {reason}")]
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
    /// istiod answered the stream with an error status.
    #[error("istiod at {address} ended the stream: {status}")]
    Rpc {
        /// The address dialled.
        address: String,
        /// The gRPC status (boxed: it is large).
        status: Box<tonic::Status>,
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
    /// The stream broke in a way the protocol does not allow.
    #[error("xDS protocol error: {0}")]
    Protocol(String),
}
