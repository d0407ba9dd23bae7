//! A scaling model: from one run's measured costs per connection and per
//! GB, what connection rate and 1- and 4-stream bulk throughput the
//! cross-node path should reach on 4, 16 and 64 cores, for no mesh, a
//! stock ztunnel (when it ran) and ours, and which resource limits each
//! figure there. The model is also evaluated on the measured machine's
//! core count and set beside the measured figure: that error is how far
//! the run was from the limit the model sees (a positive error means the
//! run left CPU idle: it waited on something the model does not count).
//!
//! Each figure is the smallest of these bounds:
//!
//! - **CPU**: every core busy, `cores / (machine CPU s per operation)`.
//!   The machine's CPU per connection or per GB (both proxies, the load
//!   generator, the server app and the kernel, from `/proc/stat`) is
//!   assumed constant: the cores are shared by proxies and applications
//!   in the proportion measured (the bound's `proxy %`), with no extra
//!   cost from contention or cache effects as cores are added.
//! - **Proxy threads**: the proxy threads one pod's traffic can use at each
//!   end, one core each, at half the measured proxy CPU per operation (the
//!   two ends are assumed to cost the same; the run measures both
//!   together). Ours under the default pinned threading serves one pod's
//!   every connection on one worker (`crates/engine/src/workers.rs`): one
//!   core per end, for connections and streams alike. A dedicated ztunnel
//!   spreads connections over its worker threads, whose default count is
//!   `max(ceil(cores / 4), 2)` (ztunnel `src/config.rs`,
//!   `default_worker_threads`: a quarter of `ZTUNNEL_CPU_LIMIT`, floored
//!   at the request and at `DEFAULT_WORKER_THREADS`); one stream's relay is
//!   one task, so a stream uses one of them at a time.
//! - **Kernel per-flow path**: one TCP flow's throughput through veth and
//!   loopback, measured by the no-mesh 1-stream run (a lower bound of it
//!   when that run was CPU-bound), times the streams; bulk only.
//! - **Clients**: the load generator's clients, each one connection at a
//!   time, cannot exceed `clients / latency` (Little's law), with the
//!   unloaded latency of one new connection (the `conn-rr` run's p50);
//!   the clients are scaled with the cores (the load per core of the
//!   run), so this bounds only a path whose latency is long.
//!
//! Memory does not bound these figures: the connections in flight at once
//! are a few per client, each of a few KiB.

use std::fmt::Write as _;

use serde_json::{Value, json};

use super::{
    report::sig3,
    samples::{Figures, Variant},
};

/// Core counts projected besides the measured machine's.
pub const CORES: [usize; 3] = [4, 16, 64];

/// How a proxy maps one pod's traffic onto threads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Threading {
    /// No proxy (the no-mesh baseline).
    NoProxy,
    /// Ours, pinned workers: one pod's connections on one worker thread.
    Pinned,
    /// A stock ztunnel's multi-thread runtime with its default worker count.
    Ztunnel,
}

/// ztunnel's default worker threads on `cores` cores when neither a CPU
/// limit nor `ZTUNNEL_WORKER_THREADS` is set (`src/config.rs`,
/// `default_worker_threads`; the harness sets `ZTUNNEL_CPU_LIMIT` to the
/// core count and a request of 1, as the chart does without a limit).
pub fn ztunnel_workers(cores: usize) -> usize {
    cores.div_ceil(4).max(2)
}

impl Threading {
    /// The threads at each end serving `parallel` independent flows of
    /// one pod, on `cores` cores; `None` without a proxy.
    fn threads(self, cores: usize, parallel: usize) -> Option<usize> {
        match self {
            Self::NoProxy => None,
            Self::Pinned => Some(1),
            Self::Ztunnel => Some(ztunnel_workers(cores).min(parallel.max(1))),
        }
    }
}

/// A resource that bounds a figure.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Limit {
    /// Every core busy; `proxy_share` of the CPU is the proxies'.
    Cpu {
        /// The proxies' share of the machine's CPU per operation.
        proxy_share: f64,
    },
    /// The proxy threads one pod's traffic uses at each end, a core each.
    ProxyThreads {
        /// Threads per end.
        threads: usize,
    },
    /// The kernel's per-flow throughput (the no-mesh 1-stream run) times
    /// the streams.
    FlowPath {
        /// Streams.
        streams: usize,
    },
    /// The load generator's clients over the unloaded connection latency.
    Clients {
        /// Clients at this core count.
        clients: f64,
    },
}

