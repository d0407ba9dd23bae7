//! The HTTP/2 and pool settings ztunnel exposes as knobs, seen from the
//! other end of real loopback sockets: the SETTINGS and WINDOW_UPDATE
//! frames a peer receives, the connections a pool dials past its
//! streams-per-connection cap, and an idle connection's close.

use tokio::sync::mpsc;

use super::*;

/// Settings unlike the defaults in every field.
fn tuned() -> wire::H2Settings {
    wire::H2Settings {
        stream_window: 1024 * 1024,
        connection_window: 3 * 1024 * 1024,
        max_frame: 32 * 1024,
    }
}

/// What one end announced: its SETTINGS values by identifier, and the
/// connection-level WINDOW_UPDATE increment that followed (0 if none).
#[derive(Debug, Default)]
struct Announced {
    settings: std::collections::HashMap<u16, u32>,
    connection_increment: u32,
}

impl Announced {
    /// The receive settings these frames announce (the connection window
    /// is the initial 65535 plus the increment).
    fn h2(&self) -> wire::H2Settings {
        wire::H2Settings {
            stream_window: self.settings.get(&0x4).copied().unwrap_or(65_535),
            connection_window: 65_535 + self.connection_increment,
            max_frame: self.settings.get(&0x5).copied().unwrap_or(16_384),
        }
    }
}

/// Reads frames from `io` until the first non-ACK SETTINGS and a
/// connection-level WINDOW_UPDATE were both seen (or 2 s passed).
async fn read_announced(io: &mut TcpStream) -> anyhow::Result<Announced> {
    let mut announced = Announced::default();
    let mut seen_settings = false;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
    while !(seen_settings && announced.connection_increment > 0) {
        let mut head = [0u8; 9];
        tokio::time::timeout_at(deadline, io.read_exact(&mut head)).await??;
        let len = (usize::from(head[0]) << 16) | (usize::from(head[1]) << 8) | usize::from(head[2]);
        let stream = u32::from_be_bytes([head[5] & 0x7f, head[6], head[7], head[8]]);
        let mut payload = vec![0u8; len];
        tokio::time::timeout_at(deadline, io.read_exact(&mut payload)).await??;
        match head[3] {
            SETTINGS if head[4] & 0x1 == 0 => {
                seen_settings = true;
                for entry in payload.chunks_exact(6) {
                    let id = u16::from_be_bytes([entry[0], entry[1]]);
                    let value = u32::from_be_bytes([entry[2], entry[3], entry[4], entry[5]]);
                    announced.settings.insert(id, value);
                }
            }
            WINDOW_UPDATE if stream == 0 && payload.len() == 4 => {
                announced.connection_increment =
                    u32::from_be_bytes([payload[0] & 0x7f, payload[1], payload[2], payload[3]]);
            }
            _ => {}
        }
    }
    Ok(announced)
}

const WINDOW_UPDATE: u8 = 0x8;

#[tokio::test]
async fn the_pool_announces_its_windows_and_frame_size() -> anyhow::Result<()> {
    for h2 in [wire::H2Settings::default(), tuned()] {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let server = listener.local_addr()?;
        let pool = HbonePool::with_settings(
            TcpDialer,
            Duration::from_secs(30),
            PoolSpread::default(),
            h2,
        );
        // The dial never completes (no server SETTINGS): the peer only reads.
        let dialing = tokio::spawn(async move { open(&pool, server, "echo.local:1").await });
        let (mut peer, _) = listener.accept().await?;
        let mut preface = [0u8; 24];
        peer.read_exact(&mut preface).await?;
        assert_eq!(preface, PREFACE);
        let announced = read_announced(&mut peer).await?;
        assert_eq!(announced.h2(), h2, "{announced:?}");
        dialing.abort();
    }
    Ok(())
}

#[tokio::test]
async fn the_server_announces_its_windows_and_frame_size() -> anyhow::Result<()> {
    for h2 in [wire::H2Settings::default(), tuned()] {
        let (_stop, shutdown) = watch::channel(false);
        let server = hbone_server_announcing(move |_| shutdown.clone(), h2).await?;
        let mut client = TcpStream::connect(server).await?;
        client.write_all(PREFACE).await?;
        client.write_all(&frame(SETTINGS, 0, 0, &[])).await?;
        let announced = read_announced(&mut client).await?;
        assert_eq!(announced.h2(), h2, "{announced:?}");
    }
    Ok(())
}

#[tokio::test]
async fn a_full_connection_makes_the_pool_dial_another() -> anyhow::Result<()> {
    let (server, _stop) = hbone_server().await?;
    let app = echo_app().await?;
    // One connection to spread over, and no busy threshold below the cap:
    // only the streams-per-connection cap can make a second connection.
    let capped = PoolSpread {
        busy_streams: 100,
        max_connections: 1,
        max_streams: 2,
    };
    let pool = HbonePool::with_spread(TcpDialer, Duration::from_secs(30), capped);
    let mut tunnels = Vec::new();
    let mut connections = Vec::new();
    for _ in 0..5 {
        tunnels.push(open(&pool, server, &app.to_string()).await?);
        connections.push(pool.connections());
    }
    assert_eq!(connections, [1, 1, 2, 2, 3]);
    assert_eq!(pool.load(&key(server)), [2, 2, 1]);
    Ok(())
}

/// A TCP relay in front of `server` that sends on the channel when a
/// client's connection through it ends (the client closed it).
async fn watched_relay(server: SocketAddr) -> std::io::Result<(SocketAddr, mpsc::Receiver<()>)> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let (ended_tx, ended) = mpsc::channel(8);
    tokio::spawn(async move {
        while let Ok((mut client, _)) = listener.accept().await {
            let ended_tx = ended_tx.clone();
            tokio::spawn(async move {
                let Ok(mut upstream) = TcpStream::connect(server).await else {
                    return;
                };
                let (mut from_client, mut to_client) = client.split();
                let (mut from_server, mut to_server) = upstream.split();
                let up = async {
                    let _ = tokio::io::copy(&mut from_client, &mut to_server).await;
                    let _ = ended_tx.send(()).await;
                    let _ = to_server.shutdown().await;
                };
                let down = tokio::io::copy(&mut from_server, &mut to_client);
                let _ = tokio::join!(up, down);
            });
        }
    });
    Ok((addr, ended))
}

#[tokio::test]
async fn an_idle_pooled_connection_is_closed_after_the_idle_time() -> anyhow::Result<()> {
    let (server, _stop) = hbone_server().await?;
    let (relay, mut ended) = watched_relay(server).await?;
    let app = echo_app().await?;
    // Long enough that nothing between the stream's end and the first
    // eviction below can take it (a margin, not a measured time).
    let idle = Duration::from_secs(2);
    let pool = HbonePool::with_spread(TcpDialer, idle, PoolSpread::default());
    drop(open(&pool, relay, &app.to_string()).await?);
    // The stream ended; its connection stays pooled for the next one: an
    // eviction now keeps it.
    assert_eq!(pool.evict_idle(), 0, "evicted before the idle time");
    assert_eq!(pool.connections(), 1);
    // Once idle for the idle time, the pool's eviction drops it and the
    // client's side of the connection closes.
    let eviction = tokio::spawn(pool.eviction());
    tokio::time::timeout(Duration::from_secs(10), ended.recv())
        .await?
        .ok_or_else(|| anyhow::anyhow!("the relay stopped"))?;
    assert_eq!(pool.connections(), 0);
    eviction.abort();
    Ok(())
}
