//! Mesh scale (issue 31's measurement): the test istiod serves a synthetic
//! mesh of N workloads (one IP each, one service per ten workloads, one
//! namespace policy per hundred) to one agent, then changes one workload
//! at a time at a fixed rate. Per N it reports the time and the agent's CPU
//! until the first complete state is ACKed (the agent ACKs a push once its
//! state holds it), its RSS then and after the churn, the agent's CPU per
//! update and the push-to-ACK latency of every update.
//!
//! Given a stock ztunnel binary ([`ScaleSettings::ztunnel`]), each size
//! then runs the same way against ztunnel: a fresh test istiod serving the
//! same resources, ztunnel started as Istio's chart starts it
//! ([`crate::ztunnel`]) in a network namespace and a cgroup of its own, the
//! same churn. ztunnel too ACKs a delta push once applied. Its
//! `/config_dump` must list every workload, service and policy, and the
//! last update, or the run fails: a ztunnel that dropped the resources
//! must not look fast. The two never run at the same time.
//!
//! Given `dp-load` ([`ScaleSettings::load`]), our agent's node also has a
//! client and a server pod in the mesh (from its file config, HBONE, no
//! fast path), and during the churn the client opens a connection to the
//! server through the agent once a second: its set-up cost (connect, 64
//! bytes there and back) at each N. ztunnel's runs have no pod: what is
//! measured of it is the mesh state alone. ztunnel's node hosts none of
//! the workloads, so it fetches no certificates ahead for them.

