//! Outbound capture: `connect4`/`connect6` + `sockops`, the original
//! destination, and what is exempt or refused.

use super::*;

#[test]
fn outbound_v4_is_captured_with_its_original_destination() -> anyhow::Result<()> {
    let mut w = RedirectorNode::new("rko4", |_| {})?;
    w.enroll(&Exclusions::default())?;
    let dst = at(w.peer.ip4, APP_PORT);
    let reply = dial(&w.app, &dst, &["--print-peer"])?;
    assert_eq!(reply, Ok(format!("peer={dst}\norig={dst}")));
    let c = w.counters()?;
    assert_eq!(c["redirected_outbound"], 1);
    assert_eq!(c["orig_dst_recorded"], 1);
    assert_eq!(c["peer_rewritten"], 1);
    // The engine consumed the tuple record; the socket's cookie record goes
    // when the client socket reaches TCP_CLOSE, which happens in the kernel
    // shortly after the client exits.
    let records = || -> anyhow::Result<usize> {
        let by_cookie: BpfHashMap<MapData, u64, CapturedDst> =
            open_map(&w.pins, m::ORIG_DST_COOKIE)?;
        let by_tuple: BpfHashMap<MapData, OrigDstKey, OrigDst> = open_map(&w.pins, m::ORIG_DST)?;
        Ok(by_cookie.keys().count() + by_tuple.keys().count())
    };
    wait_until("the original destination records to go", || {
        Ok(records()? == 0)
    })?;
    Ok(())
}

#[test]
fn outbound_v6_is_captured_with_its_original_destination() -> anyhow::Result<()> {
    let mut w = RedirectorNode::new("rko6", |_| {})?;
    w.enroll(&Exclusions::default())?;
    let dst = at(w.peer.ip6, APP_PORT);
    let reply = dial(&w.app, &dst, &["--print-peer"])?;
    assert_eq!(reply, Ok(format!("peer={dst}\norig={dst}")));
    assert_eq!(w.counter("redirected_outbound")?, 1);
    assert_eq!(w.counter("peer_rewritten")?, 1);
    Ok(())
}

#[test]
fn outbound_v4_mapped_is_captured_through_an_ipv6_socket() -> anyhow::Result<()> {
    let mut w = RedirectorNode::new("rkomap", |_| {})?;
    w.enroll(&Exclusions::default())?;
    // The app dials an IPv4 peer from an IPv6 socket: it sees the mapped
    // peer it asked for; the engine gets the IPv4 destination.
    let dst = mapped(w.peer.ip4, APP_PORT);
    let reply = dial(&w.app, &dst, &["--print-peer"])?;
    assert_eq!(
        reply,
        Ok(format!("peer={dst}\norig={}", at(w.peer.ip4, APP_PORT)))
    );
    assert_eq!(w.counter("redirected_outbound")?, 1);
    assert_eq!(w.counter("orig_dst_recorded")?, 1);
    Ok(())
}

#[test]
fn so_original_dst_is_answered_and_other_options_are_untouched() -> anyhow::Result<()> {
    let mut w = RedirectorNode::unserved("rkoptv", |_| {})?;
    w.enroll_external(|w| &w.app)?;
    // An unmodified proxy: accept from the outbound listener and ask the
    // kernel where the connection was going (an external proxy's pod: its
    // records are keyed where the attached getsockopt program looks).
    let listener = w
        .engine
        .outbound_listener
        .take()
        .ok_or_else(|| anyhow::anyhow!("no outbound listener"))?;
    let v4_dst: SocketAddr = SocketAddr::new(w.peer.ip4.into(), APP_PORT);
    let v6_dst: SocketAddr = SocketAddr::new(w.peer.ip6.into(), APP_PORT);
    let sockaddr_in = 16;
    let sockaddr_in6 = 28;

    for dst in [v4_dst, v6_dst] {
        let mut cmd = Command::new(probe_binary()?);
        cmd.args(["connect", &dst.to_string(), "hello"]);
        let client = spawn_in(cmd, Some(w.app.netns.path()), Some(w.app.cgroup.path()))?;
        let mut stream = accept_one(&listener)?;
        if dst.is_ipv4() {
            assert_eq!(original_dst(&stream, SOL_IP, sockaddr_in)?, dst);
            // The IPv6 form of an IPv4 destination is its mapped address.
            assert_eq!(
                original_dst(&stream, SOL_IPV6, sockaddr_in6)?,
                SocketAddr::new(IpAddr::V6(w.peer.ip4.to_ipv6_mapped()), APP_PORT)
            );
            // A buffer too small for a sockaddr_in gets no answer.
            assert!(original_dst(&stream, SOL_IP, 8).is_err());
        } else {
            assert_eq!(original_dst(&stream, SOL_IPV6, sockaddr_in6)?, dst);
            // An IPv6 destination has no sockaddr_in form.
            assert!(original_dst(&stream, SOL_IP, sockaddr_in).is_err());
        }
        // Other options pass through with their normal values.
        stream.set_nodelay(true)?;
        assert_eq!(
            int_option(&stream, libc::IPPROTO_TCP, libc::TCP_NODELAY)?,
            (1, 4)
        );
        let (rcvbuf, len) = int_option(&stream, libc::SOL_SOCKET, libc::SO_RCVBUF)?;
        assert!(rcvbuf > 0 && len == 4, "SO_RCVBUF {rcvbuf} ({len} bytes)");
        let mut body = Vec::new();
        stream.read_to_end(&mut body)?;
        assert_eq!(body, b"hello");
        stream.write_all(b"proxied")?;
        drop(stream);
        let out = client.wait(LIMIT)?;
        assert_eq!(out.code, Some(0), "{}", out.stderr);
        assert_eq!(out.stdout, "proxied");
    }
    assert_eq!(w.counter("orig_dst_answered")?, 3);
    Ok(())
}

