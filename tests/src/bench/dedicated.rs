//! A stock Istio ztunnel beside our agents, run the way Istio runs a proxy
//! of its own per workload: dedicated mode, one ztunnel in each enrolled
//! pod's network namespace serving that pod's workload only, fed by
//! iptables REDIRECT rules in the pod (the same rules as our `iptables`
//! mode, [`super::iptables`]), with its workloads from the test istiod's
//! xDS and its certificate from the test istiod's CA.
//!
//! What this relies on in ztunnel's code (`istio/ztunnel`):
//! - `src/config.rs` `construct_config`: `PROXY_MODE=dedicated` needs
//!   `PROXY_WORKLOAD_INFO` as `namespace/name/service-account`; outside
//!   shared mode `PACKET_MARK` has no default; the outbound (15001),
//!   inbound plaintext (15006) and HBONE (15008) listeners bind the
//!   namespace's wildcard address; readiness answers on 15021.
//! - `src/proxyfactory.rs` `ProxyFactory::new_proxies_for_dedicated`: with
//!   `PACKET_MARK` set every socket it opens carries the mark
//!   (`MarkSocketFactory`), which the rules exempt from the REDIRECT so
//!   its own connections are not sent back to it.
//! - `src/test_helpers/linux.rs` `WorkloadManager::deploy_dedicated_ztunnel`
//!   and `scripts/ztunnel-redirect.sh`: ztunnel's own dedicated-mode tests
//!   run it with mark 1337 (`0x539/0xfff`, which our rules exempt: the
//!   agents' default mark is the same), an OUTPUT REDIRECT to 15001, and
//!   original source off (`require_original_source: Some(false)`): the app
//!   shares the namespace, so a connection bound to the remote client's
//!   address would be answered out of the pod instead of to ztunnel.
//! - `src/state/workload.rs` `WorkloadStore::find_by_info`: it finds its
//!   workload among those on its own node (`NODE_NAME`), so each ztunnel
//!   is told its pod's node.
//! - `src/cert_fetcher.rs` `new`: nothing is fetched ahead in dedicated
//!   mode (`NoCertFetcher`); the first connection fetches the certificate,
//!   so [`super::mesh::ModeMesh`] opens one through every path before
//!   anything is measured.
//! - `src/version.rs` `BuildInfo`: `ztunnel version` prints the commit it
//!   was built from (`GitRevision`), which the report carries.

use std::{
    net::{Ipv4Addr, SocketAddr},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use dataplane_user::config::{LocalConfig, Workload};

use super::{probe, signal};
use crate::{
    Cgroup, TempDir,
    istiod::{TestIstiod, TestPki},
    mesh::as_istiod_serves,
    topology::Pod,
    ztunnel::{Ztunnel, ZtunnelHome, ZtunnelNode, http_get_in, ztunnel_env},
};

/// ztunnel's readiness port (`DEFAULT_READINESS_PORT` in its config).
const READINESS_PORT: u16 = 15021;

/// Start-up guard (not a timing assertion): istiod's push, the
/// certificate request and the listeners.
const READY_LIMIT: Duration = Duration::from_secs(60);

/// The mark ztunnel sets on its own sockets: ztunnel's test mark (1337,
/// `0x539`), the one the iptables rules exempt.
pub const ZTUNNEL_MARK: u32 = 1337;

/// One enrolled pod as its dedicated ztunnel sees it.
#[derive(Debug, Clone)]
struct ZtunnelPod {
    /// The pod's IPv4 address (to find the pair of a path).
    ip: Ipv4Addr,
    /// The pod's network namespace file (the pod outlives its ztunnel).
    netns: PathBuf,
    /// `namespace/name/service-account` of its workload.
    workload_info: String,
    /// Namespace, name and service account, for the downward API's names.
    workload: [String; 3],
    /// Its workload's node.
    node: String,
    /// Where the test istiod listens inside the pod (loopback, which the
    /// rules leave alone).
    istiod: SocketAddr,
    /// Its working directory, with the root and token files.
    home: PathBuf,
}

/// The dedicated ztunnels of one cluster and the test istiod they share;
/// dropping it stops them all, then istiod.
pub struct DedicatedZtunnels {
    // Field order is drop order: processes, then istiod before the
    // runtime it runs on, then the files.
    running: Vec<Ztunnel>,
    pods: Vec<ZtunnelPod>,
    _istiod: TestIstiod,
    _rt: tokio::runtime::Runtime,
    binary: PathBuf,
    tag: String,
    dir: TempDir,
}

impl std::fmt::Debug for DedicatedZtunnels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DedicatedZtunnels")
            .field("binary", &self.binary)
            .field("pods", &self.pods)
            .field("running", &self.running.len())
            .finish()
    }
}