use std::{
    collections::{BTreeMap, HashMap},
    net::{IpAddr, Ipv4Addr, SocketAddr},
    path::{Path, PathBuf},
    process::Command,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::Context as _;
use dataplane_user::{
    config::{Action, LocalConfig, Match, Policy, Protocol, Scope, Service, Workload},
    istio_api::{ADDRESS_TYPE, AUTHORIZATION_TYPE, discovery::Resource},
};
use serde::Serialize;

use super::{
    agent::MeasuredAgent,
    mesh::{ECHO_PORT, SINK_PORT},
    process::BenchProcess,
};
use crate::{
    Cgroup, Netns, TempDir,
    istio_resources::{policy_resource, service_resource, workload_resource},
    istiod::{SERVER_NAME, TestIstiod, TestPki},
    mesh::{config_of, hbone_workload, write_config},
    topology::{Node, Pod},
    ztunnel::{HeldState, Ztunnel, ZtunnelHome, ZtunnelNode},
};

/// How long the ACKs of the first state and of the last updates are
/// awaited at `n` workloads (a guard, not a timing assertion): 5 min,
/// plus 5 ms per workload (an agent whose update cost grows with the mesh
/// needs minutes to drain the churn at 100k).
pub fn ack_limit(n: usize) -> Duration {
    Duration::from_secs(300) + Duration::from_millis(5).saturating_mul(n as u32)
}

/// How often a wait for the istiod's next request looks up from it (to
/// notice a proxy that exited).
const POLL: Duration = Duration::from_secs(1);

/// What to run.
#[derive(Debug, Clone)]
pub struct ScaleSettings {
    /// Mesh sizes, in workloads.
    pub sizes: Vec<usize>,
    /// Single-workload updates per second during the churn.
    pub rate: u32,
    /// How long the churn lasts.
    pub churn: Duration,
    /// A stock ztunnel binary to measure the same way, after our agent.
    pub ztunnel: Option<PathBuf>,
    /// `dp-load`, for a connection per second through our agent during
    /// the churn (none without it).
    pub load: Option<PathBuf>,
}

impl ScaleSettings {
    /// The full run: 1k and 10k workloads, 20 updates per second for 30 s.
    pub fn full() -> Self {
        Self {
            sizes: vec![1_000, 10_000],
            rate: 20,
            churn: Duration::from_secs(30),
            ztunnel: None,
            load: None,
        }
    }

    /// CI's proof that the harness works: 1k workloads, 3 s of churn.
    pub fn quick() -> Self {
        Self {
            sizes: vec![1_000],
            rate: 20,
            churn: Duration::from_secs(3),
            ztunnel: None,
            load: None,
        }
    }
}

/// One mesh size: our agent's figures and, when run, ztunnel's.
#[derive(Debug, Clone, Serialize)]
pub struct ScaleRow {
    /// Workloads.
    pub workloads: usize,
    /// Services (a tenth of the workloads).
    pub services: usize,
    /// Namespace policies (a hundredth).
    pub policies: usize,
    /// The first push's resources, encoded, bytes (what one xDS response
    /// carries: the client's message limit must exceed it).
    pub first_push_bytes: usize,
    /// Our agent.
    pub ours: ScaleResult,
    /// ztunnel, when a binary was given and its run succeeded.
    pub ztunnel: Option<ScaleResult>,
    /// Why ztunnel's run failed, if it did.
    pub ztunnel_error: Option<String>,
}

/// One proxy's figures at one mesh size.
#[derive(Debug, Clone, Serialize)]
pub struct ScaleResult {
    /// From the proxy's start to the ACK of its first complete state, ms.
    pub first_state_ms: f64,
    /// Its CPU until then, ms.
    pub first_state_cpu_ms: f64,
    /// RSS once the first state is in, bytes.
    pub rss_first: u64,
    /// RSS after the churn, bytes.
    pub rss_after_churn: u64,
    /// Updates sent during the churn.
    pub updates: usize,
    /// Updates ACKed (the rest were still unanswered at the guard).
    pub acked: usize,
    /// Its CPU per update during the churn, ms.
    pub cpu_per_update_ms: f64,
    /// Push-to-ACK, median and 99th percentile, ms.
    pub ack_p50_ms: f64,
    /// As above.
    pub ack_p99_ms: f64,
    /// Connections opened through the proxy during the churn (one a
    /// second; our agent only).
    pub conns: usize,
    /// Their set-up cost (connect, 64 bytes there and back), median and
    /// 99th percentile, ms.
    pub conn_p50_ms: Option<f64>,
    /// As above.
    pub conn_p99_ms: Option<f64>,
}

/// The synthetic mesh of `n` workloads in n/100 namespaces.
pub fn synthetic_mesh(n: usize) -> LocalConfig {
    let namespaces = (n / 100).max(1);
    let services: Vec<Service> = (0..(n / 10).max(1))
        .map(|s| {
            let namespace = format!("ns{}", s % namespaces);
            Service {
                name: format!("svc{s}"),
                hostname: format!("svc{s}.{namespace}.svc.cluster.local"),
                namespace,
                vips: vec![service_vip(s)],
                ports: BTreeMap::from([(80, 8080)]),
                subject_alt_names: Vec::new(),
                load_balancing: Default::default(),
                health_policy: Default::default(),
                routing: Default::default(),
                waypoint: None,
            }
        })
        .collect();
    let workloads = (0..n)
        .map(|i| std::sync::Arc::new(workload(i, &services, 0)))
        .collect();
    let policies = (0..(n / 100).max(1))
        .map(|p| Policy {
            name: format!("p{p}"),
            namespace: format!("ns{}", p % namespaces),
            scope: Scope::Namespace,
            action: Action::Allow,
            rules: vec![vec![vec![Match {
                namespaces: vec![format!("ns{}", (p + 1) % namespaces)],
                ..Match::default()
            }]]],
            dry_run: false,
        })
        .collect();
    LocalConfig {
        workloads,
        services,
        policies,
        ..LocalConfig::default()
    }
}

/// Service `s`'s VIP: the `s`-th address of 172.16.0.0/12 (a million
/// services fit).
fn service_vip(s: usize) -> IpAddr {
    let base = u32::from(Ipv4Addr::new(172, 16, 0, 0));
    Ipv4Addr::from(base.wrapping_add(u32::try_from(s).unwrap_or(u32::MAX))).into()
}

/// Workload `i` of the mesh, on node `i % 100` moved by `moved` (what an
/// update changes).
fn workload(i: usize, services: &[Service], moved: usize) -> Workload {
    let service = &services[i % services.len()];
    let [_, a, b, c] = u32::try_from(i).unwrap_or(u32::MAX).to_be_bytes();
    Workload {
        uid: format!("Kubernetes//Pod/{}/w{i}", service.namespace),
        name: format!("w{i}"),
        namespace: service.namespace.as_str().into(),
        service_account: format!("sa{}", i % 500).into(),
        trust_domain: "cluster.local".into(),
        workload_ips: vec![Ipv4Addr::new(10, a, b, c).into()],
        protocol: Protocol::Hbone,
        node: format!("node{}", (i + moved) % 100).into(),
        services: [(service.key(), service.ports.clone())]
            .into_iter()
            .collect(),
        ..Workload::default()
    }
}

/// Runs every size of `settings` against `agent_binary` (and ztunnel).
pub fn run(agent_binary: &Path, settings: &ScaleSettings) -> anyhow::Result<Vec<ScaleRow>> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let pki = TestPki::generate()?;
    settings
        .sizes
        .iter()
        .map(|&n| one_size(&rt, &pki, agent_binary, n, settings))
        .collect()
}

/// The proxy a run measures.
enum Proxy<'a> {
    /// Our agent, `dataplane run`, with pods on its node when given
    /// `dp-load`.
    Ours(&'a Path, Option<&'a Path>),
    /// A stock ztunnel.
    Ztunnel(&'a Path),
}

/// The resources of one mesh as istiod serves them.
struct Served {
    addresses: Vec<Resource>,
    policies: Vec<Resource>,
}

impl Served {
    /// Their size, encoded (about what the first responses carry).
    fn encoded_len(&self) -> usize {
        self.addresses
            .iter()
            .chain(&self.policies)
            .map(prost::Message::encoded_len)
            .sum()
    }
}

