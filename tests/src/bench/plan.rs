//! What a benchmark run measures, in which order, and the samples it
//! records.
//!
//! Every workload runs in every variant (mode x protocol) and placement;
//! within a round the variants of one placement run back to back, in an
//! order rotated from round to round, so machine drift (other processes,
//! thermal state, page cache) hits all of them alike. Counts are fixed per
//! workload; the load generator never sleeps.

use std::{process::Command, time::Duration};

use serde_json::{Value, json};

use super::{
    mesh::{Binaries, ECHO_PORT, Mode, ModeMesh, Placement, Protocol, SINK_PORT},
    probe::{self, MachineCpu},
    process::BenchProcess,
    signal,
};

/// Hang guard for one client run (not a timing assertion).
const RUN_LIMIT: Duration = Duration::from_secs(120);

/// Request and response size of the latency workloads.
const RR_SIZE: usize = 1024;

/// A workload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Workload {
    /// New connection, 1-byte echo, close; connections per second.
    ConnRate,
    /// 1 KiB ping-pong on one persistent connection.
    Rr,
    /// [`Workload::Rr`] with client, server and agents pinned to one CPU,
    /// so no cross-CPU wakeup is in the path.
    RrPinned,
    /// 1 KiB request and response on a new connection each.
    ConnRr,
    /// Bulk transfer over this many parallel streams.
    Bulk(u8),
}

impl Workload {
    /// Every workload, in run order.
    pub const ALL: [Workload; 7] = [
        Workload::ConnRate,
        Workload::Rr,
        Workload::RrPinned,
        Workload::ConnRr,
        Workload::Bulk(1),
        Workload::Bulk(4),
        Workload::Bulk(8),
    ];

    /// Its name in reports.
    pub fn name(self) -> String {
        match self {
            Workload::ConnRate => "conn-rate".into(),
            Workload::Rr => "rr".into(),
            Workload::RrPinned => "rr-pinned".into(),
            Workload::ConnRr => "conn-rr".into(),
            Workload::Bulk(n) => format!("bulk-{n}"),
        }
    }
}

/// Fixed operation counts.
#[derive(Debug, Clone, Copy)]
pub struct Counts {
    /// Connections per connection-rate run.
    pub conns: u64,
    /// Client threads of the connection-rate run.
    pub conn_concurrency: usize,
    /// Ping-pongs per RR run.
    pub rr: u64,
    /// Connections per new-connection RR run.
    pub conn_rr: u64,
    /// Bytes per bulk run (split over its streams).
    pub bulk_bytes: u64,
    /// Idle connection counts at which agent memory is read.
    pub idle_steps: [usize; 2],
}

impl Counts {
    /// The full run's counts: about a second per run at HBONE speeds on two
    /// cores.
    pub const FULL: Counts = Counts {
        conns: 4000,
        conn_concurrency: 4,
        rr: 10_000,
        conn_rr: 2000,
        bulk_bytes: 512 << 20,
        idle_steps: [1000, 10_000],
    };

    /// `--quick`: proves every path works; the numbers mean nothing.
    pub const QUICK: Counts = Counts {
        conns: 200,
        conn_concurrency: 4,
        rr: 300,
        conn_rr: 50,
        bulk_bytes: 16 << 20,
        idle_steps: [50, 200],
    };
}

/// What to run.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Rounds (each runs every workload in every variant once).
    pub rounds: usize,
    /// Operation counts.
    pub counts: Counts,
    /// Workloads (all by default).
    pub workloads: Vec<Workload>,
    /// Whether to measure agent memory under idle connections.
    pub idle: bool,
    /// Only these modes (all when empty; for profiling one of them).
    pub modes: Vec<Mode>,
}

impl Plan {
    fn runs(&self, mode: Mode) -> bool {
        self.modes.is_empty() || self.modes.contains(&mode)
    }
}

/// The variants run for each placement: direct, then the engine behind
/// each capture for each protocol, then ztunnel (when given) on the HBONE
/// path.
const VARIANTS: [(Mode, Protocol); 8] = [
    (Mode::Direct, Protocol::Plain),
    (Mode::Iptables, Protocol::Plain),
    (Mode::Ebpf, Protocol::Plain),
    (Mode::Iptables, Protocol::Hbone),
    (Mode::Ebpf, Protocol::Hbone),
    (Mode::Ebpf, Protocol::FastPath),
    (Mode::Ebpf, Protocol::FastPathVip),
    (Mode::Ztunnel, Protocol::Hbone),
];

