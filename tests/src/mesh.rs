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
