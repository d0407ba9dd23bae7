//! Enrollment's life cycle: unenroll, re-enroll, an agent restart that
//! re-adopts, refused listeners, and detach on shutdown.

use super::*;

#[test]
fn unenroll_restores_direct_traffic_and_leaves_nothing() -> anyhow::Result<()> {
    let mut w = RedirectorNode::new("rkunenr", |_| {})?;
    let exclusions = Exclusions {
        outbound_ports: vec![8081],
        outbound_cidrs: vec!["10.9.0.0/16".parse()?, "fd09::/32".parse()?],
        inbound_ports: vec![9090],
        ..Exclusions::default()
    };
    w.enroll(&exclusions)?;
    let cookie = w.app_cookie()?;
    let ips = [IpAddr::V4(w.app.ip4), IpAddr::V6(w.app.ip6)];
    assert_eq!(sk_lookup_links(&w.app.netns)?, 1);
    let (a4, a6) = (w.app.ip4, w.app.ip6);
    let mut expected = vec![
        "enrolled_netns".to_string(),
        format!("inbound_excluded {a4}:9090"),
        format!("inbound_excluded [{a6}]:9090"),
        format!("listener {a4}:15006"),
        format!("listener {a4}:15008"),
        format!("listener [{a6}]:15006"),
        format!("listener [{a6}]:15008"),
        "outbound_excluded cidr 10.9.0.0/16".to_string(),
        "outbound_excluded cidr fd09::/32".to_string(),
        "outbound_excluded port 8081".to_string(),
        format!("pod_inbound {a4}"),
        format!("pod_inbound {a6}"),
    ];
    expected.sort();
    assert_eq!(pod_entries(&w.pins, cookie, &ips)?, expected);
    let dst = at(w.peer.ip4, APP_PORT);
    assert_eq!(dial(&w.app, &dst, &[])?, Ok(format!("orig={dst}")));

    w.redirector()?.unenroll_pod(cookie)?;
    w.redirector()?.unenroll_pod(cookie)?; // idempotent
    assert_eq!(dial(&w.app, &dst, &[])?, Ok("peer".into()));
    assert_eq!(
        dial(&w.peer, &at(w.app.ip4, APP_PORT), &[])?,
        Ok("app".into())
    );
    assert_eq!(sk_lookup_links(&w.app.netns)?, 0);
    assert!(!w.pins.sk_lookup_link(cookie).exists());
    assert_eq!(pod_entries(&w.pins, cookie, &ips)?, Vec::<String>::new());
    assert!(!w.redirector()?.enrolled_cookies()?.contains(&cookie));
    Ok(())
}

#[test]
fn reenroll_is_idempotent_and_drops_what_is_no_longer_wanted() -> anyhow::Result<()> {
    let mut w = RedirectorNode::new("rkreenr", |_| {})?;
    let exclusions = Exclusions {
        outbound_ports: vec![8081],
        inbound_ports: vec![9090],
        ..Exclusions::default()
    };
    w.enroll(&exclusions)?;
    w.enroll(&exclusions)?;
    let cookie = w.app_cookie()?;
    assert_eq!(sk_lookup_links(&w.app.netns)?, 1, "one link per pod");
    assert_eq!(w.redirector()?.enrolled_cookies()?, vec![cookie]);
    assert_eq!(dial(&w.app, &at(w.peer.ip4, 8081), &[])?, Ok("peer".into()));
    let inbound = dial(&w.peer, &at(w.app.ip6, APP_PORT), &[])?;
    assert!(
        inbound.as_ref().is_ok_and(|r| r.starts_with("inbound ")),
        "{inbound:?}"
    );

    // The pod loses its IPv6 address and its exclusions.
    w.enroll_ips(&[IpAddr::V4(w.app.ip4)], &Exclusions::default())?;
    assert_eq!(sk_lookup_links(&w.app.netns)?, 1);
    let dst = at(w.peer.ip4, 8081);
    assert_eq!(dial(&w.app, &dst, &[])?, Ok(format!("orig={dst}")));
    let inbound = dial(&w.peer, &at(w.app.ip4, 9090), &[])?;
    assert!(
        inbound.as_ref().is_ok_and(|r| r.starts_with("inbound ")),
        "{inbound:?}"
    );
    assert_eq!(
        dial(&w.peer, &at(w.app.ip6, APP_PORT), &[])?,
        Ok("app".into())
    );
    let ips = [IpAddr::V4(w.app.ip4), IpAddr::V6(w.app.ip6)];
    let a4 = w.app.ip4;
    assert_eq!(
        pod_entries(&w.pins, cookie, &ips)?,
        [
            "enrolled_netns".to_string(),
            format!("listener {a4}:15006"),
            format!("listener {a4}:15008"),
            format!("pod_inbound {a4}"),
        ],
        "stale entries left"
    );
    Ok(())
}

