//! How the pool spreads streams over connections to one key: real HTTP/2
//! over loopback TCP against the HBONE server, tunnels held open.

use std::sync::atomic::{AtomicUsize, Ordering};

use super::*;

fn spread(max_connections: usize) -> PoolSpread {
    PoolSpread {
        busy_streams: 2,
        max_connections,
        ..PoolSpread::default()
    }
}

#[tokio::test]
async fn busy_connections_spread_up_to_the_bound() -> anyhow::Result<()> {
    let (server, _stop) = hbone_server().await?;
    let app = echo_app().await?;
    let pool = HbonePool::with_spread(TcpDialer, Duration::from_secs(30), spread(4));
    let mut tunnels = Vec::new();
    let mut connections = Vec::new();
    for _ in 0..10 {
        tunnels.push(open(&pool, server, &app.to_string()).await?);
        connections.push(pool.connections());
    }
    // Two open streams make a connection busy: the third stream dials
    // another, and so on up to four; then the least-loaded takes more.
    assert_eq!(connections, [1, 1, 2, 2, 3, 3, 4, 4, 4, 4]);
    assert_eq!(pool.load(&key(server)), [3, 3, 2, 2]);
    assert_eq!(pool.dials(), 4);
    Ok(())
}

#[tokio::test]
async fn new_streams_go_to_the_least_loaded_connection() -> anyhow::Result<()> {
    let (server, _stop) = hbone_server().await?;
    let app = echo_app().await?;
    let pool = HbonePool::with_spread(TcpDialer, Duration::from_secs(30), spread(2));
    let mut tunnels = Vec::new();
    for _ in 0..4 {
        tunnels.push(open(&pool, server, &app.to_string()).await?);
    }
    assert_eq!(pool.load(&key(server)), [2, 2]);
    // The first two tunnels went to the first connection; they end.
    tunnels.drain(..2);
    assert_eq!(pool.load(&key(server)), [0, 2]);
    tunnels.push(open(&pool, server, &app.to_string()).await?);
    assert_eq!(pool.load(&key(server)), [1, 2]);
    tunnels.push(open(&pool, server, &app.to_string()).await?);
    tunnels.push(open(&pool, server, &app.to_string()).await?);
    assert_eq!(pool.load(&key(server)), [3, 2]);
    assert_eq!(
        pool.dials(),
        2,
        "the bound holds once every connection is busy"
    );
    Ok(())
}

/// Dials over TCP, counting dials in flight at once.
#[derive(Default)]
struct CountingDialer {
    in_flight: Arc<AtomicUsize>,
    peak: Arc<AtomicUsize>,
}

impl Dialer for CountingDialer {
    type Io = TcpStream;
    fn dial(
        &self,
        key: &PoolKey,
    ) -> Pin<Box<dyn Future<Output = std::io::Result<TcpStream>> + Send>> {
        let addr = key.dst_addr;
        let in_flight = Arc::clone(&self.in_flight);
        let peak = Arc::clone(&self.peak);
        Box::pin(async move {
            let now = in_flight.fetch_add(1, Ordering::SeqCst) + 1;
            peak.fetch_max(now, Ordering::SeqCst);
            // Widens the window in which a herd of dials would overlap.
            tokio::time::sleep(Duration::from_millis(5)).await;
            let stream = TcpStream::connect(addr).await;
            in_flight.fetch_sub(1, Ordering::SeqCst);
            stream
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_tunnels_at_once_dial_one_at_a_time_up_to_the_bound() -> anyhow::Result<()> {
    let (server, _stop) = hbone_server().await?;
    let app = echo_app().await?;
    let dialer = CountingDialer::default();
    let peak = Arc::clone(&dialer.peak);
    let pool = HbonePool::with_spread(dialer, Duration::from_secs(30), spread(4));
    let mut opens = tokio::task::JoinSet::new();
    for _ in 0..50 {
        let pool = Arc::clone(&pool);
        opens.spawn(async move { open(&pool, server, &app.to_string()).await });
    }
    let mut tunnels = Vec::new();
    while let Some(joined) = opens.join_next().await {
        tunnels.push(joined??);
    }
    assert_eq!(tunnels.len(), 50);
    assert_eq!(peak.load(Ordering::SeqCst), 1, "one dial in flight per key");
    assert_eq!(pool.dials(), 4);
    let load = pool.load(&key(server));
    assert_eq!(load.iter().sum::<usize>(), 50);
    assert!(
        load.iter().all(|&n| n >= 2),
        "no connection idles while another carries more: {load:?}"
    );
    Ok(())
}

/// Dials `good` once, then a port nobody listens on.
struct OnceDialer {
    good: SocketAddr,
    refused: SocketAddr,
    dialled: AtomicUsize,
}

impl Dialer for OnceDialer {
    type Io = TcpStream;
    fn dial(
        &self,
        _key: &PoolKey,
    ) -> Pin<Box<dyn Future<Output = std::io::Result<TcpStream>> + Send>> {
        let addr = if self.dialled.fetch_add(1, Ordering::SeqCst) == 0 {
            self.good
        } else {
            self.refused
        };
        Box::pin(async move { TcpStream::connect(addr).await })
    }
}

#[tokio::test]
async fn a_failed_spreading_dial_shares_a_busy_connection() -> anyhow::Result<()> {
    let (server, _stop) = hbone_server().await?;
    let app = echo_app().await?;
    let refused = TcpListener::bind("127.0.0.1:0").await?.local_addr()?;
    let dialer = OnceDialer {
        good: server,
        refused,
        dialled: AtomicUsize::new(0),
    };
    let pool = HbonePool::with_spread(dialer, Duration::from_secs(30), spread(4));
    let mut tunnels = Vec::new();
    for _ in 0..4 {
        tunnels.push(open(&pool, server, &app.to_string()).await?);
    }
    assert_eq!(pool.load(&key(server)), [4]);
    assert!(pool.dials() >= 2, "spreading was tried");
    Ok(())
}