fn one_size(
    rt: &tokio::runtime::Runtime,
    pki: &TestPki,
    agent_binary: &Path,
    n: usize,
    settings: &ScaleSettings,
) -> anyhow::Result<ScaleRow> {
    let mesh = synthetic_mesh(n);
    let version = "v0";
    let served = Served {
        addresses: mesh
            .workloads
            .iter()
            .map(|w| workload_resource(w, version))
            .chain(mesh.services.iter().map(|s| service_resource(s, version)))
            .collect(),
        policies: mesh
            .policies
            .iter()
            .map(|p| policy_resource(p, version))
            .collect(),
    };
    let first_push_bytes = served.encoded_len();
    let ours = measure(
        rt,
        pki,
        &Proxy::Ours(agent_binary, settings.load.as_deref()),
        &mesh,
        &served,
        settings,
    )?;
    let (ztunnel, ztunnel_error) = match &settings.ztunnel {
        None => (None, None),
        Some(binary) => match measure(rt, pki, &Proxy::Ztunnel(binary), &mesh, &served, settings) {
            Ok(result) => (Some(result), None),
            Err(e) => {
                super::signal::check()?;
                eprintln!("dp-scale: ztunnel at {n} workloads: {e:#}");
                (None, Some(format!("{e:#}")))
            }
        },
    };
    Ok(ScaleRow {
        workloads: n,
        services: mesh.services.len(),
        policies: mesh.policies.len(),
        first_push_bytes,
        ours,
        ztunnel,
        ztunnel_error,
    })
}

/// A proxy under measurement; dropping it stops it and removes what it
/// used.
enum Running {
    Ours {
        // Field order is drop order: the agent before its node.
        agent: MeasuredAgent,
        _node: Option<Cgroup>,
        pods: Option<Box<ConnPods>>,
    },
    Ztunnel {
        // Field order is drop order: the process before its namespace.
        process: Ztunnel,
        netns: Netns,
    },
}

impl Running {
    /// CPU its cgroup used so far, in microseconds.
    fn cpu_usec(&self) -> anyhow::Result<u64> {
        match self {
            Self::Ours { agent, .. } => agent.cpu_usec(),
            Self::Ztunnel { process, .. } => super::probe::cgroup_cpu_usec(process.cgroup().path()),
        }
    }

    /// Its resident memory, in bytes.
    fn rss(&self) -> anyhow::Result<u64> {
        match self {
            Self::Ours { agent, .. } => agent.rss(),
            Self::Ztunnel { process, .. } => super::probe::rss_bytes(
                process
                    .pid()
                    .ok_or_else(|| anyhow::anyhow!("ztunnel not running"))?,
            ),
        }
    }

    /// Fails, with its log, if it exited.
    fn check_alive(&mut self) -> anyhow::Result<()> {
        match self {
            Self::Ours { agent, .. } => {
                anyhow::ensure!(
                    agent.is_running(),
                    "the agent exited:\n{}",
                    agent.log_text()
                );
            }
            Self::Ztunnel { process, .. } => {
                anyhow::ensure!(
                    process.is_running(),
                    "ztunnel exited:\n{}",
                    process.log_tail()
                );
            }
        }
        Ok(())
    }

    /// Checks that it holds `mesh` with the churn's last update applied
    /// (ztunnel's `/config_dump`; our agent NACKs what it cannot apply).
    fn check_holds(&self, mesh: &LocalConfig, last: Option<&Workload>) -> anyhow::Result<()> {
        let Self::Ztunnel { process, netns } = self else {
            return Ok(());
        };
        let held = HeldState::fetch(netns, Duration::from_secs(120))
            .with_context(|| format!("ztunnel's config_dump\n{}", process.log_tail()))?;
        check_held(&held, mesh, last)
    }
}

/// Whether `held` lists every workload, service and policy of `mesh`, and
/// `last` (the churn's last update) on its new node.
fn check_held(held: &HeldState, mesh: &LocalConfig, last: Option<&Workload>) -> anyhow::Result<()> {
    anyhow::ensure!(
        (held.workloads.len(), held.services, held.policies)
            == (
                mesh.workloads.len(),
                mesh.services.len(),
                mesh.policies.len()
            ),
        "ztunnel holds {} workloads, {} services, {} policies; istiod served {}, {}, {}",
        held.workloads.len(),
        held.services,
        held.policies,
        mesh.workloads.len(),
        mesh.services.len(),
        mesh.policies.len()
    );
    if let Some(last) = last {
        let node = held.node_of(&last.uid);
        anyhow::ensure!(
            node == Some(&*last.node),
            "ztunnel holds {} on {node:?}, not on {} (the last update)",
            last.uid,
            last.node
        );
    }
    Ok(())
}

