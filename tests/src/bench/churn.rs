//! Enrollment churn: does putting pods in and out of the mesh slow down the
//! traffic of pods already in it?
//!
//! One node, one agent (`--worker-threads N`), a client and a server pod in
//! the mesh (HBONE between them), and [`ChurnSettings::pods`] more pods that
//! a driver thread enrolls and removes in a loop over the control socket.
//! The client runs persistent 1 KiB request/response to the server twice
//! per round: once with the driver idle (`quiet`), once while it churns
//! (`churn`); quiet and churn alternate so machine drift hits both alike.
//! Enrolling a pod issues a certificate, enters its namespace, creates
//! listeners, writes maps and attaches `sk_lookup`: any of that done on the
//! engine's worker threads shows up as request latency here.

use std::{
    path::{Path, PathBuf},
    process::Command,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use dataplane_user::{
    control::{self, Request},
    enroll::PodSpec,
};
use serde_json::{Value, json};

use super::{
    agent::MeasuredAgent,
    mesh::{ECHO_PORT, SINK_PORT},
    process::BenchProcess,
    sweep::PREFIX,
};
use crate::{
    TempDir,
    mesh::{config_of, hbone_workload, write_config},
    topology::{Node, Pod},
};

/// Request and response size.
const RR_SIZE: usize = 1024;

/// Hang guard for one client run or control call (not a timing assertion).
const LIMIT: Duration = Duration::from_secs(120);

/// What one churn benchmark run does.
#[derive(Debug, Clone)]
pub struct ChurnSettings {
    /// Pods enrolled and removed in a loop.
    pub pods: usize,
    /// Ping-pongs per measurement.
    pub requests: u64,
    /// Rounds of (quiet, churn) per worker-thread count.
    pub rounds: usize,
    /// Agent runtime worker threads to measure with.
    pub worker_threads: Vec<usize>,
}

impl ChurnSettings {
    /// The full run: 100 churned pods, 3 rounds of 20,000 requests, one and
    /// two worker threads.
    pub fn full() -> Self {
        Self {
            pods: 100,
            requests: 20_000,
            rounds: 3,
            worker_threads: vec![1, 2],
        }
    }

    /// Proves the harness works; the numbers mean nothing.
    pub fn quick() -> Self {
        Self {
            pods: 10,
            requests: 500,
            rounds: 1,
            worker_threads: vec![1],
        }
    }
}

/// The simulated node with its pods.
struct ChurnNode {
    // Field order is drop order: the server process goes before its pod,
    // pods before their node.
    _server: BenchProcess,
    client: Pod,
    server_pod: Pod,
    churned: Vec<Pod>,
    node: Node,
    dir: TempDir,
    config: PathBuf,
}

/// Runs the whole benchmark with the agent binary `agent` and the load
/// generator `load`; returns every sample as JSON
/// (`{"settings": .., "samples": [{"worker_threads", "round", "phase",
/// "latency": {..}, "churn_ops"}]}`).
pub fn run(agent: &Path, load: &Path, settings: &ChurnSettings) -> anyhow::Result<Value> {
    let node = build(load, settings.pods)?;
    let mut samples = Vec::new();
    for &threads in &settings.worker_threads {
        let tag = format!("{}c{threads}", PREFIX.trim_start_matches("dpt-"));
        let args: Vec<String> = vec![
            "--config".into(),
            node.config.display().to_string(),
            "--node".into(),
            "node1".into(),
            "--ca-dir".into(),
            node.dir.path().join("ca").display().to_string(),
            "--worker-threads".into(),
            threads.to_string(),
        ];
        let measured = MeasuredAgent::start(agent, &tag, node.node.cgroup().path(), &args, 2)?;
        let socket = measured.control_socket();
        for round in 0..settings.rounds {
            for phase in ["quiet", "churn"] {
                super::signal::check()?;
                let (latency, ops) = measure(load, &node, &socket, settings, phase == "churn")
                    .map_err(|e| anyhow::anyhow!("{e:#}\n{}", measured.log_text()))?;
                samples.push(json!({
                    "worker_threads": threads,
                    "round": round,
                    "phase": phase,
                    "latency": latency,
                    "churn_ops": ops,
                }));
            }
        }
    }
    Ok(json!({
        "settings": {
            "pods": settings.pods,
            "requests": settings.requests,
            "rounds": settings.rounds,
            "rr_size": RR_SIZE,
        },
        "samples": samples,
    }))
}

fn build(load: &Path, pods: usize) -> anyhow::Result<ChurnNode> {
    let tag = format!("{}c", PREFIX.trim_start_matches("dpt-"));
    let mut node = Node::new(&tag, 1)?;
    let client = node.add_pod(&tag)?;
    let server_pod = node.add_pod(&tag)?;
    let mut churned = Vec::with_capacity(pods);
    for _ in 0..pods {
        churned.push(node.add_pod(&tag)?);
    }
    let mut cmd = Command::new(load);
    cmd.args(["serve", &ECHO_PORT.to_string(), &SINK_PORT.to_string()]);
    let mut server = BenchProcess::spawn(
        cmd,
        Some(server_pod.netns.path()),
        Some(server_pod.cgroup.path()),
    )?;
    let line = server.line(Duration::from_secs(10))?;
    anyhow::ensure!(line == "listening", "server said `{line}`");
    let dir = TempDir::new(&tag)?;
    let workloads = vec![
        hbone_workload(&client, "client", "node1"),
        hbone_workload(&server_pod, "server", "node1"),
    ];
    let config = write_config(dir.path(), "mesh.yaml", &config_of(workloads))?;
    Ok(ChurnNode {
        _server: server,
        client,
        server_pod,
        churned,
        node,
        dir,
        config,
    })
}

/// One RR run, with the churn driver running beside it when `churn`.
/// Returns the client's latency report and how many enroll/remove calls
/// the driver completed.
fn measure(
    load: &Path,
    node: &ChurnNode,
    socket: &Path,
    settings: &ChurnSettings,
    churn: bool,
) -> anyhow::Result<(Value, u64)> {
    let stop = Arc::new(AtomicBool::new(false));
    let ops = Arc::new(AtomicU64::new(0));
    let driver = churn.then(|| {
        let specs: Vec<PodSpec> = node.churned.iter().enumerate().map(churn_spec).collect();
        let (stop, ops, socket) = (Arc::clone(&stop), Arc::clone(&ops), socket.to_path_buf());
        std::thread::spawn(move || drive(&socket, &specs, &stop, &ops))
    });
    // The driver gets going before the first request is timed.
    if churn {
        let started = Instant::now();
        while ops.load(Ordering::Relaxed) == 0 && started.elapsed() < LIMIT {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    let mut cmd = Command::new(load);
    cmd.args([
        "rr",
        &format!("{}:{ECHO_PORT}", node.server_pod.ip4),
        &settings.requests.to_string(),
        &RR_SIZE.to_string(),
    ]);
    let client = BenchProcess::spawn(
        cmd,
        Some(node.client.netns.path()),
        Some(node.client.cgroup.path()),
    )
    .and_then(|p| p.output(LIMIT));
    stop.store(true, Ordering::Relaxed);
    let driven = match driver {
        Some(handle) => handle
            .join()
            .map_err(|_| anyhow::anyhow!("churn driver panicked"))??,
        None => 0,
    };
    let report: Value = serde_json::from_str(client?.trim())?;
    Ok((report["latency"].clone(), driven))
}

/// Each churned pod has an identity of its own, so enrolling it issues a
/// certificate as a real pod's would.
fn churn_spec((index, pod): (usize, &Pod)) -> PodSpec {
    let mut spec = crate::Agent::spec_for(pod, &format!("churn-{index}"));
    spec.service_account = format!("sa-{index}");
    spec
}

/// Enrolls every pod, then removes every pod, until told to stop; leaves
/// none enrolled. Returns the number of calls made.
fn drive(
    socket: &Path,
    specs: &[PodSpec],
    stop: &AtomicBool,
    ops: &AtomicU64,
) -> anyhow::Result<u64> {
    let call = |request: Request| -> anyhow::Result<()> {
        let response = control::call(socket, &request, LIMIT)?;
        anyhow::ensure!(
            response.ok,
            "agent refused {request:?}: {}",
            response.error.unwrap_or_default()
        );
        ops.fetch_add(1, Ordering::Relaxed);
        Ok(())
    };
    while !stop.load(Ordering::Relaxed) {
        for spec in specs {
            call(Request::Add {
                pod: Box::new(spec.clone()),
            })?;
        }
        for spec in specs {
            call(Request::Remove {
                uid: Some(spec.uid.clone()),
                netns: None,
            })?;
        }
    }
    Ok(ops.load(Ordering::Relaxed))
}

/// The report's table: per worker-thread count and phase, the medians over
/// rounds of p50, p99 and max, and churn calls per second.
pub fn table(results: &Value) -> String {
    let samples = results["samples"].as_array().cloned().unwrap_or_default();
    let mut threads: Vec<u64> = samples
        .iter()
        .filter_map(|s| s["worker_threads"].as_u64())
        .collect();
    threads.dedup();
    let mut out = String::from(
        "| worker threads | phase | p50 µs | p99 µs | max µs | enroll/remove calls |\n|---|---|---|---|---|---|\n",
    );
    for t in threads {
        for phase in ["quiet", "churn"] {
            let of: Vec<&Value> = samples
                .iter()
                .filter(|s| s["worker_threads"].as_u64() == Some(t) && s["phase"] == phase)
                .collect();
            let median = |f: &dyn Fn(&Value) -> Option<f64>| {
                let mut v: Vec<f64> = of.iter().filter_map(|s| f(s)).collect();
                v.sort_by(f64::total_cmp);
                v.get(v.len() / 2).copied()
            };
            let fmt = |x: Option<f64>| x.map_or("-".to_owned(), |x| format!("{x:.1}"));
            let calls: u64 = of.iter().filter_map(|s| s["churn_ops"].as_u64()).sum();
            out.push_str(&format!(
                "| {t} | {phase} | {} | {} | {} | {calls} |\n",
                fmt(median(&|s| s["latency"]["p50_us"].as_f64())),
                fmt(median(&|s| s["latency"]["p99_us"].as_f64())),
                fmt(median(&|s| s["latency"]["max_us"].as_f64())),
            ));
        }
    }
    out
}
