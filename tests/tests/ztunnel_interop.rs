//! A stock Istio ztunnel, started as Istio's chart starts it (in-pod mode;
//! workloads from istiod's xDS, certificates from istiod's CA, trusting
//! istiod's root and presenting its token from the paths the chart mounts;
//! its ZDS client pointed at the agent's socket), serves the pods the
//! agents enroll with `--engine ztunnel`: the agents hand it each pod's
//! network namespace and their kernel programs capture, with no iptables
//! rule anywhere. istiod is the test control plane ([`TestIstiod`]),
//! listening on each node's loopback.
//!
//! Istio's ztunnel is not published to any registry these machines reach,
//! so this test is ignored unless asked for: build ztunnel from Istio's
//! sources (e.g. `--no-default-features --features tls-ring`) and run
//! `DATAPLANE_ZTUNNEL=/path/to/ztunnel cargo test -p dataplane-tests --test ztunnel_interop -- --ignored`.
//! The protocol and the capture are proven on every CI run by
//! `ztunnel_mode`, `zds_server` and `external_proxy`, against stand-ins
//! that behave as ztunnel does.

use std::{
    net::{IpAddr, SocketAddr},
    path::Path,
    process::Command,
    sync::{Arc, Mutex, PoisonError},
    time::{Duration, Instant},
};

use anyhow::Result;
use dataplane_tests::{
    TempDir,
    istiod::{AgentFiles, TestIstiod, TestPki, xds_flags},
    mesh::{NAMESPACE, TwoNodes, addr},
    responder::Responder,
    topology::{Node, Pod},
    traffic::{echo, echo_server, stream},
    ztunnel::{
        self, Ztunnel, ZtunnelHome, ZtunnelServedNode, start_ztunnel, wait_captured, ztunnel_binary,
    },
};

/// The test istiod, on the runtime that drives it, with its CA, serving
/// `w`'s workloads (istiod knows nothing of network namespaces) and no
/// policies.
fn istiod_serving(w: &TwoNodes) -> Result<(tokio::runtime::Runtime, TestPki, TestIstiod)> {
    let (rt, pki, istiod) = dataplane_tests::istiod::loopback_istiod()?;
    let mesh = dataplane_tests::mesh::as_istiod_serves(w.mesh_config());
    rt.block_on(istiod.publish_mesh(&mesh, "1"))?;
    Ok((rt, pki, istiod))
}

/// The identities whose certificates istiod's CA signed for the ztunnel
/// presenting `token`.
fn signed_for(istiod: &TestIstiod, token: &str) -> Vec<String> {
    let bearer = format!("Bearer {token}");
    let mut ids: Vec<String> = istiod
        .csrs
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .iter()
        .filter(|csr| csr.authorization.as_deref() == Some(bearer.as_str()))
        .filter_map(|csr| csr.impersonated.clone())
        .collect();
    ids.sort();
    ids.dedup();
    ids
}

/// The client address the app saw for the next connection it served.
fn seen_by(app: &Responder) -> anyhow::Result<IpAddr> {
    let request = app
        .next_request(Duration::from_secs(20))
        .ok_or_else(|| anyhow::anyhow!("the app served no connection"))?;
    Ok(request.peer.ip().to_canonical())
}

/// ztunnel's Prometheus text, from its stats port in `node`'s namespace.
fn ztunnel_metrics(node: &Node) -> anyhow::Result<String> {
    ztunnel::metrics(node.netns())
}

