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
    traffic::{echo, echo_server, http, try_stream, wait_until},
};
use dataplane_user::config::{LocalConfig, Service, Waypoint, Workload};

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
    // `west` reuses the addresses of `client` and `local` (overlapping pod
    // ranges, on no node here): ztunnel keys workloads by network and IP
    // (`src/state/workload.rs` `WorkloadStore::by_addr`) and looks
    // captured traffic up on its own network, so node1 still sees its
    // client on `east` and the choice is unchanged. Were the address
    // taken for `west`'s, the client would be on `west` and reach
    // `remote` alone.
    let shadows: Vec<_> = config
        .workloads
        .iter()
        .filter(|w| w.name == "client" || w.name == "local")
        .map(|w| {
            let mut shadow = (**w).clone();
            shadow.uid = format!("uid-shadow-{}", w.name).into();
            shadow.name = format!("shadow-{}", w.name);
            shadow.service_account = "shadow".into();
            shadow.node = "elsewhere".into();
            shadow.network = "west".into();
            Arc::new(shadow)
        })
        .collect();
    config.workloads.extend(shadows);
    // The VIPs on the client's network, as istiod sends a service's VIPs
    // on its cluster's network: ztunnel looks a VIP up on the client's
    // network only (`src/state.rs` `find_upstream`).
    for service in &mut config.services {
        for vip in &mut service.vips {
            vip.network = "east".into();
        }
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

/// `w`'s workloads with `client` and `local` on `client_network`,
/// `remote` on `west` behind the gateway `plain` stands in for (node2, a
/// pod of its own, out of the agents' hands) as the one endpoint of `far`
/// (whose subjectAltNames name `remote`), and the gateway's workload.
fn far_mesh(w: &TwoNodes, client_network: &str) -> (LocalConfig, Service) {
    let mut far = service("far", NAMESPACE, FAR_VIP, &[(80, 9000)]);
    // As istiod sends them: SPIFFE URIs (ztunnel ignores any other form).
    far.subject_alt_names = vec!["spiffe://cluster.local/ns/test/sa/remote".to_owned()];
    // Its VIP on the client's network, where the client looks it up
    // (ztunnel `find_upstream`: the VIP keyed by the source's network).
    for vip in &mut far.vips {
        vip.network = client_network.into();
    }
    let gateway_ip = IpAddr::from(w.plain.ip4);
    let mut workloads = w.workloads();
    for workload in &mut workloads {
        workload.network = if workload.name == "remote" {
            endpoint_of(workload, &far);
            workload.network_gateway = Some(Box::new(Waypoint {
                address: Some(gateway_ip),
                network: None,
                hostname: None,
                hbone_port: 15008,
            }));
            "west".into()
        } else {
            client_network.into()
        };
    }
    workloads.push(Workload {
        uid: "uid-eastwest".into(),
        name: "eastwest".into(),
        namespace: "istio-system".into(),
        service_account: "eastwest".into(),
        trust_domain: "cluster.local".into(),
        workload_ips: [gateway_ip].into(),
        network: "west".into(),
        ..Workload::default()
    });
    let config = LocalConfig {
        workloads: workloads.into_iter().map(Arc::new).collect(),
        services: vec![far.clone()],
        ..LocalConfig::default()
    };
    (config, far)
}

/// Checks what the gateway was asked: `connections` CONNECTs for `far` by
/// name (ztunnel `HboneAddress::SvcHostname`) with the outer tunnel's
/// headers, not the inner one's origin network.
/// Waits until `agent`, the destination's node proxy, counts `connections`
/// opened by the client pod's own identity (its mutual TLS reached the
/// destination's node, through the gateway).
fn counts_the_clients_connections(
    agent: &dataplane_tests::Agent,
    connections: u64,
) -> anyhow::Result<()> {
    let client = "spiffe://cluster.local/ns/test/sa/client";
    wait_until("the destination to count the client's connections", || {
        let opened = sum_matching(
            &scrape(agent)?,
            "istio_tcp_connections_opened_total",
            &[("reporter", "destination"), ("source_principal", client)],
        );
        Ok(opened >= connections as f64)
    })
}

fn asked_by_name(gateway: &GatewayStandIn, far: &Service, connections: u64) {
    let requests = gateway.requests();
    assert_eq!(requests.len() as u64, connections, "{requests:?}");
    for request in &requests {
        assert_eq!(request.authority, format!("{}:80", far.hostname));
        for header in ["baggage", "traceparent", "forwarded"] {
            assert!(request.headers.contains_key(header), "{request:?}");
        }
        assert!(
            !request.headers.contains_key("x-istio-origin-network"),
            "{request:?}"
        );
    }
}

#[test]
fn an_endpoint_behind_a_network_gateway_is_reached_by_double_hbone() -> anyhow::Result<()> {
    let w = TwoNodes::new("mngw")?;
    let (config, far) = far_mesh(&w, "east");
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
    // Every one went through the gateway.
    asked_by_name(&gateway, &far, CONNECTIONS);
    // The destination's node saw the client's own identity: the inner
    // tunnel's mutual TLS ran between the two nodes, through the gateway.
    counts_the_clients_connections(&a2, CONNECTIONS)?;
    Ok(())
}

/// A gateway that opens the outer tunnel to a node that never answers the
/// inner handshake (a listener on the destination's 15008 that accepts
/// nothing): the client's connection ends in a reset once the inner
/// tunnel gives up opening, never held open for ever nor closed cleanly.
#[test]
fn a_gateway_whose_far_side_never_answers_ends_in_a_reset() -> anyhow::Result<()> {
    let w = TwoNodes::new("mnsi")?;
    let (config, far) = far_mesh(&w, "east");
    let path = w.write(&config)?;
    let _a1 = w.agent("mnsi", 1, &path, &["--network", "east"])?;
    // No agent for the far node: its 15008 completes TCP handshakes from
    // the backlog and never reads.
    let far_node = SocketAddr::from((w.remote.ip4, 15008));
    let _silent = w
        .remote
        .netns
        .run(move || std::net::TcpListener::bind(far_node))??;
    let gateway = GatewayStandIn::start(
        &w.plain,
        15008,
        &w.shared_ca(),
        ("istio-system", "eastwest"),
        &[(far.hostname.as_str(), w.remote.ip4.into())],
    )?;
    let far_vip = SocketAddr::new(FAR_VIP, 80).to_string();
    let out = try_stream(&w.client, &["expect-reset", &far_vip])?;
    assert_eq!(out.stdout, "reset", "{out:?}");
    // It did get as far as the gateway.
    asked_by_name(&gateway, &far, 1);
    Ok(())
}

/// The same double HBONE with Istio's stock ztunnel as the client's node
/// proxy (ignored unless `DATAPLANE_ZTUNNEL` names a ztunnel binary, as
/// `ztunnel_interop`): the gateway stand-in sees the same outer tunnel
/// from it as from our engine (the assertions above), and our engine, the
/// destination's node proxy, serves ztunnel's inner tunnel. istiod (the
/// test one) sends the workloads' networks and the gateway as istiod does.
#[test]
#[ignore = "needs a ztunnel binary in DATAPLANE_ZTUNNEL"]
fn a_stock_ztunnel_reaches_our_engine_through_the_gateway_as_we_do() -> anyhow::Result<()> {
    let binary = dataplane_tests::ztunnel::ztunnel_binary()?;
    let w = TwoNodes::new("mnzt")?;
    // ztunnel's node is on the default network: ztunnel looks service
    // VIPs up on its own network, and the test istiod sends them on the
    // default one.
    let (config, far) = far_mesh(&w, "");
    let path = w.write(&config)?;
    let (rt, pki, mut istiod) = dataplane_tests::istiod::loopback_istiod()?;
    let served = dataplane_tests::mesh::as_istiod_serves(config);
    rt.block_on(istiod.publish_mesh(&served, "1"))?;

    // Node2: our engine, its mesh and certificates from istiod; `remote`
    // is enrolled over the control socket.
    let dataplane_tests::istiod::AgentFiles { root, token, empty } =
        dataplane_tests::istiod::AgentFiles::write(w.dir.path(), &pki, "engine-node2-token")?;
    let mut flags =
        dataplane_tests::istiod::xds_flags(istiod.addr, &root, &token, "dataplane-node2");
    flags.extend(["--cert-source", "istio", "--network", "west"].map(str::to_owned));
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let a2 = w.agent("mnzt", 2, &empty, &flags)?;
    let mut spec = dataplane_tests::Agent::spec_for(&w.remote, "remote");
    spec.service_account = "remote".to_owned();
    let response = a2.enroll(spec)?;
    anyhow::ensure!(response.ok, "enrolling remote: {:?}", response.error);

    // Node1: a stock ztunnel serves the client.
    let istiod1 = rt.block_on(istiod.listen_in(w.n1.netns()))?;
    let node1 = dataplane_tests::ztunnel::ZtunnelServedNode::start(
        &w,
        "mnzt",
        1,
        &path,
        &binary,
        istiod1,
        &pki.root_pem,
    )?;

    // The gateway, with a certificate from istiod's CA.
    dataplane_user::tls::install_provider();
    let identity = "spiffe://cluster.local/ns/istio-system/sa/eastwest";
    let (chain, key) = pki.issue(identity)?;
    let mut server = rustls::ServerConfig::builder_with_provider(dataplane_user::tls::provider())
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(chain, key)?;
    server.alpn_protocols = vec![b"h2".to_vec()];
    let gateway = GatewayStandIn::start_with(
        &w.plain,
        15008,
        Arc::new(server),
        identity.parse()?,
        &[(far.hostname.as_str(), w.remote.ip4.into())],
    )?;
    let server = echo_server(&w.remote, 9000)?;

    const CONNECTIONS: u64 = 2;
    for seed in 0..CONNECTIONS {
        echo(&w.client, SocketAddr::new(FAR_VIP, 80), 4096, seed)
            .map_err(|e| anyhow::anyhow!("{e:#}\nztunnel log:\n{}", node1.ztunnel.log_tail()))?;
    }
    assert_eq!(server.drain().len() as u64, CONNECTIONS);
    asked_by_name(&gateway, &far, CONNECTIONS);
    counts_the_clients_connections(&a2, CONNECTIONS)?;
    drop(rt);
    Ok(())
}
