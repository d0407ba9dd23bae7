//! The same-node fast path against the real kernel: two pods one agent
//! serves on one node talk socket to socket once the agent has allowed the
//! pair (the first connection goes through the proxy and decides it); the
//! kernel counters show which way each connection went, `/metrics` shows
//! the same Istio samples a proxied connection gives, a policy change
//! resets open fast-path connections it now denies, and the switches keep
//! traffic on the proxy.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use dataplane_tests::{
    Agent,
    mesh::{
        ECHO_VIP, NAMESPACE, TwoNodes, addr, endpoint_of, hbone_workload, policy, service, to_ports,
    },
    observe::{Sample, scrape, sum_matching, value},
    traffic::{echo, echo_server, stream, try_stream, wait_until},
};
use dataplane_user::config::{Action, LocalConfig, Scope};

/// Node 1's agent (instance `<tag>1-agent`) on `config`, with `extra`.
fn agent(w: &TwoNodes, tag: &str, config: &LocalConfig, extra: &[&str]) -> anyhow::Result<Agent> {
    let path = w.write(config)?;
    w.agent(tag, 1, &path, extra)
}

/// `(redirected_outbound, fast_path_outbound, fast_path_inbound)`.
fn ways(agent: &Agent) -> anyhow::Result<(u64, u64, u64)> {
    Ok((
        agent.counter("redirected_outbound")?,
        agent.counter("fast_path_outbound")?,
        agent.counter("fast_path_inbound")?,
    ))
}

/// Checks that `proxied` of three connections from `client` to `local`
/// went through the proxy and the rest took the fast path, and that
/// `status` shows the fast path as `shown` for the client and the server.
fn went_and_shown(a1: &Agent, case: &str, proxied: u64, shown: [bool; 2]) -> anyhow::Result<()> {
    let (redirected, fast, _) = ways(a1)?;
    assert_eq!((redirected, fast), (proxied, 3 - proxied), "{case}");
    let fast_path_of = |name| a1.pod_status(name).map(|p| p.fast_path);
    assert_eq!(
        [fast_path_of("client")?, fast_path_of("local")?],
        shown.map(Some),
        "{case}: status"
    );
    Ok(())
}

#[test]
fn a_same_node_pair_goes_socket_to_socket_after_the_first_connection() -> anyhow::Result<()> {
    let w = TwoNodes::new("fpsock")?;
    let a1 = agent(&w, "fps", &w.mesh_config(), &[])?;
    let _server = echo_server(&w.local, 9000)?;
    let _other = echo_server(&w.local, 9001)?;
    let dst = addr(&w.local, 9000);

    // The first connection of the pair goes through the proxy and decides it.
    echo(&w.client, dst, 1000, 1)?;
    assert_eq!(ways(&a1)?, (1, 0, 0));
    // The next ones go socket to socket, IPv4 and IPv4-mapped alike.
    echo(&w.client, dst, 1000, 2)?;
    let mapped = SocketAddr::new(w.local.ip4.to_ipv6_mapped().into(), 9000);
    echo(&w.client, mapped, 1000, 3)?;
    let (redirected, fast_out, fast_in) = ways(&a1)?;
    assert_eq!((redirected, fast_out), (1, 2));
    // sk_lookup runs per SYN: a retransmitted SYN counts again.
    assert!(fast_in >= 2, "fast_path_inbound = {fast_in}");
    // The verdict is per destination port: another port decides again.
    echo(&w.client, addr(&w.local, 9001), 10, 4)?;
    assert_eq!(ways(&a1)?.0, 2);
    // IPv6 is a destination of its own.
    let v6 = SocketAddr::new(w.local.ip6.into(), 9000);
    echo(&w.client, v6, 10, 5)?;
    echo(&w.client, v6, 10, 6)?;
    let (redirected, fast_out, _) = ways(&a1)?;
    assert_eq!((redirected, fast_out), (3, 3));

    // Telemetry: the kernel's close records become the same samples,
    // reported by both sides, with both identities and the fast path named.
    let fast = [
        ("connection_security_policy", "fast_path"),
        (
            "source_principal",
            "spiffe://cluster.local/ns/test/sa/client",
        ),
        (
            "destination_principal",
            "spiffe://cluster.local/ns/test/sa/local",
        ),
        ("destination_workload", "local"),
    ];
    let with = |reporter| {
        let mut labels = fast.to_vec();
        labels.push(("reporter", reporter));
        labels
    };
    wait_until("three fast-path closes in the metrics", || {
        let samples = scrape(&a1)?;
        Ok(sum_matching(
            &samples,
            "istio_tcp_connections_closed_total",
            &with("source"),
        ) >= 3.0)
    })?;
    let samples = scrape(&a1)?;
    for reporter in ["source", "destination"] {
        let labels = with(reporter);
        let count = |name| sum_matching(&samples, name, &labels);
        assert_eq!(
            count("istio_tcp_connections_opened_total"),
            3.0,
            "{reporter}"
        );
        assert_eq!(
            count("istio_tcp_connections_closed_total"),
            3.0,
            "{reporter}"
        );
        // The client sent 1000 + 1000 + 10 bytes and got as many back.
        assert_eq!(
            count("istio_tcp_received_bytes_total"),
            2010.0,
            "{reporter}"
        );
        assert_eq!(count("istio_tcp_sent_bytes_total"), 2010.0, "{reporter}");
    }
    assert_eq!(a1.counter("fast_path_record_lost")?, 0);
    Ok(())
}