/// The sum of `istio_tcp_connections_opened_total` samples whose labels
/// contain every one of `labels`.
fn opened(metrics: &str, labels: &[&str]) -> u64 {
    metrics
        .lines()
        .filter(|l| l.starts_with("istio_tcp_connections_opened_total{"))
        .filter(|l| labels.iter().all(|want| l.contains(want)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// Every `-A` rule `iptables-save` and `ip6tables-save` print in `netns`.
fn iptables_rules(netns: &dataplane_tests::netns::Netns) -> anyhow::Result<Vec<String>> {
    let mut rules = Vec::new();
    for tool in ["iptables-save", "ip6tables-save"] {
        let out = Command::new("ip")
            .args(["netns", "exec", netns.name(), tool])
            .output()?;
        rules.extend(
            String::from_utf8_lossy(&out.stdout)
                .lines()
                .filter(|l| l.starts_with("-A"))
                .map(str::to_owned),
        );
    }
    Ok(rules)
}

#[test]
#[ignore = "needs a ztunnel binary in DATAPLANE_ZTUNNEL"]
fn stock_ztunnel_captures_and_tunnels_enrolled_pods() -> anyhow::Result<()> {
    let binary = ztunnel_binary()?;
    let w = TwoNodes::new("ztio")?;
    let config = w.config()?;
    let (zds1, zds2) = (
        w.dir.path().join("zds1.sock"),
        w.dir.path().join("zds2.sock"),
    );
    let engine = |zds: &Path| {
        vec![
            "--engine".to_owned(),
            "ztunnel".to_owned(),
            "--zds-socket".to_owned(),
            zds.display().to_string(),
        ]
    };
    let (e1, e2) = (engine(&zds1), engine(&zds2));
    let e1: Vec<&str> = e1.iter().map(String::as_str).collect();
    let e2: Vec<&str> = e2.iter().map(String::as_str).collect();
    let a1 = w.agent("zi", 1, &config, &e1)?;
    let a2 = w.agent("zi", 2, &config, &e2)?;

    // istiod serves the mesh's workloads and no policies, on each node's
    // loopback.
    let (rt, pki, mut istiod) = istiod_serving(&w)?;
    let logs = TempDir::new("ztlog")?;
    let home1 = ZtunnelHome::new(
        logs.path(),
        "node1",
        rt.block_on(istiod.listen_in(w.n1.netns()))?,
        &pki.root_pem,
    )?;
    let home2 = ZtunnelHome::new(
        logs.path(),
        "node2",
        rt.block_on(istiod.listen_in(w.n2.netns()))?,
        &pki.root_pem,
    )?;
    let z1 = start_ztunnel(&binary, &w.n1, "node1", &zds1, &home1, logs.path())?;
    let z2 = start_ztunnel(&binary, &w.n2, "node2", &zds2, &home2, logs.path())?;
    wait_captured(&a1, &z1)?;
    wait_captured(&a2, &z2)?;

    let local = echo_server(&w.local, 9000)?;
    let remote = echo_server(&w.remote, 9000)?;
    echo(&w.client, addr(&w.local, 9000), 64, 1)?;
    assert_eq!(seen_by(&local)?, IpAddr::from(w.client.ip4), "same node");
    echo(&w.client, addr(&w.remote, 9000), 4096, 2)?;
    assert_eq!(
        seen_by(&remote)?,
        IpAddr::from(w.client.ip4),
        "across nodes"
    );

    // Through ztunnel, in HBONE: its own telemetry counts both ends.
    let m1 = ztunnel_metrics(&w.n1)?;
    let m2 = ztunnel_metrics(&w.n2)?;
    let mtls = "connection_security_policy=\"mutual_tls\"";
    assert!(
        opened(&m1, &["reporter=\"source\"", mtls]) >= 2,
        "node1's ztunnel did not open the client's connections:\n{m1}"
    );
    assert!(
        opened(&m2, &["reporter=\"destination\"", mtls]) >= 1,
        "node2's ztunnel did not serve the remote connection:\n{m2}"
    );

    // Their workloads came over xDS: each took istiod's Address push.
    let address_pushes =
        "istio_xds_message_total{url=\"type.googleapis.com/istio.workload.Address\"}";
    for (node, m) in [("node1", &m1), ("node2", &m2)] {
        let pushes = m
            .lines()
            .find_map(|l| l.strip_prefix(address_pushes)?.trim().parse::<f64>().ok());
        assert!(
            pushes >= Some(1.0),
            "{node}'s ztunnel took no xDS push:\n{m}"
        );
    }

    // Each ztunnel's certificates came from istiod's CA, asked with its
    // own token, for the workloads of its own node.
    let id = |name: &str| format!("spiffe://cluster.local/ns/{NAMESPACE}/sa/{name}");
    let from1 = signed_for(&istiod, &home1.token);
    let from2 = signed_for(&istiod, &home2.token);
    for name in ["client", "local"] {
        assert!(from1.contains(&id(name)), "node1 asked for {from1:?}");
    }
    assert!(from2.contains(&id("remote")), "node2 asked for {from2:?}");

    // No iptables rule anywhere: not in the nodes, not in the pods.
    for netns in [
        w.n1.netns(),
        w.n2.netns(),
        &w.client.netns,
        &w.local.netns,
        &w.remote.netns,
    ] {
        let rules = iptables_rules(netns)?;
        assert!(rules.is_empty(), "{}: {rules:?}", netns.name());
    }

    // ztunnel restarts: the agent sends it the snapshot again and points
    // the kernel at the new listeners.
    drop(z1);
    let z1 = start_ztunnel(&binary, &w.n1, "node1", &zds1, &home1, logs.path())?;
    wait_captured(&a1, &z1)?;
    echo(&w.client, addr(&w.remote, 9000), 64, 3)?;
    assert_eq!(
        seen_by(&remote)?,
        IpAddr::from(w.client.ip4),
        "after restart"
    );
    Ok(())
}

/// Our engine and a stock ztunnel carry each other's HBONE. Node1's agent
/// runs our engine, its mesh and its pods' certificates from istiod;
/// node2's pod is served by a stock ztunnel on the same istiod. Each
/// client speaks first, so our engine sends its first bytes with the
/// CONNECT request, before ztunnel's 200 (HTTP/2 allows it; ztunnel
/// buffers them until its connection to the app is up).
#[test]
#[ignore = "needs a ztunnel binary in DATAPLANE_ZTUNNEL"]
fn our_engine_and_a_stock_ztunnel_tunnel_both_ways() -> anyhow::Result<()> {
    let binary = ztunnel_binary()?;
    let w = TwoNodes::new("ztmx")?;
    let (rt, pki, mut istiod) = istiod_serving(&w)?;

    // Node1: our engine, its mesh and certificates from istiod; its pods
    // are enrolled over the control socket.
    let AgentFiles { root, token, empty } =
        AgentFiles::write(w.dir.path(), &pki, "engine-node1-token")?;
    let mut flags = xds_flags(istiod.addr, &root, &token, "dataplane-node1");
    flags.extend(["--cert-source", "istio"].map(str::to_owned));
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let a1 = w.agent("zm", 1, &empty, &flags)?;
    for (pod, name) in [(&w.client, "client"), (&w.local, "local")] {
        let mut spec = dataplane_tests::Agent::spec_for(pod, name);
        spec.service_account = name.to_owned();
        let response = a1.enroll(spec)?;
        anyhow::ensure!(response.ok, "enrolling {name}: {:?}", response.error);
    }

    // Node2: a stock ztunnel serves its pod.
    let config = w.config()?;
    let istiod2 = rt.block_on(istiod.listen_in(w.n2.netns()))?;
    let node2 = ZtunnelServedNode::start(&w, "zm", 2, &config, &binary, istiod2, &pki.root_pem)?;
    let z2 = &node2.ztunnel;

    let local = echo_server(&w.local, 9000)?;
    let remote = echo_server(&w.remote, 9000)?;
    // Our engine's tunnel, into ztunnel; then clients that write as soon
    // as they are connected (`echo-text`), whose bytes go with the
    // request.
    echo(&w.client, addr(&w.remote, 9000), 4096, 1)
        .map_err(|e| anyhow::anyhow!("{e:#}\nztunnel log:\n{}", z2.log_tail()))?;
    // The engine sends what the client wrote before it accepted, never
    // waiting for more: whether a client's bytes beat the accept is a race
    // each connection (about one in three here), so clients go until one
    // has, each checked whole.
    let remote_dst = addr(&w.remote, 9000).to_string();
    for _ in 0..40 {
        let reply = stream(&w.client, &["echo-text", &remote_dst, "first bytes"])
            .map_err(|e| anyhow::anyhow!("{e:#}\nztunnel log:\n{}", z2.log_tail()))?;
        assert_eq!(reply, "first bytes", "into ztunnel, early");
        if early_sent(&a1)? >= 1.0 {
            break;
        }
    }
    assert_eq!(
        seen_by(&remote)?,
        IpAddr::from(w.client.ip4),
        "into ztunnel"
    );
    // ztunnel's tunnel, into our engine.
    echo(&w.remote, addr(&w.local, 9000), 4096, 2)
        .map_err(|e| anyhow::anyhow!("{e:#}\nztunnel log:\n{}", z2.log_tail()))?;
    assert_eq!(seen_by(&local)?, IpAddr::from(w.remote.ip4), "from ztunnel");

    // Both went through ztunnel in mutual TLS, its telemetry says, and
    // through our engine, ours says.
    let m2 = ztunnel_metrics(&w.n2)?;
    let mtls = "connection_security_policy=\"mutual_tls\"";
    assert!(
        opened(&m2, &["reporter=\"destination\"", mtls]) >= 1,
        "ztunnel did not serve our engine's tunnel:\n{m2}"
    );
    assert!(
        opened(&m2, &["reporter=\"source\"", mtls]) >= 1,
        "ztunnel did not open a tunnel to our engine:\n{m2}"
    );
    let ours = dataplane_tests::observe::scrape(&a1)?;
    for reporter in ["source", "destination"] {
        let count: f64 = ours
            .iter()
            .filter(|s| s.name == "istio_tcp_connections_opened_total")
            .filter(|s| {
                let has = |k: &str, v: &str| s.labels.iter().any(|(a, b)| a == k && b == v);
                has("reporter", reporter) && has("connection_security_policy", "mutual_tls")
            })
            .map(|s| s.value)
            .sum();
        assert!(count >= 1.0, "our engine reported no {reporter} tunnel");
    }
    // And ztunnel took our client's first bytes before its 200.
    assert!(
        early_sent(&a1)? >= 1.0,
        "no tunnel into ztunnel carried early bytes"
    );
    Ok(())
}

/// How many tunnels `agent` opened with the client's first bytes.
fn early_sent(agent: &dataplane_tests::Agent) -> anyhow::Result<f64> {
    Ok(dataplane_tests::observe::scrape(agent)?
        .iter()
        .filter(|s| s.name == "dataplane_hbone_early_data_total")
        .map(|s| s.value)
        .sum())
}

/// A node proxy's HBONE port as the peer of a tunnel sees it: `[::]:15008`
/// in a pod no agent enrolled (istiod still advertises it as HBONE, so
/// ztunnel tunnels straight to it), presenting the pod's identity signed
/// by istiod's CA. It records each CONNECT's authority and `forwarded`
/// header, answers 200 and echoes the stream.
struct HbonePeer {
    seen: Arc<Mutex<Vec<(String, String)>>>,
    runtime: Option<tokio::runtime::Runtime>,
}

impl HbonePeer {
    fn start(pod: &Pod, pki: &TestPki, identity: &str) -> Result<Self> {
        dataplane_user::tls::install_provider();
        let (chain, key) = pki.issue(identity)?;
        let mut config =
            rustls::ServerConfig::builder_with_provider(dataplane_user::tls::provider())
                .with_safe_default_protocol_versions()?
                .with_no_client_auth()
                .with_single_cert(chain, key)?;
        config.alpn_protocols = vec![b"h2".to_vec()];
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = pod.netns.run(|| {
            let listener = std::net::TcpListener::bind(SocketAddr::from(([0u16; 8], 15008)))?;
            listener.set_nonblocking(true)?;
            Ok::<_, std::io::Error>(listener)
        })??;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()?;
        let seen = Arc::new(Mutex::new(Vec::new()));
        let record = Arc::clone(&seen);
        runtime.spawn(async move {
            let Ok(listener) = tokio::net::TcpListener::from_std(listener) else {
                return;
            };
            while let Ok((tcp, _)) = listener.accept().await {
                let (acceptor, record) = (acceptor.clone(), Arc::clone(&record));
                tokio::spawn(async move {
                    let _ = serve_hbone(tcp, acceptor, record).await;
                });
            }
        });
        Ok(Self {
            seen,
            runtime: Some(runtime),
        })
    }

    /// The `forwarded` header of the first tunnel to `authority`, waiting
    /// for it up to 20 s.
    fn forwarded_for(&self, authority: SocketAddr) -> Result<String> {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let found = self
                .seen
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .iter()
                .find(|(a, _)| *a == authority.to_string())
                .map(|(_, f)| f.clone());
            if let Some(forwarded) = found {
                return Ok(forwarded);
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "no tunnel to {authority}; seen {:?}",
                self.seen.lock().unwrap_or_else(PoisonError::into_inner)
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for HbonePeer {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

async fn serve_hbone(
    tcp: tokio::net::TcpStream,
    acceptor: tokio_rustls::TlsAcceptor,
    record: Arc<Mutex<Vec<(String, String)>>>,
) -> Result<()> {
    let tls = tokio::time::timeout(Duration::from_secs(20), acceptor.accept(tcp)).await??;
    let mut conn = h2::server::handshake(tls).await?;
    while let Some(request) = conn.accept().await {
        let (request, mut respond) = request?;
        let authority = request
            .uri()
            .authority()
            .map(|a| a.as_str().to_owned())
            .unwrap_or_default();
        let forwarded = request
            .headers()
            .get(http::header::FORWARDED)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        record
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push((authority, forwarded));
        let mut send = respond.send_response(http::Response::new(()), false)?;
        let mut body = request.into_body();
        tokio::spawn(async move {
            while let Some(Ok(chunk)) = body.data().await {
                let _ = body.flow_control().release_capacity(chunk.len());
                if send.send_data(chunk, false).is_err() {
                    return;
                }
            }
            let _ = send.send_data(bytes::Bytes::new(), true);
        });
    }
    Ok(())
}

/// An address as it precedes `:port` in a socket address (`[...]` for
/// IPv6), as ztunnel writes it.
fn host(ip: IpAddr) -> String {
    match ip {
        IpAddr::V4(v4) => v4.to_string(),
        IpAddr::V6(v6) => format!("[{v6}]"),
    }
}

/// The lines of `zt`'s log that are access records from `src`, waiting
/// up to 20 s for one (ztunnel writes them as connections complete).
fn access_records_from(zt: &Ztunnel, src: IpAddr) -> Result<Vec<String>> {
    let field = format!("src.addr={}:", host(src));
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let text = std::fs::read_to_string(&zt.log).unwrap_or_default();
        let records: Vec<String> = text
            .lines()
            .filter(|l| l.contains("access") && l.contains(&field))
            .map(str::to_owned)
            .collect();
        if !records.is_empty() {
            return Ok(records);
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "no access record with {field}:\n{}",
            zt.log_tail()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Issue 29, item 10: the stock ztunnel that serves a pod sees the pod's
/// own address as the client's, as under istio-cni's `REDIRECT`, IPv4 and
/// IPv6: in its access records (`src.addr`) and in the `forwarded: for=`
/// header its HBONE peer receives (on main both said 127.0.0.1 / ::1).
#[test]
#[ignore = "needs a ztunnel binary in DATAPLANE_ZTUNNEL"]
fn stock_ztunnel_sees_the_pods_own_address_as_the_client() -> anyhow::Result<()> {
    let binary = ztunnel_binary()?;
    let w = TwoNodes::new("ztsa")?;
    let config = w.config()?;
    let (rt, pki, mut istiod) = istiod_serving(&w)?;
    let peer = HbonePeer::start(
        &w.remote,
        &pki,
        &format!("spiffe://cluster.local/ns/{NAMESPACE}/sa/remote"),
    )?;
    // Node1 only: the remote pod stays unenrolled, and the peer stand-in
    // holds its HBONE port.
    let istiod1 = rt.block_on(istiod.listen_in(w.n1.netns()))?;
    let node1 = ZtunnelServedNode::start(&w, "zs", 1, &config, &binary, istiod1, &pki.root_pem)?;
    let z1 = &node1.ztunnel;

    let cases: [(IpAddr, IpAddr, &str); 2] = [
        (w.remote.ip4.into(), w.client.ip4.into(), "IPv4"),
        (w.remote.ip6.into(), w.client.ip6.into(), "IPv6"),
    ];
    for (seed, (dst, client, case)) in (1u64..).zip(cases) {
        let dst = SocketAddr::new(dst, 9000);
        echo(&w.client, dst, 64, seed)
            .map_err(|e| anyhow::anyhow!("{case}: {e:#}\nztunnel log:\n{}", z1.log_tail()))?;
        let forwarded = peer.forwarded_for(dst)?;
        let expected = format!("for=\"{}:", host(client));
        assert!(
            forwarded.starts_with(&expected),
            "{case}: the peer got forwarded: {forwarded:?}, not the pod {client}"
        );
        let records = access_records_from(z1, client)?;
        assert!(
            records.iter().any(|r| r.contains(&dst.to_string())),
            "{case}: ztunnel's records from {client}: {records:#?}"
        );
    }
    Ok(())
}
