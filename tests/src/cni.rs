//! Running CNI plugins the way a container runtime does (libcni): one
//! network configuration list, each plugin executed from `CNI_PATH` with the
//! `CNI_*` environment and its configuration on stdin (`cniVersion` and
//! `name` injected, `prevResult` chained), ADD in order, DEL in reverse,
//! CHECK in order with the cached result.
//!
//! Plugins run inside a test-owned "node" network namespace (joined between
//! fork and exec), so the bridge plugin creates its bridge and host-side
//! veths there and nothing in the host's namespace. host-local IPAM keeps
//! its state in the network's own temporary directory (`dataDir`).

use std::{
    collections::BTreeMap,
    fs::File,
    io::Write as _,
    os::{fd::AsRawFd as _, unix::process::CommandExt as _},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Duration,
};

use serde_json::{Value, json};

use crate::{ChildGuard, Netns, TempDir, process::target_binary};

/// Where Debian's `containernetworking-plugins` installs the reference
/// plugins.
pub const REFERENCE_PLUGINS: &str = "/usr/lib/cni";

/// Guard against hangs (not a timing assertion).
const LIMIT: Duration = Duration::from_secs(20);

/// The built `dataplane-cni` plugin binary.
pub fn plugin_binary() -> anyhow::Result<PathBuf> {
    target_binary(
        "dataplane-cni",
        "build it with `cargo build -p dataplane-user` (`cargo xtask test` does)",
    )
}

/// Fails with an install hint when the reference plugins are missing.
pub fn require_reference_plugins() -> anyhow::Result<()> {
    for name in ["bridge", "host-local", "loopback"] {
        anyhow::ensure!(
            Path::new(REFERENCE_PLUGINS).join(name).exists(),
            "{REFERENCE_PLUGINS}/{name} is missing: install Debian's containernetworking-plugins (`cargo xtask setup` does)"
        );
    }
    Ok(())
}

/// One plugin execution's outcome.
#[derive(Debug, Clone)]
pub struct PluginRun {
    /// Exit code.
    pub code: Option<i32>,
    /// stdout.
    pub stdout: String,
    /// stderr.
    pub stderr: String,
}

impl PluginRun {
    /// stdout as JSON (Null when empty).
    pub fn json(&self) -> anyhow::Result<Value> {
        if self.stdout.trim().is_empty() {
            return Ok(Value::Null);
        }
        serde_json::from_str(&self.stdout)
            .map_err(|e| anyhow::anyhow!("plugin printed non-JSON ({e}): {}", self.stdout))
    }
}

/// A failed chain: which plugin failed and its spec error.
#[derive(Debug, Clone)]
pub struct ChainError {
    /// The failing plugin's `type`.
    pub plugin: String,
    /// Its error object (`code`, `msg`, `details`).
    pub error: Value,
    /// Its stderr.
    pub stderr: String,
}

/// A container's attachment: what the runtime passes in the environment.
#[derive(Debug, Clone)]
pub struct Attachment {
    /// `CNI_CONTAINERID`.
    pub container_id: String,
    /// `CNI_NETNS`.
    pub netns: PathBuf,
    /// `CNI_IFNAME`.
    pub ifname: String,
    /// `CNI_ARGS` pairs.
    pub args: BTreeMap<String, String>,
}

