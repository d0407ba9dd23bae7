//! A stock Istio ztunnel, started as Istio starts it (in-pod mode, its ZDS
//! client pointed at the agent's socket), serves the pods the agents
//! enroll with `--engine ztunnel`: the agents hand it each pod's network
//! namespace and their kernel programs capture, with no iptables rule
//! anywhere.
//!
//! Istio's ztunnel is not published to any registry these machines reach,
//! so this test is ignored unless asked for: build ztunnel from Istio's
//! sources with `--no-default-features --features tls-ring,testing` (its
//! fake CA) and run
//! `DATAPLANE_ZTUNNEL=/path/to/ztunnel cargo test -p dataplane-tests --test ztunnel_interop -- --ignored`.
//! The protocol and the capture are proven on every CI run by
//! `ztunnel_mode`, `zds_server` and `external_proxy`, against stand-ins
//! that behave as ztunnel does.

use std::{
    io::{Read as _, Write as _},
    net::{IpAddr, TcpStream},
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use dataplane_tests::{
    Cgroup, ChildGuard, TempDir,
    mesh::{NAMESPACE, TwoNodes, addr},
    responder::Responder,
    spawn_logged_in,
    topology::{Node, Pod},
    traffic::{echo, echo_server},
};

/// The ztunnel binary to test against.
fn ztunnel_binary() -> anyhow::Result<PathBuf> {
    let path = PathBuf::from(
        std::env::var_os("DATAPLANE_ZTUNNEL")
            .ok_or_else(|| anyhow::anyhow!("set DATAPLANE_ZTUNNEL to a ztunnel binary"))?,
    );
    anyhow::ensure!(path.is_file(), "{} is not a file", path.display());
    Ok(path)
}

/// One ztunnel, in a node's network namespace and in a cgroup of its own
/// under the node's (as its pod would be), with its log in the test's
/// directory.
struct Ztunnel {
    _process: ChildGuard,
    _cgroup: Cgroup,
    log: PathBuf,
}

impl Ztunnel {
    fn start(
        binary: &Path,
        node: &Node,
        node_name: &str,
        zds: &Path,
        config: &Path,
        dir: &Path,
    ) -> anyhow::Result<Self> {
        let cgroup = Cgroup::child(node.cgroup(), "zt")?;
        let log = dir.join(format!("ztunnel-{node_name}.log"));
        let mut cmd = Command::new(binary);
        cmd.env_clear()
            .env("PATH", "/usr/bin:/bin")
            .env("RUST_LOG", "info")
            .env("NODE_NAME", node_name)
            .env("INPOD_UDS", zds)
            .env("LOCAL_XDS_PATH", config)
            .env("XDS_ADDRESS", "")
            .env("CA_ADDRESS", "")
            .env("FAKE_CA", "true")
            .env("CLUSTER_ID", "Kubernetes");
        let process = spawn_logged_in(cmd, Some(node.netns().path()), Some(cgroup.path()), &log)?;
        Ok(Self {
            _process: process,
            _cgroup: cgroup,
            log,
        })
    }

    /// The last lines of its log, without the configuration it prints at
    /// start.
    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("20") || l.starts_with("Error"))
            .collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }
}

/// ztunnel's local configuration for the world's mesh pods.
fn ztunnel_config(w: &TwoNodes) -> String {
    let workload = |pod: &Pod, name: &str, node: &str| {
        format!(
            "- uid: Kubernetes//Pod/{NAMESPACE}/{name}\n  name: {name}\n  namespace: {NAMESPACE}\n  \
             serviceAccount: {name}\n  trustDomain: cluster.local\n  workloadIps: [\"{}\", \"{}\"]\n  \
             protocol: HBONE\n  node: {node}\n  services: {{}}\n",
            pod.ip4, pod.ip6
        )
    };
    format!(
        "workloads:\n{}{}{}policies: []\nservices: []\n",
        workload(&w.client, "client", "node1"),
        workload(&w.local, "local", "node1"),
        workload(&w.remote, "remote", "node2"),
    )
}

/// Waits until `agent` reports every pod it enrolled as captured (for
/// `--engine ztunnel`: acknowledged by ztunnel and its listeners in the
/// kernel's socket map).
fn wait_captured(agent: &dataplane_tests::Agent, zt: &Ztunnel) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let pods = agent.status()?.pods;
        let waiting: Vec<_> = pods
            .iter()
            .filter(|p| !p.captured)
            .map(|p| format!("{}: {}", p.name, p.reason))
            .collect();
        if !pods.is_empty() && waiting.is_empty() {
            return Ok(());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "pods not captured: {waiting:?}\nztunnel log:\n{}",
            zt.log_tail()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
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
    node.netns().run(|| -> anyhow::Result<String> {
        let mut stream = TcpStream::connect(("127.0.0.1", 15020))?;
        stream.set_read_timeout(Some(Duration::from_secs(10)))?;
        stream.write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")?;
        let mut body = String::new();
        stream.read_to_string(&mut body)?;
        Ok(body)
    })?
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
    let zt_config = w.dir.path().join("ztunnel.yaml");
    std::fs::write(&zt_config, ztunnel_config(&w))?;
    let logs = TempDir::new("ztlog")?;
    let z1 = Ztunnel::start(&binary, &w.n1, "node1", &zds1, &zt_config, logs.path())?;
    let z2 = Ztunnel::start(&binary, &w.n2, "node2", &zds2, &zt_config, logs.path())?;
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
    let z1 = Ztunnel::start(&binary, &w.n1, "node1", &zds1, &zt_config, logs.path())?;
    wait_captured(&a1, &z1)?;
    echo(&w.client, addr(&w.remote, 9000), 64, 3)?;
    assert_eq!(
        seen_by(&remote)?,
        IpAddr::from(w.client.ip4),
        "after restart"
    );
    Ok(())
}
