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

#[tokio::test]
async fn sixteen_mebibytes_round_trip_exactly_with_half_close() -> anyhow::Result<()> {
    let (server, _stop) = hbone_server().await?;
    let app = echo_app().await?;
    let pool = HbonePool::new(TcpDialer, Duration::from_secs(30));
    let tunnel = open(&pool, server, &app.to_string()).await?;
    let (mut client, engine) = tcp_pair().await?;
    let relay_task = tokio::spawn(relay(engine, tunnel.send, tunnel.recv, Default::default()));

    let data: Vec<u8> = (0..16 * 1024 * 1024u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8)
        .collect();
    let (mut r, mut w) = client.split();
    let expected = data.clone();
    let (_, received) = tokio::try_join!(
        async {
            w.write_all(&data).await?;
            w.shutdown().await // half-close: the echo side then finishes
        },
        async {
            let mut got = Vec::with_capacity(expected.len());
            r.read_to_end(&mut got).await?;
            Ok::<_, std::io::Error>(got)
        }
    )?;
    assert_eq!(received.len(), expected.len());
    assert!(received == expected, "payload corrupted");
    let transferred = relay_task.await??;
    assert_eq!(transferred.sent, 16 * 1024 * 1024);
    assert_eq!(transferred.received, 16 * 1024 * 1024);
    Ok(())
}

#[tokio::test]
async fn hostname_authorities_are_resolved_by_the_server() -> anyhow::Result<()> {
    let (server, _stop) = hbone_server().await?;
    let app = echo_app().await?;
    let pool = HbonePool::new(TcpDialer, Duration::from_secs(30));
    let tunnel = open(&pool, server, &format!("echo.local:{}", app.port())).await?;
    let (mut client, engine) = tcp_pair().await?;
    tokio::spawn(relay(engine, tunnel.send, tunnel.recv, Default::default()));
    client.write_all(b"ping").await?;
    client.shutdown().await?;
    let mut reply = Vec::new();
    client.read_to_end(&mut reply).await?;
    assert_eq!(reply, b"ping");
    Ok(())
}

#[tokio::test]
async fn fifty_tunnels_share_one_connection_when_the_bound_is_one() -> anyhow::Result<()> {
    let (server, _stop) = hbone_server().await?;
    let app = echo_app().await?;
    let one = PoolSpread {
        max_connections: 1,
        ..PoolSpread::default()
    };
    let pool = HbonePool::with_spread(TcpDialer, Duration::from_secs(30), one);
    let mut opens = tokio::task::JoinSet::new();
    for _ in 0..50 {
        let pool = Arc::clone(&pool);
        let authority = app.to_string();
        opens.spawn(async move { open(&pool, server, &authority).await });
    }
    let mut tunnels = Vec::new();
    while let Some(joined) = opens.join_next().await {
        tunnels.push(joined??);
    }
    assert_eq!(tunnels.len(), 50);
    assert_eq!(pool.dials(), 1, "one dial in flight per key");
    assert_eq!(pool.connections(), 1);
    Ok(())
}