/// Serves `served` from a fresh test istiod to `proxy`, awaits its first
/// complete state, churns, and reads its figures.
fn measure(
    rt: &tokio::runtime::Runtime,
    pki: &TestPki,
    proxy: &Proxy<'_>,
    mesh: &LocalConfig,
    served: &Served,
    settings: &ScaleSettings,
) -> anyhow::Result<ScaleResult> {
    let n = mesh.workloads.len();
    let mut istiod = rt.block_on(TestIstiod::start(pki, "127.0.0.1:0".parse()?))?;
    rt.block_on(async {
        istiod
            .publish(ADDRESS_TYPE, served.addresses.clone(), &[])
            .await?;
        istiod
            .publish(AUTHORIZATION_TYPE, served.policies.clone(), &[])
            .await
    })?;
    let side = match proxy {
        Proxy::Ours(..) => "a",
        Proxy::Ztunnel(_) => "z",
    };
    let tag = format!("bench-scale{n}{side}");
    let dir = TempDir::new(&tag)?;
    let (started, mut running) = match *proxy {
        Proxy::Ours(binary, load) => start_ours(binary, load, &tag, dir.path(), pki, &istiod)?,
        Proxy::Ztunnel(binary) => start_ztunnel(rt, binary, &tag, dir.path(), pki, &mut istiod)?,
    };
    let limit = ack_limit(n);
    rt.block_on(first_state(
        &mut istiod,
        &mut running,
        limit,
        served.encoded_len(),
    ))?;
    let first_state_ms = started.elapsed().as_secs_f64() * 1e3;
    let cpu_first = running.cpu_usec()?;
    let rss_first = running.rss()?;

    let churned = rt.block_on(churn(&mut istiod, &mut running, mesh, settings, limit))?;
    let rss_after_churn = running.rss()?;
    running.check_holds(mesh, churned.last.as_ref())?;
    drop(running);
    rt.block_on(istiod.stop());
    let mut sorted = churned.latencies.clone();
    sorted.sort_by(f64::total_cmp);
    let mut conns = churned.conns.clone();
    conns.sort_by(f64::total_cmp);
    let conn_quantile = |p| (!conns.is_empty()).then(|| percentile(&conns, p));
    Ok(ScaleResult {
        first_state_ms,
        // Since the proxy started (its cgroup is its own): start-up
        // itself is in it too, a few ms.
        first_state_cpu_ms: cpu_first as f64 / 1e3,
        rss_first,
        rss_after_churn,
        updates: churned.updates,
        acked: churned.latencies.len(),
        cpu_per_update_ms: if churned.updates == 0 {
            f64::NAN
        } else {
            churned.cpu_usec as f64 / 1e3 / churned.updates as f64
        },
        ack_p50_ms: percentile(&sorted, 0.50),
        ack_p99_ms: percentile(&sorted, 0.99),
        conns: conns.len(),
        conn_p50_ms: conn_quantile(0.50),
        conn_p99_ms: conn_quantile(0.99),
    })
}

/// The `p` quantile (nearest rank) of `sorted`, NaN when empty.
fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

/// Starts our agent on `istiod`: with no pod and an empty file config,
/// or, given `dp-load`, with a client and a server pod ([`ConnPods`]).
fn start_ours(
    binary: &Path,
    load: Option<&Path>,
    tag: &str,
    dir: &Path,
    pki: &TestPki,
    istiod: &TestIstiod,
) -> anyhow::Result<(Instant, Running)> {
    let root = dir.join("root-cert.pem");
    std::fs::write(&root, &pki.root_pem)?;
    let token = dir.join("istio-token");
    std::fs::write(&token, "scale-token\n")?;
    let (node, pods, config) = match load {
        None => {
            let empty = dir.join("empty.yaml");
            std::fs::write(&empty, "workloads: []\n")?;
            (Some(Cgroup::new(&format!("{tag}-node"))?), None, empty)
        }
        Some(load) => {
            let (pods, config) = ConnPods::new(load, tag, dir)?;
            (None, Some(Box::new(pods)), config)
        }
    };
    let node_cgroup = match (&node, &pods) {
        (Some(cgroup), _) => cgroup.path().to_owned(),
        (None, Some(pods)) => pods.node.cgroup().path().to_owned(),
        (None, None) => anyhow::bail!("no node cgroup"),
    };
    let flags: Vec<String> = [
        "--config",
        &config.display().to_string(),
        "--xds",
        "--istiod-address",
        &istiod.addr.to_string(),
        "--istiod-server-name",
        SERVER_NAME,
        "--istiod-root-cert",
        &root.display().to_string(),
        "--istiod-token",
        &token.display().to_string(),
        "--pod-name",
        "dataplane-scale",
        "--node",
        "node0",
        "--instance-ip",
        "127.0.0.1",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    let started = Instant::now();
    let expected_pods = if pods.is_some() { 2 } else { 0 };
    let agent = MeasuredAgent::start(binary, tag, &node_cgroup, &flags, expected_pods)?;
    Ok((
        started,
        Running::Ours {
            agent,
            _node: node,
            pods,
        },
    ))
}

/// A client and a server pod on our agent's node (index 200: their
/// addresses, 10.200.0.x, are no synthetic workload's below 13M), in the
/// mesh through the agent's file config (HBONE, fast path off, so every
/// connection goes through the agent), the server running `dp-load serve`.
struct ConnPods {
    // Field order is drop order: processes, pods, then the node.
    _server: BenchProcess,
    client: Pod,
    server: Pod,
    node: Node,
    load: PathBuf,
}

impl ConnPods {
    /// Builds them; returns them and the agent's config file.
    fn new(load: &Path, tag: &str, dir: &Path) -> anyhow::Result<(Self, PathBuf)> {
        let mut node = Node::new(tag, 200)?;
        let client = node.add_pod(tag)?;
        let server = node.add_pod(tag)?;
        let mut cmd = Command::new(load);
        cmd.args(["serve", &ECHO_PORT.to_string(), &SINK_PORT.to_string()]);
        let mut process =
            BenchProcess::spawn(cmd, Some(server.netns.path()), Some(server.cgroup.path()))?;
        let line = process.line(Duration::from_secs(10))?;
        anyhow::ensure!(line == "listening", "server said `{line}`");
        let workloads = [(&client, "client"), (&server, "server")]
            .into_iter()
            .map(|(pod, name)| {
                let mut workload = hbone_workload(pod, name, "node0");
                workload.fast_path = Some(false);
                workload
            })
            .collect();
        let config = write_config(dir, "pods.yaml", &config_of(workloads))?;
        Ok((
            Self {
                _server: process,
                client,
                server,
                node,
                load: load.to_owned(),
            },
            config,
        ))
    }

    /// Starts opening a connection a second from the client to the server.
    fn probe(&self) -> ConnProbe {
        ConnProbe::start(
            self.load.clone(),
            self.client.netns.path().to_owned(),
            self.client.cgroup.path().to_owned(),
            SocketAddr::new(self.server.ip4.into(), ECHO_PORT),
        )
    }
}

/// A thread that runs `dp-load conn ADDR 1 1 64` in the client pod once a
/// second until stopped, keeping each connection's time.
struct ConnProbe {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<anyhow::Result<Vec<f64>>>,
}

impl ConnProbe {
    fn start(load: PathBuf, netns: PathBuf, cgroup: PathBuf, server: SocketAddr) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = Arc::clone(&stop);
        let thread = std::thread::spawn(move || {
            let mut times = Vec::new();
            let mut next = Instant::now();
            while !stopped.load(Ordering::Relaxed) {
                if Instant::now() < next {
                    std::thread::sleep(Duration::from_millis(20));
                    continue;
                }
                next += Duration::from_secs(1);
                let mut cmd = Command::new(&load);
                cmd.args(["conn", &server.to_string(), "1", "1", "64"]);
                let text = BenchProcess::spawn(cmd, Some(&netns), Some(&cgroup))?
                    .output(Duration::from_secs(60))?;
                times.push(conn_time_ms(&text)?);
            }
            Ok(times)
        });
        Self { stop, thread }
    }

    /// Stops it; returns every connection's time, ms.
    fn finish(self) -> anyhow::Result<Vec<f64>> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread
            .join()
            .map_err(|_| anyhow::anyhow!("the connection probe panicked"))?
    }
}

