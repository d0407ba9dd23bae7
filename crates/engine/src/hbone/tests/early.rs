//! The client's first bytes go with the CONNECT request, not a round trip
//! after its response: against a bare HTTP/2 server that answers only once
//! they arrived (a client waiting for the response first would never be
//! answered), through a stream retried on a new connection, and through
//! the HBONE server to an app.

use bytes::Bytes;
use tokio::sync::mpsc;

use super::*;

/// How long a test waits for what must happen before it fails.
const BOUND: Duration = Duration::from_secs(10);

/// What a bare server does with the first stream of its `n`th connection
/// (from 0).
#[derive(Clone, Copy)]
enum Answer {
    /// Refuses it without processing it (`REFUSED_STREAM`).
    Refuse,
    /// Waits for its first data, reports it, then answers 200.
    AfterData,
}

/// A bare HTTP/2 server on loopback: the first stream of connection `n`
/// is answered as `answer(n)` says; the data it waited for is sent on the
/// returned channel.
async fn bare_server(
    answer: impl Fn(usize) -> Answer + Send + 'static,
) -> std::io::Result<(SocketAddr, mpsc::UnboundedReceiver<Bytes>)> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let (seen_tx, seen) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut accepted = 0;
        while let Ok((tcp, _)) = listener.accept().await {
            let answer = answer(accepted);
            accepted += 1;
            let seen_tx = seen_tx.clone();
            tokio::spawn(async move {
                let Ok(mut conn) = h2::server::handshake(tcp).await else {
                    return;
                };
                let Some(Ok((request, mut respond))) = conn.accept().await else {
                    return;
                };
                // The connection is driven beside the stream.
                tokio::spawn(async move { while conn.accept().await.is_some() {} });
                match answer {
                    Answer::Refuse => respond.send_reset(h2::Reason::REFUSED_STREAM),
                    Answer::AfterData => {
                        let mut body = request.into_body();
                        let Some(Ok(data)) = body.data().await else {
                            return;
                        };
                        let _ = seen_tx.send(data);
                        let response = http::Response::new(());
                        let Ok(_send) = respond.send_response(response, false) else {
                            return;
                        };
                        // Held until the client is done.
                        let _ = body.data().await;
                    }
                }
            });
        }
    });
    Ok((addr, seen))
}

/// [`open_with`], bounded by [`BOUND`].
async fn open_early(
    pool: &Arc<HbonePool<TcpDialer>>,
    server: SocketAddr,
    authority: &str,
    early: &Bytes,
) -> anyhow::Result<Tunnel> {
    let opening = open_with(pool, server, authority, early);
    Ok(tokio::time::timeout(BOUND, opening).await??)
}

#[tokio::test]
async fn the_first_bytes_reach_the_server_before_its_response() -> anyhow::Result<()> {
    let (server, mut seen) = bare_server(|_| Answer::AfterData).await?;
    let pool = HbonePool::new(TcpDialer, Duration::from_secs(30));
    let early = Bytes::from_static(b"GET / HTTP/1.1\r\n\r\n");
    let _tunnel = open_early(&pool, server, "10.0.0.1:80", &early).await?;
    assert_eq!(seen.recv().await, Some(early));
    Ok(())
}

#[tokio::test]
async fn a_refused_stream_is_retried_with_its_first_bytes() -> anyhow::Result<()> {
    let (server, mut seen) = bare_server(|n| {
        if n == 0 {
            Answer::Refuse
        } else {
            Answer::AfterData
        }
    })
    .await?;
    let pool = HbonePool::new(TcpDialer, Duration::from_secs(30));
    let early = Bytes::from_static(b"hello");
    let _tunnel = open_early(&pool, server, "10.0.0.1:80", &early).await?;
    assert_eq!(
        pool.dials(),
        2,
        "the refused stream went to a new connection"
    );
    assert_eq!(seen.recv().await, Some(early));
    Ok(())
}

#[tokio::test]
async fn early_and_later_bytes_reach_the_app_in_order_and_are_counted() -> anyhow::Result<()> {
    let (server, _stop) = hbone_server().await?;
    let app = echo_app().await?;
    let pool = HbonePool::new(TcpDialer, Duration::from_secs(30));
    let early = Bytes::from_static(b"first;");
    let tunnel = open_early(&pool, server, &app.to_string(), &early).await?;
    let (mut client, engine) = tcp_pair().await?;
    let relay = relay(engine, tunnel.send, tunnel.recv, Default::default()).sent_before(6);
    let relay = tokio::spawn(relay);
    client.write_all(b"then").await?;
    client.shutdown().await?;
    let mut reply = Vec::new();
    tokio::time::timeout(BOUND, client.read_to_end(&mut reply)).await??;
    assert_eq!(reply, b"first;then");
    let transferred = tokio::time::timeout(BOUND, relay).await???;
    assert_eq!((transferred.sent, transferred.received), (10, 10));
    Ok(())
}
