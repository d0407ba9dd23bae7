//! An agent (`dataplane run`) for one simulated node, in a cgroup of its
//! own so that `cpu.stat` tells exactly what it costs, logging warnings
//! only (one access-log line per connection would be measured too).
//! Stopped with SIGTERM (kernel state detached) and cleaned up on drop.

use std::{
    fs::File,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use dataplane_user::control::{self, Request};

use super::{probe, process::join_on_exec};
use crate::{BpffsDir, Cgroup, TempDir};

/// Start-up and shutdown guard (not a timing assertion).
const LIMIT: Duration = Duration::from_secs(30);

/// A running agent.
#[derive(Debug)]
pub struct MeasuredAgent {
    // Field order is drop order: the process goes before its cgroup and
    // the directories it uses.
    child: Option<Child>,
    cgroup: Cgroup,
    bpffs: BpffsDir,
    state: TempDir,
    instance: String,
    log: PathBuf,
}

impl MeasuredAgent {
    /// Starts `binary run` for the node whose cgroup is `node_cgroup`, with
    /// `extra` arguments, and waits until its control socket lists
    /// `expected_pods` pods.
    pub fn start(
        binary: &Path,
        tag: &str,
        node_cgroup: &Path,
        extra: &[String],
        expected_pods: usize,
    ) -> anyhow::Result<Self> {
        let cgroup = Cgroup::new(tag)?;
        let bpffs = BpffsDir::new(tag)?;
        let state = TempDir::new(tag)?;
        let instance = format!("{tag}-agent");
        let log = state.path().join("agent.log");
        let mut cmd = Command::new(binary);
        cmd.arg("run")
            .arg("--instance")
            .arg(&instance)
            .arg("--bpffs")
            .arg(bpffs.path())
            .arg("--state-dir")
            .arg(state.path())
            .arg("--cgroup")
            .arg(node_cgroup)
            .args(["--on-exit", "detach"])
            // Several agents share the host: no fixed endpoint ports.
            .args(["--readiness-addr", "127.0.0.1:0"])
            .args(["--metrics-addr", "127.0.0.1:0"])
            .args(["--admin-addr", "127.0.0.1:0"])
            .args(extra)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(File::create(&log)?);
        join_on_exec(&mut cmd, None, Some(cgroup.path()))?;
        let child = cmd.spawn()?;
        let mut agent = Self {
            child: Some(child),
            cgroup,
            bpffs,
            state,
            instance,
            log,
        };
        agent.wait_ready(expected_pods)?;
        Ok(agent)
    }

    fn wait_ready(&mut self, expected_pods: usize) -> anyhow::Result<()> {
        let socket = control::socket_path(self.state.path(), &self.instance);
        let deadline = Instant::now() + LIMIT;
        loop {
            super::signal::check()?;
            if let Ok(response) = control::call(&socket, &Request::List, LIMIT)
                && response.pods.len() >= expected_pods
            {
                return Ok(());
            }
            if let Some(child) = self.child.as_mut()
                && let Some(status) = child.try_wait()?
            {
                anyhow::bail!(
                    "agent exited during start-up ({status}):\n{}",
                    self.log_text()
                );
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "agent did not enroll {expected_pods} pods:\n{}",
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The agent's control socket.
    pub fn control_socket(&self) -> PathBuf {
        control::socket_path(self.state.path(), &self.instance)
    }

    /// The agent's process id.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Whether it has not exited.
    pub fn is_running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// CPU time its cgroup used so far, in microseconds.
    pub fn cpu_usec(&self) -> anyhow::Result<u64> {
        probe::cgroup_cpu_usec(self.cgroup.path())
    }

    /// Its resident memory, in bytes.
    pub fn rss(&self) -> anyhow::Result<u64> {
        let pid = self
            .pid()
            .ok_or_else(|| anyhow::anyhow!("agent not running"))?;
        probe::rss_bytes(pid)
    }

    /// Its bpffs directory (`--bpffs`), for `dataplane redirect stats`.
    pub fn bpffs(&self) -> &Path {
        self.bpffs.path()
    }

    /// Its log so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Stops it with SIGTERM (kernel state detached); SIGKILL after the
    /// guard.
    pub fn stop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let pid = nix::unistd::Pid::from_raw(child.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let deadline = Instant::now() + LIMIT;
        while matches!(child.try_wait(), Ok(None)) {
            if Instant::now() > deadline {
                let _ = child.kill();
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = child.wait();
    }
}

impl Drop for MeasuredAgent {
    fn drop(&mut self) {
        self.stop();
        // The BpffsDir guard removes any pin left (which detaches links).
    }
}
