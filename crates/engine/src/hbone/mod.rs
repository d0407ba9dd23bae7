//! HBONE: TCP tunnelled as HTTP/2 `CONNECT` streams over mutual TLS on port
//! 15008, wire-compatible with Istio ambient's ztunnel (see the design's
//! "HBONE: wire facts").
//!
//! [`pool`] is the client side (pooled connections, one stream per
//! tunnelled connection), [`server`] the side in the destination pod,
//! [`wire`] holds the request format and HTTP/2 settings, [`app_tunnel`]
//! how a stream reaches a workload that takes tunnels itself, [`preface`] says
//! when a client has finished its HTTP/2 handshake. Bytes move
//! through [`crate::relay::tunnel`]; policy is asked through the server's
//! hooks. TLS is the transport's business (`crate::tls`): these modules
//! work over any established byte stream, and know nothing of pods or
//! capture (`crate::proxy` does).

pub mod app_tunnel;
pub mod head;
pub mod linger;
pub mod pool;
pub mod preface;
pub mod server;
pub mod stream_io;
pub mod wire;

pub use pool::{Dialer, HbonePool, PoolError, PoolKey, StreamSlot, Tunnel};
pub use preface::PrefaceWatch;
pub use server::{
    AppDialer, AppTunnelLookup, AuthorityResolver, Authorizer, ServerContext, serve_connection,
};

#[cfg(test)]
mod tests;
