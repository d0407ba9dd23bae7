//! Mesh scale (issue 31's measurement): the test istiod serves a synthetic
//! mesh of N workloads (one IP each, one service per ten workloads, one
//! namespace policy per hundred) to one agent, then changes one workload
//! at a time at a fixed rate. Per N it reports the time and the agent's CPU
//! until the first complete state is ACKed (the agent ACKs a push once its
//! state holds it), its RSS then and after the churn, the agent's CPU per
//! update and the push-to-ACK latency of every update.
//!
//! The agent has no pod enrolled: what is measured is the mesh state alone.

use std::{
    collections::{BTreeMap, HashMap},
    net::{IpAddr, Ipv4Addr},
    path::Path,
    time::{Duration, Instant},
};

use anyhow::Context as _;
use dataplane_user::{
    config::{Action, LocalConfig, Match, Policy, Protocol, Scope, Service, Workload},
    istio_api::{ADDRESS_TYPE, AUTHORIZATION_TYPE},
};
use serde::Serialize;

use super::agent::MeasuredAgent;
use crate::{
    Cgroup, TempDir,
    istio_resources::{policy_resource, service_resource, workload_resource},
    istiod::{SERVER_NAME, TestIstiod, TestPki},
};

/// How long the ACKs of the first state and of the last updates are
/// awaited (a guard, not a timing assertion).
const ACK_LIMIT: Duration = Duration::from_secs(300);

/// What to run.
#[derive(Debug, Clone)]
pub struct ScaleSettings {
    /// Mesh sizes, in workloads.
    pub sizes: Vec<usize>,
    /// Single-workload updates per second during the churn.
    pub rate: u32,
    /// How long the churn lasts.
    pub churn: Duration,
}

impl ScaleSettings {
    /// The full run: 1k and 10k workloads, 20 updates per second for 30 s.
    pub fn full() -> Self {
        Self {
            sizes: vec![1_000, 10_000],
            rate: 20,
            churn: Duration::from_secs(30),
        }
    }

    /// CI's proof that the harness works: 1k workloads, 3 s of churn.
    pub fn quick() -> Self {
        Self {
            sizes: vec![1_000],
            rate: 20,
            churn: Duration::from_secs(3),
        }
    }
}