#[test]
fn a_policy_change_resets_open_fast_path_connections_it_denies() -> anyhow::Result<()> {
    let w = TwoNodes::new("fppol")?;
    let config = w.mesh_config();
    let a1 = agent(&w, "fpp", &config, &[])?;
    let _echo = echo_server(&w.local, 9001)?;
    let _echo2 = echo_server(&w.local, 9002)?;
    // Decide both pairs through the proxy.
    echo(&w.client, addr(&w.local, 9001), 10, 1)?;
    echo(&w.client, addr(&w.local, 9002), 10, 1)?;
    let before = ways(&a1)?;
    let outcome = std::thread::scope(|scope| -> anyhow::Result<String> {
        let holder = scope.spawn(|| {
            stream(
                &w.client,
                &["hold-end", &addr(&w.local, 9001).to_string(), "30"],
            )
        });
        wait_until("the held connection to take the fast path", || {
            Ok(ways(&a1)?.1 > before.1)
        })?;
        let mut lockdown = config.clone();
        lockdown.policies = vec![policy(
            "lockdown",
            NAMESPACE,
            Scope::Namespace,
            Action::Deny,
            to_ports(&[9001]),
        )];
        w.write(&lockdown)?;
        holder
            .join()
            .map_err(|_| anyhow::anyhow!("holder panicked"))?
    })?;
    assert_eq!(
        outcome, "reset",
        "the denied fast-path connection was reset"
    );
    // The verdicts went with the old state: the next connection to a port
    // still allowed goes through the proxy again (and decides anew) ...
    let redirected = ways(&a1)?.0;
    echo(&w.client, addr(&w.local, 9002), 10, 2)?;
    assert_eq!(ways(&a1)?.0, redirected + 1);
    // ... and the denied one is refused by the proxy.
    let denied = stream(
        &w.client,
        &["expect-reset", &addr(&w.local, 9001).to_string()],
    )?;
    assert_eq!(denied, "reset");
    assert_eq!(ways(&a1)?.0, redirected + 2);
    Ok(())
}