impl DedicatedZtunnels {
    /// Starts a test istiod serving `mesh` (as istiod serves it) and
    /// listening inside every pod of `pods` (each with its workload); the
    /// ztunnels themselves start with [`DedicatedZtunnels::start`].
    pub fn new(
        binary: &Path,
        tag: &str,
        mesh: &LocalConfig,
        pods: &[(&Pod, &Workload)],
    ) -> anyhow::Result<Self> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()?;
        let pki = TestPki::generate()?;
        let mut istiod = rt.block_on(TestIstiod::start(&pki, "127.0.0.1:0".parse()?))?;
        rt.block_on(istiod.publish_mesh(&as_istiod_serves(mesh.clone()), "1"))?;
        let dir = TempDir::new(&format!("{tag}zt"))?;
        let mut zpods = Vec::new();
        for (pod, workload) in pods {
            let istiod_addr = rt.block_on(istiod.listen_in(&pod.netns))?;
            let home = ZtunnelHome::new(dir.path(), &workload.name, istiod_addr, &pki.root_pem)?;
            let names = [
                workload.namespace.to_string(),
                workload.name.to_string(),
                workload.service_account.to_string(),
            ];
            zpods.push(ZtunnelPod {
                ip: pod.ip4,
                netns: pod.netns.path().to_owned(),
                workload_info: names.join("/"),
                workload: names,
                node: workload.node.to_string(),
                istiod: istiod_addr,
                home: home.dir,
            });
        }
        Ok(Self {
            running: Vec::new(),
            pods: zpods,
            _istiod: istiod,
            _rt: rt,
            binary: binary.to_owned(),
            tag: tag.to_owned(),
            dir,
        })
    }

    /// (Re)starts every ztunnel, fresh processes in fresh cgroups, and
    /// waits until each reports ready.
    pub fn start(&mut self) -> anyhow::Result<()> {
        self.running.clear();
        for (index, pod) in self.pods.iter().enumerate() {
            let cgroup = Cgroup::new(&format!("{}z{index}", self.tag))?;
            let log = self
                .dir
                .path()
                .join(format!("ztunnel-{}.log", pod.workload[1]));
            let env = dedicated_env(pod);
            let process =
                Ztunnel::start_with_env(&self.binary, &pod.netns, cgroup, &env, &pod.home, &log)?;
            self.running.push(process);
        }
        for index in 0..self.pods.len() {
            self.wait_ready(index)?;
        }
        Ok(())
    }

    fn wait_ready(&mut self, index: usize) -> anyhow::Result<()> {
        let deadline = Instant::now() + READY_LIMIT;
        let pod = &self.pods[index];
        loop {
            signal::check()?;
            if http_get_in(
                &pod.netns,
                READINESS_PORT,
                "/healthz/ready",
                Duration::from_secs(2),
            )
            .is_ok()
            {
                return Ok(());
            }
            let process = &mut self.running[index];
            anyhow::ensure!(
                process.is_running(),
                "ztunnel for {} exited during start-up:\n{}",
                pod.workload_info,
                process.log_tail()
            );
            anyhow::ensure!(
                Instant::now() < deadline,
                "ztunnel for {} not ready within {READY_LIMIT:?}:\n{}",
                pod.workload_info,
                process.log_tail()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// CPU all ztunnels used so far (their cgroups), in microseconds.
    pub fn cpu_usec(&self) -> anyhow::Result<u64> {
        let mut usec = 0;
        for process in &self.running {
            usec += probe::cgroup_cpu_usec(process.cgroup().path())?;
        }
        Ok(usec)
    }

    /// Every ztunnel's process id.
    pub fn pids(&self) -> Vec<u32> {
        self.running.iter().filter_map(Ztunnel::pid).collect()
    }

    /// The resident memory of the ztunnel of the pod at `ip`, in bytes.
    pub fn rss_of(&self, ip: Ipv4Addr) -> anyhow::Result<u64> {
        let index = self
            .pods
            .iter()
            .position(|p| p.ip == ip)
            .ok_or_else(|| anyhow::anyhow!("no ztunnel serves {ip}"))?;
        let pid = self
            .running
            .get(index)
            .and_then(Ztunnel::pid)
            .ok_or_else(|| anyhow::anyhow!("the ztunnel of {ip} is not running"))?;
        probe::rss_bytes(pid)
    }

    /// The last lines of every ztunnel's log (for error reports).
    pub fn logs(&self) -> String {
        self.pods
            .iter()
            .zip(&self.running)
            .map(|(pod, process)| format!("ztunnel {}:\n{}", pod.workload_info, process.log_tail()))
            .collect::<Vec<_>>()
            .join("\n")
    }
}

/// The environment of a pod's dedicated ztunnel: what Istio's chart gives
/// a ztunnel ([`ztunnel_env`]: istiod, its root and token, the CPU count),
/// in dedicated mode for the pod's workload, with its sockets marked and
/// original source off as ztunnel's own dedicated-mode tests run it (see
/// the module doc), the downward API's names of the pod's own workload,
/// and logging at `warn` as the agents do (no access-log line per
/// connection on either side).
fn dedicated_env(pod: &ZtunnelPod) -> Vec<(String, String)> {
    // No ZDS in dedicated mode: ztunnel never opens this path.
    let zds = Path::new("/dev/null");
    let node = ZtunnelNode {
        name: &pod.node,
        instance_ip: pod.ip.into(),
        zds,
    };
    let replaced = [
        "INPOD_ENABLED",
        "INPOD_UDS",
        "RUST_LOG",
        "POD_NAME",
        "POD_NAMESPACE",
        "SERVICE_ACCOUNT",
    ];
    let mut env = ztunnel_env(&node, pod.istiod);
    env.retain(|(name, _)| !replaced.contains(&name.as_str()));
    let [namespace, name, service_account] = pod.workload.clone();
    env.extend(
        [
            ("PROXY_MODE", "dedicated".to_owned()),
            ("PROXY_WORKLOAD_INFO", pod.workload_info.clone()),
            ("PACKET_MARK", ZTUNNEL_MARK.to_string()),
            ("ENABLE_ORIG_SRC", "false".to_owned()),
            ("RUST_LOG", "warn".to_owned()),
            ("POD_NAME", name),
            ("POD_NAMESPACE", namespace),
            ("SERVICE_ACCOUNT", service_account),
        ]
        .map(|(k, v)| (k.to_owned(), v)),
    );
    env
}

/// What a ztunnel binary says it was built from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ZtunnelBuild {
    /// The binary's path.
    pub binary: PathBuf,
    /// The commit: `GitRevision` of `ztunnel version`, or the `HEAD` of
    /// the git checkout the binary sits in when the build recorded none.
    pub commit: Option<String>,
    /// `ztunnel version`'s line, as printed.
    pub version: String,
}

impl ZtunnelBuild {
    /// Asks `binary` (`ztunnel version`), then git, if need be.
    pub fn of(binary: &Path) -> Self {
        let version = Command::new(binary)
            .arg("version")
            .env_clear()
            .stdin(Stdio::null())
            .stderr(Stdio::null())
            .output()
            .ok()
            .map(|out| String::from_utf8_lossy(&out.stdout).trim().to_owned())
            .unwrap_or_default();
        let commit = git_revision(&version).or_else(|| checkout_head(binary));
        Self {
            binary: binary.to_owned(),
            commit,
            version,
        }
    }
}

/// `GitRevision` of ztunnel's `version.BuildInfo{...}` line, when it names
/// a commit (with `-dirty` when the tree it was built from had changes,
/// as ztunnel's `common/scripts/report_build_info.sh` marks it).
fn git_revision(version: &str) -> Option<String> {
    let rest = version.split("GitRevision:\"").nth(1)?;
    let revision = rest.split('"').next()?;
    let hash = revision.strip_suffix("-dirty").unwrap_or(revision);
    (hash.len() >= 7 && hash.chars().all(|c| c.is_ascii_hexdigit())).then(|| revision.to_owned())
}

/// `HEAD` of the git checkout holding `binary` (e.g. `<src>/out/rust/release/ztunnel`).
fn checkout_head(binary: &Path) -> Option<String> {
    let root = binary.ancestors().find(|dir| dir.join(".git").exists())?;
    let out = Command::new("git")
        .arg("-C")
        .arg(root)
        .args(["rev-parse", "HEAD"])
        .output()
        .ok()?;
    let head = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    (out.status.success() && !head.is_empty()).then_some(head)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod() -> ZtunnelPod {
        ZtunnelPod {
            ip: Ipv4Addr::new(10, 1, 0, 11),
            netns: PathBuf::from("/var/run/netns/x"),
            workload_info: "test/client/client-sa".into(),
            workload: ["test".into(), "client".into(), "client-sa".into()],
            node: "node1".into(),
            istiod: SocketAddr::from(([127, 0, 0, 1], 15012)),
            home: PathBuf::from("/tmp/home"),
        }
    }

    #[test]
    fn the_env_runs_ztunnel_dedicated_for_the_pods_workload() {
        let env = dedicated_env(&pod());
        let get = |k: &str| {
            let all: Vec<&str> = env
                .iter()
                .filter(|(n, _)| n == k)
                .map(|(_, v)| v.as_str())
                .collect();
            assert!(all.len() <= 1, "{k} set twice: {all:?}");
            all.first().copied()
        };
        assert_eq!(get("PROXY_MODE"), Some("dedicated"));
        assert_eq!(get("PROXY_WORKLOAD_INFO"), Some("test/client/client-sa"));
        assert_eq!(get("PACKET_MARK"), Some("1337"));
        assert_eq!(get("ENABLE_ORIG_SRC"), Some("false"));
        assert_eq!(get("NODE_NAME"), Some("node1"));
        assert_eq!(get("INSTANCE_IP"), Some("10.1.0.11"));
        assert_eq!(get("XDS_ADDRESS"), Some("127.0.0.1:15012"));
        assert_eq!(get("POD_NAMESPACE"), Some("test"));
        assert_eq!(get("SERVICE_ACCOUNT"), Some("client-sa"));
        assert_eq!(get("RUST_LOG"), Some("warn"));
        assert_eq!(get("INPOD_ENABLED"), None);
        assert_eq!(get("INPOD_UDS"), None);
    }

    #[test]
    fn the_mark_is_the_one_the_rules_exempt() {
        assert_eq!(ZTUNNEL_MARK, dataplane_common::DEFAULT_PROXY_MARK);
    }

    #[test]
    fn the_commit_comes_from_the_build_info_line() {
        let line = "version.BuildInfo{Version:\"62d8265\", GitRevision:\"62d826530e5ce85764e309170205b293efcbc80b\", RustVersion:\"1.90\", BuildProfile:\"release\", BuildStatus:\"Clean\", IstioVersion:\"unknown\", CryptoProvider:\"boring\"}";
        assert_eq!(
            git_revision(line).as_deref(),
            Some("62d826530e5ce85764e309170205b293efcbc80b")
        );
        assert_eq!(
            git_revision("version.BuildInfo{GitRevision:\"62d826530e5c-dirty\"}").as_deref(),
            Some("62d826530e5c-dirty")
        );
        assert_eq!(
            git_revision("version.BuildInfo{Version:\"\", GitRevision:\"unknown\"}"),
            None
        );
        assert_eq!(git_revision(""), None);
    }
}
