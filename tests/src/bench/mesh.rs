//! One simulated two-node cluster per capture mode, all built once and
//! alive side by side, so runs can alternate modes without restarting
//! anything: the topologies share nothing (each has its own namespaces,
//! cgroups, agents and addresses inside its own namespaces), and an idle
//! agent costs nothing measurable.
//!
//! Each cluster: node 1 holds the client pod and the same-node servers,
//! node 2 the cross-node servers. A "plain" server is not in the mesh
//! config (the client's engine passes its traffic through as plain TCP); an
//! "hbone" server is (the engines tunnel to it). The direct cluster has no
//! agent and only plain servers. The ztunnel cluster, built only when a
//! ztunnel binary is given, has no agent either: a stock ztunnel in each
//! HBONE pod, in dedicated mode behind the iptables rules
//! ([`super::dedicated`]), and only HBONE servers.

use std::{
    net::{IpAddr, SocketAddr},
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use super::{
    agent::MeasuredAgent, dedicated::DedicatedZtunnels, iptables, process::BenchProcess,
    sweep::PREFIX,
};
use crate::{
    TempDir,
    mesh::{NAMESPACE, config_of, endpoint_of, hbone_workload, service, write_config},
    topology::{Node, Pod, link_nodes},
};

/// The echo server's port in every server pod.
pub const ECHO_PORT: u16 = 9000;
/// The sink server's port in every server pod.
pub const SINK_PORT: u16 = 9001;

/// The VIP of the service whose only endpoint is the fast-path server.
const FAST_PATH_VIP: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(10, 96, 0, 99));

/// The proxy mark the agents run with (their default).
const PROXY_MARK: u32 = dataplane_common::DEFAULT_PROXY_MARK;

/// How pod traffic reaches (or does not reach) the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Mode {
    /// No mesh at all.
    Direct,
    /// Istio-style iptables REDIRECT into the same engine.
    Iptables,
    /// Our kernel programs.
    Ebpf,
    /// Istio's ztunnel in dedicated mode behind the same iptables rules as
    /// [`Mode::Iptables`], in place of our engine (only with a ztunnel
    /// binary).
    Ztunnel,
}

impl Mode {
    /// Every mode.
    pub const ALL: [Mode; 4] = [Mode::Direct, Mode::Iptables, Mode::Ebpf, Mode::Ztunnel];

    /// Its name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Direct => "direct",
            Mode::Iptables => "iptables",
            Mode::Ebpf => "ebpf",
            Mode::Ztunnel => "ztunnel",
        }
    }

    fn tag(self) -> &'static str {
        match self {
            Mode::Direct => "d",
            Mode::Iptables => "i",
            Mode::Ebpf => "e",
            Mode::Ztunnel => "z",
        }
    }
}

/// Where the server runs relative to the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Placement {
    /// Same node.
    SameNode,
    /// The other node.
    CrossNode,
}

impl Placement {
    /// Both placements.
    pub const ALL: [Placement; 2] = [Placement::SameNode, Placement::CrossNode];

    /// Its name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Placement::SameNode => "same-node",
            Placement::CrossNode => "cross-node",
        }
    }
}

/// How the engine carries the connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Protocol {
    /// Passed through as plain TCP (destination not in the mesh config);
    /// for direct mode, simply TCP.
    Plain,
    /// Tunnelled in HBONE between the two engines.
    Hbone,
    /// A same-node HBONE pair whose workloads opt into the kernel fast
    /// path (ebpf mode only): socket to socket once the pair's first
    /// connection decided it.
    FastPath,
    /// The fast-path server reached through a service VIP whose only
    /// endpoint it is: the kernel chooses the endpoint and rewrites the
    /// destination per connection.
    FastPathVip,
}

impl Protocol {
    /// Its name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Protocol::Plain => "plain",
            Protocol::Hbone => "hbone",
            Protocol::FastPath => "fast-path",
            Protocol::FastPathVip => "fast-path-vip",
        }
    }

    /// Whether it is one of the fast paths (no proxy once decided).
    pub fn is_fast_path(self) -> bool {
        matches!(self, Protocol::FastPath | Protocol::FastPathVip)
    }

    /// Whether a cluster of `mode` has a server for it at `placement`.
    pub fn exists(self, mode: Mode, placement: Placement) -> bool {
        match self {
            // ztunnel is compared on the tunnelled path only.
            Protocol::Plain => mode != Mode::Ztunnel,
            Protocol::Hbone => mode != Mode::Direct,
            Protocol::FastPath | Protocol::FastPathVip => {
                mode == Mode::Ebpf && placement == Placement::SameNode
            }
        }
    }
}

