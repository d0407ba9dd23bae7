//! A `dataplane run` process for one simulated node, with its own instance
//! name, bpffs directory and state directory, stopped (SIGTERM, then
//! SIGKILL) and cleaned up on drop.

use std::{
    fs::File,
    os::unix::process::CommandExt as _,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use dataplane_user::{
    control::{self, Request, Response},
    enroll::PodSpec,
    inspect::{CertInfo, Endpoints, PodCaptureState, StatusReport},
    redirect::PinLayout,
};

use crate::{BpffsDir, TempDir, agent_binary, topology::Node};

/// How long start-up and shutdown may take before the test gives up (a
/// guard against hangs, not a timing assertion).
const LIMIT: Duration = Duration::from_secs(30);

/// What [`Agent::take_over`] saw.
#[derive(Debug, Clone, Copy)]
pub struct TakeOver {
    /// The agent taken over from.
    pub old_pid: u32,
    /// The agent now running.
    pub new_pid: u32,
    /// The old agent's exit code.
    pub old_exit: Option<i32>,
}

/// A running agent.
#[derive(Debug)]
pub struct Agent {
    child: Option<Child>,
    instance: String,
    bpffs: BpffsDir,
    state: TempDir,
    log: PathBuf,
    cgroup: PathBuf,
    extra: Vec<String>,
    /// `RLIMIT_NOFILE` (soft, hard) to start it with, instead of the
    /// test's own.
    nofile: Option<(u64, u64)>,
    /// Environment variables set for it besides the test's own.
    env: Vec<(String, String)>,
    /// Where its HTTP endpoints listen, as its status report said once
    /// ready.
    endpoints: Endpoints,
}

impl Agent {
    /// Starts an agent attached to `node`'s cgroup, with `extra` arguments.
    pub fn start(tag: &str, node: &Node, extra: &[&str]) -> anyhow::Result<Self> {
        Self::start_with_nofile(tag, node, extra, None)
    }

    /// As [`Agent::start`], with the file descriptor limit `(soft, hard)`
    /// set for the agent process (as a container runtime would), if given.
    pub fn start_with_nofile(
        tag: &str,
        node: &Node,
        extra: &[&str],
        nofile: Option<(u64, u64)>,
    ) -> anyhow::Result<Self> {
        Self::launch(tag, node, extra, nofile, &[])
    }

    /// As [`Agent::start`], with `env` set for the agent process (and its
    /// restarts).
    pub fn start_with_env(
        tag: &str,
        node: &Node,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> anyhow::Result<Self> {
        Self::launch(tag, node, extra, None, env)
    }

    fn launch(
        tag: &str,
        node: &Node,
        extra: &[&str],
        nofile: Option<(u64, u64)>,
        env: &[(&str, &str)],
    ) -> anyhow::Result<Self> {
        let mut agent = Self {
            child: None,
            instance: format!("{tag}-agent"),
            bpffs: BpffsDir::new(tag)?,
            state: TempDir::new(tag)?,
            log: PathBuf::new(),
            cgroup: node.cgroup().path().to_path_buf(),
            extra: extra.iter().map(|s| (*s).to_owned()).collect(),
            nofile,
            env: env
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            endpoints: Endpoints::default(),
        };
        agent.log = agent.state.path().join("agent.log");
        agent.spawn()?;
        Ok(agent)
    }

    /// Starts an agent in standalone mode on `node`: it enrolls the pods
    /// `config` places on `node_name` and takes certificates from the CA in
    /// `ca` (generated on first start; agents of one mesh share it).
    pub fn standalone(
        tag: &str,
        node: &Node,
        node_name: &str,
        config: &Path,
        ca: &Path,
        extra: &[&str],
    ) -> anyhow::Result<Self> {
        Self::standalone_with_nofile(tag, node, node_name, config, ca, extra, None)
    }

    /// As [`Agent::standalone`], with the file descriptor limit `(soft,
    /// hard)` set for the agent process, if given.
    pub fn standalone_with_nofile(
        tag: &str,
        node: &Node,
        node_name: &str,
        config: &Path,
        ca: &Path,
        extra: &[&str],
        nofile: Option<(u64, u64)>,
    ) -> anyhow::Result<Self> {
        let (config, ca) = (config.display().to_string(), ca.display().to_string());
        let mut args = vec![
            "--config",
            config.as_str(),
            "--node",
            node_name,
            "--ca-dir",
            ca.as_str(),
        ];
        args.extend_from_slice(extra);
        Self::start_with_nofile(tag, node, &args, nofile)
    }

    fn spawn(&mut self) -> anyhow::Result<()> {
        self.child = Some(self.spawn_child()?);
        self.wait_ready()?;
        self.endpoints = self.status()?.endpoints;
        Ok(())
    }

    /// Starts the agent process (its log appended to the agent's log).
    fn spawn_child(&self) -> anyhow::Result<Child> {
        let log = File::options().create(true).append(true).open(&self.log)?;
        let mut cmd = Command::new(agent_binary()?);
        cmd.arg("run")
            .arg("--instance")
            .arg(&self.instance)
            .arg("--bpffs")
            .arg(self.bpffs.path())
            .arg("--state-dir")
            .arg(self.state.path())
            .arg("--cgroup")
            .arg(&self.cgroup)
            .args(&self.extra)
            .env("RUST_LOG", "info")
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::null())
            .stderr(log);
        if !self.extra.iter().any(|a| a == "--on-exit") {
            cmd.args(["--on-exit", "detach"]);
        }
        // Parallel agents on one host cannot all have 15021, 15020, 15000.
        for flag in ["--readiness-addr", "--metrics-addr", "--admin-addr"] {
            if !self.extra.iter().any(|a| a == flag) {
                cmd.args([flag, "127.0.0.1:0"]);
            }
        }
        if let Some((soft, hard)) = self.nofile {
            let limit = libc::rlimit {
                rlim_cur: soft,
                rlim_max: hard,
            };
            // SAFETY: setrlimit is async-signal-safe and only reads the
            // struct, copied into the closure before the fork.
            unsafe {
                cmd.pre_exec(move || {
                    if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        Ok(cmd.spawn()?)
    }

    /// The agent's status report (`dataplane status --json`).
    pub fn status(&self) -> anyhow::Result<StatusReport> {
        let response = self.call(&Request::Status)?;
        anyhow::ensure!(response.ok, "status refused: {:?}", response.error);
        Ok(serde_json::from_value(response.report.unwrap_or_default())?)
    }

    /// What its status report says of the pod named `name`.
    pub fn pod_status(&self, name: &str) -> anyhow::Result<PodCaptureState> {
        self.status()?
            .pods
            .into_iter()
            .find(|p| p.name == name)
            .ok_or_else(|| anyhow::anyhow!("status lists no pod `{name}`"))
    }

    /// The workload certificates it holds (`dataplane certs --json`).
    pub fn certs(&self) -> anyhow::Result<Vec<CertInfo>> {
        let response = self.call(&Request::Certs)?;
        anyhow::ensure!(response.ok, "certs refused: {:?}", response.error);
        Ok(serde_json::from_value(response.report.unwrap_or_default())?)
    }

    /// Whether the agent process has exited (on its own, e.g. after a
    /// drain); [`Agent::stop`] then returns its exit code.
    pub fn has_exited(&mut self) -> anyhow::Result<bool> {
        match self.child.as_mut() {
            Some(child) => Ok(child.try_wait()?.is_some()),
            None => Ok(true),
        }
    }

    /// Waits until the control socket answers.
    fn wait_ready(&mut self) -> anyhow::Result<()> {
        self.wait_answering("start-up", |agent| agent.call(&Request::List).is_ok())
    }

    /// Waits until `answered` holds, failing at once if the agent process
    /// exits, or after [`LIMIT`]; `during` names the wait in the error.
    fn wait_answering(
        &mut self,
        during: &str,
        answered: impl Fn(&Self) -> bool,
    ) -> anyhow::Result<()> {
        let deadline = Instant::now() + LIMIT;
        loop {
            if answered(self) {
                return Ok(());
            }
            if let Some(child) = self.child.as_mut()
                && let Some(status) = child.try_wait()?
            {
                anyhow::bail!(
                    "agent exited during {during} ({status}):\n{}",
                    self.log_text()
                );
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "agent not done with {during} in time:\n{}",
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Sends a control request.
    pub fn call(&self, request: &Request) -> anyhow::Result<Response> {
        let socket = control::socket_path(self.state.path(), &self.instance);
        Ok(control::call(&socket, request, LIMIT)?)
    }

    /// Enrolls a pod.
    pub fn enroll(&self, spec: PodSpec) -> anyhow::Result<Response> {
        self.call(&Request::Add {
            pod: Box::new(spec),
        })
    }

    /// The agent's log so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Where the readiness endpoint listens.
    pub fn readiness_addr(&self) -> anyhow::Result<std::net::SocketAddr> {
        endpoint("readiness", self.endpoints.readiness)
    }

    /// Where the metrics endpoint listens.
    pub fn metrics_addr(&self) -> anyhow::Result<std::net::SocketAddr> {
        endpoint("metrics", self.endpoints.metrics)
    }

    /// Where the admin endpoint listens.
    pub fn admin_addr(&self) -> anyhow::Result<std::net::SocketAddr> {
        endpoint("admin", self.endpoints.admin)
    }

    /// The instance name.
    pub fn instance(&self) -> &str {
        &self.instance
    }

    /// The state directory (`--state-dir`).
    pub fn state_dir(&self) -> &Path {
        self.state.path()
    }

    /// The bpffs directory (`--bpffs`).
    pub fn bpffs(&self) -> &Path {
        self.bpffs.path()
    }

    /// One kernel counter of this instance.
    pub fn counter(&self, name: &str) -> anyhow::Result<u64> {
        crate::counters::one(&PinLayout::new(self.bpffs.path(), &self.instance), name)
    }

    /// SIGKILLs the agent (no cleanup runs), as a crash would.
    pub fn kill_hard(&mut self) -> anyhow::Result<()> {
        if let Some(mut child) = self.child.take() {
            child.kill()?;
            child.wait()?;
        }
        Ok(())
    }

    /// Starts the agent again with the same instance, pins and state.
    pub fn restart(&mut self) -> anyhow::Result<()> {
        self.kill_hard()?;
        self.spawn()
    }

    /// Upgrades in place: starts a new agent of the same instance with
    /// `--takeover`, waits until the control socket answers from it, then
    /// until the old one has drained and exited. The new one is this
    /// agent from then on.
    pub fn take_over(&mut self) -> anyhow::Result<TakeOver> {
        let mut old = self
            .child
            .take()
            .ok_or_else(|| anyhow::anyhow!("no agent is running to take over from"))?;
        let old_pid = old.id();
        self.extra.push("--takeover".to_owned());
        let spawned = self.spawn_child();
        self.extra.pop();
        self.child = Some(spawned?);
        let new_pid = self.pid().unwrap_or_default();
        let taken = self.wait_answering("the takeover", |agent| {
            agent.status().is_ok_and(|status| status.pid == new_pid)
        });
        if let Err(err) = taken {
            let _ = old.kill();
            let _ = old.wait();
            return Err(err);
        }
        let deadline = Instant::now() + LIMIT;
        let old_exit = loop {
            if let Some(status) = old.try_wait()? {
                break status.code();
            }
            if Instant::now() > deadline {
                let _ = old.kill();
                let _ = old.wait();
                anyhow::bail!(
                    "the old agent did not exit after the hand-over:\n{}",
                    self.log_text()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        self.endpoints = self.status()?.endpoints;
        Ok(TakeOver {
            old_pid,
            new_pid,
            old_exit,
        })
    }

    /// SIGTERMs the agent and returns its exit code.
    pub fn stop(&mut self) -> anyhow::Result<Option<i32>> {
        self.stop_within(LIMIT)
    }

    /// SIGTERMs the agent and returns its exit code, waiting up to `limit`
    /// for it to exit (a drain longer than the usual hang guard).
    pub fn stop_within(&mut self, limit: Duration) -> anyhow::Result<Option<i32>> {
        let Some(mut child) = self.child.take() else {
            return Ok(None);
        };
        // An agent that already exited (and was reaped by `has_exited`)
        // no longer owns its pid: signal only a running one.
        if let Some(status) = child.try_wait()? {
            return Ok(status.code());
        }
        let pid = nix::unistd::Pid::from_raw(child.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = child.try_wait()? {
                return Ok(status.code());
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                anyhow::bail!("agent ignored SIGTERM:\n{}", self.log_text());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The agent's process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// A pod spec for a namespace path that is not a test pod's, with one
    /// IPv4 address.
    pub fn spec_for_netns(netns: &str, name: &str, ip: &str) -> PodSpec {
        let mut spec = Self::spec_named(name, PathBuf::from(netns));
        spec.ips = ip.parse().into_iter().collect();
        spec
    }

    /// A pod spec for `pod` on this agent's node.
    pub fn spec_for(pod: &crate::topology::Pod, name: &str) -> PodSpec {
        let mut spec = Self::spec_named(name, pod.netns.path().to_path_buf());
        spec.ips = vec![pod.ip4.into(), pod.ip6.into()];
        spec.node_addr = Some(pod.node_side);
        spec
    }

    /// Pod `name` (uid `uid-<name>`, the mesh's namespace, the default
    /// service account) in `netns`, without addresses.
    fn spec_named(name: &str, netns: PathBuf) -> PodSpec {
        PodSpec {
            uid: format!("uid-{name}"),
            name: name.to_owned(),
            namespace: crate::mesh::NAMESPACE.to_owned(),
            service_account: "default".to_owned(),
            trust_domain: "cluster.local".to_owned(),
            netns,
            ips: Vec::new(),
            node_addr: None,
            exclusions: Default::default(),
            dns_capture: None,
            fast_path: None,
        }
    }
}

fn endpoint(
    name: &str,
    addr: Option<std::net::SocketAddr>,
) -> anyhow::Result<std::net::SocketAddr> {
    addr.ok_or_else(|| anyhow::anyhow!("the agent serves no {name} endpoint (see its status)"))
}

impl Drop for Agent {
    fn drop(&mut self) {
        if let Err(e) = self.stop() {
            eprintln!("cleanup: {e}");
        }
        // A test that killed the agent leaves pins; the BpffsDir guard
        // removes them, which detaches the links they hold.
    }
}