/// The time of the one connection a `dp-load conn ADDR 1 ...` report
/// holds, ms.
fn conn_time_ms(report: &str) -> anyhow::Result<f64> {
    let report: serde_json::Value =
        serde_json::from_str(report.trim()).context("dp-load's report")?;
    report["latency"]["p50_us"]
        .as_f64()
        .map(|us| us / 1e3)
        .with_context(|| format!("no latency in dp-load's report {report}"))
}

/// Starts ztunnel in a network namespace of its own, where `istiod` also
/// listens, for a node that hosts none of the workloads.
fn start_ztunnel(
    rt: &tokio::runtime::Runtime,
    binary: &Path,
    tag: &str,
    dir: &Path,
    pki: &TestPki,
    istiod: &mut TestIstiod,
) -> anyhow::Result<(Instant, Running)> {
    let netns = Netns::new(tag)?;
    let home = ZtunnelHome::new(
        dir,
        "ztunnel-bench",
        rt.block_on(istiod.listen_in(&netns))?,
        &pki.root_pem,
    )?;
    let zds = dir.join("no-zds.sock");
    let node = ZtunnelNode {
        name: "ztunnel-bench",
        instance_ip: Ipv4Addr::LOCALHOST.into(),
        zds: &zds,
    };
    let cgroup = Cgroup::new(tag)?;
    let log = dir.join("ztunnel.log");
    let started = Instant::now();
    let process = Ztunnel::start(binary, &netns, cgroup, &node, &home, &log)?;
    Ok((started, Running::Ztunnel { process, netns }))
}

/// The next request `istiod` receives, looking up every [`POLL`] to fail
/// if `running` exited or `deadline` passed.
async fn next_request(
    istiod: &mut TestIstiod,
    running: &mut Running,
    deadline: Instant,
    what: &str,
) -> anyhow::Result<crate::istiod::SeenRequest> {
    loop {
        super::signal::check()?;
        running.check_alive()?;
        anyhow::ensure!(Instant::now() < deadline, "{what}: no ACK in time");
        if let Some(seen) = istiod.try_next_request(POLL).await? {
            return Ok(seen);
        }
    }
}

