//! What the server refuses, and with which status: denied or unknown
//! destinations, methods other than CONNECT, and garbage, HTTP/1 or
//! malformed and oversized headers, none of which hurt it.

use super::*;

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