/// How many variants a round of one workload runs under `plan`, over both
/// placements.
pub fn variants_per_workload(plan: &Plan) -> usize {
    Placement::ALL
        .into_iter()
        .flat_map(|placement| VARIANTS.map(|variant| (placement, variant)))
        .filter(|(placement, (mode, protocol))| {
            plan.runs(*mode) && protocol.exists(*mode, *placement)
        })
        .count()
}

/// The clusters: one per mode, ztunnel's only with a ztunnel binary.
#[derive(Debug)]
pub struct Clusters {
    /// Direct, iptables, ebpf, and ztunnel when given.
    pub meshes: Vec<ModeMesh>,
    /// Binaries.
    pub bins: Binaries,
}

impl Clusters {
    /// The modes that get a cluster with `bins`.
    pub fn modes(bins: &Binaries) -> Vec<Mode> {
        Mode::ALL
            .into_iter()
            .filter(|m| *m != Mode::Ztunnel || bins.ztunnel.is_some())
            .collect()
    }

    /// Builds one cluster for each of `modes` (see [`Clusters::modes`]).
    pub fn build(bins: Binaries, modes: &[Mode]) -> anyhow::Result<Self> {
        let mut meshes = Vec::new();
        for &mode in modes {
            signal::check()?;
            meshes.push(ModeMesh::build(mode, &bins)?);
        }
        Ok(Self { meshes, bins })
    }

    /// Whether `mode` has a cluster.
    pub fn has(&self, mode: Mode) -> bool {
        self.meshes.iter().any(|m| m.mode == mode)
    }

    fn mesh(&self, mode: Mode) -> anyhow::Result<&ModeMesh> {
        self.meshes
            .iter()
            .find(|m| m.mode == mode)
            .ok_or_else(|| anyhow::anyhow!("no {} cluster", mode.name()))
    }

    fn mesh_mut(&mut self, mode: Mode) -> anyhow::Result<&mut ModeMesh> {
        self.meshes
            .iter_mut()
            .find(|m| m.mode == mode)
            .ok_or_else(|| anyhow::anyhow!("no {} cluster", mode.name()))
    }
}

/// Checks each path is what it claims: with one connection held open
/// through it, the client pod has a socket on the outbound capture port
/// exactly when the mode captures, and one to an HBONE port exactly when
/// the path is tunnelled.
pub fn verify_paths(clusters: &Clusters) -> anyhow::Result<Vec<Value>> {
    let mut checks = Vec::new();
    for placement in Placement::ALL {
        for (mode, protocol) in VARIANTS {
            if !protocol.exists(mode, placement) || !clusters.has(mode) {
                continue;
            }
            signal::check()?;
            let mesh = clusters.mesh(mode)?;
            let addr = mesh.addr(placement, protocol, ECHO_PORT)?;
            let (netns, cgroup) = mesh.client_paths();
            let mut cmd = Command::new(&clusters.bins.load);
            cmd.args(["idle", &addr.to_string(), "1"]);
            let mut client = BenchProcess::spawn(cmd, Some(netns), Some(cgroup))?;
            let ready = client.line(Duration::from_secs(30))?;
            anyhow::ensure!(ready == "ready 1", "idle client said `{ready}`");
            let captured =
                count_sockets(mesh.client_netns(), "( sport = :15001 or dport = :15001 )")? > 0;
            // Only this server's tunnel: pooled connections to other
            // servers outlive earlier checks.
            let hbone = format!("dst {}:15008", addr.ip());
            let tunnelled = count_sockets(mesh.client_netns(), &hbone)? > 0;
            client.close_stdin();
            client.finish(Duration::from_secs(30))?;
            // The fast path's first connection was the warm-up's.
            let want_captured = mode != Mode::Direct && !protocol.is_fast_path();
            let want_tunnel = protocol == Protocol::Hbone;
            // The warm-up's pooled tunnel to the fast-path server stays
            // until it idles out; that the held connection is not captured
            // is what shows it went socket to socket.
            let tunnel_ok = tunnelled == want_tunnel || protocol.is_fast_path();
            anyhow::ensure!(
                captured == want_captured && tunnel_ok,
                "{} {} {}: captured={captured} (want {want_captured}), tunnelled={tunnelled} (want {want_tunnel})\n{}",
                mode.name(),
                placement.name(),
                protocol.name(),
                mesh.agent_logs()
            );
            checks.push(json!({
                "mode": mode.name(), "placement": placement.name(), "protocol": protocol.name(),
                "captured": captured, "tunnelled": tunnelled,
            }));
        }
    }
    Ok(checks)
}