/// Waits for the first complete state: both types' first responses ACKed
/// (our agent's second ACK waits for the state built from both).
/// A proxy that opens a second stream meanwhile dropped the first push
/// (`push_bytes` encoded): it fails at once rather than at the guard.
async fn first_state(
    istiod: &mut TestIstiod,
    running: &mut Running,
    limit: Duration,
    push_bytes: usize,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + limit;
    let mut acked = [false; 2];
    let mut first_stream = None;
    while !acked.iter().all(|a| *a) {
        let seen = next_request(istiod, running, deadline, "the first state").await?;
        let stream = *first_stream.get_or_insert(seen.stream);
        anyhow::ensure!(
            seen.stream == stream,
            "the proxy reconnected before ACKing its first state: it dropped the first push \
             ({:.1} MB encoded; over its xDS message limit?)",
            push_bytes as f64 / 1e6
        );
        let request = seen.request;
        if request.response_nonce.is_empty() {
            continue;
        }
        anyhow::ensure!(
            request.error_detail.is_none(),
            "the first state was NACKed: {:?}",
            request.error_detail
        );
        if let Some(i) = [ADDRESS_TYPE, AUTHORIZATION_TYPE]
            .iter()
            .position(|t| *t == request.type_url)
        {
            acked[i] = true;
        }
    }
    Ok(())
}

/// What a churn did.
struct Churned {
    /// Updates sent.
    updates: usize,
    /// Every ACK's push-to-ACK latency, ms.
    latencies: Vec<f64>,
    /// The proxy's CPU from the first update to the last ACK, us.
    cpu_usec: u64,
    /// The last update's workload.
    last: Option<Workload>,
    /// The time of every connection opened through the proxy meanwhile,
    /// ms.
    conns: Vec<f64>,
}

/// Sends `settings.rate` single-workload updates per second for
/// `settings.churn`, then awaits their ACKs (each within `limit` of the
/// churn's end).
async fn churn(
    istiod: &mut TestIstiod,
    running: &mut Running,
    mesh: &LocalConfig,
    settings: &ScaleSettings,
    limit: Duration,
) -> anyhow::Result<Churned> {
    let n = mesh.workloads.len();
    let total = (settings.churn.as_secs_f64() * f64::from(settings.rate)).round() as usize;
    let period = Duration::from_secs_f64(1.0 / f64::from(settings.rate.max(1)));
    let mut sent: HashMap<String, Instant> = HashMap::new();
    let mut latencies = Vec::with_capacity(total);
    let mut last = None;
    let probe = match running {
        Running::Ours {
            pods: Some(pods), ..
        } => Some(pods.probe()),
        _ => None,
    };
    let cpu_before = running.cpu_usec()?;
    let mut ticks = tokio::time::interval(period);
    let mut next = 0;
    let deadline = Instant::now() + settings.churn + limit;
    while latencies.len() < total {
        anyhow::ensure!(
            Instant::now() < deadline,
            "{} of {total} updates unACKed",
            total - latencies.len()
        );
        tokio::select! {
            _ = ticks.tick(), if next < total => {
                // Spread over the mesh: a different workload each time.
                let i = (next * 7919) % n;
                let moved = workload(i, &mesh.services, next + 1);
                let version = format!("v{}", next + 1);
                let nonce = istiod
                    .publish(ADDRESS_TYPE, vec![workload_resource(&moved, &version)], &[])
                    .await?;
                sent.insert(nonce, Instant::now());
                last = Some(moved);
                next += 1;
            }
            seen = next_request(istiod, running, deadline, "the churn") => {
                let request = seen?.request;
                if let Some(at) = sent.remove(&request.response_nonce) {
                    anyhow::ensure!(
                        request.error_detail.is_none(),
                        "an update was NACKed: {:?}",
                        request.error_detail
                    );
                    latencies.push(at.elapsed().as_secs_f64() * 1e3);
                }
            }
        }
    }
    let cpu_usec = running.cpu_usec()? - cpu_before;
    let conns = match probe {
        Some(probe) => probe.finish()?,
        None => Vec::new(),
    };
    Ok(Churned {
        updates: total,
        latencies,
        cpu_usec,
        last,
        conns,
    })
}

/// The results as a Markdown table: one line per size for our agent
/// alone; with ztunnel, one line per figure and size, ours, ztunnel's and
/// ours/ztunnel side by side.
pub fn table(rows: &[ScaleRow]) -> String {
    if rows
        .iter()
        .all(|r| r.ztunnel.is_none() && r.ztunnel_error.is_none())
    {
        return ours_table(rows);
    }
    let mut out = String::from(
        "| workloads (services, policies) | figure | ours | ztunnel | ours/ztunnel |\n|---|---|---|---|---|\n",
    );
    let mut failures = Vec::new();
    for row in rows {
        let mut label = format!(
            "{} ({}, {})",
            count(row.workloads),
            count(row.services),
            count(row.policies)
        );
        for figure in FIGURES {
            let ours = (figure.values)(&row.ours, row.workloads);
            if ours.iter().all(|v| v.is_nan()) {
                // Not measured (connections without `dp-load`).
                continue;
            }
            let (theirs, ratios) = match &row.ztunnel {
                Some(zt) => {
                    let theirs = (figure.values)(zt, row.workloads);
                    let ratios: Vec<String> = ours
                        .iter()
                        .zip(&theirs)
                        .map(|(a, b)| ratio(*a, *b))
                        .collect();
                    (cell(&theirs, figure.format), ratios.join(" / "))
                }
                None => ("failed".to_owned(), "-".to_owned()),
            };
            out.push_str(&format!(
                "| {label} | {} | {} | {theirs} | {ratios} |\n",
                figure.name,
                cell(&ours, figure.format),
            ));
            label.clear();
        }
        if let Some(e) = &row.ztunnel_error {
            failures.push(format!(
                "- ztunnel at {}: {}",
                count(row.workloads),
                e.lines().next().unwrap_or_default()
            ));
        }
    }
    if !failures.is_empty() {
        out.push('\n');
        out.push_str(&failures.join("\n"));
        out.push('\n');
    }
    out
}