#[tokio::test]
async fn a_stream_a_draining_peer_refuses_goes_to_a_new_connection() -> anyhow::Result<()> {
    // The first connection's server drains (as an agent that handed its
    // pods over does); later ones are served by its successor.
    let (drain_first, first) = watch::channel(false);
    let (_successor, later) = watch::channel(false);
    let server =
        hbone_server_with(move |n| if n == 0 { first.clone() } else { later.clone() }).await?;
    let app = echo_app().await?;
    let pool = HbonePool::new(TcpDialer, Duration::from_secs(30));
    let held = open(&pool, server, &app.to_string()).await?;
    drain_first.send(true)?;
    // Opened one after another while GOAWAY reaches the client: every one
    // must succeed, on the draining connection before GOAWAY arrives and
    // on a new one after.
    for _ in 0..20 {
        let tunnel = open(&pool, server, &app.to_string()).await?;
        drop(tunnel);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(pool.dials(), 2, "one new connection after the GOAWAY");
    // The stream the draining peer had accepted still works.
    let (mut app_end, engine) = tcp_pair().await?;
    let relay = tokio::spawn(relay(engine, held.send, held.recv, Default::default()));
    app_end.write_all(b"still here").await?;
    app_end.shutdown().await?;
    let mut reply = Vec::new();
    app_end.read_to_end(&mut reply).await?;
    assert_eq!(reply, b"still here");
    let _ = relay.await;
    Ok(())
}

#[tokio::test]
async fn refusals_carry_the_right_status() -> anyhow::Result<()> {
    let (server, _stop) = hbone_server().await?;
    let pool = HbonePool::new(TcpDialer, Duration::from_secs(30));
    let status = |r: Result<Tunnel, PoolError>| match r {
        Err(PoolError::Refused { status, .. }) => Some(status),
        _ => None,
    };
    // Authority IP is not the IP the connection arrived on.
    assert_eq!(
        status(open(&pool, server, "127.0.0.2:80").await),
        Some(StatusCode::BAD_REQUEST)
    );
    // Engine port.
    assert_eq!(
        status(open(&pool, server, "127.0.0.1:15001").await),
        Some(StatusCode::BAD_REQUEST)
    );
    // Not ip:port.
    assert_eq!(
        status(open(&pool, server, "example:80").await),
        Some(StatusCode::BAD_REQUEST)
    );
    // Policy.
    assert_eq!(
        status(open(&pool, server, "127.0.0.1:9").await),
        Some(StatusCode::UNAUTHORIZED)
    );
    // App down: bind and drop to find a closed port.
    let closed = TcpListener::bind("127.0.0.1:0").await?.local_addr()?;
    assert_eq!(
        status(open(&pool, server, &closed.to_string()).await),
        Some(StatusCode::SERVICE_UNAVAILABLE)
    );
    Ok(())
}

#[tokio::test]
async fn the_200_says_what_the_destination_is_in_baggage() -> anyhow::Result<()> {
    let (server, _stop) = hbone_server().await?;
    let app = echo_app().await?;
    let io = TcpStream::connect(server).await?;
    let (send, conn) = h2::client::handshake(io).await?;
    tokio::spawn(conn);
    let mut send = send.ready().await?;
    let request = http::Request::builder()
        .method("CONNECT")
        .uri(app.to_string())
        .body(())?;
    let (response, _stream) = send.send_request(request, false)?;
    let response = response.await?;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(
        response.headers()["baggage"],
        "k8s.cluster.name=east,k8s.namespace.name=shop,k8s.pod.name=web-0,service.name=web,\
         service.version=v2,cloud.region=eu"
    );
    Ok(())
}

#[tokio::test]
async fn only_connect_is_served() -> anyhow::Result<()> {
    let (server, _stop) = hbone_server().await?;
    let io = TcpStream::connect(server).await?;
    let (send, conn) = h2::client::handshake(io).await?;
    tokio::spawn(conn);
    let mut send = send.ready().await?;
    let request = http::Request::builder()
        .method("GET")
        .uri("http://127.0.0.1:80/")
        .body(())?;
    let (response, _) = send.send_request(request, true)?;
    assert_eq!(response.await?.status(), StatusCode::BAD_REQUEST);
    Ok(())
}

#[tokio::test]
async fn garbage_and_http1_do_not_hurt_the_server() -> anyhow::Result<()> {
    let (server, _stop) = hbone_server().await?;
    for junk in [
        &b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"[..],
        &[0xffu8; 4096][..],
    ] {
        let mut stream = TcpStream::connect(server).await?;
        let _ = stream.write_all(junk).await;
        let mut sink = Vec::new();
        // The server closes on a protocol error; a read must end.
        let _ =
            tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut sink)).await?;
    }
    // Still serving.
    let app = echo_app().await?;
    let pool = HbonePool::new(TcpDialer, Duration::from_secs(30));
    assert!(open(&pool, server, &app.to_string()).await.is_ok());
    Ok(())
}