#[test]
fn the_switches_keep_pairs_on_the_proxy() -> anyhow::Result<()> {
    // (case, server's and client's workload setting, agent flags,
    // connections through the proxy out of three, `status`'s fast path for
    // the client and the server)
    type Case<'a> = (&'a str, Option<bool>, &'a [&'a str], u64, [bool; 2]);
    let cases: [Case; 3] = [
        (
            "off mesh-wide",
            None,
            &["--fast-path", "off"],
            3,
            [false; 2],
        ),
        (
            "the server's workload opts out",
            Some(false),
            &[],
            3,
            [true, false],
        ),
        (
            "off mesh-wide, both workloads opt in",
            Some(true),
            &["--fast-path", "off"],
            1,
            [true; 2],
        ),
    ];
    for (n, (case, setting, flags, proxied, shown)) in cases.into_iter().enumerate() {
        let w = TwoNodes::new(&format!("fpsw{n}"))?;
        let _server = echo_server(&w.local, 9000)?;
        let mut config = w.mesh_config();
        for workload in &mut config.workloads {
            let workload = std::sync::Arc::make_mut(workload);
            if workload.name == "local" || setting == Some(true) {
                workload.fast_path = setting;
            }
        }
        let a1 = agent(&w, &format!("fpw{n}"), &config, flags)?;
        for seed in 0..3 {
            echo(&w.client, addr(&w.local, 9000), 10, seed)?;
        }
        went_and_shown(&a1, case, proxied, shown)?;
    }
    Ok(())
}

#[test]
fn a_pods_own_setting_decides_over_its_workload_and_the_agent() -> anyhow::Result<()> {
    // Pods enrolled over the control socket (as the Kubernetes reconciler
    // and the CNI plugin enroll them, with the pod's `dataplane/fast-path`
    // annotation): (case, the client's and the server's own setting, the
    // server's workload setting, agent flags, connections through the
    // proxy out of three, `status`'s fast path for the client and the
    // server).
    type Case<'a> = (
        &'a str,
        [Option<bool>; 2],
        Option<bool>,
        &'a [&'a str],
        u64,
        [bool; 2],
    );
    let cases: [Case; 3] = [
        (
            "the server pod opts out",
            [None, Some(false)],
            None,
            &[],
            3,
            [true, false],
        ),
        (
            "the server pod opts in, its workload out",
            [None, Some(true)],
            Some(false),
            &[],
            1,
            [true, true],
        ),
        (
            "off mesh-wide, both pods opt in",
            [Some(true), Some(true)],
            None,
            &["--fast-path", "off"],
            1,
            [true, true],
        ),
    ];
    for (n, (case, own, workload_setting, flags, proxied, shown)) in cases.into_iter().enumerate() {
        let w = TwoNodes::new(&format!("fpown{n}"))?;
        let _server = echo_server(&w.local, 9000)?;
        let mut config = w.mesh_config();
        for workload in &mut config.workloads {
            let workload = std::sync::Arc::make_mut(workload);
            if workload.name == "client" || workload.name == "local" {
                workload.netns = None;
            }
            if workload.name == "local" {
                workload.fast_path = workload_setting;
            }
        }
        let a1 = agent(&w, &format!("fpo{n}"), &config, flags)?;
        for ((pod, name), setting) in [(&w.client, "client"), (&w.local, "local")]
            .into_iter()
            .zip(own)
        {
            let mut spec = Agent::spec_for(pod, name);
            spec.service_account = name.to_owned();
            spec.fast_path = setting;
            let response = a1.enroll(spec)?;
            anyhow::ensure!(
                response.ok,
                "{case}: enrolling {name}: {:?}",
                response.error
            );
        }
        for seed in 0..3 {
            echo(&w.client, addr(&w.local, 9000), 10, seed)?;
        }
        went_and_shown(&a1, case, proxied, shown)?;
    }
    Ok(())
}

/// Closed connections to the service `hostname` reported by their source,
/// with `policy` as their `connection_security_policy`, to `workload`.
fn closes(samples: &[Sample], hostname: &str, policy: &str, workload: &str) -> f64 {
    let labels = [
        ("reporter", "source"),
        ("destination_service", hostname),
        ("connection_security_policy", policy),
        ("destination_workload", workload),
    ];
    sum_matching(samples, "istio_tcp_connections_closed_total", &labels)
}