impl Limit {
    /// A short name for the report.
    pub fn describe(&self) -> String {
        match *self {
            // No proxy, no share to speak of.
            Self::Cpu { proxy_share } if proxy_share <= 0.0 => "CPU".into(),
            Self::Cpu { proxy_share } => {
                format!("CPU, proxy {:.0} %", proxy_share * 100.0)
            }
            Self::ProxyThreads { threads: 1 } => "1 proxy core per end".into(),
            Self::ProxyThreads { threads } => format!("{threads} proxy threads per end"),
            Self::FlowPath { streams: 1 } => "kernel path, 1 flow".into(),
            Self::FlowPath { streams } => format!("kernel path, {streams} flows"),
            Self::Clients { clients } => format!("{clients:.0} clients' latency"),
        }
    }

    /// A stable key for report.json.
    pub fn key(&self) -> &'static str {
        match self {
            Self::Cpu { .. } => "cpu",
            Self::ProxyThreads { .. } => "proxy_threads",
            Self::FlowPath { .. } => "flow_path",
            Self::Clients { .. } => "clients",
        }
    }
}

/// The measured costs of the connection-rate run of one path.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ConnCosts {
    /// Measured connections/s.
    pub rate: f64,
    /// Both proxies' CPU seconds per connection (0 without a proxy).
    pub proxy_s: f64,
    /// The machine's busy CPU seconds per connection.
    pub machine_s: f64,
    /// The load generator's concurrent clients in the run.
    pub clients: f64,
    /// One new connection's unloaded latency, seconds, if measured.
    pub latency_s: Option<f64>,
}

/// The measured costs of a bulk run of one path.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BulkCosts {
    /// Parallel streams.
    pub streams: usize,
    /// Measured Gbit/s.
    pub gbps: f64,
    /// Both proxies' CPU seconds per GB (0 without a proxy).
    pub proxy_s_per_gb: f64,
    /// The machine's busy CPU seconds per GB.
    pub machine_s_per_gb: f64,
}

/// Every bound at one core count and the one that binds.
#[derive(Debug, Clone, PartialEq)]
pub struct Projection {
    /// Cores.
    pub cores: usize,
    /// Each bound with its value.
    pub bounds: Vec<(Limit, f64)>,
}

impl Projection {
    fn new(cores: usize, bounds: Vec<(Limit, f64)>) -> Self {
        let bounds = bounds
            .into_iter()
            .filter(|(_, v)| v.is_finite() && *v > 0.0)
            .collect();
        Self { cores, bounds }
    }

    /// The binding bound: the smallest.
    pub fn binding(&self) -> Option<(Limit, f64)> {
        self.bounds
            .iter()
            .copied()
            .min_by(|a, b| a.1.total_cmp(&b.1))
    }

    /// The projected figure.
    pub fn value(&self) -> Option<f64> {
        self.binding().map(|(_, v)| v)
    }
}

impl ConnCosts {
    /// Connections/s on `cores` cores, the run having had `measured_cores`.
    pub fn project(&self, threading: Threading, cores: usize, measured_cores: usize) -> Projection {
        let mut bounds = Vec::new();
        if self.machine_s > 0.0 {
            bounds.push((
                Limit::Cpu {
                    proxy_share: self.proxy_s / self.machine_s,
                },
                cores as f64 / self.machine_s,
            ));
        }
        let clients = self.clients * cores as f64 / measured_cores.max(1) as f64;
        let parallel = clients.ceil() as usize;
        if let Some(threads) = threading.threads(cores, parallel)
            && self.proxy_s > 0.0
        {
            bounds.push((
                Limit::ProxyThreads { threads },
                threads as f64 / (self.proxy_s / 2.0),
            ));
        }
        if let Some(latency) = self.latency_s.filter(|l| *l > 0.0) {
            bounds.push((Limit::Clients { clients }, clients / latency));
        }
        Projection::new(cores, bounds)
    }
}