#[tokio::test]
async fn app_reset_reaches_the_client_as_reset() -> anyhow::Result<()> {
    let (server, _stop) = hbone_server().await?;
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let app = listener.local_addr()?;
    tokio::spawn(async move {
        if let Ok((mut stream, _)) = listener.accept().await {
            let mut one = [0u8; 1];
            let _ = stream.read(&mut one).await;
            let _ = socket2::SockRef::from(&stream).set_linger(Some(Duration::ZERO));
        }
    });
    let pool = HbonePool::new(TcpDialer, Duration::from_secs(30));
    let tunnel = open(&pool, server, &app.to_string()).await?;
    let (mut client, engine) = tcp_pair().await?;
    let relay_task = tokio::spawn(relay(engine, tunnel.send, tunnel.recv, Default::default()));
    client.write_all(b"x").await?;
    assert!(matches!(
        relay_task.await?,
        Err(TunnelRelayError::Stream { .. })
    ));
    let mut buf = [0u8; 16];
    let err = loop {
        match client.read(&mut buf).await {
            Ok(0) => anyhow::bail!("closed with FIN, expected a reset"),
            Ok(_) => continue,
            Err(err) => break err,
        }
    };
    assert_eq!(err.kind(), std::io::ErrorKind::ConnectionReset);
    Ok(())
}

#[tokio::test]
async fn idle_connections_are_evicted() -> anyhow::Result<()> {
    let (server, _stop) = hbone_server().await?;
    let app = echo_app().await?;
    let pool = HbonePool::new(TcpDialer, Duration::from_millis(1));
    drop(open(&pool, server, &app.to_string()).await?);
    tokio::time::sleep(Duration::from_millis(5)).await;
    assert_eq!(pool.evict_idle(), 1);
    assert_eq!(pool.connections(), 0);
    // The destination's dial lock goes with its last connection.
    assert_eq!(pool.dial_locks(), 0);
    Ok(())
}

#[tokio::test]
async fn closing_the_pool_ends_its_connections_and_their_streams() -> anyhow::Result<()> {
    let (server, _stop) = hbone_server().await?;
    let app = echo_app().await?;
    let pool = HbonePool::new(TcpDialer, Duration::from_secs(30));
    let mut tunnel = open(&pool, server, &app.to_string()).await?;
    assert_eq!((pool.connections(), pool.dial_locks()), (1, 1));
    assert_eq!(pool.close(), 1);
    assert_eq!((pool.connections(), pool.dial_locks()), (0, 0));
    // The open stream ends with its connection instead of waiting on it.
    let ended = tokio::time::timeout(Duration::from_secs(10), tunnel.recv.data()).await?;
    assert!(
        !matches!(ended, Some(Ok(_))),
        "a stream of a closed connection still delivered data"
    );
    Ok(())
}

#[tokio::test]
async fn a_lost_connection_resets_a_quiet_client_whose_response_ended() -> anyhow::Result<()> {
    let (server, _stop) = hbone_server().await?;
    // The app answers at once, half-closes, and waits for the client.
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let app = listener.local_addr()?;
    tokio::spawn(async move {
        if let Ok((mut stream, _)) = listener.accept().await {
            let _ = stream.write_all(b"done").await;
            let _ = stream.shutdown().await;
            let mut sink = [0u8; 64];
            while matches!(stream.read(&mut sink).await, Ok(n) if n > 0) {}
        }
    });
    let pool = HbonePool::new(TcpDialer, Duration::from_secs(30));
    let tunnel = open(&pool, server, &app.to_string()).await?;
    let (mut client, engine) = tcp_pair().await?;
    let relay_task = tokio::spawn(relay(engine, tunnel.send, tunnel.recv, Default::default()));
    // The whole response, then the server's FIN; the client sends nothing
    // and keeps its side open.
    let mut response = Vec::new();
    client.read_to_end(&mut response).await?;
    assert_eq!(response, b"done");
    // The tunnel's connection is lost: with nothing to read from the
    // client, the relay must still notice and reset the client.
    assert_eq!(pool.close(), 1);
    let ended = tokio::time::timeout(Duration::from_secs(10), relay_task).await;
    let Ok(ended) = ended else {
        anyhow::bail!("the relay waited on its quiet client after the tunnel was lost");
    };
    assert!(
        matches!(ended?, Err(TunnelRelayError::Stream { .. })),
        "the relay did not end with the stream's failure"
    );
    // The client (in CLOSE_WAIT) learns of the reset as EPIPE.
    assert!(client.take_error()?.is_some(), "the client was not reset");
    Ok(())
}

