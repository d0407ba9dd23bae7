//! Local mesh configuration files for tests: the simulated nodes' pods as
//! the agent's own config types ([`LocalConfig`], [`Workload`], [`Service`],
//! [`Policy`]), serialized to the YAML file the agent reads, so a test's
//! config always has the shape the agent parses. (Tests of malformed files
//! write their raw text themselves.)

use std::{
    net::IpAddr,
    path::{Path, PathBuf},
};

use dataplane_user::config::{
    Action, LoadBalancing, LocalConfig, Match, Policy, Protocol, Scope, Service, Workload,
};

use crate::topology::Pod;

/// The Kubernetes namespace of every test workload.
pub const NAMESPACE: &str = "test";

/// An HBONE workload `name` (uid `uid-<name>`, service account `name`) for
/// `pod` on `node`, enrolled at start by that node's agent.
pub fn hbone_workload(pod: &Pod, name: &str, node: &str) -> Workload {
    Workload {
        uid: format!("uid-{name}").into(),
        name: name.to_owned(),
        namespace: NAMESPACE.into(),
        service_account: name.into(),
        trust_domain: "cluster.local".into(),
        workload_ips: [pod.ip4.into(), pod.ip6.into()].into(),
        protocol: Protocol::Hbone,
        node: node.into(),
        netns: Some(Box::new(pod.netns.path().to_path_buf())),
        services: Default::default(),
        authorization_policies: Box::default(),
        ..Workload::default()
    }
}

/// Service `name` in `namespace` (hostname `<name>.<namespace>.svc.cluster.local`)
/// on `vip`, with `ports` (service port, target port).
pub fn service(name: &str, namespace: &str, vip: IpAddr, ports: &[(u16, u16)]) -> Service {
    Service {
        name: name.to_owned(),
        namespace: namespace.to_owned(),
        hostname: format!("{name}.{namespace}.svc.cluster.local"),
        vips: vec![vip.into()],
        cidr_vips: Vec::new(),
        weighted_waypoints: Vec::new(),
        ip_families: None,
        ports: ports.iter().copied().collect(),
        subject_alt_names: Vec::new(),
        load_balancing: LoadBalancing::default(),
        health_policy: Default::default(),
        routing: Default::default(),
        waypoint: None,
        canonical: false,
        visibility: Default::default(),
    }
}

/// Makes `workload` an endpoint of `service`, on the service's own port
/// mapping.
pub fn endpoint_of(workload: &mut Workload, service: &Service) {
    workload
        .services
        .insert(service.key(), (&service.ports).into());
}

/// A policy in `namespace` with one rule of one clause of one match.
pub fn policy(name: &str, namespace: &str, scope: Scope, action: Action, only: Match) -> Policy {
    Policy {
        name: name.to_owned(),
        namespace: namespace.to_owned(),
        scope,
        action,
        rules: vec![vec![vec![only]]],
        dry_run: false,
    }
}

/// A match on destination ports.
pub fn to_ports(ports: &[u16]) -> Match {
    Match {
        destination_ports: ports.to_vec(),
        ..Match::default()
    }
}

/// A config with `workloads` and no services or policies.
pub fn config_of(workloads: Vec<Workload>) -> LocalConfig {
    LocalConfig {
        workloads: workloads.into_iter().map(std::sync::Arc::new).collect(),
        ..LocalConfig::default()
    }
}

/// `config` as the YAML file the agent reads.
pub fn to_yaml(config: &LocalConfig) -> anyhow::Result<String> {
    let mut value = serde_yaml_ng::to_value(config)?;
    // `origin` records where a parsed config was read from; a file has no
    // such field (the agent refuses unknown fields).
    if let Some(map) = value.as_mapping_mut() {
        map.remove("origin");
    }
    Ok(serde_yaml_ng::to_string(&value)?)
}

/// Writes `config` to `<dir>/<file>` and returns its path.
pub fn write_config(dir: &Path, file: &str, config: &LocalConfig) -> anyhow::Result<PathBuf> {
    write_config_text(dir, file, &to_yaml(config)?)
}

