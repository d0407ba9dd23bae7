//! A stock Istio ztunnel, started as Istio's chart starts it (in-pod
//! mode; workloads from istiod's xDS, certificates from istiod's CA,
//! trusting istiod's root and presenting its token from the paths the
//! chart mounts), against the test istiod ([`crate::istiod::TestIstiod`]):
//! what the interop tests (`tests/ztunnel_interop.rs`) and the scale
//! benchmark ([`crate::bench::scale`]) run.
//!
//! Istio's ztunnel is not published to any registry these machines reach:
//! the binary comes from `DATAPLANE_ZTUNNEL` ([`ztunnel_binary`]), built
//! from Istio's sources (e.g. `--no-default-features --features tls-ring`).

use std::{
    io::{Read as _, Write as _},
    net::{IpAddr, SocketAddr, TcpStream},
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use anyhow::{Context as _, Result};
use serde::Deserialize;

use crate::{Cgroup, ChildGuard, Netns, istiod::SERVER_NAME, spawn_logged_in};

/// ztunnel's admin port (`/config_dump`), on its namespace's loopback.
pub const ADMIN_PORT: u16 = 15000;
/// ztunnel's stats port (`/metrics`), on its namespace's loopback.
pub const STATS_PORT: u16 = 15020;

/// The ztunnel binary `DATAPLANE_ZTUNNEL` names.
pub fn ztunnel_binary() -> Result<PathBuf> {
    let path = PathBuf::from(
        std::env::var_os("DATAPLANE_ZTUNNEL")
            .ok_or_else(|| anyhow::anyhow!("set DATAPLANE_ZTUNNEL to a ztunnel binary"))?,
    );
    anyhow::ensure!(path.is_file(), "{} is not a file", path.display());
    Ok(path)
}

/// Where one ztunnel finds istiod and what it holds from its pod spec:
/// the root and token files at the paths Istio's chart mounts them
/// (relative to its working directory, as ztunnel reads its defaults).
pub struct ZtunnelHome {
    /// Its working directory.
    pub dir: PathBuf,
    /// istiod, as this ztunnel reaches it.
    pub istiod: SocketAddr,
    /// The token this ztunnel presents.
    pub token: String,
}

impl ZtunnelHome {
    /// Makes `<dir>/<node_name>` with the root `root_pem` and a token
    /// named for the node.
    pub fn new(dir: &Path, node_name: &str, istiod: SocketAddr, root_pem: &str) -> Result<Self> {
        let dir = dir.join(node_name);
        let root = dir.join("var/run/secrets/istio");
        let tokens = dir.join("var/run/secrets/tokens");
        std::fs::create_dir_all(&root)?;
        std::fs::create_dir_all(&tokens)?;
        std::fs::write(root.join("root-cert.pem"), root_pem)?;
        let token = format!("ztunnel-{node_name}-token");
        std::fs::write(tokens.join("istio-token"), &token)?;
        Ok(Self { dir, istiod, token })
    }
}

/// The node a ztunnel runs for: what its pod's downward API tells it.
pub struct ZtunnelNode<'a> {
    /// `NODE_NAME`: ztunnel fetches certificates ahead for the workloads
    /// of this node.
    pub name: &'a str,
    /// `INSTANCE_IP`: its pod's address.
    pub instance_ip: IpAddr,
    /// `INPOD_UDS`: where its ZDS client connects (the agent's socket
    /// under `--engine ztunnel`; a path nobody serves when ztunnel is fed
    /// no pods).
    pub zds: &'a Path,
}

/// One ztunnel process, in a network namespace and a cgroup of its own
/// (as its pod would be), with its log; killed on drop, before its cgroup
/// goes.
pub struct Ztunnel {
    process: ChildGuard,
    cgroup: Cgroup,
    /// Its log (stdout and stderr).
    pub log: PathBuf,
}

impl Ztunnel {
    /// Starts `binary` in `netns` and `cgroup` with the environment Istio's
    /// ztunnel chart gives it ([`ztunnel_env`]), in `home`, logging to
    /// `log`.
    pub fn start(
        binary: &Path,
        netns: &Netns,
        cgroup: Cgroup,
        node: &ZtunnelNode<'_>,
        home: &ZtunnelHome,
        log: &Path,
    ) -> Result<Self> {
        let env = ztunnel_env(node, home.istiod);
        Self::start_with_env(binary, netns.path(), cgroup, &env, &home.dir, log)
    }

