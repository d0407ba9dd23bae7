//! Multi-network (ztunnel `NETWORK`, `src/state.rs` `load_balance`,
//! `src/proxy/outbound.rs` double HBONE): a service's endpoint on another
//! network is not chosen when it has no network gateway, so every
//! connection goes to the one on the client's network; one behind a
//! gateway is reached through it, the gateway (a stand-in in a pod of its
//! own) seeing only the outer tunnel; the node's network shows in the
//! config dump.

use std::{
    net::{IpAddr, SocketAddr},
    sync::Arc,
};

use dataplane_tests::{
    gateway::GatewayStandIn,
    mesh::{ECHO_VIP, NAMESPACE, TwoNodes, endpoint_of, service},
    observe::{scrape, sum_matching},
    traffic::{echo, echo_server, http, wait_until},
};
use dataplane_user::config::{LocalConfig, Waypoint, Workload};

#[test]
fn an_endpoint_on_another_network_without_a_gateway_is_never_chosen() -> anyhow::Result<()> {
    let w = TwoNodes::new("mnet")?;
    // node1 (client, local) is network `east`; `remote` on node2 is on
    // `west` and has an address but no gateway: ztunnel's
    // `build_request_wrong_network` case.
    let mut config = w.echo_config();
    for workload in &mut config.workloads {
        let workload = Arc::make_mut(workload);
        workload.network = if workload.name == "remote" {
            "west".into()
        } else {
            "east".into()
        };
    }
    let path = w.write(&config)?;
    let a1 = w.agent("mnet", 1, &path, &["--network", "east"])?;
    let _a2 = w.agent("mnet", 2, &path, &["--network", "west"])?;
    let local = echo_server(&w.local, 9000)?;
    let remote = echo_server(&w.remote, 9000)?;
    // With the network ignored, each connection would reach `remote` with
    // chance 1/2 (round robin in the proxy, a uniform draw in the kernel's
    // fast path): 32 connections all at `local` is then 1 in 4 * 10^9.
    const CONNECTIONS: u64 = 32;
    let vip = SocketAddr::new(ECHO_VIP, 80);
    for seed in 0..CONNECTIONS {
        echo(&w.client, vip, 100, seed)?;
    }
    assert_eq!(
        (local.drain().len() as u64, remote.drain().len()),
        (CONNECTIONS, 0),
        "(local, remote) connections"
    );

    // The node's network where ztunnel's dump has it (its `config`; ours
    // is the agent's).
    let (status, text) = http(a1.admin_addr()?, "GET", "/config_dump")?;
    anyhow::ensure!(status == 200, "{text}");
    let dump: serde_json::Value = serde_json::from_str(&text)?;
    assert_eq!(
        dump["agentConfig"]["network"], "east",
        "{}",
        dump["agentConfig"]
    );
    Ok(())
}

/// The far service's VIP.
const FAR_VIP: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(10, 96, 0, 20));

#[test]
fn an_endpoint_behind_a_network_gateway_is_reached_by_double_hbone() -> anyhow::Result<()> {
    let w = TwoNodes::new("mngw")?;
    // `far`'s one endpoint, `remote`, is on `west` behind the gateway
    // `plain` stands in for (node2, a pod of its own, out of the mesh
    // agents' hands); the client is on `east`.
    let mut far = service("far", NAMESPACE, FAR_VIP, &[(80, 9000)]);
    far.subject_alt_names = vec!["cluster.local/ns/test/sa/remote".to_owned()];
    let gateway_ip = IpAddr::from(w.plain.ip4);
    let mut workloads = w.workloads();
    for workload in &mut workloads {
        workload.network = if workload.name == "remote" {
            endpoint_of(workload, &far);
            workload.network_gateway = Some(Box::new(Waypoint {
                address: Some(gateway_ip),
                hostname: None,
                hbone_port: 15008,
            }));
            "west".into()
        } else {
            "east".into()
        };
    }
    workloads.push(Workload {
        uid: "uid-eastwest".into(),
        name: "eastwest".into(),
        namespace: "istio-system".into(),
        service_account: "eastwest".into(),
        trust_domain: "cluster.local".into(),
        workload_ips: vec![gateway_ip],
        network: "west".into(),
        ..Workload::default()
    });
    let config = LocalConfig {
        workloads: workloads.into_iter().map(Arc::new).collect(),
        services: vec![far.clone()],
        ..LocalConfig::default()
    };
    let path = w.write(&config)?;
    let _a1 = w.agent("mngw", 1, &path, &["--network", "east"])?;
    let a2 = w.agent("mngw", 2, &path, &["--network", "west"])?;
    let gateway = GatewayStandIn::start(
        &w.plain,
        15008,
        &w.shared_ca(),
        ("istio-system", "eastwest"),
        &[(far.hostname.as_str(), w.remote.ip4.into())],
    )?;
    let server = echo_server(&w.remote, 9000)?;

    const CONNECTIONS: u64 = 4;
    for seed in 0..CONNECTIONS {
        // The app gets the client's bytes (and echoes them back).
        echo(&w.client, SocketAddr::new(FAR_VIP, 80), 4096, seed)?;
    }
    assert_eq!(server.drain().len() as u64, CONNECTIONS);
    // Every one went through the gateway, asked for the service by name
    // (ztunnel `HboneAddress::SvcHostname`) with the outer tunnel's
    // headers, not the inner one's origin network.
    let requests = gateway.requests();
    assert_eq!(requests.len() as u64, CONNECTIONS, "{requests:?}");
    for request in &requests {
        assert_eq!(request.authority, format!("{}:80", far.hostname));
        assert!(request.headers.contains_key("baggage"), "{request:?}");
        assert!(request.headers.contains_key("traceparent"), "{request:?}");
        assert!(request.headers.contains_key("forwarded"), "{request:?}");
        assert!(
            !request.headers.contains_key("x-istio-origin-network"),
            "{request:?}"
        );
    }
    // The destination's node saw the client's own identity: the inner
    // tunnel's mutual TLS ran between the two nodes, through the gateway.
    let client = "spiffe://cluster.local/ns/test/sa/client";
    wait_until("the destination to count the client's connections", || {
        let opened = sum_matching(
            &scrape(&a2)?,
            "istio_tcp_connections_opened_total",
            &[("reporter", "destination"), ("source_principal", client)],
        );
        Ok(opened >= CONNECTIONS as f64)
    })?;
    Ok(())
}