/// One figure of the comparison table: its values for one proxy (several
/// are shown as `a / b`) at n workloads, and how one is written.
struct Figure {
    name: &'static str,
    values: fn(&ScaleResult, usize) -> Vec<f64>,
    format: fn(f64) -> String,
}

const FIGURES: &[Figure] = &[
    Figure {
        name: "first complete state: time / CPU",
        values: |r, _| vec![r.first_state_ms, r.first_state_cpu_ms],
        format: ms,
    },
    Figure {
        name: "RSS after the first state / after churn",
        values: |r, _| vec![r.rss_first as f64, r.rss_after_churn as f64],
        format: megabytes,
    },
    Figure {
        name: "RSS per workload (first state)",
        values: |r, n| vec![r.rss_first as f64 / n.max(1) as f64],
        format: kilobytes,
    },
    Figure {
        name: "CPU per update",
        values: |r, _| vec![r.cpu_per_update_ms],
        format: ms,
    },
    Figure {
        name: "push-to-ACK p50 / p99",
        values: |r, _| vec![r.ack_p50_ms, r.ack_p99_ms],
        format: ms,
    },
    Figure {
        name: "connection set-up during churn p50 / p99",
        values: |r, _| {
            vec![
                r.conn_p50_ms.unwrap_or(f64::NAN),
                r.conn_p99_ms.unwrap_or(f64::NAN),
            ]
        },
        format: ms,
    },
];

/// `values` written with `format`, joined by ` / `.
fn cell(values: &[f64], format: fn(f64) -> String) -> String {
    values
        .iter()
        .map(|v| format(*v))
        .collect::<Vec<_>>()
        .join(" / ")
}

/// Milliseconds, with as many digits as they deserve; seconds from 10 s.
fn ms(v: f64) -> String {
    if !v.is_finite() {
        "-".to_owned()
    } else if v >= 10_000.0 {
        format!("{:.1} s", v / 1e3)
    } else if v >= 100.0 {
        format!("{v:.0} ms")
    } else if v >= 1.0 {
        format!("{v:.1} ms")
    } else {
        format!("{v:.2} ms")
    }
}

/// Bytes as MB (10^6).
fn megabytes(v: f64) -> String {
    format!("{:.1} MB", v / 1e6)
}

/// Bytes as KB (10^3).
fn kilobytes(v: f64) -> String {
    format!("{:.1} KB", v / 1e3)
}

/// `a / b` as a factor: two digits below 1, one below 10, none above;
/// `-` when either is missing or `b` is zero.
fn ratio(a: f64, b: f64) -> String {
    let r = a / b;
    if !a.is_finite() || !b.is_finite() || b <= 0.0 || !r.is_finite() {
        "-".to_owned()
    } else if r < 1.0 {
        format!("{r:.2}x")
    } else if r < 10.0 {
        format!("{r:.1}x")
    } else {
        format!("{r:.0}x")
    }
}

/// A count as the issue writes sizes: `1k`, `100k`, `1M`; exact below a
/// thousand or when not round.
fn count(n: usize) -> String {
    if n >= 1_000_000 && n.is_multiple_of(1_000_000) {
        format!("{}M", n / 1_000_000)
    } else if n >= 1_000 && n.is_multiple_of(1_000) {
        format!("{}k", n / 1_000)
    } else {
        n.to_string()
    }
}

