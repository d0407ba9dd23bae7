//! The chart's agent container run as a kubelet would run it, on a
//! simulated node. Its command, arguments, environment and readiness probe
//! are read from `deploy/kubernetes/dataplane.yaml`, the chart's default
//! rendering (`tests/kube_deploy.rs` checks the two are equal), not copied
//! by hand: a change to the chart changes what runs here.
//!
//! What a node gives the container, and what stands in for it:
//!
//! | in the pod | here |
//! |---|---|
//! | the image's `/usr/local/bin/dataplane` | the build's `dataplane` ([`agent_binary`]) |
//! | `hostNetwork` | the simulated node's network namespace (its 15000, 15020, 15021 are the node's, not the test host's) |
//! | `hostPID` | the test's PID namespace |
//! | the container's own cgroup below the host's cgroup v2 root | a cgroup of its own below the node's cgroup |
//! | volume `bpffs` (host `/sys/fs/bpf`) | a directory of the test's own on bpffs |
//! | volume `cgroup` (the host's cgroup v2 root) | the node's cgroup |
//! | volume `state` (host `/run/dataplane`) | a temporary directory |
//! | volume `netns` (host `/var/run/netns`) | `/var/run/netns`: the test's pod namespaces are pinned there |
//! | `fieldRef: spec.nodeName` | the node name the test gives |
//! | the image's `PATH` | the Debian default `PATH` |
//! | the API server in-cluster (service-account token, `KUBERNETES_SERVICE_*`) | `KUBECONFIG` naming a kubeconfig for the stand-in API |
//!
//! Every argument, variable and probe argument that is a path under a
//! mount is moved onto the mount's stand-in (`--state-dir=/run/dataplane`
//! becomes `--state-dir=<temp dir>`). Any other absolute path, a volume
//! the table does not name, or another `valueFrom` is an error, so the test
//! cannot quietly run something other than the chart. The `exec` readiness
//! probe runs in the container's network namespace and cgroup, as the
//! runtime's exec joins them; it passes when it exits 0 within the probe's
//! `timeoutSeconds`.

