//! Double HBONE: the tunnel to a workload on another network, carried
//! inside the tunnel to that network's gateway (ztunnel
//! `src/proxy/outbound.rs` `proxy_to_double_hbone`). The gateway ends the
//! outer tunnel and passes its bytes on to the workload's node unread; the
//! inner one is mutual TLS between this pod and that node, then HTTP/2
//! CONNECT on a connection of its own (never pooled, as ztunnel: a pooled
//! one would always reach the same workload behind the gateway).

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderName, HeaderValue, StatusCode};
use rustls::pki_types::ServerName;
use tokio_rustls::TlsConnector;
use tracing::debug;

use super::{Through, TunnelHop};
use crate::{
    hbone::{PoolError, Tunnel, stream_io::StreamIo, wire},
    logging::Chain,
    proxy::PodContext,
};

/// ztunnel's `X_FORWARDED_NETWORK_HEADER`: the client's network, on the
/// inner CONNECT only (`create_hbone_request` with `origin_network`).
pub const ORIGIN_NETWORK_HEADER: &str = "x-istio-origin-network";

/// The headers of the inner CONNECT: those of the outer one, and the
/// client's network.
pub(super) struct InnerHeaders<'a> {
    /// The client's address and the service it dialled.
    pub forwarded: (SocketAddr, Option<&'a str>),
    /// The `baggage` header.
    pub baggage: &'a HeaderValue,
    /// The connection's `traceparent`.
    pub traceparent: &'a str,
    /// This node's network (`--network`).
    pub origin_network: &'a str,
}

/// The inner CONNECT request to `authority`: the outer one's headers and
/// [`ORIGIN_NETWORK_HEADER`].
pub fn inner_request(
    authority: &str,
    (source, service): (SocketAddr, Option<&str>),
    (baggage, traceparent): (&HeaderValue, &str),
    origin_network: &str,
) -> Result<http::Request<()>, http::Error> {
    let mut request = wire::connect_request(authority, source, service, baggage, traceparent)?;
    request.headers_mut().insert(
        HeaderName::from_static(ORIGIN_NETWORK_HEADER),
        HeaderValue::from_str(origin_network)?,
    );
    Ok(request)
}

/// Longest the inner tunnel may take to open (its TLS and HTTP/2
/// handshakes and the CONNECT's answer), as a dial to a node
/// (`proxy::dialer`): the outer tunnel's keepalive sees a live gateway
/// even when nothing answers behind it, so without this bound a gateway
/// that never carries the handshake would hold the client's connection
/// open for ever.
const INNER_OPEN_TIMEOUT: Duration = Duration::from_secs(10);

/// Opens the inner tunnel of `hop` inside `outer`, its tunnel to the
/// gateway, sending the client's `early` bytes behind the request; gives
/// up after [`INNER_OPEN_TIMEOUT`].
pub(super) async fn open_inner(
    ctx: &PodContext,
    hop: &TunnelHop,
    through: &Through,
    outer: Tunnel,
    headers: InnerHeaders<'_>,
    early: &Bytes,
) -> Result<Tunnel, PoolError> {
    let opening = open_inner_unbounded(ctx, hop, through, outer, headers, early);
    match tokio::time::timeout(INNER_OPEN_TIMEOUT, opening).await {
        Ok(opened) => opened,
        Err(_) => Err(inner_failed(
            hop,
            through,
            std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!(
                    "the inner tunnel did not open within {}s",
                    INNER_OPEN_TIMEOUT.as_secs()
                ),
            ),
        )),
    }
}

/// The inner tunnel of `hop` through `through`'s gateway failed.
fn inner_failed(hop: &TunnelHop, through: &Through, source: std::io::Error) -> PoolError {
    PoolError::Inner {
        gateway: hop.via,
        authority: through.authority.clone(),
        source,
    }
}

async fn open_inner_unbounded(
    ctx: &PodContext,
    hop: &TunnelHop,
    through: &Through,
    outer: Tunnel,
    headers: InnerHeaders<'_>,
    early: &Bytes,
) -> Result<Tunnel, PoolError> {
    let failed = |source: std::io::Error| inner_failed(hop, through, source);
    let h2_failed = |err: h2::Error| failed(std::io::Error::other(err));
    let request = inner_request(
        &through.authority,
        headers.forwarded,
        (headers.baggage, headers.traceparent),
        headers.origin_network,
    )
    .map_err(|source| PoolError::Request {
        authority: through.authority.clone(),
        source,
    })?;
    let config = ctx
        .mesh
        .client_configs
        .get(&hop.src_identity, &through.identities)
        .map_err(|e| failed(std::io::Error::other(Chain(&e).to_string())))?;
    let (send, recv, slot) = outer.into_parts();
    let io = StreamIo::new(send, recv, slot);
    // The server's name is not checked (its SPIFFE identity is); the
    // gateway's address stands in for it.
    let tls = TlsConnector::from(config)
        .connect(ServerName::IpAddress(hop.via.ip().into()), io)
        .await
        .map_err(failed)?;
    let h2 = ctx.mesh.h2.clamped();
    let (send_request, connection) = h2::client::Builder::new()
        .initial_window_size(h2.stream_window)
        .initial_connection_window_size(h2.connection_window)
        .max_frame_size(h2.max_frame)
        .max_header_list_size(wire::MAX_HEADER_LIST)
        .handshake::<_, Bytes>(tls)
        .await
        .map_err(h2_failed)?;
    // The connection ends once its one stream has and the request handle
    // is gone; the outer tunnel ends with it.
    let gateway = hop.via;
    tokio::spawn(async move {
        if let Err(err) = connection.await {
            debug!(%gateway, error = %err, "inner HBONE connection through a network gateway ended");
        }
    });
    let mut send_request = send_request.ready().await.map_err(h2_failed)?;
    let (response, mut send) = send_request
        .send_request(request, false)
        .map_err(h2_failed)?;
    if !early.is_empty() {
        send.send_data(early.clone(), false).map_err(h2_failed)?;
    }
    let response = response.await.map_err(h2_failed)?;
    if response.status() != StatusCode::OK {
        return Err(PoolError::Refused {
            addr: hop.via,
            authority: through.authority.clone(),
            status: response.status(),
        });
    }
    Ok(Tunnel::unpooled(send, response.into_body()))
}