#[test]
fn restarted_agent_readopts_and_unenrolls_from_the_maps() -> anyhow::Result<()> {
    let mut w = RedirectorNode::new("rkrestart", |_| {})?;
    let exclusions = Exclusions {
        outbound_ports: vec![8081],
        outbound_cidrs: vec![format!("{}/32", w.other.ip4).parse()?],
        inbound_ports: vec![9090],
        ..Exclusions::default()
    };
    w.enroll(&exclusions)?;
    let cookie = w.app_cookie()?;
    let ips = [IpAddr::V4(w.app.ip4), IpAddr::V6(w.app.ip6)];
    let options = RedirectorOptions::new(w.node.cgroup().path().to_path_buf(), w.pins.clone());
    let restart = |w: &mut RedirectorNode| -> anyhow::Result<()> {
        if let Some(r) = w.redirector.take() {
            r.shutdown(ExitMode::Keep)?;
        }
        w.redirector = Some(Redirector::attach(&options)?);
        Ok(())
    };

    // Capture survives the restart: the previous generation's sk_lookup
    // link stays until the pod is enrolled again.
    restart(&mut w)?;
    assert_eq!(w.redirector()?.enrolled_cookies()?, vec![cookie]);
    let inbound = dial(&w.peer, &at(w.app.ip4, APP_PORT), &[])?;
    assert!(
        inbound.as_ref().is_ok_and(|r| r.starts_with("inbound ")),
        "{inbound:?}"
    );

    // Re-adoption replaces the link and drops an exclusion the new
    // registration lacks, though this agent never saw the old one.
    let fewer = Exclusions {
        outbound_ports: vec![],
        ..exclusions.clone()
    };
    w.enroll(&fewer)?;
    assert_eq!(sk_lookup_links(&w.app.netns)?, 1);
    let dst = at(w.peer.ip4, 8081);
    assert_eq!(dial(&w.app, &dst, &[])?, Ok(format!("orig={dst}")));
    assert_eq!(
        dial(&w.app, &at(w.other.ip4, APP_PORT), &[])?,
        Ok("other".into())
    );

    // A second restart, then unenroll with an empty registry.
    restart(&mut w)?;
    w.redirector()?.unenroll_pod(cookie)?;
    assert_eq!(sk_lookup_links(&w.app.netns)?, 0);
    assert_eq!(pod_entries(&w.pins, cookie, &ips)?, Vec::<String>::new());
    assert_eq!(
        dial(&w.peer, &at(w.app.ip4, APP_PORT), &[])?,
        Ok("app".into())
    );
    Ok(())
}

#[test]
fn enroll_refuses_listeners_sk_lookup_could_not_use() -> anyhow::Result<()> {
    let mut w = RedirectorNode::new("rkbadlsn", |_| {})?;
    let cookie = w.app_cookie()?;
    let ips = [IpAddr::V4(w.app.ip4), IpAddr::V6(w.app.ip6)];
    let netns = File::open(w.app.netns.path())?;
    let udp = w
        .app
        .netns
        .run(|| std::net::UdpSocket::bind("[::]:15006"))??;
    let v4_only = w.app.netns.run(|| TcpListener::bind("0.0.0.0:15016"))??;
    let good = w
        .engine
        .hbone_fd
        .as_ref()
        .ok_or_else(|| anyhow::anyhow!("no hbone listener"))?
        .try_clone()?;
    let exclusions = Exclusions::default();
    for (inbound, reason) in [
        (udp.as_fd(), "not a TCP socket"),
        (v4_only.as_fd(), "IPv6 connections"),
    ] {
        let capture = PodCapture {
            netns_cookie: cookie,
            netns: netns.as_fd(),
            ips: &ips,
            node_addr: None,
            exclusions: &exclusions,
            inbound_listener: inbound,
            hbone_listener: good.as_fd(),
            dns_capture: false,
        };
        let err = w
            .redirector()?
            .enroll_pod(&capture)
            .err()
            .ok_or_else(|| anyhow::anyhow!("enrolled with an unusable listener"))?;
        assert!(err.to_string().contains(reason), "{err}");
    }
    // Refused before anything was written.
    assert_eq!(pod_entries(&w.pins, cookie, &ips)?, Vec::<String>::new());
    assert_eq!(sk_lookup_links(&w.app.netns)?, 0);
    Ok(())
}

#[test]
fn detach_shutdown_removes_every_link() -> anyhow::Result<()> {
    let mut w = RedirectorNode::new("rkdetach", |_| {})?;
    w.enroll(&Exclusions::default())?;
    assert_eq!(sk_lookup_links(&w.app.netns)?, 1);
    if let Some(r) = w.redirector.take() {
        r.shutdown(ExitMode::Detach)?;
    }
    assert_eq!(sk_lookup_links(&w.app.netns)?, 0);
    assert!(!w.pins.dir().exists());
    assert_eq!(
        dial(&w.app, &at(w.peer.ip4, APP_PORT), &[])?,
        Ok("peer".into())
    );
    assert_eq!(
        dial(&w.peer, &at(w.app.ip4, APP_PORT), &[])?,
        Ok("app".into())
    );
    Ok(())
}
