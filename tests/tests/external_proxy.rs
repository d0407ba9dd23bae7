//! The kernel capture aimed at an external in-pod proxy (Istio's ztunnel in
//! in-pod mode), played by `dp-inpod-proxy`: its own process, listeners
//! inside each pod's namespace on `[::]:15001/15006/15008` with
//! `IP_TRANSPARENT`, `SO_REUSEPORT` and mark 0x539, `SO_ORIGINAL_DST` read
//! as ztunnel reads it, and transparent connections to the app from the
//! client's address. The agent's side: `enroll_external_pod` (capture and
//! the `lo` program), the listener harvest (`pidfd_getfd`), and
//! `set_pod_listeners`. Real kernel, real namespaces; no ZDS here.

use std::{fs::File, net::IpAddr, os::fd::AsFd, time::Duration};

use dataplane_common::DEFAULT_PROXY_MARK;
use dataplane_tests::{
    capture::PacketCapture,
    external_proxy::{APP_PORT, ExternalProxyNode, WhichPod},
    redirector_node::{Dial, assert_refused, at, dial, pod_entries},
};
use dataplane_user::redirect::{ExternalListeners, HarvestError};

/// Where `dial` from `peer` to `app` at `ip` went through the proxy: the
/// proxy's line, then the app's answer with the client it saw.
fn via_proxy(w: &ExternalProxyNode, ip: IpAddr) -> String {
    format!(
        "inbound pod=app local={}\napp peer={}",
        at(ip, APP_PORT),
        client_of(w, ip)
    )
}

/// The peer pod's address of `ip`'s family.
fn client_of(w: &ExternalProxyNode, ip: IpAddr) -> IpAddr {
    if ip.is_ipv4() {
        w.peer.ip4.into()
    } else {
        w.peer.ip6.into()
    }
}

fn ok(dial: Dial, what: &str) -> String {
    match dial {
        Ok(out) => out,
        Err(e) => panic!("{what}: {e}"),
    }
}

#[test]
fn the_harvest_takes_exactly_the_proxys_listeners_in_that_pod() -> anyhow::Result<()> {
    let w = ExternalProxyNode::new("xph", |_| {})?;
    let pid = w.proxy_pid()?;
    let app = w.harvest(WhichPod::App)?;
    let app2 = w.harvest(WhichPod::App2)?;
    assert_eq!(app.inbound.local.port(), 15006);
    assert_eq!(app.hbone.local.port(), 15008);
    for (listeners, pod, other) in [(&app, &w.app, &w.app2), (&app2, &w.app2, &w.app)] {
        for l in [&listeners.inbound, &listeners.hbone] {
            // The socket's own namespace, asked of the kernel.
            let cookie = dataplane_user::netns::socket_netns_cookie(l.socket.as_fd())?;
            assert_eq!(cookie, pod.netns.cookie()?);
            assert_ne!(cookie, other.netns.cookie()?);
            assert!(l.local.ip().is_unspecified(), "{}", l.local);
            // One of the proxy's own descriptors.
            let held = std::fs::read_dir(format!("/proc/{pid}/fd"))?
                .flatten()
                .filter_map(|e| std::fs::read_link(e.path()).ok())
                .any(|link| link.to_string_lossy() == format!("socket:[{}]", l.inode));
            assert!(held, "inode {} is not the proxy's", l.inode);
        }
    }
    assert_ne!(app.inbound.inode, app2.inbound.inode);

    // A namespace where the proxy has no listener, a process without
    // listeners, and a process that is gone.
    let peer_ns = File::open(w.peer.netns.path())?;
    let Err(err) = ExternalListeners::harvest(pid, peer_ns.as_fd(), 15006, 15008) else {
        panic!("the proxy has no listener in the peer pod, yet a harvest");
    };
    assert!(
        matches!(err, HarvestError::NoListener { port: 15006, .. }),
        "{err}"
    );
    // Our own copies are gone: the test process holds no such listener.
    drop((app, app2));
    let app_ns = File::open(w.app.netns.path())?;
    let Err(err) = ExternalListeners::harvest(std::process::id(), app_ns.as_fd(), 15006, 15008)
    else {
        panic!("the test process has no listener in the app pod, yet a harvest");
    };
    assert!(matches!(err, HarvestError::NoListener { .. }), "{err}");
    let mut w = w;
    if let Some(proxy) = w.proxy.take() {
        proxy.kill()?;
    }
    let Err(err) = ExternalListeners::harvest(pid, app_ns.as_fd(), 15006, 15008) else {
        panic!("the proxy is gone, yet a harvest");
    };
    assert!(matches!(err, HarvestError::ProcessGone { .. }), "{err}");
    Ok(())
}