impl BulkCosts {
    /// Gbit/s on `cores` cores, given one flow's Gbit/s through the kernel
    /// path (the no-mesh 1-stream run) when measured.
    pub fn project(
        &self,
        threading: Threading,
        cores: usize,
        flow_gbps: Option<f64>,
    ) -> Projection {
        // 8 Gbit per GB.
        let mut bounds = Vec::new();
        if self.machine_s_per_gb > 0.0 {
            bounds.push((
                Limit::Cpu {
                    proxy_share: self.proxy_s_per_gb / self.machine_s_per_gb,
                },
                8.0 * cores as f64 / self.machine_s_per_gb,
            ));
        }
        if let Some(threads) = threading.threads(cores, self.streams)
            && self.proxy_s_per_gb > 0.0
        {
            bounds.push((
                Limit::ProxyThreads { threads },
                8.0 * threads as f64 / (self.proxy_s_per_gb / 2.0),
            ));
        }
        if let Some(flow) = flow_gbps {
            bounds.push((
                Limit::FlowPath {
                    streams: self.streams,
                },
                flow * self.streams as f64,
            ));
        }
        Projection::new(cores, bounds)
    }
}

/// One figure of one path: measured, and projected at every core count
/// (the measured machine's first).
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    /// `connections/s`, `bulk 1 stream Gbit/s`, ...
    pub figure: &'static str,
    /// `no mesh`, `ztunnel` or `ours`.
    pub path: &'static str,
    /// The measured figure.
    pub measured: f64,
    /// The measured machine's cores, then [`CORES`].
    pub projections: Vec<Projection>,
}

impl Row {
    /// (model - measured) / measured on the measured machine's cores.
    pub fn error(&self) -> Option<f64> {
        let model = self.projections.first()?.value()?;
        super::samples::ratio(model - self.measured, self.measured)
    }
}

/// The paths modelled: the cross-node headline.
const PATHS: [(&str, &str, &str, Threading); 3] = [
    ("no mesh", "direct", "plain", Threading::NoProxy),
    ("ztunnel", "ztunnel", "hbone", Threading::Ztunnel),
    ("ours", "ebpf", "hbone", Threading::Pinned),
];

const PLACEMENT: &str = "cross-node";

/// The costs of a path's connection-rate run, if it ran.
fn conn_costs(figures: &Figures, variant: &Variant, clients: f64) -> Option<ConnCosts> {
    let get = |workload: &str, metric: &str| figures.median(workload, variant, metric);
    Some(ConnCosts {
        rate: get("conn-rate", "conn/s")?,
        proxy_s: get("conn-rate", "agent CPU s/10k conn").unwrap_or(0.0) / 1e4,
        machine_s: get("conn-rate", "machine CPU s/10k conn")? / 1e4,
        clients,
        latency_s: get("conn-rr", "p50 us").map(|us| us / 1e6),
    })
}

/// The costs of a path's bulk run over `streams`, if it ran.
fn bulk_costs(figures: &Figures, variant: &Variant, streams: usize) -> Option<BulkCosts> {
    let workload = format!("bulk-{streams}");
    let get = |metric: &str| figures.median(&workload, variant, metric);
    Some(BulkCosts {
        streams,
        gbps: get("Gbit/s")?,
        proxy_s_per_gb: get("agent CPU s/GB").unwrap_or(0.0),
        machine_s_per_gb: get("machine CPU s/GB")?,
    })
}

/// The model of one run.
#[derive(Debug, Clone, PartialEq)]
pub struct Model {
    /// The measured machine's cores.
    pub measured_cores: usize,
    /// Every row: connections/s, then 1- and 4-stream bulk, each per path.
    pub rows: Vec<Row>,
}

