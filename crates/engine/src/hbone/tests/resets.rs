//! Resets cross the tunnel: an app's reset reaches the client, a lost
//! connection resets a quiet client, and a client's reset after its
//! half-close reaches the waiting app.

use super::*;

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
