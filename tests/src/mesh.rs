//! Local mesh configuration files for tests: the workloads of the simulated
//! nodes' pods, in the agent's config format.

use std::path::{Path, PathBuf};

use crate::topology::Pod;

/// One workload entry.
#[derive(Debug, Clone)]
pub struct WorkloadEntry {
    /// Workload uid and name.
    pub name: String,
    /// Service account (the identity's last part).
    pub service_account: String,
    /// Node name (`node1`, ...).
    pub node: String,
    /// Pod IPs.
    pub ips: Vec<String>,
    /// The pod's netns, so the node's agent enrolls it at start.
    pub netns: Option<PathBuf>,
    /// `HBONE` or `TCP`.
    pub protocol: &'static str,
    /// Extra YAML lines for this entry (e.g. `  services: {...}\n`).
    pub extra: String,
}

impl WorkloadEntry {
    /// An HBONE workload for `pod` on `node`, enrolled at start.
    pub fn hbone(pod: &Pod, name: &str, node: &str) -> Self {
        Self {
            name: name.to_owned(),
            service_account: name.to_owned(),
            node: node.to_owned(),
            ips: vec![pod.ip4.to_string(), pod.ip6.to_string()],
            netns: Some(pod.netns.path().to_path_buf()),
            protocol: "HBONE",
            extra: String::new(),
        }
    }
}

/// Writes a config with `workloads` and no services or policies to
/// `<dir>/<file>` and returns its path.
pub fn write_config(
    dir: &Path,
    file: &str,
    workloads: &[WorkloadEntry],
) -> anyhow::Result<PathBuf> {
    write_config_with(dir, file, workloads, "services: []\npolicies: []\n")
}

/// Writes a config with `workloads` followed by `rest` (the `services:`
/// and `policies:` sections, as YAML) and returns its path. The file is
/// replaced atomically, as a config management tool would.
pub fn write_config_with(
    dir: &Path,
    file: &str,
    workloads: &[WorkloadEntry],
    rest: &str,
) -> anyhow::Result<PathBuf> {
    let mut text = String::from("workloads:\n");
    for w in workloads {
        let ips: Vec<String> = w.ips.iter().map(|ip| format!("'{ip}'")).collect();
        text.push_str(&format!(
            "- uid: uid-{name}\n  name: {name}\n  namespace: test\n  serviceAccount: {sa}\n  node: {node}\n  protocol: {proto}\n  workloadIps: [{ips}]\n",
            name = w.name,
            sa = w.service_account,
            node = w.node,
            proto = w.protocol,
            ips = ips.join(", "),
        ));
        if let Some(netns) = &w.netns {
            text.push_str(&format!("  netns: {}\n", netns.display()));
        }
        text.push_str(&w.extra);
    }
    text.push_str(rest);
    let path = dir.join(file);
    let tmp = dir.join(format!(".{file}.tmp"));
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, &path)?;
    Ok(path)
}

/// Two linked simulated nodes with the pods most mesh tests need: node1
/// has `client` and `local` (a server on the client's node), node2 has
/// `remote` and `plain` (a server outside the mesh). Agents share one CA
/// under the world's directory.
#[derive(Debug)]
pub struct TwoNodes {
    /// node1.
    pub n1: crate::topology::Node,
    /// node2.
    pub n2: crate::topology::Node,
    /// The client, on node1.
    pub client: Pod,
    /// A server on node1.
    pub local: Pod,
    /// A server on node2.
    pub remote: Pod,
    /// A server on node2 that is not in the mesh.
    pub plain: Pod,
    /// Config files and the shared CA.
    pub dir: crate::TempDir,
}

impl TwoNodes {
    /// Creates the nodes, their link and the pods, named after `tag`.
    pub fn new(tag: &str) -> anyhow::Result<Self> {
        let mut n1 = crate::topology::Node::new(tag, 1)?;
        let mut n2 = crate::topology::Node::new(tag, 2)?;
        crate::topology::link_nodes(&n1, &n2)?;
        Ok(Self {
            client: n1.add_pod(tag)?,
            local: n1.add_pod(tag)?,
            remote: n2.add_pod(tag)?,
            plain: n2.add_pod(tag)?,
            dir: crate::TempDir::new(tag)?,
            n1,
            n2,
        })
    }

    /// `client`, `local` and `remote` as HBONE workloads (`plain` is left
    /// out of the mesh).
    pub fn workloads(&self) -> Vec<WorkloadEntry> {
        vec![
            WorkloadEntry::hbone(&self.client, "client", "node1"),
            WorkloadEntry::hbone(&self.local, "local", "node1"),
            WorkloadEntry::hbone(&self.remote, "remote", "node2"),
        ]
    }

    /// Writes [`TwoNodes::workloads`] as `mesh.yaml` with `rest` (services
    /// and policies YAML) and returns its path.
    pub fn config(&self, rest: &str) -> anyhow::Result<PathBuf> {
        write_config_with(self.dir.path(), "mesh.yaml", &self.workloads(), rest)
    }

    /// The CA directory every agent shares.
    pub fn shared_ca(&self) -> PathBuf {
        self.dir.path().join("ca")
    }

    /// Starts node `n`'s agent (instance `<tag><n>-agent`) on `config`
    /// with the shared CA and `extra` arguments.
    pub fn agent(
        &self,
        tag: &str,
        n: u8,
        config: &Path,
        extra: &[&str],
    ) -> anyhow::Result<crate::Agent> {
        self.agent_with_ca(tag, n, config, &self.shared_ca(), extra)
    }

    /// As [`TwoNodes::agent`], with the CA in `ca`.
    pub fn agent_with_ca(
        &self,
        tag: &str,
        n: u8,
        config: &Path,
        ca: &Path,
        extra: &[&str],
    ) -> anyhow::Result<crate::Agent> {
        let node = if n == 1 { &self.n1 } else { &self.n2 };
        let (config, ca) = (config.display().to_string(), ca.display().to_string());
        let node_name = format!("node{n}");
        let mut args = vec![
            "--config",
            config.as_str(),
            "--node",
            node_name.as_str(),
            "--ca-dir",
            ca.as_str(),
        ];
        args.extend_from_slice(extra);
        crate::Agent::start(&format!("{tag}{n}"), node, &args)
    }
}

/// `pod`'s IPv4 address with `port`.
pub fn addr(pod: &Pod, port: u16) -> std::net::SocketAddr {
    std::net::SocketAddr::new(pod.ip4.into(), port)
}