    /// Starts `binary` in the network namespace at `netns` and in `cgroup`
    /// with exactly the environment `env`, in the working directory `dir`
    /// (where it finds the root and token files of a [`ZtunnelHome`]),
    /// logging to `log`.
    pub fn start_with_env(
        binary: &Path,
        netns: &Path,
        cgroup: Cgroup,
        env: &[(String, String)],
        dir: &Path,
        log: &Path,
    ) -> Result<Self> {
        let mut cmd = Command::new(binary);
        cmd.env_clear().current_dir(dir);
        for (name, value) in env {
            cmd.env(name, value);
        }
        let process = spawn_logged_in(cmd, Some(netns), Some(cgroup.path()), log)?;
        Ok(Self {
            process,
            cgroup,
            log: log.to_owned(),
        })
    }

    /// Its cgroup (its CPU is `cpu.stat` there).
    pub fn cgroup(&self) -> &Cgroup {
        &self.cgroup
    }

    /// Its process id.
    pub fn pid(&self) -> Option<u32> {
        self.process.id()
    }

    /// Whether it has not exited.
    pub fn is_running(&mut self) -> bool {
        self.process.is_running()
    }

    /// The last lines of its log, without the configuration it prints at
    /// start.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("20") || l.starts_with("Error"))
            .collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }
}

/// Starts ztunnel for `node` as Istio's chart does ([`ztunnel_env`]), in
/// the node's network namespace and in a cgroup of its own under the
/// node's (as its pod would be), with its log in `logs`.
pub fn start_ztunnel(
    binary: &Path,
    node: &crate::topology::Node,
    node_name: &str,
    zds: &Path,
    home: &ZtunnelHome,
    logs: &Path,
) -> Result<Ztunnel> {
    let cgroup = Cgroup::child(node.cgroup(), "zt")?;
    let log = logs.join(format!("ztunnel-{node_name}.log"));
    let site = ZtunnelNode {
        name: node_name,
        instance_ip: node.bridge_ip4().into(),
        zds,
    };
    Ztunnel::start(binary, node.netns(), cgroup, &site, home, &log)
}

/// Node `n` (1 or 2) of a [`crate::mesh::TwoNodes`] whose pods a stock
/// ztunnel serves: our agent there runs with `--engine ztunnel` on
/// `config` and hands its pods to ztunnel over ZDS.
pub struct ZtunnelServedNode {
    /// ztunnel (declared first: stopped before the agent, as its pod
    /// would go before the node agent).
    pub ztunnel: Ztunnel,
    /// Our agent, under `--engine ztunnel`.
    pub agent: crate::Agent,
    _home: ZtunnelHome,
    _logs: crate::TempDir,
}

impl ZtunnelServedNode {
    /// Starts node `n`'s agent (tag `tag`, on `config`) and ztunnel
    /// (`binary`, reaching the test istiod at `istiod`, an address it
    /// listens on in the node's namespace, and trusting `root_pem`);
    /// returns once ztunnel has every pod the agent enrolled.
    pub fn start(
        w: &crate::mesh::TwoNodes,
        tag: &str,
        n: u8,
        config: &Path,
        binary: &Path,
        istiod: SocketAddr,
        root_pem: &str,
    ) -> Result<Self> {
        Self::start_with_env(w, tag, n, config, binary, istiod, root_pem, &[])
    }

    /// [`Self::start`] with `extra` added to ztunnel's environment (a
    /// setting a test compares, such as `LOCALHOST_APP_TUNNEL`).
    #[expect(
        clippy::too_many_arguments,
        reason = "start's arguments and the one setting more"
    )]
    pub fn start_with_env(
        w: &crate::mesh::TwoNodes,
        tag: &str,
        n: u8,
        config: &Path,
        binary: &Path,
        istiod: SocketAddr,
        root_pem: &str,
        extra: &[(&str, &str)],
    ) -> Result<Self> {
        let node = if n == 1 { &w.n1 } else { &w.n2 };
        let name = format!("node{n}");
        let zds = w.dir.path().join(format!("zds{n}.sock"));
        let zds_flag = zds.display().to_string();
        let agent = w.agent(
            tag,
            n,
            config,
            &["--engine", "ztunnel", "--zds-socket", &zds_flag],
        )?;
        let logs = crate::TempDir::new(&format!("{tag}log"))?;
        let home = ZtunnelHome::new(logs.path(), &name, istiod, root_pem)?;
        let cgroup = Cgroup::child(node.cgroup(), "zt")?;
        let site = ZtunnelNode {
            name: &name,
            instance_ip: node.bridge_ip4().into(),
            zds: &zds,
        };
        let mut env = ztunnel_env(&site, home.istiod);
        env.extend(
            extra
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned())),
        );
        let log = logs.path().join(format!("ztunnel-{name}.log"));
        let ztunnel =
            Ztunnel::start_with_env(binary, node.netns().path(), cgroup, &env, &home.dir, &log)?;
        wait_captured(&agent, &ztunnel)?;
        Ok(Self {
            ztunnel,
            agent,
            _home: home,
            _logs: logs,
        })
    }
}

