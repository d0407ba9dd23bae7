//! Istio's control plane as a config source: the workloads, services and
//! authorization policies istiod serves over delta xDS
//! (`envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources`
//! on `istiod.istio-system.svc:15012`), as Istio's node proxy receives them.
//!
//! [`node`] says who the agent is (istiod chooses what to send from it),
//! [`crate::istiod`] dials istiod over TLS verified against the mesh root,
//! [`wire`] reads a response in place, [`resources`] holds what was received and decides ACK or NACK per
//! response, [`client`] runs the stream and reconnects.

pub mod client;
pub mod grpc;
pub mod journal;
pub mod metrics;
pub mod model;
pub mod node;
pub mod resources;
pub mod translate;
pub mod wire;

#[cfg(test)]
mod test_support;

pub use client::{Applied, AppliedReporter, XdsClient, XdsSnapshot, XdsStatus};
pub use metrics::XdsMetrics;
pub use model::{ChangedEntries, XdsEntries, XdsModel};
pub use node::NodeIdentity;
pub use resources::{Verdict, XdsResources};
pub use translate::{Translated, translate};
pub use wire::{Response, WireError};

use crate::istiod::{IstiodEndpoint, IstiodError};

/// Where istiod is and who the agent is to it.
#[derive(Debug, Clone)]
pub struct XdsConfig {
    /// istiod's address, TLS trust and token.
    pub istiod: IstiodEndpoint,
    /// Who the agent is.
    pub node: NodeIdentity,
}

/// Why an xDS stream ended.
#[derive(Debug, thiserror::Error)]
pub enum XdsError {
    /// istiod could not be reached or authenticated to.
    #[error(transparent)]
    Istiod(#[from] IstiodError),
    /// istiod answered the stream with an error status.
    #[error("istiod at {address} ended the stream: {status}")]
    Rpc {
        /// The address dialled.
        address: String,
        /// The gRPC status (boxed: it is large).
        status: Box<tonic::Status>,
    },
    /// The stream broke in a way the protocol does not allow.
    #[error("xDS protocol error: {0}")]
    Protocol(String),
}