/// A server pod and its server process.
#[derive(Debug)]
struct ServerPod {
    placement: Placement,
    protocol: Protocol,
    // Process before pod: it lives in the pod's namespace.
    server: BenchProcess,
    pod: Pod,
}

/// One mode's cluster.
#[derive(Debug)]
pub struct ModeMesh {
    /// The mode.
    pub mode: Mode,
    /// Which iptables front end installed the rules (iptables mode).
    pub iptables_backend: Option<&'static str>,
    // Field order is drop order: agents or ztunnels, servers, pods, then
    // nodes.
    agents: Vec<MeasuredAgent>,
    ztunnels: Option<DedicatedZtunnels>,
    servers: Vec<ServerPod>,
    client: Pod,
    n1: Node,
    n2: Node,
    dir: TempDir,
    agent_binary: PathBuf,
    load_binary: PathBuf,
    config: Option<PathBuf>,
}

/// Binaries the harness runs.
#[derive(Debug, Clone)]
pub struct Binaries {
    /// The agent (`dataplane`).
    pub agent: PathBuf,
    /// The load generator (`dp-load`).
    pub load: PathBuf,
    /// A stock ztunnel, for [`Mode::Ztunnel`].
    pub ztunnel: Option<PathBuf>,
}

impl ModeMesh {
    /// Builds the cluster, starts its servers and (unless direct) its two
    /// agents with the capture mode's rules in place.
    pub fn build(mode: Mode, bins: &Binaries) -> anyhow::Result<Self> {
        let tag = format!("{}{}", PREFIX.trim_start_matches("dpt-"), mode.tag());
        let mut n1 = Node::new(&tag, 1)?;
        let mut n2 = Node::new(&tag, 2)?;
        link_nodes(&n1, &n2)?;
        let client = n1.add_pod(&tag)?;
        tune(&client)?;
        let mut servers = Vec::new();
        for placement in Placement::ALL {
            for protocol in [Protocol::Plain, Protocol::Hbone, Protocol::FastPath]
                .into_iter()
                .filter(|p| p.exists(mode, placement))
            {
                let node = match placement {
                    Placement::SameNode => &mut n1,
                    Placement::CrossNode => &mut n2,
                };
                let pod = node.add_pod(&tag)?;
                tune(&pod)?;
                let mut cmd = Command::new(&bins.load);
                cmd.args(["serve", &ECHO_PORT.to_string(), &SINK_PORT.to_string()]);
                let mut server =
                    BenchProcess::spawn(cmd, Some(pod.netns.path()), Some(pod.cgroup.path()))?;
                let line = server.line(Duration::from_secs(10))?;
                anyhow::ensure!(line == "listening", "server said `{line}`");
                servers.push(ServerPod {
                    placement,
                    protocol,
                    server,
                    pod,
                });
            }
        }
        let dir = TempDir::new(&tag)?;
        let mut mesh = Self {
            mode,
            iptables_backend: None,
            agents: Vec::new(),
            ztunnels: None,
            servers,
            client,
            n1,
            n2,
            dir,
            agent_binary: bins.agent.clone(),
            load_binary: bins.load.clone(),
            config: None,
        };
        if mode != Mode::Direct {
            mesh.enter_mesh(bins)?;
        }
        Ok(mesh)
    }