/// Waits until `agent` reports every pod it enrolled as captured (for
/// `--engine ztunnel`: acknowledged by ztunnel and its listeners in the
/// kernel's socket map).
pub fn wait_captured(agent: &crate::Agent, zt: &Ztunnel) -> Result<()> {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let pods = agent.status()?.pods;
        let waiting: Vec<_> = pods
            .iter()
            .filter(|p| !p.captured)
            .map(|p| format!("{}: {}", p.name, p.reason))
            .collect();
        if !pods.is_empty() && waiting.is_empty() {
            return Ok(());
        }
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "pods not captured: {waiting:?}\nztunnel log:\n{}",
            zt.log_tail()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// ztunnel's environment for `node`: what Istio's ztunnel chart sets (its
/// defaults; the downward API's pod, node, address, service account and
/// CPU count; no CPU limit, a 200m request rounded up as the API does),
/// with istiod at `istiod`, and the few settings only the tests need.
pub fn ztunnel_env(node: &ZtunnelNode<'_>, istiod: SocketAddr) -> Vec<(String, String)> {
    let cpus = std::thread::available_parallelism().map_or(1, usize::from);
    [
        ("CA_ADDRESS", istiod.to_string()),
        ("XDS_ADDRESS", istiod.to_string()),
        ("RUST_LOG", "info".to_owned()),
        ("RUST_BACKTRACE", "1".to_owned()),
        ("ISTIO_META_CLUSTER_ID", "Kubernetes".to_owned()),
        ("INPOD_ENABLED", "true".to_owned()),
        ("TERMINATION_GRACE_PERIOD_SECONDS", "30".to_owned()),
        ("POD_NAME", format!("ztunnel-{}", node.name)),
        ("POD_NAMESPACE", "istio-system".to_owned()),
        ("NODE_NAME", node.name.to_owned()),
        ("INSTANCE_IP", node.instance_ip.to_string()),
        ("SERVICE_ACCOUNT", "ztunnel".to_owned()),
        ("ZTUNNEL_CPU_LIMIT", cpus.to_string()),
        ("ZTUNNEL_RESOURCE_CPU_REQUEST", "1".to_owned()),
        // Not the chart's: the ZDS socket is the agent's (the chart
        // mounts it at ztunnel's default path), istiod is reached by
        // address and named for its certificate (no cluster DNS here),
        // and the test's programs live in the usual places.
        ("INPOD_UDS", node.zds.display().to_string()),
        ("ALT_CA_HOSTNAME", SERVER_NAME.to_owned()),
        ("ALT_XDS_HOSTNAME", SERVER_NAME.to_owned()),
        ("PATH", "/usr/bin:/bin".to_owned()),
    ]
    .into_iter()
    .map(|(name, value)| (name.to_owned(), value))
    .collect()
}

/// The body of `GET <path>` on `127.0.0.1:<port>` inside `netns` (HTTP/1.0:
/// the server closes when done), within `limit`.
pub fn http_get(netns: &Netns, port: u16, path: &str, limit: Duration) -> Result<String> {
    http_get_in(netns.path(), port, path, limit)
}

/// [`http_get`] in the network namespace whose file is `netns` (one the
/// caller does not own, such as a pod's).
pub fn http_get_in(netns: &Path, port: u16, path: &str, limit: Duration) -> Result<String> {
    let request = format!("GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n");
    let response = dataplane_user::netns::run_in_netns(netns, move || -> Result<Vec<u8>> {
        let mut stream =
            TcpStream::connect_timeout(&SocketAddr::from(([127, 0, 0, 1], port)), limit)?;
        stream.set_read_timeout(Some(limit))?;
        stream.write_all(request.as_bytes())?;
        let mut response = Vec::new();
        stream.read_to_end(&mut response)?;
        Ok(response)
    })??;
    http_body(&String::from_utf8_lossy(&response))
        .with_context(|| format!("GET {path} on port {port}"))
}

/// The body of an HTTP/1 response, if its status is 200.
fn http_body(response: &str) -> Result<String> {
    let (head, body) = response
        .split_once("\r\n\r\n")
        .context("no end of headers in the response")?;
    let status = head.lines().next().unwrap_or_default();
    anyhow::ensure!(
        status.split_whitespace().nth(1) == Some("200"),
        "answered `{status}`"
    );
    Ok(body.to_owned())
}

/// ztunnel's Prometheus text, from its stats port in `netns`.
pub fn metrics(netns: &Netns) -> Result<String> {
    http_get(netns, STATS_PORT, "/metrics", Duration::from_secs(10))
}

/// What a ztunnel's `/config_dump` says it holds.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct HeldState {
    /// Workloads: uid and node.
    pub workloads: Vec<(String, String)>,
    /// How many services.
    pub services: usize,
    /// How many authorization policies.
    pub policies: usize,
}

