//! The client pool's connections: shared under the stream bound, a stream
//! refused by a draining peer retried on a new connection, idle ones
//! evicted, all ended when the pool closes.

use super::*;

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