/// Our agent alone: one line per size.
fn ours_table(rows: &[ScaleRow]) -> String {
    let mut out = String::from(
        "| workloads (services, policies) | first state: time / CPU | RSS first / after churn | CPU per update | push-to-ACK p50 / p99 | RSS / workload | connection set-up p50 / p99 |\n|---|---|---|---|---|---|---|\n",
    );
    for row in rows {
        let r = &row.ours;
        out.push_str(&format!(
            "| {} ({}, {}) | {} / {} | {} / {} | {} | {} / {} | {} | {} / {} |\n",
            count(row.workloads),
            count(row.services),
            count(row.policies),
            ms(r.first_state_ms),
            ms(r.first_state_cpu_ms),
            megabytes(r.rss_first as f64),
            megabytes(r.rss_after_churn as f64),
            ms(r.cpu_per_update_ms),
            ms(r.ack_p50_ms),
            ms(r.ack_p99_ms),
            kilobytes(r.rss_first as f64 / row.workloads.max(1) as f64),
            ms(r.conn_p50_ms.unwrap_or(f64::NAN)),
            ms(r.conn_p99_ms.unwrap_or(f64::NAN)),
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn result(scale: f64) -> ScaleResult {
        ScaleResult {
            first_state_ms: 120.0 * scale,
            first_state_cpu_ms: 80.0 * scale,
            rss_first: (27e6 * scale) as u64,
            rss_after_churn: (30e6 * scale) as u64,
            updates: 600,
            acked: 600,
            cpu_per_update_ms: 0.5 * scale,
            ack_p50_ms: 4.0 * scale,
            ack_p99_ms: 18.0 * scale,
            conns: 0,
            conn_p50_ms: None,
            conn_p99_ms: None,
        }
    }

    #[test]
    fn figures_are_written_to_their_size() {
        assert_eq!(ms(0.184), "0.18 ms");
        assert_eq!(ms(4.04), "4.0 ms");
        assert_eq!(ms(450.2), "450 ms");
        assert_eq!(ms(53_400.0), "53.4 s");
        assert_eq!(ms(f64::NAN), "-");
        assert_eq!(ratio(1.0, 2.0), "0.50x");
        assert_eq!(ratio(7.0, 2.0), "3.5x");
        assert_eq!(ratio(85_000.0, 1.0), "85000x");
        assert_eq!(ratio(1.0, 0.0), "-");
        assert_eq!(ratio(f64::NAN, 1.0), "-");
        assert_eq!(count(1_000), "1k");
        assert_eq!(count(100_000), "100k");
        assert_eq!(count(1_000_000), "1M");
        assert_eq!(count(1_500), "1500");
        assert_eq!(count(10), "10");
    }

    #[test]
    fn the_table_sets_ours_beside_ztunnel() {
        let row = ScaleRow {
            workloads: 1_000,
            services: 100,
            policies: 10,
            first_push_bytes: 0,
            ours: result(2.0),
            ztunnel: Some(result(1.0)),
            ztunnel_error: None,
        };
        let text = table(std::slice::from_ref(&row));
        assert!(text.contains("| 1k (100, 10) | first complete state: time / CPU | 240 ms / 160 ms | 120 ms / 80.0 ms | 2.0x / 2.0x |"), "{text}");
        assert!(
            text.contains("|  | CPU per update | 1.0 ms | 0.50 ms | 2.0x |"),
            "{text}"
        );
        assert!(
            text.contains("|  | RSS per workload (first state) | 54.0 KB | 27.0 KB | 2.0x |"),
            "{text}"
        );
        // No connection figure: none was measured.
        assert_eq!(text.lines().count(), 2 + FIGURES.len() - 1);

        let failed = ScaleRow {
            ztunnel: None,
            ztunnel_error: Some("ztunnel exited:\nlog".to_owned()),
            ..row.clone()
        };
        let text = table(&[failed]);
        assert!(text.contains("| failed | - |"), "{text}");
        assert!(text.contains("- ztunnel at 1k: ztunnel exited:"), "{text}");

        let alone = ScaleRow {
            ztunnel: None,
            ..row
        };
        let text = table(&[alone]);
        assert!(
            text.starts_with("| workloads (services, policies) | first state"),
            "{text}"
        );
        assert_eq!(text.lines().count(), 3);
    }

    #[test]
    fn the_held_state_must_match_what_istiod_served() -> anyhow::Result<()> {
        let mesh = synthetic_mesh(200);
        let mut held = HeldState {
            workloads: mesh
                .workloads
                .iter()
                .map(|w| (w.uid.clone(), w.node.to_string()))
                .collect(),
            services: mesh.services.len(),
            policies: mesh.policies.len(),
        };
        check_held(&held, &mesh, None)?;
        let moved = workload(3, &mesh.services, 5);
        assert!(check_held(&held, &mesh, Some(&moved)).is_err());
        held.workloads[3].1 = moved.node.to_string();
        check_held(&held, &mesh, Some(&moved))?;
        held.policies = 0;
        assert!(check_held(&held, &mesh, None).is_err());
        Ok(())
    }

    #[test]
    fn service_vips_are_distinct_up_to_a_million() {
        assert_eq!(service_vip(0), IpAddr::from([172, 16, 0, 0]));
        assert_eq!(service_vip(257), IpAddr::from([172, 16, 1, 1]));
        assert_eq!(service_vip(65_536), IpAddr::from([172, 17, 0, 0]));
        assert_eq!(service_vip(999_999), IpAddr::from([172, 31, 66, 63]));
    }

    #[test]
    fn a_connection_time_from_dp_loads_report() -> anyhow::Result<()> {
        let report = r#"{"ops":1,"secs":0.002,"rate":500.0,"latency":{"samples":1,"p50_us":1523.5,"p99_us":1523.5}}"#;
        assert!((conn_time_ms(report)? - 1.5235).abs() < 1e-9);
        assert!(conn_time_ms(r#"{"ops":1}"#).is_err());
        assert!(conn_time_ms("oops").is_err());
        Ok(())
    }

    #[test]
    fn the_ack_guard_grows_with_the_mesh() {
        assert_eq!(ack_limit(0), Duration::from_secs(300));
        assert_eq!(ack_limit(100_000), Duration::from_secs(800));
    }
}