#[test]
fn connections_reach_the_external_proxy_and_through_it_the_app() -> anyhow::Result<()> {
    let mut w = ExternalProxyNode::new("xpc", |_| {})?;
    w.enroll(WhichPod::App)?;
    w.harvest_and_register(WhichPod::App)?;
    let capture = PacketCapture::start(&w.app.netns, "eth0")?;

    // Inbound plaintext, IPv4 and IPv6: the proxy's 15006 with the original
    // destination as local address, then its transparent connection to the
    // app, which sees the client's own address; replies flow both ways.
    for ip in [IpAddr::V4(w.app.ip4), IpAddr::V6(w.app.ip6)] {
        let out = ok(dial(&w.peer, &at(ip, APP_PORT), &[])?, "inbound");
        assert_eq!(out, via_proxy(&w, ip), "inbound to {ip}");
    }
    assert!(w.counter("proxy_syn_remarked")? >= 2);
    assert!(w.counter("transparent_passed")? >= 2);

    // The HBONE port lands on the proxy's 15008.
    for ip in [IpAddr::V4(w.app.ip4), IpAddr::V6(w.app.ip6)] {
        let out = ok(dial(&w.peer, &at(ip, 15008), &[])?, "hbone");
        assert_eq!(out, format!("hbone pod=app local={}\n", at(ip, 15008)));
    }

    // Outbound from the app lands on the proxy's 15001; SO_ORIGINAL_DST
    // answers SOL_IP on its IPv4-mapped accepted socket (SOL_IPV6 for an
    // IPv6 destination), and the proxy's own connection out (mark 0x539)
    // reaches the peer directly: neither captured nor routed back locally.
    let out = ok(dial(&w.app, &at(w.peer.ip4, APP_PORT), &[])?, "outbound");
    assert_eq!(
        out,
        format!(
            "outbound orig={} via=SOL_IP client={}\npeer",
            at(w.peer.ip4, APP_PORT),
            w.app.ip4
        )
    );
    let out = ok(dial(&w.app, &at(w.peer.ip6, APP_PORT), &[])?, "outbound v6");
    assert_eq!(
        out,
        format!(
            "outbound orig={} via=SOL_IPV6 client={}\npeer",
            at(w.peer.ip6, APP_PORT),
            w.app.ip6
        )
    );
    // A connection from the app carrying the proxy mark is not captured.
    let out = ok(
        dial(
            &w.app,
            &at(w.peer.ip4, APP_PORT),
            &["--mark", &DEFAULT_PROXY_MARK.to_string()],
        )?,
        "marked",
    );
    assert_eq!(out, "peer");

    // Kubelet probes: Istio's probe source (169.254.7.127, the agent's
    // default `--probe-source`, in PROBE_SOURCES) reaches the app
    // uncaptured.
    w.node
        .netns()
        .ip(&["addr", "add", "169.254.7.127/32", "dev", "br0"])?;
    let probe_src: IpAddr = "169.254.7.127".parse()?;
    let app4 = w.app.ip4;
    let seen = w.node.netns().run(move || -> anyhow::Result<String> {
        use std::io::{Read as _, Write as _};
        let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
        socket.bind(&std::net::SocketAddr::new(probe_src, 0).into())?;
        socket.connect_timeout(
            &std::net::SocketAddr::new(app4.into(), APP_PORT).into(),
            Duration::from_secs(10),
        )?;
        let mut stream: std::net::TcpStream = socket.into();
        stream.set_read_timeout(Some(Duration::from_secs(10)))?;
        stream.write_all(b"probe")?;
        stream.shutdown(std::net::Shutdown::Write)?;
        let mut back = String::new();
        stream.read_to_string(&mut back)?;
        Ok(back)
    })??;
    assert_eq!(seen, "app peer=169.254.7.127", "probe from 169.254.7.127");

    // Nothing with a client's address left the pod: the proxy's transparent
    // SYNs and the app's replies stayed on lo.
    let captured = capture.finish();
    assert!(
        captured.outgoing_from(w.app.ip4.into()) > 0,
        "the capture saw nothing leave the app pod; it cannot vouch for anything"
    );
    assert_eq!(captured.outgoing_from(w.peer.ip4.into()), 0);
    assert_eq!(captured.outgoing_from(w.peer.ip6.into()), 0);
    Ok(())
}