use std::{
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use k8s_openapi::api::{apps::v1::DaemonSet, core::v1::Container};
use k8s_openapi::serde::Deserialize as _;

use crate::{Cgroup, ChildGuard, agent_binary, spawn_in, spawn_logged_in, topology::Node};

/// Where the image puts the agent binary.
const IMAGE_BINARY: &str = "/usr/local/bin/dataplane";

/// The image's `PATH` (Debian's default).
const IMAGE_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// One environment variable of the container.
#[derive(Debug, Clone)]
enum EnvValue {
    Literal(String),
    NodeName,
}

/// The chart's `agent` container.
#[derive(Debug, Clone)]
pub struct ChartContainer {
    argv: Vec<String>,
    env: Vec<(String, EnvValue)>,
    probe: Vec<String>,
    probe_timeout: Duration,
    /// mountPath -> volume name.
    mounts: Vec<(String, String)>,
}

impl ChartContainer {
    /// The `agent` container of the DaemonSet in the plain manifest.
    pub fn agent_from_manifest() -> anyhow::Result<Self> {
        let path =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/kubernetes/dataplane.yaml");
        let text = std::fs::read_to_string(&path)?;
        for doc in serde_yaml_ng::Deserializer::from_str(&text) {
            let value = serde_yaml_ng::Value::deserialize(doc)?;
            if value["kind"].as_str() == Some("DaemonSet") {
                let ds: DaemonSet = serde_yaml_ng::from_value(value)?;
                let container = ds
                    .spec
                    .and_then(|s| s.template.spec)
                    .and_then(|p| p.containers.into_iter().find(|c| c.name == "agent"))
                    .ok_or_else(|| anyhow::anyhow!("{}: no agent container", path.display()))?;
                return Self::from_container(container);
            }
        }
        anyhow::bail!("{}: no DaemonSet", path.display())
    }

    fn from_container(c: Container) -> anyhow::Result<Self> {
        let mut argv = c.command.unwrap_or_default();
        anyhow::ensure!(
            argv.len() == 1,
            "the agent container's command is {argv:?}; the chart names the binary alone"
        );
        argv.extend(c.args.unwrap_or_default());
        let mut env = Vec::new();
        for var in c.env.unwrap_or_default() {
            let value = match (var.value, var.value_from) {
                (Some(v), None) => EnvValue::Literal(v),
                (None, Some(from))
                    if from.field_ref.as_ref().map(|f| f.field_path.as_str())
                        == Some("spec.nodeName") =>
                {
                    EnvValue::NodeName
                }
                (v, from) => anyhow::bail!("{}: no stand-in for {v:?} / {from:?}", var.name),
            };
            env.push((var.name, value));
        }
        let probe = c
            .readiness_probe
            .ok_or_else(|| anyhow::anyhow!("the agent container has no readiness probe"))?;
        let probe_timeout = Duration::from_secs(probe.timeout_seconds.unwrap_or(1).try_into()?);
        let probe = probe
            .exec
            .and_then(|e| e.command)
            .ok_or_else(|| anyhow::anyhow!("the readiness probe is not an exec probe"))?;
        let mounts = c
            .volume_mounts
            .unwrap_or_default()
            .into_iter()
            .map(|m| (m.mount_path, m.name))
            .collect();
        Ok(Self {
            argv,
            env,
            probe,
            probe_timeout,
            mounts,
        })
    }

    /// The container's arguments (command first), as declared.
    pub fn argv(&self) -> &[String] {
        &self.argv
    }
}

/// What stands in for the node's host paths, by volume name.
#[derive(Debug, Clone)]
pub struct HostPaths {
    /// Volume `bpffs`.
    pub bpffs: PathBuf,
    /// Volume `state`.
    pub state: PathBuf,
    /// A kubeconfig for the stand-in API server.
    pub kubeconfig: PathBuf,
    /// `spec.nodeName`.
    pub node_name: String,
}

/// Runs the chart's container on one simulated node, as its kubelet.
#[derive(Debug)]
pub struct Kubelet<'a> {
    container: ChartContainer,
    node: &'a Node,
    /// mountPath -> stand-in, longest first.
    mounts: Vec<(String, PathBuf)>,
    host: HostPaths,
    binary: PathBuf,
}

impl<'a> Kubelet<'a> {
    /// A kubelet for `node` running `container` with `host`'s stand-ins.
    pub fn new(container: ChartContainer, node: &'a Node, host: HostPaths) -> anyhow::Result<Self> {
        let mut mounts = Vec::new();
        for (path, volume) in &container.mounts {
            let to = match volume.as_str() {
                "bpffs" => host.bpffs.clone(),
                "cgroup" => node.cgroup().path().to_path_buf(),
                "state" => host.state.clone(),
                "netns" => PathBuf::from("/var/run/netns"),
                other => anyhow::bail!("no stand-in for the agent's volume {other} at {path}"),
            };
            mounts.push((path.clone(), to));
        }
        mounts.sort_by_key(|(path, _)| std::cmp::Reverse(path.len()));
        Ok(Self {
            container,
            node,
            mounts,
            host,
            binary: agent_binary()?,
        })
    }

    /// An argument or value with container paths moved onto their
    /// stand-ins (`--flag=PATH` and bare `PATH` forms).
    fn map(&self, value: &str) -> anyhow::Result<String> {
        if let Some((flag, rest)) = value.split_once('=')
            && flag.starts_with("--")
        {
            return Ok(format!("{flag}={}", self.map_path(rest)?));
        }
        self.map_path(value)
    }