/// Established TCP sockets in a namespace matching an `ss` filter.
fn count_sockets(netns: &str, filter: &str) -> anyhow::Result<usize> {
    let mut args = vec!["netns", "exec", netns, "ss", "-Htn", "state", "established"];
    args.extend(filter.split_whitespace());
    Ok(crate::run("ip", &args)?
        .lines()
        .filter(|l| !l.trim().is_empty())
        .count())
}

/// Runs every round; `on_sample` gets each sample as it is taken.
pub fn run_rounds(
    clusters: &mut Clusters,
    plan: &Plan,
    mut on_sample: impl FnMut(&Value),
) -> anyhow::Result<Vec<Value>> {
    let mut samples = Vec::new();
    let mut seq = 0;
    for round in 0..plan.rounds {
        for &workload in &plan.workloads {
            for placement in Placement::ALL {
                for i in 0..VARIANTS.len() {
                    let (mode, protocol) = VARIANTS[(i + round) % VARIANTS.len()];
                    if !plan.runs(mode) || !protocol.exists(mode, placement) {
                        continue;
                    }
                    signal::check()?;
                    let sample = measure(clusters, plan, workload, mode, placement, protocol)
                        .unwrap_or_else(|e| {
                            let logs = clusters.mesh(mode).map(log_tail).unwrap_or_default();
                            json!({"ok": false, "error": format!("{e:#}\nagents:\n{logs}")})
                        });
                    let mut sample = sample;
                    if let Some(obj) = sample.as_object_mut() {
                        obj.insert("workload".into(), json!(workload.name()));
                        obj.insert("mode".into(), json!(mode.name()));
                        obj.insert("placement".into(), json!(placement.name()));
                        obj.insert("protocol".into(), json!(protocol.name()));
                        obj.insert("round".into(), json!(round));
                        obj.insert("seq".into(), json!(seq));
                    }
                    seq += 1;
                    signal::check()?;
                    on_sample(&sample);
                    samples.push(sample);
                }
            }
        }
    }
    Ok(samples)
}

/// One run: the client in the client pod, CPU read around it.
fn measure(
    clusters: &Clusters,
    plan: &Plan,
    workload: Workload,
    mode: Mode,
    placement: Placement,
    protocol: Protocol,
) -> anyhow::Result<Value> {
    let mesh = clusters.mesh(mode)?;
    let counts = plan.counts;
    let echo = mesh.addr(placement, protocol, ECHO_PORT)?.to_string();
    let sink = mesh.addr(placement, protocol, SINK_PORT)?.to_string();
    let args: Vec<String> = match workload {
        Workload::ConnRate => vec![
            "conn".into(),
            echo,
            counts.conns.to_string(),
            counts.conn_concurrency.to_string(),
            "1".into(),
        ],
        Workload::Rr | Workload::RrPinned => vec![
            "rr".into(),
            echo,
            counts.rr.to_string(),
            RR_SIZE.to_string(),
        ],
        Workload::ConnRr => vec![
            "conn".into(),
            echo,
            counts.conn_rr.to_string(),
            "1".into(),
            RR_SIZE.to_string(),
        ],
        Workload::Bulk(streams) => vec![
            "bulk".into(),
            sink,
            counts.bulk_bytes.to_string(),
            streams.to_string(),
        ],
    };
    let pinned = workload == Workload::RrPinned;
    let server_pid = mesh.server_pid(placement, protocol)?;
    let mut pids = mesh.agent_pids();
    pids.push(server_pid);
    if pinned {
        for &pid in &pids {
            probe::set_affinity(pid, Some(0))?;
        }
    }
    let result = (|| {
        let mut cmd = Command::new(&clusters.bins.load);
        cmd.args(&args);
        if pinned {
            cmd.args(["--cpu", "0"]);
        }
        let (netns, cgroup) = mesh.client_paths();
        let agent_before = mesh.agent_cpu()?;
        let machine_before = MachineCpu::now()?;
        let started = std::time::Instant::now();
        let client = BenchProcess::spawn(cmd, Some(netns), Some(cgroup))?;
        let line = client.output(RUN_LIMIT)?;
        let wall = started.elapsed().as_secs_f64();
        let machine = MachineCpu::now()?.since(machine_before);
        let agent = mesh.agent_cpu()? - agent_before;
        let result: Value = serde_json::from_str(&line)
            .map_err(|e| anyhow::anyhow!("bad dp-load output `{line}`: {e}"))?;
        Ok::<_, anyhow::Error>(json!({
            "ok": true,
            "result": result,
            "wall_s": wall,
            "agent_cpu_s": agent,
            "machine_cpu_s": machine.busy,
            "machine_kernel_s": machine.kernel,
        }))
    })();
    if pinned {
        for &pid in &pids {
            let _ = probe::set_affinity(pid, None);
        }
    }
    result
}

