//! The HBONE server handing streams to a workload with an application
//! tunnel (a sandwiched waypoint): on its tunnel port, a PROXY header
//! first naming what the client asked for (an address, even another
//! workload's; for a hostname the VIP the lookup gives), the client's bytes
//! after it; a hostname without a VIP is refused as ztunnel refuses it.

use super::*;
use crate::config::{AppTunnelProtocol, ApplicationTunnel};
use crate::hbone::app_tunnel::LocalTunnel;

/// The VIP the test's lookup gives `echo.local`.
const VIP: [u8; 4] = [10, 96, 0, 10];

/// An app on loopback and an HBONE server whose workload takes its
/// tunnels as PROXY on that app's port; `echo.local` has [`VIP`] unless
/// `vip` is false. The server drains once the returned sender goes.
async fn proxy_world(vip: bool) -> std::io::Result<(SocketAddr, TcpListener, watch::Sender<bool>)> {
    let app = TcpListener::bind("127.0.0.1:0").await?;
    let tunnel = ApplicationTunnel {
        protocol: AppTunnelProtocol::Proxy,
        port: Some(app.local_addr()?.port()),
    };
    let lookup: AppTunnelLookup = Arc::new(move |authority, _local| {
        let asked = match authority {
            head::Authority::Addr(addr) => Some(*addr),
            head::Authority::Host { port, .. } => vip.then(|| SocketAddr::new(VIP.into(), *port)),
        };
        Some(LocalTunnel {
            tunnel,
            asked,
            localhost: true,
        })
    });
    let (stop, shutdown) = watch::channel(false);
    let server = hbone_server_serving(
        move |_| shutdown.clone(),
        wire::H2Settings::default(),
        lookup,
    )
    .await?;
    Ok((server, app, stop))
}

/// Sends `ping` through a tunnel to `authority` and returns what the app
/// read: the header's destination, whether it names the client's identity,
/// and the bytes after it.
async fn through(
    server: SocketAddr,
    app: &TcpListener,
    authority: &str,
) -> anyhow::Result<(SocketAddr, bool, Vec<u8>)> {
    let pool = HbonePool::new(TcpDialer, Duration::from_secs(30));
    let tunnel = open(&pool, server, authority).await?;
    let (mut client, engine) = tcp_pair().await?;
    tokio::spawn(relay(engine, tunnel.send, tunnel.recv, Default::default()));
    client.write_all(b"ping").await?;
    client.shutdown().await?;
    let (mut accepted, _) = tokio::time::timeout(Duration::from_secs(10), app.accept()).await??;
    let mut got = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), accepted.read_to_end(&mut got)).await??;
    anyhow::ensure!(
        got.len() >= 28 && got[12..14] == [0x21, 0x11],
        "no IPv4 PROXY header: {got:02x?}"
    );
    let length = 16 + usize::from(u16::from_be_bytes([got[14], got[15]]));
    let ip = std::net::Ipv4Addr::new(got[20], got[21], got[22], got[23]);
    let destination = SocketAddr::new(ip.into(), u16::from_be_bytes([got[26], got[27]]));
    let header = got.get(..length).unwrap_or_default();
    let uri = client_identity().to_uri();
    let names_client = header.windows(uri.len()).any(|w| w == uri.as_bytes());
    Ok((
        destination,
        names_client,
        got.get(length..).unwrap_or_default().to_vec(),
    ))
}

#[tokio::test]
async fn a_hostname_is_named_by_its_vip_and_another_address_as_asked() -> anyhow::Result<()> {
    let (server, app, _stop) = proxy_world(true).await?;
    let (destination, names_client, rest) = through(server, &app, "echo.local:9000").await?;
    assert_eq!(destination, SocketAddr::new(VIP.into(), 9000));
    assert!(names_client);
    assert_eq!(rest, b"ping");
    // The workload behind the waypoint, at an address not the server's.
    let (destination, _, rest) = through(server, &app, "10.1.0.9:8080").await?;
    assert_eq!(destination, "10.1.0.9:8080".parse()?);
    assert_eq!(rest, b"ping");
    Ok(())
}

#[tokio::test]
async fn a_hostname_without_a_vip_is_refused() -> anyhow::Result<()> {
    let (server, _app, _stop) = proxy_world(false).await?;
    let pool = HbonePool::new(TcpDialer, Duration::from_secs(30));
    match open(&pool, server, "echo.local:9000").await {
        Err(PoolError::Refused { status, .. }) => {
            assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        }
        other => anyhow::bail!("not refused: {:?}", other.map(|_| ())),
    }
    Ok(())
}