/// One mesh size's figures.
#[derive(Debug, Clone, Serialize)]
pub struct ScaleResult {
    /// Workloads (services: a tenth, policies: a hundredth).
    pub workloads: usize,
    /// From the agent's start to the ACK of its first complete state, ms.
    pub first_state_ms: f64,
    /// The agent's CPU until then, ms.
    pub first_state_cpu_ms: f64,
    /// RSS once the first state is in, bytes.
    pub rss_first: u64,
    /// RSS after the churn, bytes.
    pub rss_after_churn: u64,
    /// Updates sent during the churn.
    pub updates: usize,
    /// Updates ACKed (the rest were still unanswered at the guard).
    pub acked: usize,
    /// The agent's CPU per update during the churn, ms.
    pub cpu_per_update_ms: f64,
    /// Push-to-ACK, median and 99th percentile, ms.
    pub ack_p50_ms: f64,
    /// As above.
    pub ack_p99_ms: f64,
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
                vips: vec![IpAddr::from([172, 16, (s >> 8) as u8, s as u8])],
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

/// Runs every size of `settings` against `agent_binary`.
pub fn run(agent_binary: &Path, settings: &ScaleSettings) -> anyhow::Result<Vec<ScaleResult>> {
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

fn one_size(
    rt: &tokio::runtime::Runtime,
    pki: &TestPki,
    agent_binary: &Path,
    n: usize,
    settings: &ScaleSettings,
) -> anyhow::Result<ScaleResult> {
    let mesh = synthetic_mesh(n);
    let mut istiod = rt.block_on(TestIstiod::start(pki, "127.0.0.1:0".parse()?))?;
    let version = "v0";
    rt.block_on(async {
        let addresses = mesh
            .workloads
            .iter()
            .map(|w| workload_resource(w, version))
            .chain(mesh.services.iter().map(|s| service_resource(s, version)))
            .collect();
        istiod.publish(ADDRESS_TYPE, addresses, &[]).await?;
        let policies = mesh
            .policies
            .iter()
            .map(|p| policy_resource(p, version))
            .collect();
        istiod.publish(AUTHORIZATION_TYPE, policies, &[]).await
    })?;

    let tag = format!("dpt-bench-scale{n}");
    let dir = TempDir::new(&tag)?;
    let root = dir.path().join("root-cert.pem");
    std::fs::write(&root, &pki.root_pem)?;
    let token = dir.path().join("istio-token");
    std::fs::write(&token, "scale-token\n")?;
    let empty = dir.path().join("empty.yaml");
    std::fs::write(&empty, "workloads: []\n")?;
    let node = Cgroup::new(&format!("{tag}-node"))?;
    let flags: Vec<String> = [
        "--config",
        &empty.display().to_string(),
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
    let agent = MeasuredAgent::start(agent_binary, &tag, node.path(), &flags, 0)?;
    // The first complete state: both types' first responses ACKed (the
    // second ACK waits for the state built from both).
    rt.block_on(async {
        let mut acked = [false; 2];
        while !acked.iter().all(|a| *a) {
            super::signal::check()?;
            let seen = istiod
                .next_request(ACK_LIMIT)
                .await
                .context("the first state was not ACKed")?;
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
        anyhow::Ok(())
    })?;
    let first_state_ms = started.elapsed().as_secs_f64() * 1e3;
    let cpu_first = agent.cpu_usec()?;
    let rss_first = agent.rss()?;

    let (updates, latencies, cpu_churn) =
        rt.block_on(churn(&mut istiod, &agent, &mesh, settings))?;
    let rss_after_churn = agent.rss()?;
    rt.block_on(istiod.stop());
    let mut sorted = latencies.clone();
    sorted.sort_by(f64::total_cmp);
    let percentile = |p: f64| -> f64 {
        if sorted.is_empty() {
            return f64::NAN;
        }
        let rank = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len());
        sorted[rank - 1]
    };
    Ok(ScaleResult {
        workloads: n,
        first_state_ms,
        // Since the agent started (its cgroup is its own): start-up
        // itself is in it too, a few ms.
        first_state_cpu_ms: cpu_first as f64 / 1e3,
        rss_first,
        rss_after_churn,
        updates,
        acked: latencies.len(),
        cpu_per_update_ms: if updates == 0 {
            f64::NAN
        } else {
            cpu_churn as f64 / 1e3 / updates as f64
        },
        ack_p50_ms: percentile(0.50),
        ack_p99_ms: percentile(0.99),
    })
}

/// Sends `settings.rate` single-workload updates per second for
/// `settings.churn`, then awaits their ACKs; returns the updates sent,
/// every ACK's push-to-ACK latency in ms and the agent's CPU (us) from the
/// first update to the last ACK.
async fn churn(
    istiod: &mut TestIstiod,
    agent: &MeasuredAgent,
    mesh: &LocalConfig,
    settings: &ScaleSettings,
) -> anyhow::Result<(usize, Vec<f64>, u64)> {
    let n = mesh.workloads.len();
    let total = (settings.churn.as_secs_f64() * f64::from(settings.rate)).round() as usize;
    let period = Duration::from_secs_f64(1.0 / f64::from(settings.rate.max(1)));
    let mut sent: HashMap<String, Instant> = HashMap::new();
    let mut latencies = Vec::with_capacity(total);
    let cpu_before = agent.cpu_usec()?;
    let mut ticks = tokio::time::interval(period);
    let mut next = 0;
    let deadline = Instant::now() + settings.churn + ACK_LIMIT;
    while latencies.len() < total {
        super::signal::check()?;
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
                next += 1;
            }
            seen = istiod.next_request(ACK_LIMIT) => {
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
    Ok((total, latencies, agent.cpu_usec()? - cpu_before))
}

/// The results as a Markdown table.
pub fn table(results: &[ScaleResult]) -> String {
    let mut out = String::from(
        "| workloads (services, policies) | first state: time / CPU | RSS first / after churn | CPU per update | push-to-ACK p50 / p99 | RSS / workload |\n|---|---|---|---|---|---|\n",
    );
    for r in results {
        out.push_str(&format!(
            "| {} ({}, {}) | {:.0} ms / {:.0} ms | {:.1} / {:.1} MB | {:.2} ms | {:.2} / {:.2} ms | {:.0} |\n",
            r.workloads,
            (r.workloads / 10).max(1),
            (r.workloads / 100).max(1),
            r.first_state_ms,
            r.first_state_cpu_ms,
            r.rss_first as f64 / 1e6,
            r.rss_after_churn as f64 / 1e6,
            r.cpu_per_update_ms,
            r.ack_p50_ms,
            r.ack_p99_ms,
            r.rss_first as f64 / r.workloads.max(1) as f64,
        ));
    }
    out
}