/// The agents' last log lines, for a failed run's error.
fn log_tail(mesh: &ModeMesh) -> String {
    let logs = mesh.agent_logs();
    let lines: Vec<&str> = logs.lines().collect();
    lines[lines.len().saturating_sub(10)..].join("\n")
}

/// Agent memory with idle connections held open through it, for every
/// capture mode, placement and protocol; each on freshly started agents.
pub fn measure_idle(clusters: &mut Clusters, plan: &Plan) -> anyhow::Result<Vec<Value>> {
    let mut out = Vec::new();
    let steps = plan.counts.idle_steps;
    for (mode, protocol) in VARIANTS
        .iter()
        .copied()
        // The agents hold nothing of a fast-path connection, whatever
        // address it was dialled at: one fast path is measured.
        .filter(|(m, p)| *m != Mode::Direct && plan.runs(*m) && *p != Protocol::FastPathVip)
    {
        for placement in Placement::ALL
            .into_iter()
            .filter(|p| protocol.exists(mode, *p))
        {
            signal::check()?;
            clusters.mesh_mut(mode)?.start_proxies()?;
            let mesh = clusters.mesh(mode)?;
            let steps = steps.map(|s| s.min(idle_capacity(mode, placement, protocol)));
            let result = idle_once(mesh, &clusters.bins, placement, protocol, steps);
            let mut sample = result.unwrap_or_else(
                |e| json!({"ok": false, "error": format!("{e:#}\nagents:\n{}", log_tail(mesh))}),
            );
            if let Some(obj) = sample.as_object_mut() {
                obj.insert("mode".into(), json!(mode.name()));
                obj.insert("placement".into(), json!(placement.name()));
                obj.insert("protocol".into(), json!(protocol.name()));
            }
            out.push(sample);
        }
    }
    Ok(out)
}

/// How many idle connections the busiest agent can hold within the
/// descriptor limit it inherits (often a hard 20,000 in containers, which
/// even root cannot raise): it holds two sockets per connection when it
/// has both ends (plain passthrough, or HBONE on one node), one when the
/// other end is the other node's agent. Each dedicated ztunnel holds one
/// (its own pod's end; the tunnels to the other are pooled).
fn idle_capacity(mode: Mode, placement: Placement, protocol: Protocol) -> usize {
    let per_connection = match (mode, placement, protocol) {
        (Mode::Ztunnel, _, _) | (_, Placement::CrossNode, Protocol::Hbone) => 1,
        _ => 2,
    };
    let spare = 1000;
    (probe::nofile_limit().saturating_sub(spare) / per_connection) as usize
}

fn idle_once(
    mesh: &ModeMesh,
    bins: &Binaries,
    placement: Placement,
    protocol: Protocol,
    steps: [usize; 2],
) -> anyhow::Result<Value> {
    let rss = |mesh: &ModeMesh| mesh.proxy_rss(placement);
    let base = rss(mesh)?;
    let addr = mesh.addr(placement, protocol, ECHO_PORT)?;
    let (netns, cgroup) = mesh.client_paths();
    let mut cmd = Command::new(&bins.load);
    cmd.args([
        "idle",
        &addr.to_string(),
        &format!("{},{}", steps[0], steps[1]),
    ]);
    let mut client = BenchProcess::spawn(cmd, Some(netns), Some(cgroup))?;
    let mut at_steps = Vec::new();
    for step in steps {
        signal::check()?;
        let line = client.line(RUN_LIMIT)?;
        anyhow::ensure!(line == format!("ready {step}"), "idle client said `{line}`");
        at_steps.push(json!({"connections": step, "rss_bytes": rss(mesh)?}));
        client.send_line("next")?;
    }
    client.finish(RUN_LIMIT)?;
    Ok(json!({"ok": true, "base_rss_bytes": base, "steps": at_steps}))
}
