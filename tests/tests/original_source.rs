//! Original source: the app sees its client's own address, as behind
//! Istio's node proxy. The engine connects to the app with a transparent
//! socket bound to the client's address and the pod's policy routing
//! brings the replies back (see `proxy::original_source`).
//!
//! Each case asks the app itself: the echo server records the peer address
//! of every connection it accepts (`getpeername`). A capture on the server
//! pod's interface shows that no packet with a client's address ever
//! leaves the pod, also when the app is down and the kernel answers.

use std::{
    io::{Read as _, Write as _},
    net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream},
    time::Duration,
};

use dataplane_tests::{
    capture::PacketCapture,
    mesh::{TwoNodes, addr},
    responder::Responder,
    traffic::{echo, echo_server, try_stream},
};

/// The client address the app saw for the next connection it served.
fn seen_by(app: &Responder) -> anyhow::Result<IpAddr> {
    let request = app
        .next_request(Duration::from_secs(20))
        .ok_or_else(|| anyhow::anyhow!("the app served no connection"))?;
    Ok(request.peer.ip().to_canonical())
}

/// One echo from `src` (an address of `netns`, port 0 for any) to `dst`.
fn echo_from(
    netns: &dataplane_tests::Netns,
    src: SocketAddr,
    dst: SocketAddr,
) -> anyhow::Result<()> {
    netns.run(move || -> anyhow::Result<()> {
        let socket = socket2::Socket::new(
            socket2::Domain::for_address(dst),
            socket2::Type::STREAM,
            None,
        )?;
        socket.bind(&src.into())?;
        socket.connect_timeout(&dst.into(), Duration::from_secs(20))?;
        let mut stream: TcpStream = socket.into();
        stream.set_read_timeout(Some(Duration::from_secs(20)))?;
        stream.write_all(b"from the client")?;
        stream.shutdown(std::net::Shutdown::Write)?;
        let mut back = Vec::new();
        stream.read_to_end(&mut back)?;
        anyhow::ensure!(back == b"from the client", "echo differs: {back:?}");
        Ok(())
    })?
}

#[test]
fn apps_see_their_clients_own_addresses() -> anyhow::Result<()> {
    let w = TwoNodes::new("osrc")?;
    let (_a1, a2) = w.agents("os", &w.mesh_config())?;
    let local = echo_server(&w.local, 9000)?;
    let remote = echo_server(&w.remote, 9000)?;
    let capture = PacketCapture::start(&w.remote.netns, "eth0")?;

    // HBONE from a mesh pod (`client`, node1), plaintext from a pod outside
    // the mesh (`plain`, node2); same node and across nodes; IPv4 and IPv6.
    let (node1, node2) = ((&w.local, &local), (&w.remote, &remote));
    let cases = [
        ("HBONE, same node", &w.client, node1, false),
        ("HBONE, across nodes", &w.client, node2, false),
        ("HBONE over IPv6", &w.client, node2, true),
        ("plaintext, same node", &w.plain, node2, false),
        ("plaintext, across nodes", &w.plain, node1, false),
        ("plaintext over IPv6", &w.plain, node2, true),
    ];
    for (seed, (case, client, (server, app), v6)) in cases.into_iter().enumerate() {
        let (dst, expected): (IpAddr, IpAddr) = if v6 {
            (server.ip6.into(), client.ip6.into())
        } else {
            (server.ip4.into(), client.ip4.into())
        };
        echo(client, SocketAddr::new(dst, 9000), 64, seed as u64)?;
        assert_eq!(seen_by(app)?, expected, "{case}");
    }

    // A client on the node itself, from an address local to the node (not
    // the pod-facing one, which is exempt from capture like kubelet's).
    let node_local = IpAddr::V4(Ipv4Addr::new(192, 168, 255, 2));
    echo_from(
        w.n2.netns(),
        SocketAddr::new(node_local, 0),
        addr(&w.remote, 9000),
    )?;
    assert_eq!(seen_by(&remote)?, node_local, "a node-local client");

    // An app that is down answers the engine's SYN with a kernel RST,
    // which must come back to the engine (not go out to the client) so
    // the client is reset at once, plaintext and through a tunnel.
    for client in [&w.plain, &w.client] {
        let out = try_stream(
            client,
            &["expect-reset", &addr(&w.remote, 9999).to_string()],
        )?;
        assert_eq!(out.stdout, "reset", "{out:?}");
    }

    let captured = capture.finish();
    anyhow::ensure!(
        captured.outgoing_from(w.remote.ip4.into()) > 0,
        "the capture saw nothing leave the server pod; it cannot vouch for anything"
    );
    for client in [
        IpAddr::from(w.client.ip4),
        w.client.ip6.into(),
        w.plain.ip4.into(),
        w.plain.ip6.into(),
        node_local,
    ] {
        assert_eq!(
            captured.outgoing_from(client),
            0,
            "a packet with the client address {client} left the server pod"
        );
    }

    let pod = a2.pod_status("remote")?;
    assert_eq!(pod.original_source, Some(true), "status: {pod:?}");
    Ok(())
}

#[test]
fn the_opt_out_keeps_the_pods_own_address() -> anyhow::Result<()> {
    let w = TwoNodes::new("osoff")?;
    let config = w.config()?;
    let off = ["--original-source", "off"];
    let _a1 = w.agent("oso", 1, &config, &off)?;
    let a2 = w.agent("oso", 2, &config, &off)?;
    let remote = echo_server(&w.remote, 9000)?;

    echo(&w.client, addr(&w.remote, 9000), 64, 1)?;
    assert_eq!(seen_by(&remote)?, IpAddr::from(w.remote.ip4), "HBONE");
    echo(&w.plain, addr(&w.remote, 9000), 64, 2)?;
    assert_eq!(seen_by(&remote)?, IpAddr::from(w.remote.ip4), "plaintext");

    let pod = a2.pod_status("remote")?;
    assert_eq!(pod.original_source, Some(false), "status: {pod:?}");
    Ok(())
}

/// The engine's connection to the app is made from the client's address
/// with a port of its own choosing; it must never be the port of a
/// captured connection from that client to that app that is still open,
/// whose tuple the pod's namespace already holds (the engine's SYN would
/// meet the captured connection instead of the app, and hang). The
/// engine takes ports in turn, so the client binds the one it would take
/// next.
#[test]
fn the_engine_never_takes_the_port_of_a_captured_connection() -> anyhow::Result<()> {
    let w = TwoNodes::new("osport")?;
    let (_a1, _a2) = w.agents("osp", &w.mesh_config())?;
    let app = echo_server(&w.remote, 9000)?;
    let dst = addr(&w.remote, 9000);
    let port_seen = || -> anyhow::Result<u16> {
        let request = app
            .next_request(Duration::from_secs(20))
            .ok_or_else(|| anyhow::anyhow!("the app served no connection"))?;
        assert_eq!(request.peer.ip().to_canonical(), IpAddr::from(w.plain.ip4));
        Ok(request.peer.port())
    };

    echo(&w.plain, dst, 64, 1)?;
    let taken = port_seen()?;
    // The kernel's ephemeral range, 32768-60999, in turn.
    let next = if taken == 60_999 { 32_768 } else { taken + 1 };
    echo_from(
        &w.plain.netns,
        SocketAddr::new(w.plain.ip4.into(), next),
        dst,
    )?;
    let skipped = port_seen()?;
    assert_ne!(skipped, next, "the engine took its client's own port");
    Ok(())
}