impl Model {
    /// The model of a run from its figures and the harness's `meta`
    /// (core count, clients of the connection-rate run).
    pub fn from_run(figures: &Figures, meta: &Value) -> Self {
        let measured_cores = meta["machine"]["cpus"].as_u64().unwrap_or(1).max(1) as usize;
        let clients = meta["counts"]["conn_concurrency"].as_f64().unwrap_or(1.0);
        let core_counts: Vec<usize> = std::iter::once(measured_cores).chain(CORES).collect();
        let flow = figures.median(
            "bulk-1",
            &Variant::new(PLACEMENT, "direct", "plain"),
            "Gbit/s",
        );
        let mut rows = Vec::new();
        for (path, mode, protocol, threading) in PATHS {
            let variant = Variant::new(PLACEMENT, mode, protocol);
            if let Some(costs) = conn_costs(figures, &variant, clients) {
                rows.push(Row {
                    figure: "connections/s",
                    path,
                    measured: costs.rate,
                    projections: core_counts
                        .iter()
                        .map(|&n| costs.project(threading, n, measured_cores))
                        .collect(),
                });
            }
        }
        for (streams, figure) in [(1, "bulk 1 stream Gbit/s"), (4, "bulk 4 streams Gbit/s")] {
            for (path, mode, protocol, threading) in PATHS {
                let variant = Variant::new(PLACEMENT, mode, protocol);
                if let Some(costs) = bulk_costs(figures, &variant, streams) {
                    rows.push(Row {
                        figure,
                        path,
                        measured: costs.gbps,
                        projections: core_counts
                            .iter()
                            .map(|&n| costs.project(threading, n, flow))
                            .collect(),
                    });
                }
            }
        }
        Self {
            measured_cores,
            rows,
        }
    }

    /// The report's section.
    pub fn markdown(&self) -> String {
        let mut md = String::from("## Scaling model (cross-node)\n\n");
        if self.rows.is_empty() {
            md.push_str("No connection-rate or bulk run to model.\n\n");
            return md;
        }
        let n = self.measured_cores;
        let _ = writeln!(
            md,
            "Each figure projected from this run's costs as the smallest of: CPU (every core busy at the measured machine CPU per connection or per GB: proxies, load generator, server and kernel shared in the measured proportion), the proxy threads one pod's traffic can use at each end at half the measured proxy CPU each (ours pinned: one worker; ztunnel: `max(ceil(cores/4), 2)` workers, one per stream), one flow's kernel path (the no-mesh 1-stream run) per stream, and the load generator's clients (scaled with the cores) over one new connection's unloaded latency (`conn-rr` p50). Model at {n} cores against the measured figure: a positive error is CPU the run left idle while waiting (the model sees costs, not waits), a negative one a run too short for the 10 ms CPU ticks or a cost that falls with load. The projections are what the costs allow, an upper bound where the error is positive. Doc and assumptions: `xtask/src/bench/scaling.rs`.\n"
        );
        let _ = write!(
            md,
            "| figure | path | measured, {n} cores | model, {n} cores (error) |"
        );
        for c in CORES {
            let _ = write!(md, " {c} cores |");
        }
        let _ = write!(md, "\n|---|---|---:|---|");
        for _ in CORES {
            md.push_str("---|");
        }
        md.push('\n');
        for row in &self.rows {
            let error = row
                .error()
                .map_or(String::new(), |e| format!(" ({:+.0} %)", e * 100.0));
            let _ = write!(
                md,
                "| {} | {} | {} | {}{error} |",
                row.figure,
                row.path,
                sig3(row.measured),
                cell(row.projections.first())
            );
            for p in row.projections.iter().skip(1) {
                let _ = write!(md, " {} |", cell(Some(p)));
            }
            md.push('\n');
        }
        md.push('\n');
        md
    }

    /// The section for report.json.
    pub fn to_json(&self) -> Value {
        json!({
            "placement": PLACEMENT,
            "measured_cores": self.measured_cores,
            "rows": self.rows.iter().map(|row| json!({
                "figure": row.figure,
                "path": row.path,
                "measured": row.measured,
                "error_at_measured_cores": row.error(),
                "projections": row.projections.iter().map(|p| json!({
                    "cores": p.cores,
                    "value": p.value(),
                    "limit": p.binding().map(|(l, _)| l.key()),
                    "limit_text": p.binding().map(|(l, _)| l.describe()),
                    "bounds": p.bounds.iter().map(|(l, v)| json!({
                        "limit": l.key(), "text": l.describe(), "value": v,
                    })).collect::<Vec<_>>(),
                })).collect::<Vec<_>>(),
            })).collect::<Vec<_>>(),
        })
    }
}

fn cell(projection: Option<&Projection>) -> String {
    match projection.and_then(Projection::binding) {
        Some((limit, value)) => format!("{} ({})", sig3(value), limit.describe()),
        None => "-".into(),
    }
}

#[cfg(test)]
#[path = "scaling_tests.rs"]
mod tests;
