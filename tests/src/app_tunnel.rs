//! The world of the application-tunnel tests (`tests/app_tunnel.rs`): a
//! sandwiched waypoint taking its tunnels as PROXY on its own port, a
//! workload behind it, one without a tunnel, and what each must get from
//! a client on the other node, as ztunnel delivers it (`src/proxy/
//! inbound.rs` `serve_connect`, `find_inbound_upstream`; `src/proxy.rs`
//! `write_proxy_protocol`). Shared by the tests of our engine (from the
//! file and from the test istiod) and of a stock ztunnel.

use std::net::{IpAddr, SocketAddr, TcpListener};
use std::time::Duration;

use dataplane_user::config::{AppTunnelProtocol, ApplicationTunnel, LocalConfig, Waypoint};

use crate::{
    Responder,
    mesh::{NAMESPACE, TwoNodes, addr, hbone_workload},
    proxy_protocol::{self, PEER_IDENTITY_TLV, ProxyHeader},
    topology::Pod,
    traffic::{echo, echo_server},
};

/// The waypoint's PROXY port (Istio's waypoints listen there for it).
pub const TUNNEL_PORT: u16 = 15088;
/// The port the clients ask for.
pub const APP_PORT: u16 = 9000;
/// Hang guard for a request the server should already have (not timing).
const LIMIT: Duration = Duration::from_secs(20);

/// A stand-in for a waypoint's PROXY listener on loopback `bind` in `pod`:
/// reads each connection to its end, echoes what follows a well-formed
/// header (nothing when the header is not one, so the client's echo check
/// fails) and keeps the request for the test.
fn proxy_echo(pod: &Pod, bind: SocketAddr) -> anyhow::Result<Responder> {
    let listener = pod.netns.run(move || TcpListener::bind(bind))??;
    Responder::start(listener, |request| {
        proxy_protocol::parse(&request.body).map_or_else(|_| Vec::new(), |(_, rest)| rest.to_vec())
    })
}

/// The header of the next connection `server` got, and how many bytes
/// followed it.
fn next_header(server: &Responder, what: &str) -> anyhow::Result<(ProxyHeader, usize)> {
    let request = server
        .next_request(LIMIT)
        .ok_or_else(|| anyhow::anyhow!("{what}: the tunnel listener got no connection"))?;
    let (header, rest) = proxy_protocol::parse(&request.body)
        .map_err(|err| err.context(format!("{what}: no PROXY header first")))?;
    Ok((header, rest.len()))
}

/// The world's mesh: `wp` (on node2) is a waypoint taking its tunnels as
/// PROXY on [`TUNNEL_PORT`], `local` (on node1) is behind it, `remote` (on
/// node2) has no application tunnel.
pub fn mesh(w: &TwoNodes, wp: &Pod) -> LocalConfig {
    let mut config = w.mesh_config();
    for workload in &mut config.workloads {
        let workload = std::sync::Arc::make_mut(workload);
        if workload.name == "local" {
            workload.waypoint = Some(Box::new(Waypoint {
                address: Some(wp.ip4.into()),
                network: None,
                hostname: None,
                hbone_port: 15008,
            }));
        }
    }
    let mut waypoint = hbone_workload(wp, "waypoint", "node2");
    waypoint.application_tunnel = Some(ApplicationTunnel {
        protocol: AppTunnelProtocol::Proxy,
        port: Some(TUNNEL_PORT),
    });
    config.workloads.push(waypoint.into());
    config
}

/// What each workload gets from the client, with the agents serving
/// [`mesh`].
pub fn deliveries_are_ztunnels(w: &TwoNodes, wp: &Pod) -> anyhow::Result<()> {
    let tunnel4 = proxy_echo(wp, SocketAddr::from(([127, 0, 0, 1], TUNNEL_PORT)))?;
    let tunnel6 = proxy_echo(wp, SocketAddr::new("::1".parse()?, TUNNEL_PORT))?;
    // The port the clients ask for, on the waypoint and on the workload
    // behind it: neither may see a tunnel the waypoint takes.
    let asked_on_waypoint = echo_server(wp, APP_PORT)?;
    let behind = echo_server(&w.local, APP_PORT)?;
    let without_tunnel = echo_server(&w.remote, APP_PORT)?;
    let client_id = format!("spiffe://cluster.local/ns/{NAMESPACE}/sa/client");

    // To the waypoint's own address, IPv4: the client (the HBONE
    // connection's source, in the client pod), the destination asked for,
    // its identity; then exactly its bytes, both ways.
    echo(&w.client, addr(wp, APP_PORT), 50_000, 1)?;
    let (header, payload) = next_header(&tunnel4, "to the waypoint, IPv4")?;
    assert_eq!(header.source.ip(), IpAddr::from(w.client.ip4));
    assert_ne!(header.source.port(), 0);
    assert_eq!(header.destination, addr(wp, APP_PORT));
    assert_eq!(header.tlv_text(PEER_IDENTITY_TLV), Some(client_id.clone()));
    assert_eq!(header.tlvs.len(), 1, "only the identity: {header:?}");
    assert_eq!(payload, 50_000);

    // IPv6: over ::1, with IPv6 addresses.
    let wp6 = SocketAddr::new(wp.ip6.into(), APP_PORT);
    echo(&w.client, wp6, 3_000, 2)?;
    let (header, payload) = next_header(&tunnel6, "to the waypoint, IPv6")?;
    assert_eq!(header.source.ip(), IpAddr::from(w.client.ip6));
    assert_eq!(header.destination, wp6);
    assert_eq!(header.tlv_text(PEER_IDENTITY_TLV), Some(client_id.clone()));
    assert_eq!(payload, 3_000);

    // The sandwich: the client's node sends `local`'s connection to its
    // waypoint with `local` as the authority; the waypoint is told so.
    echo(&w.client, addr(&w.local, APP_PORT), 10_000, 3)?;
    let (header, payload) = next_header(&tunnel4, "through the waypoint")?;
    assert_eq!(header.source.ip(), IpAddr::from(w.client.ip4));
    assert_eq!(header.destination, addr(&w.local, APP_PORT));
    assert_eq!(header.tlv_text(PEER_IDENTITY_TLV), Some(client_id));
    assert_eq!(payload, 10_000);

    // A workload without an application tunnel: the client's bytes alone.
    echo(&w.client, addr(&w.remote, APP_PORT), 10_000, 4)?;
    let got = without_tunnel
        .next_request(LIMIT)
        .ok_or_else(|| anyhow::anyhow!("remote got no connection"))?;
    assert_eq!(got.body.len(), 10_000, "bytes before the client's");
    assert!(!got.body.starts_with(&proxy_protocol::SIGNATURE[..4]));

    assert!(tunnel4.drain().is_empty() && tunnel6.drain().is_empty());
    assert!(
        asked_on_waypoint.drain().is_empty(),
        "a tunnel reached the waypoint's asked port instead of its tunnel port"
    );
    assert!(
        behind.drain().is_empty(),
        "the waypoint's traffic went around it"
    );
    Ok(())
}