#[test]
fn external_proxies_of_two_pods_dialling_from_the_same_tuple_get_their_own_destinations()
-> anyhow::Result<()> {
    let mut w = RedirectorNode::unserved("rkotwin", |_| {})?;
    w.enroll_external(|w| &w.app)?;
    w.enroll_external(|w| &w.other)?;
    let app_listener = w
        .engine
        .outbound_listener
        .take()
        .ok_or_else(|| anyhow::anyhow!("no outbound listener"))?;
    let other_listener = listener_in_pod(&w.other, "[::]:15001")?;
    let app_dst = SocketAddr::new(w.peer.ip4.into(), APP_PORT);
    let other_dst = SocketAddr::new(w.peer.ip4.into(), 8081);

    // Both pods' apps connect from the same source port before either
    // proxy accepts: 127.0.0.1:P -> 127.0.0.1:15001 in each namespace.
    let client = |pod: &Pod, dst: SocketAddr| -> anyhow::Result<ChildGuard> {
        let mut cmd = Command::new(probe_binary()?);
        cmd.args(["connect", &dst.to_string(), "hello", "--bind-port", "40124"]);
        spawn_in(cmd, Some(pod.netns.path()), Some(pod.cgroup.path()))
    };
    let app_client = client(&w.app, app_dst)?;
    wait_until("the app pod's record", || {
        Ok(w.counter("orig_dst_recorded")? == 1)
    })?;
    let other_client = client(&w.other, other_dst)?;
    wait_until("the other pod's record", || {
        Ok(w.counter("orig_dst_recorded")? == 2)
    })?;
    let mut app_stream = accept_one(&app_listener)?;
    let mut other_stream = accept_one(&other_listener)?;
    let app_answer = original_dst(&app_stream, SOL_IP, 16)?;
    let other_answer = original_dst(&other_stream, SOL_IP, 16)?;
    if features::sockopt_knows_netns() {
        assert_eq!((app_answer, other_answer), (app_dst, other_dst));
    } else {
        // Before 5.15 the records are keyed by tuple alone, as the agent
        // logs: the later one replaced the earlier.
        assert_eq!((app_answer, other_answer), (other_dst, other_dst));
    }
    for (stream, client) in [
        (&mut app_stream, app_client),
        (&mut other_stream, other_client),
    ] {
        let mut body = Vec::new();
        stream.read_to_end(&mut body)?;
        assert_eq!(body, b"hello");
        stream.write_all(b"proxied")?;
        stream.shutdown(std::net::Shutdown::Write)?;
        let out = client.wait(LIMIT)?;
        assert_eq!(out.code, Some(0), "{}", out.stderr);
    }
    Ok(())
}

