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
    mesh::{NAMESPACE, TwoNodes, addr, endpoint_of, hbone_workload, service},
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

/// What the waypoint gets when its node's agent runs with
/// `--localhost-app-tunnel false` (ztunnel's `LOCALHOST_APP_TUNNEL=false`,
/// `src/proxy/inbound.rs` `serve_connect`: not `localhost_tunnel`, so the
/// upstream is `find_inbound_upstream`'s address, the pod's own with the
/// tunnel port): its tunnel listener is on its pod address alone, and
/// still gets each tunnel behind the PROXY header, from outside loopback.
pub fn pod_address_deliveries(w: &TwoNodes, wp: &Pod) -> anyhow::Result<()> {
    let tunnel = proxy_echo(wp, SocketAddr::new(wp.ip4.into(), TUNNEL_PORT))?;
    let client_id = format!("spiffe://cluster.local/ns/{NAMESPACE}/sa/client");
    for (n, asked, what) in [
        (1, addr(wp, APP_PORT), "to the waypoint"),
        (2, addr(&w.local, APP_PORT), "through the waypoint"),
    ] {
        echo(&w.client, asked, 20_000, n)?;
        let request = tunnel
            .next_request(LIMIT)
            .ok_or_else(|| anyhow::anyhow!("{what}: the tunnel listener got no connection"))?;
        assert!(
            !request.peer.ip().is_loopback(),
            "{what}: delivered from {}",
            request.peer
        );
        let (header, rest) = proxy_protocol::parse(&request.body)
            .map_err(|err| err.context(format!("{what}: no PROXY header first")))?;
        assert_eq!(header.source.ip(), IpAddr::from(w.client.ip4), "{what}");
        assert_eq!(header.destination, asked, "{what}");
        assert_eq!(
            header.tlv_text(PEER_IDENTITY_TLV),
            Some(client_id.clone()),
            "{what}"
        );
        assert_eq!(rest.len(), 20_000, "{what}");
    }
    assert!(tunnel.drain().is_empty());
    Ok(())
}

/// [`mesh`] with a waypoint that takes its tunnels like any workload (no
/// application tunnel): ztunnel's sandwich case without a tunnel.
pub fn mesh_without_tunnel(w: &TwoNodes, wp: &Pod) -> LocalConfig {
    let mut config = mesh(w, wp);
    for workload in &mut config.workloads {
        let workload = std::sync::Arc::make_mut(workload);
        if workload.name == "waypoint" {
            workload.application_tunnel = None;
        }
    }
    config
}

/// With [`mesh_without_tunnel`]: `local`'s connection reaches its
/// waypoint as a tunnel whose authority is `local`, and the waypoint's node
/// delivers it to the waypoint at the asked port (ztunnel `src/proxy/
/// inbound.rs` `validate_destination`: the authority's workload names this
/// workload as its waypoint; `find_inbound_upstream`: the local workload's
/// address with the authority's port), never around it to `local`.
pub fn waypoint_without_tunnel_gets_what_it_fronts(w: &TwoNodes, wp: &Pod) -> anyhow::Result<()> {
    let on_waypoint = echo_server(wp, APP_PORT)?;
    let behind = echo_server(&w.local, APP_PORT)?;
    echo(&w.client, addr(&w.local, APP_PORT), 10_000, 1)?;
    let got = on_waypoint
        .next_request(LIMIT)
        .ok_or_else(|| anyhow::anyhow!("the waypoint got no connection"))?;
    assert_eq!(got.body.len(), 10_000, "bytes before the client's");
    // The echo server is dual-stack: IPv4 is seen mapped.
    let local = SocketAddr::new(got.local.ip().to_canonical(), got.local.port());
    assert_eq!(local, addr(wp, APP_PORT));
    assert!(
        behind.drain().is_empty(),
        "the waypoint's traffic went around it"
    );
    Ok(())
}

/// The VIP of the waypoint service of [`mesh_with_waypoint_service`].
pub const WAYPOINT_VIP: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(10, 96, 0, 88));

/// [`mesh`] where `local`'s waypoint is the service at [`WAYPOINT_VIP`],
/// whose ports lack the HBONE port (15021 only, as a waypoint's status
/// port), with two instances on node2: `wp` with its PROXY tunnel, `wp2`
/// without one.
pub fn mesh_with_waypoint_service(w: &TwoNodes, wp: &Pod, wp2: &Pod) -> LocalConfig {
    let mut config = mesh(w, wp);
    let waypoints = service("waypoint", NAMESPACE, WAYPOINT_VIP, &[(15021, 15021)]);
    let mut plain = hbone_workload(wp2, "waypoint2", "node2");
    endpoint_of(&mut plain, &waypoints);
    for workload in &mut config.workloads {
        let workload = std::sync::Arc::make_mut(workload);
        match workload.name.as_str() {
            "waypoint" => endpoint_of(workload, &waypoints),
            "local" => {
                if let Some(waypoint) = workload.waypoint.as_deref_mut() {
                    waypoint.address = Some(WAYPOINT_VIP);
                }
            }
            _ => {}
        }
    }
    config.workloads.push(plain.into());
    config.services.push(waypoints);
    config
}

/// With [`mesh_with_waypoint_service`]: every connection to `local` goes
/// to `wp`, the only instance ztunnel would choose (`src/state.rs`
/// `load_balance` in `ServiceResolutionMode::Waypoint`: without the HBONE
/// port on the service, only instances with an application tunnel), and
/// none to `wp2`.
pub fn only_tunnel_instances_serve_a_portless_waypoint(
    w: &TwoNodes,
    wp: &Pod,
    wp2: &Pod,
) -> anyhow::Result<()> {
    let tunnel = proxy_echo(wp, SocketAddr::from(([127, 0, 0, 1], TUNNEL_PORT)))?;
    let on_wp2 = echo_server(wp2, APP_PORT)?;
    let behind = echo_server(&w.local, APP_PORT)?;
    // Round robin or random, four connections would reach both instances
    // were both offered.
    for n in 1..=4 {
        echo(&w.client, addr(&w.local, APP_PORT), 1_000, n)?;
        let (header, payload) = next_header(&tunnel, "through the waypoint service")?;
        assert_eq!(header.destination, addr(&w.local, APP_PORT));
        assert_eq!(payload, 1_000);
    }
    assert!(
        on_wp2.drain().is_empty(),
        "an instance without a tunnel was chosen"
    );
    assert!(
        behind.drain().is_empty(),
        "the waypoint's traffic went around it"
    );
    Ok(())
}
