//! What a tunnel carries: sixteen mebibytes both ways with half-close, a
//! hostname authority resolved by the server, and the destination in the
//! 200's baggage.

use super::*;

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