#[test]
fn excluded_outbound_port_and_cidr_are_exempt() -> anyhow::Result<()> {
    let mut w = RedirectorNode::new("rkoexcl", |_| {})?;
    let exclusions = Exclusions {
        outbound_ports: vec![8081],
        outbound_cidrs: vec![
            format!("{}/32", w.other.ip4).parse()?,
            format!("{}/128", w.other.ip6).parse()?,
        ],
        inbound_ports: vec![],
        ..Exclusions::default()
    };
    w.enroll(&exclusions)?;
    assert_eq!(dial(&w.app, &at(w.peer.ip4, 8081), &[])?, Ok("peer".into()));
    assert_eq!(dial(&w.app, &at(w.peer.ip6, 8081), &[])?, Ok("peer".into()));
    assert_eq!(
        dial(&w.app, &at(w.other.ip4, APP_PORT), &[])?,
        Ok("other".into())
    );
    assert_eq!(
        dial(&w.app, &at(w.other.ip6, APP_PORT), &[])?,
        Ok("other".into())
    );
    assert_eq!(
        dial(&w.app, &mapped(w.other.ip4, APP_PORT), &[])?,
        Ok("other".into())
    );
    // Everything else is still captured.
    let dst = at(w.peer.ip4, APP_PORT);
    assert_eq!(dial(&w.app, &dst, &[])?, Ok(format!("orig={dst}")));
    let c = w.counters()?;
    assert_eq!(c["exempt_excluded_port"], 2);
    assert_eq!(c["exempt_excluded_cidr"], 3);
    assert_eq!(c["redirected_outbound"], 1);
    Ok(())
}

#[test]
fn loopback_and_proxy_marked_traffic_is_untouched() -> anyhow::Result<()> {
    let mut w = RedirectorNode::new("rklo", |_| {})?;
    w.enroll(&Exclusions::default())?;
    assert_eq!(
        dial(&w.app, &at([127, 0, 0, 1], APP_PORT), &[])?,
        Ok("app".into())
    );
    assert_eq!(
        dial(&w.app, &at(Ipv6Addr::LOCALHOST, APP_PORT), &[])?,
        Ok("app".into())
    );
    assert_eq!(w.counter("exempt_loopback")?, 2);
    // The engine's own sockets carry the proxy mark: not captured outbound,
    // and a connection to its own pod IP is not captured inbound either.
    let mark = format!("{DEFAULT_PROXY_MARK:#x}");
    assert_eq!(
        dial(&w.app, &at(w.app.ip4, APP_PORT), &["--mark", &mark])?,
        Ok("app".into())
    );
    assert_eq!(
        dial(&w.app, &at(w.peer.ip6, APP_PORT), &["--mark", &mark])?,
        Ok("peer".into())
    );
    let c = w.counters()?;
    assert_eq!(c["exempt_proxy_mark"], 2);
    // sk_lookup runs once per SYN that reaches the listener's lookup, so a
    // SYN retransmitted under a slow emulated kernel counts the same
    // connection twice; the outbound counts above come from connect() and
    // are exact.
    assert!(
        c["exempt_loopback"] >= 3,
        "pod to its own IP is exempt inbound: {c:?}"
    );
    assert_eq!(c["redirected_outbound"], 0);
    assert_eq!(c["redirected_inbound"], 0);
    Ok(())
}

#[test]
fn pod_not_enrolled_is_untouched() -> anyhow::Result<()> {
    let mut w = RedirectorNode::new("rknoenr", |_| {})?;
    w.enroll(&Exclusions::default())?;
    // `other` is in the node's cgroup but not enrolled, in both directions.
    assert_eq!(
        dial(&w.other, &at(w.peer.ip4, APP_PORT), &[])?,
        Ok("peer".into())
    );
    assert_eq!(
        dial(&w.other, &at(w.peer.ip6, APP_PORT), &[])?,
        Ok("peer".into())
    );
    assert_eq!(
        dial(&w.peer, &at(w.other.ip4, APP_PORT), &[])?,
        Ok("other".into())
    );
    let c = w.counters()?;
    assert_eq!(c["redirected_outbound"], 0);
    assert_eq!(c["redirected_inbound"], 0);
    assert!(c["skipped_not_enrolled"] >= 3);
    Ok(())
}

#[test]
fn engine_ports_are_refused_not_looped() -> anyhow::Result<()> {
    let mut w = RedirectorNode::new("rkself", |_| {})?;
    w.enroll(&Exclusions::default())?;
    // Outbound to a capture port: connect() fails with EPERM.
    assert_eperm(
        &dial(&w.app, &at(w.peer.ip4, 15001), &[])?,
        "app -> peer:15001",
    );
    assert_eperm(
        &dial(&w.app, &at(w.peer.ip6, 15006), &[])?,
        "app -> [peer]:15006",
    );
    // Inbound to a capture port from outside the pod: the lookup ends with
    // no match, so the client gets a reset.
    assert_refused(
        &dial(&w.peer, &at(w.app.ip4, 15006), &[])?,
        "peer -> app:15006",
    );
    assert_refused(
        &dial(&w.peer, &at(w.app.ip6, 15001), &[])?,
        "peer -> [app]:15001",
    );
    assert_eq!(w.counter("refused_engine_port")?, 4);
    assert!(
        w.engine
            .inbound
            .as_ref()
            .is_some_and(|r| r.drain().is_empty()),
        "nothing reached the inbound listener"
    );
    Ok(())
}