    /// Writes the mesh config, installs the iptables rules (iptables and
    /// ztunnel modes) and starts both agents (or the ztunnels).
    fn enter_mesh(&mut self, bins: &Binaries) -> anyhow::Result<()> {
        // The agents run with the fast path off; only the fast-path server
        // and the client opt in, so every other variant keeps its path.
        let mut client = hbone_workload(&self.client, "client", "node1");
        client.fast_path = Some(true);
        let mut workloads = vec![client];
        for s in self
            .servers
            .iter()
            .filter(|s| s.protocol != Protocol::Plain)
        {
            let (name, node) = match (s.placement, s.protocol) {
                (Placement::SameNode, Protocol::FastPath) => ("server-fast", "node1"),
                (Placement::SameNode, _) => ("server-same", "node1"),
                (Placement::CrossNode, _) => ("server-cross", "node2"),
            };
            let mut workload = hbone_workload(&s.pod, name, node);
            workload.fast_path = Some(s.protocol == Protocol::FastPath);
            workloads.push(workload);
        }
        let mut config = config_of(workloads);
        // The fast-path server behind a VIP of its own.
        let ports = [(ECHO_PORT, ECHO_PORT), (SINK_PORT, SINK_PORT)];
        let fast = service("fast", NAMESPACE, FAST_PATH_VIP, &ports);
        for workload in config
            .workloads
            .iter_mut()
            .filter(|w| w.name == "server-fast")
        {
            endpoint_of(std::sync::Arc::make_mut(workload), &fast);
        }
        config.services.push(fast);
        self.config = Some(write_config(self.dir.path(), "mesh.yaml", &config)?);
        if matches!(self.mode, Mode::Iptables | Mode::Ztunnel) {
            let enrolled = std::iter::once(&self.client).chain(
                self.servers
                    .iter()
                    .filter(|s| s.protocol != Protocol::Plain)
                    .map(|s| &s.pod),
            );
            for pod in enrolled {
                let IpAddr::V4(node_side) = pod.node_side else {
                    anyhow::bail!("node-side address is not IPv4");
                };
                let rules = iptables::rules(pod.ip4, node_side, PROXY_MARK);
                self.iptables_backend = Some(iptables::install(&pod.netns, &rules)?);
            }
        }
        if self.mode == Mode::Ztunnel {
            let binary = bins
                .ztunnel
                .as_deref()
                .ok_or_else(|| anyhow::anyhow!("the ztunnel mode needs a ztunnel binary"))?;
            let enrolled = std::iter::once(&self.client).chain(
                self.servers
                    .iter()
                    .filter(|s| s.protocol != Protocol::Plain)
                    .map(|s| &s.pod),
            );
            let mut pods = Vec::new();
            for pod in enrolled {
                let workload = config
                    .workloads
                    .iter()
                    .find(|w| w.workload_ips.contains(&IpAddr::V4(pod.ip4)))
                    .ok_or_else(|| anyhow::anyhow!("no workload has {}", pod.ip4))?;
                pods.push((pod, &**workload));
            }
            let tag = format!("{}{}", PREFIX.trim_start_matches("dpt-"), self.mode.tag());
            self.ztunnels = Some(DedicatedZtunnels::new(binary, &tag, &config, &pods)?);
        }
        self.start_proxies()
    }

    /// (Re)starts both agents, or the ztunnels: fresh processes, fresh
    /// memory.
    pub fn start_proxies(&mut self) -> anyhow::Result<()> {
        if let Some(ztunnels) = self.ztunnels.as_mut() {
            ztunnels.start()?;
            // Each ztunnel fetches its certificate on its first connection.
            return self
                .warm([Placement::SameNode, Placement::CrossNode].map(|p| (p, Protocol::Hbone)));
        }
        self.agents.clear();
        let config = self
            .config
            .clone()
            .ok_or_else(|| anyhow::anyhow!("direct mode has no agents"))?;
        let capture = match self.mode {
            Mode::Iptables => "iptables",
            _ => "ebpf",
        };
        let ca = self.dir.path().join("ca");
        let tag = format!("{}{}a", PREFIX.trim_start_matches("dpt-"), self.mode.tag());
        let same_node_pods = 1 + self
            .servers
            .iter()
            .filter(|s| s.placement == Placement::SameNode && s.protocol != Protocol::Plain)
            .count();
        for (index, node, pods) in [(1, &self.n1, same_node_pods), (2, &self.n2, 1)] {
            let args: Vec<String> = [
                "--config",
                &config.display().to_string(),
                "--node",
                &format!("node{index}"),
                "--ca-dir",
                &ca.display().to_string(),
                "--capture",
                capture,
                "--fast-path",
                "off",
            ]
            .map(str::to_owned)
            .to_vec();
            let agent = MeasuredAgent::start(
                &self.agent_binary,
                &format!("{tag}{index}"),
                node.cgroup().path(),
                &args,
                pods,
            )?;
            self.agents.push(agent);
        }
        if !Protocol::FastPath.exists(self.mode, Placement::SameNode) {
            return Ok(());
        }
        // The agents void every fast-path verdict when they start.
        self.warm([Protocol::FastPath, Protocol::FastPathVip].map(|p| (Placement::SameNode, p)))
    }

    /// Opens one connection to each port of each server of `paths` through
    /// the proxy, so that what a path's first connection settles (a
    /// fast-path verdict, a certificate) is settled before anything is
    /// measured.
    fn warm(&self, paths: [(Placement, Protocol); 2]) -> anyhow::Result<()> {
        // One echoed byte, and one byte into the sink.
        let runs: [(u16, &str, &[&str]); 2] = [
            (ECHO_PORT, "conn", &["1", "1", "1"]),
            (SINK_PORT, "bulk", &["1", "1"]),
        ];
        let each = paths
            .into_iter()
            .flat_map(|path| runs.map(|run| (path, run)));
        for ((placement, protocol), (port, verb, rest)) in each {
            let addr = self.addr(placement, protocol, port)?;
            let mut cmd = Command::new(&self.load_binary);
            cmd.arg(verb).arg(addr.to_string()).args(rest);
            let (netns, cgroup) = self.client_paths();
            let client = BenchProcess::spawn(cmd, Some(netns), Some(cgroup))?;
            client.output(Duration::from_secs(30))?;
        }
        Ok(())
    }

