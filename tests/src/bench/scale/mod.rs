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
//! measured of it is the mesh state alone, so the agent's CPU for the
//! probe's connections (measured alone before the churn, per connection)
//! is taken out of its CPU per update. ztunnel's node hosts none of
//! the workloads, so it fetches no certificates ahead for them.

mod conn;
mod proxies;
mod report;

use std::{
    collections::{BTreeMap, HashMap},
    net::{IpAddr, Ipv4Addr},
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::Context as _;
use dataplane_user::{
    config::{Action, LocalConfig, Match, Policy, Protocol, Scope, Service, Workload},
    istio_api::{ADDRESS_TYPE, AUTHORIZATION_TYPE, discovery::Resource},
};
use serde::Serialize;

use self::conn::ConnPods;
use self::proxies::{Running, start_ours, start_ztunnel};
pub use self::report::table;
use super::agent::MeasuredAgent;
use crate::{
    Cgroup, Netns, TempDir,
    istio_resources::{policy_resource, service_resource, workload_resource},
    istiod::{TestIstiod, TestPki},
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
    /// The most RSS until then (the first push's peak: the response and
    /// what is built from it), bytes.
    pub rss_peak_first: u64,
    /// RSS after the churn, bytes.
    pub rss_after_churn: u64,
    /// Updates sent during the churn.
    pub updates: usize,
    /// Updates ACKed (the rest were still unanswered at the guard).
    pub acked: usize,
    /// Its CPU per update during the churn, ms (our agent's without its
    /// probe connections' share, [`ScaleResult::conn_cpu_ms`] each).
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
    /// The agent's CPU per probe connection (measured alone before the
    /// churn), ms.
    pub conn_cpu_ms: Option<f64>,
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
                vips: vec![service_vip(s).into()],
                ports: BTreeMap::from([(80, 8080)]),
                subject_alt_names: Vec::new(),
                load_balancing: Default::default(),
                health_policy: Default::default(),
                routing: Default::default(),
                waypoint: None,
                canonical: false,
                visibility: Default::default(),
                cidr_vips: Vec::new(),
                weighted_waypoints: Vec::new(),
                ip_families: None,
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
        uid: format!("Kubernetes//Pod/{}/w{i}", service.namespace).into(),
        name: format!("w{i}"),
        namespace: service.namespace.as_str().into(),
        service_account: format!("sa{}", i % 500).into(),
        trust_domain: "cluster.local".into(),
        workload_ips: [Ipv4Addr::new(10, a, b, c).into()].into(),
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
    let rss_peak_first = running.peak_rss()?;

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
        rss_peak_first,
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
        conn_cpu_ms: churned.conn_cpu_usec.map(|us| us as f64 / 1e3),
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
    /// The proxy's CPU from the first update to the last ACK, the probe's
    /// connections taken out, us.
    cpu_usec: u64,
    /// What one probe connection cost the agent, measured before the
    /// churn, us.
    conn_cpu_usec: Option<u64>,
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
    let conn_cpu_usec = match &*running {
        Running::Ours {
            pods: Some(pods), ..
        } => Some(pods.connection_cpu_usec(8, || running.cpu_usec())?),
        _ => None,
    };
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
    // The probe's connections are not the updates' cost.
    let conns_usec = conn_cpu_usec.unwrap_or(0) * conns.len() as u64;
    let cpu_usec = cpu_usec.saturating_sub(conns_usec);
    Ok(Churned {
        updates: total,
        latencies,
        cpu_usec,
        conn_cpu_usec,
        last,
        conns,
    })
}

#[cfg(test)]
mod tests;
