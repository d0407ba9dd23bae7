//! The two proxies under measurement, our agent and a stock ztunnel:
//! starting each on the test istiod, reading its CPU and memory, and
//! checking it holds what was served.

use super::*;
use crate::istiod::xds_flags;

/// A proxy under measurement; dropping it stops it and removes what it
/// used.
pub(super) enum Running {
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
    pub(super) fn cpu_usec(&self) -> anyhow::Result<u64> {
        match self {
            Self::Ours { agent, .. } => agent.cpu_usec(),
            Self::Ztunnel { process, .. } => {
                super::super::probe::cgroup_cpu_usec(process.cgroup().path())
            }
        }
    }

    /// Its process id, while it runs.
    fn pid(&self) -> anyhow::Result<u32> {
        match self {
            Self::Ours { agent, .. } => agent.pid(),
            Self::Ztunnel { process, .. } => process.pid(),
        }
        .ok_or_else(|| anyhow::anyhow!("the proxy is not running"))
    }

    /// Its resident memory, in bytes.
    pub(super) fn rss(&self) -> anyhow::Result<u64> {
        super::super::probe::rss_bytes(self.pid()?)
    }

    /// The most memory it has had resident since it started, in bytes.
    pub(super) fn peak_rss(&self) -> anyhow::Result<u64> {
        super::super::probe::peak_rss_bytes(self.pid()?)
    }

    /// Fails, with its log, if it exited.
    pub(super) fn check_alive(&mut self) -> anyhow::Result<()> {
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
    pub(super) fn check_holds(
        &self,
        mesh: &LocalConfig,
        last: Option<&Workload>,
    ) -> anyhow::Result<()> {
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
pub(super) fn check_held(
    held: &HeldState,
    mesh: &LocalConfig,
    last: Option<&Workload>,
) -> anyhow::Result<()> {
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

/// Starts our agent on `istiod`: with no pod and an empty file config,
/// or, given `dp-load`, with a client and a server pod ([`ConnPods`]).
pub(super) fn start_ours(
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
    let mut flags = vec!["--config".to_owned(), config.display().to_string()];
    flags.extend(xds_flags(istiod.addr, &root, &token, "dataplane-scale"));
    flags.extend(["--node", "node0"].map(str::to_owned));
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

/// Starts ztunnel in a network namespace of its own, where `istiod` also
/// listens, for a node that hosts none of the workloads.
pub(super) fn start_ztunnel(
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