    /// The client pod.
    pub fn client(&self) -> &Pod {
        &self.client
    }

    /// The server pod for a placement and protocol (direct mode has plain
    /// servers only).
    pub fn server(&self, placement: Placement, protocol: Protocol) -> anyhow::Result<&Pod> {
        self.server_entry(placement, protocol).map(|s| &s.pod)
    }

    /// Pid of the server process for a placement and protocol.
    pub fn server_pid(&self, placement: Placement, protocol: Protocol) -> anyhow::Result<u32> {
        self.server_entry(placement, protocol)
            .map(|s| s.server.pid())
    }

    fn server_entry(&self, placement: Placement, protocol: Protocol) -> anyhow::Result<&ServerPod> {
        // The VIP's endpoint is the fast-path server.
        let protocol = match protocol {
            Protocol::FastPathVip => Protocol::FastPath,
            other => other,
        };
        self.servers
            .iter()
            .find(|s| s.placement == placement && s.protocol == protocol)
            .ok_or_else(|| {
                anyhow::anyhow!(
                    "{} has no {} {} server",
                    self.mode.name(),
                    placement.name(),
                    protocol.name()
                )
            })
    }

    /// The echo or sink address of a server.
    pub fn addr(
        &self,
        placement: Placement,
        protocol: Protocol,
        port: u16,
    ) -> anyhow::Result<SocketAddr> {
        let server = self.server(placement, protocol)?;
        let ip = match protocol {
            Protocol::FastPathVip => FAST_PATH_VIP,
            _ => server.ip4.into(),
        };
        Ok(SocketAddr::new(ip, port))
    }

    /// The resident memory of the proxies of a path to `placement`, in
    /// bytes: node 1's and node 2's agents, or the ztunnels of the client
    /// pod and of the HBONE server there.
    pub fn proxy_rss(&self, placement: Placement) -> anyhow::Result<Vec<u64>> {
        match &self.ztunnels {
            Some(ztunnels) => {
                let server = self.server(placement, Protocol::Hbone)?;
                Ok(vec![
                    ztunnels.rss_of(self.client.ip4)?,
                    ztunnels.rss_of(server.ip4)?,
                ])
            }
            None => self.agents.iter().map(MeasuredAgent::rss).collect(),
        }
    }

    /// CPU time all agents (or ztunnels) used so far, in seconds.
    pub fn agent_cpu(&self) -> anyhow::Result<f64> {
        let mut usec = 0;
        for agent in &self.agents {
            usec += agent.cpu_usec()?;
        }
        if let Some(ztunnels) = &self.ztunnels {
            usec += ztunnels.cpu_usec()?;
        }
        Ok(usec as f64 / 1e6)
    }

    /// Pids of every agent (or ztunnel).
    pub fn agent_pids(&self) -> Vec<u32> {
        let mut pids: Vec<u32> = self.agents.iter().filter_map(MeasuredAgent::pid).collect();
        pids.extend(self.ztunnels.iter().flat_map(DedicatedZtunnels::pids));
        pids
    }

    /// The agents' (or ztunnels') logs (for error reports).
    pub fn agent_logs(&self) -> String {
        let mut logs: Vec<String> = self.agents.iter().map(MeasuredAgent::log_text).collect();
        logs.extend(self.ztunnels.iter().map(DedicatedZtunnels::logs));
        logs.join("\n")
    }

    /// The client pod's namespace name (for `ss` checks).
    pub fn client_netns(&self) -> &str {
        self.client.netns.name()
    }

    /// The client pod's namespace and cgroup.
    pub fn client_paths(&self) -> (&Path, &Path) {
        (self.client.netns.path(), self.client.cgroup.path())
    }
}

/// Per-pod sysctls for connection-heavy runs: reuse TIME_WAIT ports for new
/// outgoing connections and widen the ephemeral range, so tens of thousands
/// of short connections to one destination never run out of ports.
fn tune(pod: &Pod) -> anyhow::Result<()> {
    pod.netns.run(|| -> std::io::Result<()> {
        std::fs::write("/proc/sys/net/ipv4/tcp_tw_reuse", "1")?;
        std::fs::write("/proc/sys/net/ipv4/ip_local_port_range", "10000 65000")?;
        Ok(())
    })??;
    Ok(())
}