impl Attachment {
    /// A Kubernetes pod's attachment, as containerd describes it.
    pub fn pod(netns: &Netns, namespace: &str, name: &str, uid: &str) -> Self {
        let container_id = format!("{:064x}", hash(netns.name()));
        let args = [
            ("IgnoreUnknown", "1"),
            ("K8S_POD_NAMESPACE", namespace),
            ("K8S_POD_NAME", name),
            ("K8S_POD_INFRA_CONTAINER_ID", container_id.as_str()),
            ("K8S_POD_UID", uid),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        Self {
            container_id,
            netns: netns.path().to_path_buf(),
            ifname: "eth0".into(),
            args,
        }
    }

    fn cni_args(&self) -> String {
        self.args
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(";")
    }
}

fn hash(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

/// A network configuration list and where its plugins run.
#[derive(Debug)]
pub struct CniNetwork {
    /// The list (`cniVersion`, `name`, `plugins`).
    pub conflist: Value,
    /// Directories searched for plugin binaries.
    pub cni_path: Vec<PathBuf>,
    /// Network namespace the plugins run in.
    pub run_in: PathBuf,
    data: TempDir,
}

impl CniNetwork {
    /// The test network: bridge `cni0` (gateway 10.88.0.1, fd88::1) with
    /// host-local IPAM, then `dataplane-cni` configured with `ours`
    /// (merged into its entry). Plugins run in `node`.
    pub fn bridge_with_dataplane(tag: &str, node: &Netns, ours: Value) -> anyhow::Result<Self> {
        require_reference_plugins()?;
        let data = TempDir::new(&format!("{tag}ipam"))?;
        let mut dataplane = json!({"type": "dataplane-cni"});
        if let (Some(entry), Some(extra)) = (dataplane.as_object_mut(), ours.as_object()) {
            entry.extend(extra.clone());
        }
        let conflist = json!({
            "cniVersion": "1.0.0",
            "name": "dpt-net",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": "cni0",
                    "isGateway": true,
                    "ipMasq": false,
                    "hairpinMode": true,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": "10.88.0.0/16"}], [{"subnet": "fd88::/64"}]],
                        "routes": [{"dst": "0.0.0.0/0"}, {"dst": "::/0"}],
                        "dataDir": data.path(),
                    }
                },
                dataplane
            ]
        });
        let ours_dir = plugin_binary()?
            .parent()
            .map(Path::to_path_buf)
            .ok_or_else(|| anyhow::anyhow!("plugin binary has no directory"))?;
        Ok(Self {
            conflist,
            cni_path: vec![PathBuf::from(REFERENCE_PLUGINS), ours_dir],
            run_in: node.path().to_path_buf(),
            data,
        })
    }

    /// host-local's state directory.
    pub fn ipam_dir(&self) -> PathBuf {
        self.data.path().join("dpt-net")
    }

    fn plugins(&self) -> Vec<Value> {
        self.conflist["plugins"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    }

    /// The configuration plugin `plugin` receives.
    fn plugin_conf(&self, plugin: &Value, prev: Option<&Value>) -> Value {
        let mut conf = plugin.clone();
        conf["cniVersion"] = self.conflist["cniVersion"].clone();
        conf["name"] = self.conflist["name"].clone();
        if let Some(prev) = prev {
            conf["prevResult"] = prev.clone();
        }
        conf
    }

    /// Runs one plugin with raw stdin.
    pub fn exec_raw(
        &self,
        plugin_type: &str,
        command: &str,
        att: Option<&Attachment>,
        stdin: &[u8],
    ) -> anyhow::Result<PluginRun> {
        let binary = self
            .cni_path
            .iter()
            .map(|dir| dir.join(plugin_type))
            .find(|p| p.exists())
            .ok_or_else(|| anyhow::anyhow!("no plugin `{plugin_type}` in {:?}", self.cni_path))?;
        let mut cmd = Command::new(binary);
        cmd.env_clear()
            .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
            .env("CNI_COMMAND", command)
            .env("CNI_PATH", std::env::join_paths(&self.cni_path)?);
        if let Some(att) = att {
            cmd.env("CNI_CONTAINERID", &att.container_id)
                .env("CNI_NETNS", &att.netns)
                .env("CNI_IFNAME", &att.ifname)
                .env("CNI_ARGS", att.cni_args());
        }
        cmd.stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let ns = File::open(&self.run_in)?;
        let fd = ns.as_raw_fd();
        // SAFETY: only setns(2) on a descriptor opened before the fork.
        unsafe {
            cmd.pre_exec(move || {
                if libc::setns(fd, libc::CLONE_NEWNET) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = cmd.spawn()?;
        drop(ns);
        if let Some(mut input) = child.stdin.take() {
            input.write_all(stdin)?;
        }
        let out = ChildGuard::new(child).wait(LIMIT)?;
        Ok(PluginRun {
            code: out.code,
            stdout: out.stdout,
            stderr: out.stderr,
        })
    }

    /// Runs one plugin of the list (by position) as the runtime would.
    pub fn exec(
        &self,
        index: usize,
        command: &str,
        att: &Attachment,
        prev: Option<&Value>,
    ) -> anyhow::Result<PluginRun> {
        let plugins = self.plugins();
        let plugin = plugins
            .get(index)
            .ok_or_else(|| anyhow::anyhow!("no plugin {index}"))?;
        let conf = self.plugin_conf(plugin, prev);
        let plugin_type = plugin["type"].as_str().unwrap_or_default().to_owned();
        self.exec_raw(
            &plugin_type,
            command,
            Some(att),
            conf.to_string().as_bytes(),
        )
    }

    /// ADD through the whole list: the final result, or the first error.
    pub fn add(&self, att: &Attachment) -> anyhow::Result<Result<Value, ChainError>> {
        let mut prev: Option<Value> = None;
        for i in 0..self.plugins().len() {
            match self.step(i, "ADD", att, prev.as_ref())? {
                Ok(result) => prev = Some(result),
                Err(err) => return Ok(Err(err)),
            }
        }
        Ok(Ok(prev.unwrap_or(Value::Null)))
    }

    /// DEL through the list in reverse, each plugin given the cached result.
    pub fn del(
        &self,
        att: &Attachment,
        cached: Option<&Value>,
    ) -> anyhow::Result<Result<(), ChainError>> {
        for i in (0..self.plugins().len()).rev() {
            if let Err(err) = self.step(i, "DEL", att, cached)? {
                return Ok(Err(err));
            }
        }
        Ok(Ok(()))
    }

    /// CHECK through the list, each plugin given the cached result.
    pub fn check(
        &self,
        att: &Attachment,
        cached: &Value,
    ) -> anyhow::Result<Result<(), ChainError>> {
        for i in 0..self.plugins().len() {
            if let Err(err) = self.step(i, "CHECK", att, Some(cached))? {
                return Ok(Err(err));
            }
        }
        Ok(Ok(()))
    }

    fn step(
        &self,
        index: usize,
        command: &str,
        att: &Attachment,
        prev: Option<&Value>,
    ) -> anyhow::Result<Result<Value, ChainError>> {
        let run = self.exec(index, command, att, prev)?;
        let plugin = self.plugins()[index]["type"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        if run.code == Some(0) {
            Ok(Ok(run.json()?))
        } else {
            Ok(Err(ChainError {
                plugin,
                error: run.json().unwrap_or(Value::String(run.stdout.clone())),
                stderr: run.stderr,
            }))
        }
    }

    /// The loopback plugin on `att`'s namespace, as runtimes run it beside
    /// the pod network.
    pub fn loopback(&self, att: &Attachment) -> anyhow::Result<PluginRun> {
        let conf = json!({"cniVersion": "1.0.0", "name": "cni-loopback", "type": "loopback"});
        let mut lo = att.clone();
        lo.ifname = "lo".into();
        self.exec_raw("loopback", "ADD", Some(&lo), conf.to_string().as_bytes())
    }
}
