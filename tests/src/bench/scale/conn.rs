//! The connection set-up cost during the churn: a client and a server pod
//! on our agent's node, one connection a second between them.

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    process::Command,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::Context as _;

use super::super::{
    mesh::{ECHO_PORT, SINK_PORT},
    process::BenchProcess,
};
use crate::{
    mesh::{config_of, hbone_workload, write_config},
    topology::{Node, Pod},
};

/// A client and a server pod on our agent's node (index 200: their
/// addresses, 10.200.0.x, are no synthetic workload's below 13M), in the
/// mesh through the agent's file config (HBONE, fast path off, so every
/// connection goes through the agent), the server running `dp-load serve`.
pub(super) struct ConnPods {
    // Field order is drop order: processes, pods, then the node.
    _server: BenchProcess,
    client: Pod,
    server: Pod,
    pub(super) node: Node,
    load: PathBuf,
}

impl ConnPods {
    /// Builds them; returns them and the agent's config file.
    pub(super) fn new(load: &Path, tag: &str, dir: &Path) -> anyhow::Result<(Self, PathBuf)> {
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

    /// The agent's CPU one of the probe's connections costs, us: `count`
    /// connections one after another with nothing else happening, the
    /// agent's CPU read by `cpu` around them. The churn takes this much
    /// per connection out of the CPU it charges to updates, since
    /// ztunnel's runs carry no connection.
    pub(super) fn connection_cpu_usec(
        &self,
        count: u32,
        cpu: impl Fn() -> anyhow::Result<u64>,
    ) -> anyhow::Result<u64> {
        let server = SocketAddr::new(self.server.ip4.into(), ECHO_PORT);
        let (netns, cgroup) = (self.client.netns.path(), self.client.cgroup.path());
        // The first one may open the pooled HBONE connection: not counted.
        connect_once(&self.load, netns, cgroup, server)?;
        let before = cpu()?;
        for _ in 0..count {
            connect_once(&self.load, netns, cgroup, server)?;
        }
        Ok((cpu()? - before) / u64::from(count.max(1)))
    }

    /// Starts opening a connection a second from the client to the server.
    pub(super) fn probe(&self) -> ConnProbe {
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
pub(super) struct ConnProbe {
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
                times.push(connect_once(&load, &netns, &cgroup, server)?);
            }
            Ok(times)
        });
        Self { stop, thread }
    }

    /// Stops it; returns every connection's time, ms.
    pub(super) fn finish(self) -> anyhow::Result<Vec<f64>> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread
            .join()
            .map_err(|_| anyhow::anyhow!("the connection probe panicked"))?
    }
}

/// Runs `dp-load conn ADDR 1 1 64` in the client pod (its own process, in
/// the pod's cgroup, so none of its CPU is the agent's); returns the
/// connection's time, ms.
fn connect_once(
    load: &Path,
    netns: &Path,
    cgroup: &Path,
    server: SocketAddr,
) -> anyhow::Result<f64> {
    let mut cmd = Command::new(load);
    cmd.args(["conn", &server.to_string(), "1", "1", "64"]);
    let text =
        BenchProcess::spawn(cmd, Some(netns), Some(cgroup))?.output(Duration::from_secs(60))?;
    conn_time_ms(&text)
}

/// The time of the one connection a `dp-load conn ADDR 1 ...` report
/// holds, ms.
pub(super) fn conn_time_ms(report: &str) -> anyhow::Result<f64> {
    let report: serde_json::Value =
        serde_json::from_str(report.trim()).context("dp-load's report")?;
    report["latency"]["p50_us"]
        .as_f64()
        .map(|us| us / 1e3)
        .with_context(|| format!("no latency in dp-load's report {report}"))
}
