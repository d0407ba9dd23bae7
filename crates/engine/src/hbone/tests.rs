//! HBONE's HTTP/2 layer over real loopback TCP: the server, the pool and the
//! relay together, without TLS (the TLS transport is tested on its own and
//! end to end in `tests/`).

use std::{future::Future, net::SocketAddr, pin::Pin, sync::Arc, time::Duration};

use http::StatusCode;
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
    sync::watch,
};

use super::{pool::PoolSpread, *};
use crate::relay::{TunnelRelayError, relay_tunnel as relay};

mod app_tunnel;
mod early;
mod knobs;
mod slow_readers;
mod spread;

mod pooling;
mod refusals;
mod resets;
mod tunnels;

struct TcpDialer;

impl Dialer for TcpDialer {
    type Io = TcpStream;
    fn dial(
        &self,
        key: &PoolKey,
    ) -> Pin<Box<dyn Future<Output = std::io::Result<TcpStream>> + Send>> {
        let addr = key.dst_addr;
        Box::pin(async move { TcpStream::connect(addr).await })
    }
}

/// An HBONE server on loopback whose tunnels reach `127.0.0.1:<port>`.
/// Policy denies destination port 9.
async fn hbone_server() -> std::io::Result<(SocketAddr, watch::Sender<bool>)> {
    let (shutdown_tx, shutdown) = watch::channel(false);
    let addr = hbone_server_with(move |_| shutdown.clone()).await?;
    Ok((addr, shutdown_tx))
}

/// [`hbone_server`] whose `n`th connection (from 0) drains when
/// `shutdown_of(n)` says so: two agents serving one listening socket.
async fn hbone_server_with(
    shutdown_of: impl Fn(usize) -> watch::Receiver<bool> + Send + 'static,
) -> std::io::Result<SocketAddr> {
    hbone_server_announcing(shutdown_of, wire::H2Settings::default()).await
}

/// [`hbone_server_with`] announcing `h2` to its clients.
async fn hbone_server_announcing(
    shutdown_of: impl Fn(usize) -> watch::Receiver<bool> + Send + 'static,
    h2: wire::H2Settings,
) -> std::io::Result<SocketAddr> {
    hbone_server_serving(shutdown_of, h2, Arc::new(|_, _| None)).await
}

/// [`hbone_server_announcing`] whose local workload's application tunnel
/// is what `app_tunnel` says.
async fn hbone_server_serving(
    shutdown_of: impl Fn(usize) -> watch::Receiver<bool> + Send + 'static,
    h2: wire::H2Settings,
    app_tunnel: AppTunnelLookup,
) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        let mut accepted = 0;
        while let Ok((stream, peer)) = listener.accept().await {
            let shutdown = shutdown_of(accepted);
            accepted += 1;
            let Ok(local) = stream.local_addr() else {
                continue;
            };
            let destination = Arc::new(crate::telemetry::Peer {
                workload: Some("web-0".into()),
                namespace: Some("shop".into()),
                canonical_service: Some("web".into()),
                canonical_revision: Some("v2".into()),
                cluster: Some("east".into()),
                region: Some("eu".into()),
                ..crate::telemetry::Peer::default()
            });
            let ctx = ServerContext {
                local,
                peer,
                peer_identity: Some(client_identity()),
                dial: Arc::new(|_client, dst| Box::pin(TcpStream::connect(dst))),
                authorize: Arc::new(|r| {
                    if r.dst.port() == 9 {
                        Err("port 9 is closed".into())
                    } else {
                        Ok(())
                    }
                }),
                resolve_authority: Arc::new(|authority, local| {
                    // `echo.local:<port>` names the loopback app.
                    let port = authority.strip_prefix("echo.local:")?.parse().ok()?;
                    Some(SocketAddr::new(local.ip(), port))
                }),
                app_tunnel: Arc::clone(&app_tunnel),
                is_waypoint_of: Arc::new(|_, _| false),
                attribute: Arc::new(|_, _| None),
                live: None,
                shutdown,
                metrics: Arc::new(crate::telemetry::Metrics::new()),
                source: Arc::default(),
                source_known: true,
                destination_baggage: ServerContext::baggage_of(&destination),
                destination,
                idle_timeout: std::time::Duration::from_secs(60),
                h2,
            };
            tokio::spawn(async move {
                let _ = serve_connection(stream, ctx).await;
            });
        }
    });
    Ok(addr)
}

/// An app that echoes everything until the client half-closes.
async fn echo_app() -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let (mut r, mut w) = stream.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
                let _ = w.shutdown().await;
            });
        }
    });
    Ok(addr)
}

fn client_identity() -> crate::identity::Identity {
    crate::identity::Identity::new("cluster.local", "a", "client")
        .unwrap_or_else(|e| panic!("fixture identity: {e}"))
}

fn key(server: SocketAddr) -> PoolKey {
    PoolKey {
        src_identity: client_identity(),
        dst_identity: crate::identity::Identity::new("cluster.local", "b", "server")
            .unwrap_or_else(|e| panic!("fixture identity: {e}")),
        alt_identities: Arc::default(),
        dst_addr: server,
    }
}

/// A connected pair of loopback sockets: (the app's end, the engine's end).
async fn tcp_pair() -> std::io::Result<(TcpStream, TcpStream)> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let app = TcpStream::connect(listener.local_addr()?).await?;
    let (engine, _) = listener.accept().await?;
    Ok((app, engine))
}

/// Opens a tunnel to `authority` through the HBONE server at `server`,
/// sending `early` with the request.
async fn open_with<D: Dialer>(
    pool: &Arc<HbonePool<D>>,
    server: SocketAddr,
    authority: &str,
    early: &bytes::Bytes,
) -> Result<Tunnel, PoolError> {
    let src = SocketAddr::from(([127, 0, 0, 1], 40000));
    let baggage = http::HeaderValue::from_static("k8s.cluster.name=Kubernetes");
    let traceparent = wire::new_traceparent();
    pool.connect(
        &key(server),
        authority,
        (src, None),
        (&baggage, &traceparent),
        early,
    )
    .await
}

/// [`open_with`] sending nothing early.
async fn open<D: Dialer>(
    pool: &Arc<HbonePool<D>>,
    server: SocketAddr,
    authority: &str,
) -> Result<Tunnel, PoolError> {
    open_with(pool, server, authority, &bytes::Bytes::new()).await
}

/// An HTTP/2 frame header plus payload.
fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len() as u32;
    let mut out = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
    out.extend_from_slice(&stream.to_be_bytes());
    out.extend_from_slice(payload);
    out
}

/// Whether the server's frames refuse stream 1: GOAWAY, RST_STREAM on
/// stream 1, or a response HEADERS on stream 1 (an error status: the
/// request never reached the tunnel code, which would answer 400 at most).
fn refused_stream_one(mut bytes: &[u8]) -> bool {
    while bytes.len() >= 9 {
        let len =
            (usize::from(bytes[0]) << 16) | (usize::from(bytes[1]) << 8) | usize::from(bytes[2]);
        let kind = bytes[3];
        let stream = u32::from_be_bytes([bytes[5] & 0x7f, bytes[6], bytes[7], bytes[8]]);
        if kind == 0x7 || (stream == 1 && (kind == 0x3 || kind == HEADERS)) {
            return true;
        }
        bytes = bytes.get(9 + len..).unwrap_or_default();
    }
    false
}

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const HEADERS: u8 = 0x1;
const SETTINGS: u8 = 0x4;
const CONTINUATION: u8 = 0x9;
const END_HEADERS: u8 = 0x4;
