//! Application tunnels: how an accepted CONNECT stream is handed to a
//! local workload that takes its tunnels itself (Istio's "sandwiched"
//! waypoint), as ztunnel hands it (`src/proxy/inbound.rs`
//! `find_inbound_upstream`, `serve_connect`; `src/proxy.rs`
//! `write_proxy_protocol`).
//!
//! Such a workload's `applicationTunnel` says:
//! - `port`: the port every tunnel is delivered to, whatever port the
//!   client asked for (unset: the asked one);
//! - `protocol: PROXY`: the connection is made over loopback inside the
//!   pod (ztunnel's `LOCALHOST_APP_TUNNEL`, on by default: the app
//!   listens on localhost, so only the node proxy reaches it; off, to the
//!   pod's own address as any delivery, `--localhost-app-tunnel false`)
//!   and starts with a PROXY protocol v2 header naming the client (the
//!   HBONE connection's peer), the destination the client asked for (the
//!   `:authority`, or for a hostname the service's VIP) and, in TLV
//!   `0xD0`, the client's SPIFFE identity;
//! - `protocol: NONE`: the port alone changes.
//!
//! The workload gets the destination the client asked for in the header,
//! so the `:authority` may name another address than the one the tunnel
//! arrived on (the service or workload behind the waypoint): ztunnel's
//! `validate_destination` lets that through for such workloads, and for
//! a waypoint without a tunnel only when the authority's workload or
//! service names it as its waypoint (`hbone::server`'s `check`).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use crate::config::{AppTunnelProtocol, ApplicationTunnel};

use crate::identity::Identity;

/// ztunnel's `PROXY_PROTOCOL_AUTHORITY_TLV` (`src/proxy.rs`): the
/// client's SPIFFE identity (Istio `proto/workload.proto`,
/// `ApplicationTunnel.Protocol.PROXY`).
pub const PEER_IDENTITY_TLV: u8 = 0xD0;

/// A local workload's application tunnel, as the server looks it up for
/// each stream (the mesh state may change between streams).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalTunnel {
    /// The workload's `applicationTunnel`.
    pub tunnel: ApplicationTunnel,
    /// The address the stream's `:authority` names: its own, or for a
    /// hostname its service's VIP with the asked port
    /// ([`crate::state::MeshState::hostname_vip`]); `None` when the
    /// service has none.
    pub asked: Option<SocketAddr>,
    /// Whether a PROXY tunnel is dialled over loopback (ztunnel's
    /// `LOCALHOST_APP_TUNNEL`, `--localhost-app-tunnel`) rather than at
    /// the pod's address.
    pub localhost: bool,
}

/// Where one accepted stream goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delivery {
    /// The app as policy, telemetry and re-checks see it: the local
    /// workload's address and the port delivered to (ztunnel authorizes
    /// the same `upstream_addr`).
    pub app: SocketAddr,
    /// Where the socket connects: `app`, or loopback at its port for a
    /// PROXY tunnel over loopback.
    pub connect: SocketAddr,
    /// The source to connect from in place of the client's address
    /// (loopback for a PROXY tunnel over loopback, as ztunnel binds it:
    /// an app on localhost answers only loopback).
    pub from: Option<IpAddr>,
    /// For a PROXY tunnel, the destination its header names.
    pub proxy_destination: Option<SocketAddr>,
}

impl Delivery {
    /// A stream to the app at `app` (on the local workload's address),
    /// asked for as `asked` (the `:authority`'s address, or for a hostname
    /// the service's VIP and port when it has one), through `tunnel` when
    /// the workload has one; a PROXY tunnel over loopback when `localhost`
    /// (ztunnel `src/proxy/inbound.rs` `serve_connect`: `localhost_tunnel`
    /// is `cfg.localhost_app_tunnel` and the protocol's
    /// `supports_localhost_send`, PROXY's alone), else at `app` from the
    /// client's address, as a delivery without a tunnel.
    pub fn new(
        app: SocketAddr,
        asked: Option<SocketAddr>,
        tunnel: Option<ApplicationTunnel>,
        localhost: bool,
    ) -> Self {
        let Some(tunnel) = tunnel else {
            return Self {
                app,
                connect: app,
                from: None,
                proxy_destination: None,
            };
        };
        let app = SocketAddr::new(app.ip(), tunnel.port.unwrap_or(app.port()));
        match tunnel.protocol {
            AppTunnelProtocol::None => Self {
                app,
                connect: app,
                from: None,
                proxy_destination: None,
            },
            AppTunnelProtocol::Proxy if !localhost => Self {
                app,
                connect: app,
                from: None,
                proxy_destination: Some(asked.unwrap_or(app)),
            },
            AppTunnelProtocol::Proxy => {
                // The family of the app's address, as ztunnel guesses it.
                let loopback = match app.ip() {
                    IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::LOCALHOST),
                    IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::LOCALHOST),
                };
                Self {
                    app,
                    connect: SocketAddr::new(loopback, app.port()),
                    from: Some(loopback),
                    proxy_destination: Some(asked.unwrap_or(app)),
                }
            }
        }
    }
}

/// Errors building a PROXY header.
#[derive(Debug, thiserror::Error)]
pub enum HeaderError {
    /// The header would not fit the format (its length is 16 bits).
    #[error("cannot build the PROXY protocol header for {client} -> {destination}")]
    Build {
        /// The client's address.
        client: SocketAddr,
        /// The destination it names.
        destination: SocketAddr,
        /// What the encoder said.
        #[source]
        source: std::io::Error,
    },
}

/// The PROXY protocol v2 header ztunnel writes (`write_proxy_protocol`):
/// version 2, command PROXY, TCP over the addresses' family (both of one
/// family, else `UNSPEC`), and the client's identity in TLV
/// [`PEER_IDENTITY_TLV`] when it has one. `ppp` is the encoder ztunnel
/// uses, so the bytes are its bytes.
pub fn proxy_header(
    client: SocketAddr,
    destination: SocketAddr,
    identity: Option<&Identity>,
) -> Result<Vec<u8>, HeaderError> {
    use ppp::v2::{Builder, Command, Protocol, Version};
    let build = || {
        let mut builder = Builder::with_addresses(
            Version::Two | Command::Proxy,
            Protocol::Stream,
            (client, destination),
        );
        if let Some(identity) = identity {
            builder = builder.write_tlv(PEER_IDENTITY_TLV, identity.as_uri().as_bytes())?;
        }
        builder.build()
    };
    build().map_err(|source| HeaderError::Build {
        client,
        destination,
        source,
    })
}

#[cfg(test)]
#[path = "app_tunnel_tests.rs"]
mod tests;