#[tokio::test]
async fn a_client_reset_after_its_half_close_reaches_the_waiting_app() -> anyhow::Result<()> {
    let (server, _stop) = hbone_server().await?;
    // The app reads the request to its end, then holds the connection
    // without answering; the test gets its socket back.
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let app = listener.local_addr()?;
    let (got_request, request_read) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        if let Ok((mut stream, _)) = listener.accept().await {
            let mut request = Vec::new();
            let _ = stream.read_to_end(&mut request).await;
            let _ = got_request.send((request, stream));
        }
    });
    let pool = HbonePool::new(TcpDialer, Duration::from_secs(30));
    let tunnel = open(&pool, server, &app.to_string()).await?;
    let (mut client, engine) = tcp_pair().await?;
    let relay_task = tokio::spawn(relay(engine, tunnel.send, tunnel.recv, Default::default()));
    client.write_all(b"request").await?;
    client.shutdown().await?;
    let (request, app_side) = tokio::time::timeout(Duration::from_secs(10), request_read).await??;
    assert_eq!(request, b"request");
    // The client gives up waiting for the reply: it resets.
    socket2::SockRef::from(&client).set_linger(Some(Duration::ZERO))?;
    drop(client);
    let ended = tokio::time::timeout(Duration::from_secs(10), relay_task).await;
    let Ok(ended) = ended else {
        anyhow::bail!("the relay did not notice its half-closed client's reset");
    };
    assert!(
        matches!(ended?, Err(TunnelRelayError::Tcp { .. })),
        "the relay did not end with the client's failure"
    );
    // The app, still holding its side, is reset through the tunnel.
    let reset = tokio::time::timeout(
        Duration::from_secs(10),
        app_side.ready(tokio::io::Interest::ERROR),
    )
    .await;
    assert!(reset.is_ok(), "the app was not reset");
    assert!(app_side.take_error()?.is_some(), "the app was not reset");
    Ok(())
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

#[tokio::test]
async fn malformed_and_oversized_headers_do_not_hurt_the_server() -> anyhow::Result<()> {
    let (server, _stop) = hbone_server().await?;

    // Garbage where an HPACK block should be.
    let mut garbage = PREFACE.to_vec();
    garbage.extend(frame(SETTINGS, 0, 0, &[]));
    garbage.extend(frame(HEADERS, END_HEADERS, 1, &[0xff; 512]));

    // A valid HPACK literal whose value is 100 kB, four times the header
    // list the server accepts, split over CONTINUATION frames.
    let mut block = vec![0x00, 0x01, b'x', 0x7f, 0xa1, 0x8c, 0x06];
    block.extend(std::iter::repeat_n(b'a', 100_000));
    let mut oversized = PREFACE.to_vec();
    oversized.extend(frame(SETTINGS, 0, 0, &[]));
    let chunks: Vec<&[u8]> = block.chunks(16_384).collect();
    for (i, chunk) in chunks.iter().enumerate() {
        let kind = if i == 0 { HEADERS } else { CONTINUATION };
        let flags = if i + 1 == chunks.len() {
            END_HEADERS
        } else {
            0
        };
        oversized.extend(frame(kind, flags, 1, chunk));
    }

    for attack in [garbage, oversized] {
        let mut stream = TcpStream::connect(server).await?;
        let _ = stream.write_all(&attack).await;
        // Collect the server's frames until it closes or goes quiet.
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        while let Ok(Ok(n)) =
            tokio::time::timeout(Duration::from_secs(2), stream.read(&mut buf)).await
        {
            if n == 0 {
                break;
            }
            got.extend_from_slice(&buf[..n]);
        }
        assert!(
            refused_stream_one(&got),
            "no GOAWAY, RST_STREAM or error response for the bad request"
        );
    }
    let app = echo_app().await?;
    let pool = HbonePool::new(TcpDialer, Duration::from_secs(30));
    assert!(
        open(&pool, server, &app.to_string()).await.is_ok(),
        "server still serves"
    );
    Ok(())
}