#[test]
fn a_gone_proxy_fails_closed_until_the_next_harvest() -> anyhow::Result<()> {
    let mut w = ExternalProxyNode::new("xpfc", |_| {})?;
    w.enroll(WhichPod::App)?;
    let ip = IpAddr::V4(w.app.ip4);
    // Enrolled, not harvested yet: no listener, fail-closed.
    assert_refused(
        &dial(&w.peer, &at(ip, APP_PORT), &[])?,
        "before the harvest",
    );
    w.harvest_and_register(WhichPod::App)?;
    assert_eq!(
        ok(dial(&w.peer, &at(ip, APP_PORT), &[])?, "captured"),
        via_proxy(&w, ip)
    );

    // The proxy exits: the kernel drops its LISTENERS entries with its
    // sockets (the agent kept no copy), so inbound is refused at once.
    let refused = w.counter("engine_down_refused")?;
    if let Some(proxy) = w.proxy.take() {
        proxy.kill()?;
    }
    assert_refused(&dial(&w.peer, &at(ip, APP_PORT), &[])?, "proxy gone");
    assert!(w.counter("engine_down_refused")? > refused);
    assert!(
        pod_entries(&w.pins, w.app.netns.cookie()?, &[ip])?
            .iter()
            .all(|e| !e.starts_with("listener")),
        "LISTENERS still holds the dead proxy's sockets"
    );
    // Outbound: nothing listens on 15001 any more.
    assert_refused(
        &dial(&w.app, &at(w.peer.ip4, APP_PORT), &[])?,
        "outbound, proxy gone",
    );

    // A new proxy, a new harvest: captured again, both ways.
    w.restart_proxy()?;
    w.harvest_and_register(WhichPod::App)?;
    assert_eq!(
        ok(dial(&w.peer, &at(ip, APP_PORT), &[])?, "restored"),
        via_proxy(&w, ip)
    );
    let out = ok(
        dial(&w.app, &at(w.peer.ip4, APP_PORT), &[])?,
        "outbound restored",
    );
    assert!(out.starts_with("outbound orig="), "{out}");
    Ok(())
}

#[test]
fn a_gone_proxy_fails_open_when_so_configured() -> anyhow::Result<()> {
    let mut w = ExternalProxyNode::new("xpfo", |o| o.fail_open = true)?;
    w.enroll(WhichPod::App)?;
    w.harvest_and_register(WhichPod::App)?;
    let ip = IpAddr::V4(w.app.ip4);
    assert_eq!(
        ok(dial(&w.peer, &at(ip, APP_PORT), &[])?, "captured"),
        via_proxy(&w, ip)
    );
    if let Some(proxy) = w.proxy.take() {
        proxy.kill()?;
    }
    // Inbound goes straight to the app.
    let out = ok(dial(&w.peer, &at(ip, APP_PORT), &[])?, "fail-open inbound");
    assert_eq!(out, format!("app peer={}", w.peer.ip4));
    // Outbound too, once the agent learnt the proxy is gone.
    let cookie = w.app.netns.cookie()?;
    w.redirector()?.clear_pod_listeners(cookie)?;
    let out = ok(
        dial(&w.app, &at(w.peer.ip4, APP_PORT), &[])?,
        "fail-open outbound",
    );
    assert_eq!(out, "peer");
    w.restart_proxy()?;
    w.harvest_and_register(WhichPod::App)?;
    assert_eq!(
        ok(dial(&w.peer, &at(ip, APP_PORT), &[])?, "restored"),
        via_proxy(&w, ip)
    );
    Ok(())
}

#[test]
fn unenrolling_removes_the_lo_program_and_every_entry() -> anyhow::Result<()> {
    let mut w = ExternalProxyNode::new("xpu", |_| {})?;
    w.enroll(WhichPod::App)?;
    w.harvest_and_register(WhichPod::App)?;
    let before = lo_filters(&w)?;
    assert_eq!(before, 1, "dp_proxy_syn on lo ingress");
    // Enrolling again (an agent restart) replaces the filter in place.
    w.enroll(WhichPod::App)?;
    assert_eq!(lo_filters(&w)?, 1);
    let ip = IpAddr::V4(w.app.ip4);
    assert_eq!(
        ok(dial(&w.peer, &at(ip, APP_PORT), &[])?, "re-enrolled"),
        via_proxy(&w, ip)
    );

    let cookie = w.app.netns.cookie()?;
    let netns = File::open(w.app.netns.path())?;
    w.redirector()?
        .unenroll_external_pod(cookie, Some(netns.as_fd()))?;
    assert_eq!(lo_filters(&w)?, 0);
    let ips = [ip, IpAddr::V6(w.app.ip6)];
    assert_eq!(pod_entries(&w.pins, cookie, &ips)?, Vec::<String>::new());
    // Uncaptured now: the app answers directly.
    let out = ok(dial(&w.peer, &at(ip, APP_PORT), &[])?, "unenrolled");
    assert_eq!(out, format!("app peer={}", w.peer.ip4));
    Ok(())
}

/// `dp_proxy_syn` filters on ingress of the app pod's `lo`, as the kernel
/// lists them (`bpftool net show` in the pod's namespace).
fn lo_filters(w: &ExternalProxyNode) -> anyhow::Result<usize> {
    let mut cmd = std::process::Command::new("bpftool");
    cmd.args(["net", "show", "dev", "lo", "--json"]);
    let out = dataplane_tests::spawn_in(cmd, Some(w.app.netns.path()), None)?
        .wait(Duration::from_secs(20))?;
    anyhow::ensure!(out.code == Some(0), "bpftool: {}", out.stderr);
    let json: serde_json::Value = serde_json::from_str(&out.stdout)?;
    let count = json
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|entry| entry["tc"].as_array())
        .flatten()
        .filter(|f| {
            f["kind"] == "clsact/ingress"
                && f["name"]
                    .as_str()
                    .is_some_and(|n| n.starts_with("dp_proxy_syn"))
        })
        .count();
    Ok(count)
}