/// A VIP of a service whose endpoints are all on node1.
const PAIR_VIP4: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 20);
/// [`PAIR_VIP4`] as an address.
const PAIR_VIP: IpAddr = IpAddr::V4(PAIR_VIP4);
/// The same service's IPv6 VIP.
const PAIR_VIP6: IpAddr = IpAddr::V6(Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x20));

#[test]
fn a_service_whose_endpoints_are_all_on_the_node_goes_socket_to_socket() -> anyhow::Result<()> {
    let mut w = TwoNodes::new("fpsvc")?;
    let local2 = w.n1.add_pod("fpsvc")?;
    // `pair` (dual-stack) has both endpoints on node1, `local2` on target
    // port 9001; `echo` has one endpoint on node2.
    let mut pair = service("pair", NAMESPACE, PAIR_VIP, &[(80, 9000)]);
    pair.vips.push(PAIR_VIP6.into());
    let mut config = w.echo_config();
    for workload in config.workloads.iter_mut().filter(|w| w.name == "local") {
        let workload = std::sync::Arc::make_mut(workload);
        endpoint_of(workload, &pair);
    }
    let mut second = hbone_workload(&local2, "local2", "node1");
    second
        .services
        .insert(pair.key(), [(80, 9001)].into_iter().collect());
    config.workloads.push(second.into());
    config.services.push(pair);
    let a1 = agent(&w, "fpv", &config, &[])?;
    let _first = echo_server(&w.local, 9000)?;
    let _second = echo_server(&local2, 9001)?;
    let vip = SocketAddr::new(PAIR_VIP, 80);

    // The first connection goes through the proxy and decides the pair.
    echo(&w.client, vip, 100, 1)?;
    assert_eq!(ways(&a1)?, (1, 0, 0));
    // The next ones go socket to socket, to an endpoint the kernel chose,
    // IPv4 and IPv4-mapped alike.
    for seed in 2..21 {
        echo(&w.client, vip, 100, seed)?;
    }
    let mapped = SocketAddr::new(PAIR_VIP4.to_ipv6_mapped().into(), 80);
    echo(&w.client, mapped, 100, 21)?;
    let (redirected, fast, _) = ways(&a1)?;
    assert_eq!((redirected, fast), (1, 20));
    assert_eq!(a1.counter("fast_path_service")?, 20);
    // The application sees the VIP as its peer, as after kube-proxy.
    let peer = stream(&w.client, &["peer", &vip.to_string()])?;
    assert_eq!(peer.trim(), vip.to_string());

    // Each close is the service's, and both endpoints had a share (the
    // chance that 21 uniform choices all fell on one is 1 in 10^6).
    let closed = |samples: &_, workload| {
        closes(
            samples,
            "pair.test.svc.cluster.local",
            "fast_path",
            workload,
        )
    };
    wait_until("21 fast-path closes of the service", || {
        let samples = scrape(&a1)?;
        Ok(closed(&samples, "local") + closed(&samples, "local2") >= 21.0)
    })?;
    let samples = scrape(&a1)?;
    let shares = [closed(&samples, "local"), closed(&samples, "local2")];
    assert!(shares.iter().all(|n| *n >= 1.0), "shares {shares:?}");
    assert_eq!(shares[0] + shares[1], 21.0);

    // The IPv6 VIP is a destination of its own, with the endpoints' IPv6
    // addresses.
    let vip6 = SocketAddr::new(PAIR_VIP6, 80);
    for seed in 40..43 {
        echo(&w.client, vip6, 100, seed)?;
    }
    let (redirected, fast, _) = ways(&a1)?;
    assert_eq!((redirected, fast), (2, 23));
    assert_eq!(a1.counter("fast_path_service")?, 23);

    // A policy that denies `local2` leaves it to the proxy, which refuses
    // the connections the kernel draws for it; the kernel keeps taking
    // `local`.
    let applied = || -> anyhow::Result<f64> {
        let samples = scrape(&a1)?;
        let labels = [("result", "applied")];
        Ok(value(&samples, "dataplane_config_reloads_total", &labels).unwrap_or(0.0))
    };
    let before = applied()?;
    let mut denied = config.clone();
    denied.policies = vec![policy(
        "no-9001",
        NAMESPACE,
        Scope::Namespace,
        Action::Deny,
        to_ports(&[9001]),
    )];
    w.write(&denied)?;
    wait_until("the policy to apply", || Ok(applied()? > before))?;
    // The verdicts went with the old state: a connection through the proxy
    // decides anew.
    let attempt = |seed: u64| {
        try_stream(
            &w.client,
            &["echo", &vip.to_string(), "10", &seed.to_string()],
        )
    };
    wait_until("a connection through the proxy", || {
        attempt(50)?;
        Ok(ways(&a1)?.0 > redirected)
    })?;
    let ((redirected, fast, _), left) = (ways(&a1)?, a1.counter("fast_path_service_proxied")?);
    let mut delivered = 0;
    for seed in 51..71 {
        delivered += u64::from(attempt(seed)?.code == Some(0));
    }
    let (taken, proxied) = (
        ways(&a1)?.1 - fast,
        a1.counter("fast_path_service_proxied")? - left,
    );
    assert_eq!(taken + proxied, 20);
    assert!(
        taken >= 1 && proxied >= 1,
        "taken {taken}, proxied {proxied}"
    );
    assert_eq!(ways(&a1)?.0 - redirected, proxied);
    // Only the kernel's reached an app: the proxy's all went to `local2`.
    assert_eq!(delivered, taken);
    Ok(())
}