    fn map_path(&self, value: &str) -> anyhow::Result<String> {
        if !value.starts_with('/') {
            return Ok(value.to_owned());
        }
        if value == IMAGE_BINARY {
            return Ok(self.binary.display().to_string());
        }
        for (mount, to) in &self.mounts {
            if let Some(rest) = value.strip_prefix(mount.as_str())
                && (rest.is_empty() || rest.starts_with('/'))
            {
                return Ok(format!("{}{rest}", to.display()));
            }
        }
        anyhow::bail!("the container uses {value}, under no mount the test stands in for")
    }

    fn command(&self, argv: &[String]) -> anyhow::Result<Command> {
        let argv: Vec<String> = argv.iter().map(|a| self.map(a)).collect::<Result<_, _>>()?;
        let (program, args) = argv
            .split_first()
            .ok_or_else(|| anyhow::anyhow!("empty command"))?;
        let mut cmd = Command::new(program);
        cmd.args(args).env_clear().env("PATH", IMAGE_PATH);
        // An exec probe runs with the container's environment too.
        for (name, value) in &self.container.env {
            let value = match value {
                EnvValue::Literal(v) => self.map(v)?,
                EnvValue::NodeName => self.host.node_name.clone(),
            };
            cmd.env(name, value);
        }
        cmd.env("KUBECONFIG", &self.host.kubeconfig);
        Ok(cmd)
    }

    /// Starts the agent container of the pod named `pod`: a cgroup of its
    /// own, its output appended to `<logs>/<pod>.log`.
    pub fn start(&self, pod: &str, logs: &Path) -> anyhow::Result<RunningContainer> {
        let cmd = self.command(&self.container.argv)?;
        let cgroup = Cgroup::child(self.node.cgroup(), pod)?;
        let log = logs.join(format!("{pod}.log"));
        let child = spawn_logged_in(
            cmd,
            Some(self.node.netns().path()),
            Some(cgroup.path()),
            &log,
        )?;
        let pid = child
            .id()
            .ok_or_else(|| anyhow::anyhow!("the container's process is gone"))?;
        Ok(RunningContainer {
            child,
            pid,
            cgroup,
            log,
        })
    }

    /// Runs the chart's readiness probe in `container`, as its kubelet:
    /// `Ok(true)` when it exits 0 within `timeoutSeconds`.
    pub fn probe(&self, container: &RunningContainer) -> anyhow::Result<Probe> {
        let cmd = self.command(&self.container.probe)?;
        let child = spawn_in(
            cmd,
            Some(self.node.netns().path()),
            Some(container.cgroup.path()),
        )?;
        Ok(match child.wait(self.container.probe_timeout) {
            Ok(out) => Probe {
                passed: out.code == Some(0),
                output: format!("exit {:?}: {}{}", out.code, out.stdout, out.stderr),
            },
            // Past timeoutSeconds the kubelet counts a failure.
            Err(err) => Probe {
                passed: false,
                output: err.to_string(),
            },
        })
    }
}

/// One run of the readiness probe.
#[derive(Debug)]
pub struct Probe {
    /// Exit 0 within the probe's timeout.
    pub passed: bool,
    /// Its exit code and output, or why it failed.
    pub output: String,
}

/// A container the [`Kubelet`] started; killed with its cgroup on drop.
#[derive(Debug)]
pub struct RunningContainer {
    // Declared before the cgroup: killed and reaped first.
    child: ChildGuard,
    pid: u32,
    cgroup: Cgroup,
    log: PathBuf,
}

impl RunningContainer {
    /// The agent's pid.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Whether the agent has not exited.
    pub fn is_running(&mut self) -> bool {
        self.child.is_running()
    }

    /// Its log so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGTERM, as the kubelet sends when the pod is deleted, and its exit
    /// code once it exits (a hang guard of `limit`).
    pub fn terminate(self, limit: Duration) -> anyhow::Result<Option<i32>> {
        self.child.signal(nix::sys::signal::Signal::SIGTERM)?;
        let log = self.log.clone();
        let out = self.child.wait(limit).map_err(|e| {
            anyhow::anyhow!(
                "{e}:\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            )
        })?;
        Ok(out.code)
    }
}
