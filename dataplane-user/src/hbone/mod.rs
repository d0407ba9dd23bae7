//! HBONE: TCP tunnelled as HTTP/2 `CONNECT` streams over mutual TLS on port
//! 15008, wire-compatible with Istio ambient's ztunnel (see the design's
//! "HBONE: wire facts").
//!
//! [`pool`] is the client side (pooled connections, one stream per
//! tunnelled connection), [`server`] the side in the destination pod,
//! [`relay`] moves bytes between a TCP connection and a stream with TCP's
//! half-close and reset semantics, [`wire`] holds the request format and
//! HTTP/2 settings. TLS is the transport's business (`crate::tls`): these
//! modules work over any established byte stream.

pub mod pool;
pub mod relay;
pub mod server;
pub mod wire;

pub use pool::{Dialer, HbonePool, PoolError, PoolKey, Tunnel};
pub use relay::{TunnelRelayError, relay};
pub use server::{
    AppDialer, AuthorityResolver, Authorizer, AuthzRequest, ServerContext, serve_connection,
};

#[cfg(test)]
mod tests;