/// Writes `text` to `<dir>/<file>` and returns its path. The file is
/// replaced atomically, as a config management tool would, so the agent
/// never reads it half-written.
pub fn write_config_text(dir: &Path, file: &str, text: &str) -> anyhow::Result<PathBuf> {
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
    pub fn workloads(&self) -> Vec<Workload> {
        vec![
            hbone_workload(&self.client, "client", "node1"),
            hbone_workload(&self.local, "local", "node1"),
            hbone_workload(&self.remote, "remote", "node2"),
        ]
    }

    /// [`TwoNodes::workloads`], no services, no policies.
    pub fn mesh_config(&self) -> LocalConfig {
        config_of(self.workloads())
    }

    /// [`TwoNodes::workloads`] where `local` and `remote` are endpoints of
    /// the service `echo` (VIP [`ECHO_VIP`]:80 -> 9000); no policies.
    pub fn echo_config(&self) -> LocalConfig {
        let echo = service("echo", NAMESPACE, ECHO_VIP, &[(80, 9000)]);
        let mut workloads = self.workloads();
        for w in workloads.iter_mut().filter(|w| w.name != "client") {
            endpoint_of(w, &echo);
        }
        LocalConfig {
            workloads: workloads.into_iter().map(std::sync::Arc::new).collect(),
            services: vec![echo],
            ..LocalConfig::default()
        }
    }

    /// Writes `config` as `mesh.yaml` in the world's directory and returns
    /// its path.
    pub fn write(&self, config: &LocalConfig) -> anyhow::Result<PathBuf> {
        write_config(self.dir.path(), "mesh.yaml", config)
    }

    /// Writes [`TwoNodes::mesh_config`] as `mesh.yaml` and returns its
    /// path.
    pub fn config(&self) -> anyhow::Result<PathBuf> {
        self.write(&self.mesh_config())
    }

    /// Writes `config` and starts both nodes' agents on it (instances
    /// `<tag>1-agent`, `<tag>2-agent`) with the shared CA.
    pub fn agents(
        &self,
        tag: &str,
        config: &LocalConfig,
    ) -> anyhow::Result<(crate::Agent, crate::Agent)> {
        let path = self.write(config)?;
        Ok((
            self.agent(tag, 1, &path, &[])?,
            self.agent(tag, 2, &path, &[])?,
        ))
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

    /// As [`TwoNodes::agent`], started with the file descriptor limit
    /// `(soft, hard)`.
    pub fn agent_with_nofile(
        &self,
        tag: &str,
        n: u8,
        config: &Path,
        extra: &[&str],
        nofile: (u64, u64),
    ) -> anyhow::Result<crate::Agent> {
        let node = if n == 1 { &self.n1 } else { &self.n2 };
        let (node_name, ca) = (format!("node{n}"), self.shared_ca());
        crate::Agent::standalone_with_nofile(
            &format!("{tag}{n}"),
            node,
            &node_name,
            config,
            &ca,
            extra,
            Some(nofile),
        )
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
        let node_name = format!("node{n}");
        crate::Agent::standalone(&format!("{tag}{n}"), node, &node_name, config, ca, extra)
    }
}

/// The `echo` service's VIP in [`TwoNodes::echo_config`].
pub const ECHO_VIP: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(10, 96, 0, 10));

/// `pod`'s IPv4 address with `port`.
pub fn addr(pod: &Pod, port: u16) -> std::net::SocketAddr {
    std::net::SocketAddr::new(pod.ip4.into(), port)
}

/// `config` as istiod would serve it: istiod knows nothing of network
/// namespaces, so no workload names one (the pods are enrolled over the
/// control socket instead).
pub fn as_istiod_serves(mut config: LocalConfig) -> LocalConfig {
    for workload in &mut config.workloads {
        std::sync::Arc::make_mut(workload).netns = None;
    }
    config
}