#[test]
fn a_service_with_an_endpoint_elsewhere_shares_its_connections_with_the_proxy() -> anyhow::Result<()>
{
    // `echo` has one endpoint on each node.
    let w = TwoNodes::new("fpsplit")?;
    let path = w.write(&w.echo_config())?;
    let a1 = w.agent("fpx", 1, &path, &[])?;
    let _a2 = w.agent("fpx", 2, &path, &[])?;
    let _local = echo_server(&w.local, 9000)?;
    let _remote = echo_server(&w.remote, 9000)?;
    let vip = SocketAddr::new(ECHO_VIP, 80);

    // The first connection goes through the proxy and decides the pair;
    // then the kernel draws between the two endpoints for each connection,
    // takes the local one's and leaves the remote one's to the proxy.
    echo(&w.client, vip, 10, 1)?;
    assert_eq!(ways(&a1)?, (1, 0, 0));
    for seed in 2..22 {
        echo(&w.client, vip, 10, seed)?;
    }
    let taken = a1.counter("fast_path_service")?;
    let left = a1.counter("fast_path_service_proxied")?;
    assert_eq!(taken + left, 20);
    // The chance that 20 uniform draws all fell on one is 1 in 500,000.
    assert!(taken >= 1 && left >= 1, "taken {taken}, left {left}");
    assert_eq!(ways(&a1)?.0, 1 + left);

    // The proxy gave its share to the remote endpoint alone, so each
    // endpoint got what it would have got from the proxy.
    let closed = |samples: &_, policy, workload| {
        closes(samples, "echo.test.svc.cluster.local", policy, workload)
    };
    let all = |samples: &_| {
        closed(samples, "fast_path", "local")
            + closed(samples, "mutual_tls", "local")
            + closed(samples, "mutual_tls", "remote")
    };
    wait_until(
        "21 closes in the metrics",
        || Ok(all(&scrape(&a1)?) >= 21.0),
    )?;
    let samples = scrape(&a1)?;
    assert_eq!(closed(&samples, "fast_path", "local"), taken as f64);
    // The deciding connection may have gone to either.
    let proxied_local = closed(&samples, "mutual_tls", "local");
    assert!(proxied_local <= 1.0, "{proxied_local} proxied to local");
    assert_eq!(
        closed(&samples, "mutual_tls", "remote") + proxied_local,
        (1 + left) as f64
    );
    Ok(())
}