impl HeldState {
    /// Reads ztunnel's `/config_dump` JSON (its proxy state is flattened
    /// into the top level: `workloads`, `services`, `policies`).
    pub fn from_config_dump(json: &str) -> Result<Self> {
        #[derive(Deserialize)]
        struct Dump {
            #[serde(default)]
            workloads: Vec<DumpWorkload>,
            #[serde(default)]
            services: Vec<serde::de::IgnoredAny>,
            #[serde(default)]
            policies: Vec<serde::de::IgnoredAny>,
        }
        #[derive(Deserialize)]
        struct DumpWorkload {
            uid: String,
            #[serde(default)]
            node: String,
        }
        let dump: Dump = serde_json::from_str(json).context("ztunnel's config_dump")?;
        Ok(Self {
            workloads: dump
                .workloads
                .into_iter()
                .map(|w| (w.uid, w.node))
                .collect(),
            services: dump.services.len(),
            policies: dump.policies.len(),
        })
    }

    /// The node of the workload `uid`, if held.
    pub fn node_of(&self, uid: &str) -> Option<&str> {
        self.workloads
            .iter()
            .find(|(u, _)| u == uid)
            .map(|(_, node)| node.as_str())
    }

    /// Fetches and reads the `/config_dump` of the ztunnel in `netns`.
    pub fn fetch(netns: &Netns, limit: Duration) -> Result<Self> {
        Self::from_config_dump(&http_get(netns, ADMIN_PORT, "/config_dump", limit)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_body_of_a_200_and_an_error_otherwise() -> Result<()> {
        let ok = "HTTP/1.0 200 OK\r\ncontent-type: text/plain\r\n\r\nhello\r\n";
        assert_eq!(http_body(ok)?, "hello\r\n");
        let err = "HTTP/1.0 404 Not Found\r\n\r\nnope";
        assert!(matches!(http_body(err), Err(e) if e.to_string().contains("404")));
        assert!(http_body("HTTP/1.0 200 OK\r\n").is_err());
        Ok(())
    }

    #[test]
    fn held_state_counts_what_the_dump_lists() -> Result<()> {
        let json = r#"{
            "workloads": [
                {"uid": "Kubernetes//Pod/ns0/w0", "node": "node3", "name": "w0"},
                {"uid": "Kubernetes//Pod/ns0/w1", "name": "w1"}
            ],
            "services": [{"hostname": "svc0.ns0.svc.cluster.local"}],
            "policies": [],
            "stagedServices": {},
            "config": {"nodeName": "x"}
        }"#;
        let held = HeldState::from_config_dump(json)?;
        assert_eq!(held.workloads.len(), 2);
        assert_eq!(held.services, 1);
        assert_eq!(held.policies, 0);
        assert_eq!(held.node_of("Kubernetes//Pod/ns0/w0"), Some("node3"));
        assert_eq!(held.node_of("Kubernetes//Pod/ns0/w1"), Some(""));
        assert_eq!(held.node_of("Kubernetes//Pod/ns0/w2"), None);
        assert!(HeldState::from_config_dump("not json").is_err());
        Ok(())
    }

    #[test]
    fn the_env_names_istiod_and_the_node() -> Result<()> {
        let zds = PathBuf::from("/run/zds.sock");
        let node = ZtunnelNode {
            name: "node7",
            instance_ip: "10.0.0.7".parse()?,
            zds: &zds,
        };
        let env = ztunnel_env(&node, "127.0.0.1:15012".parse()?);
        let get = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
        assert_eq!(get("XDS_ADDRESS"), Some("127.0.0.1:15012"));
        assert_eq!(get("CA_ADDRESS"), Some("127.0.0.1:15012"));
        assert_eq!(get("NODE_NAME"), Some("node7"));
        assert_eq!(get("POD_NAME"), Some("ztunnel-node7"));
        assert_eq!(get("INSTANCE_IP"), Some("10.0.0.7"));
        assert_eq!(get("INPOD_UDS"), Some("/run/zds.sock"));
        assert_eq!(get("ALT_XDS_HOSTNAME"), Some(SERVER_NAME));
        Ok(())
    }
}
