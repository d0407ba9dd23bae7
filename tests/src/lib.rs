//! Test harness for integration tests against the real kernel: network
//! namespaces, cgroups, bpffs directories and child processes, each owned by
//! a guard that removes it on drop, including when the test panics.
//!
//! Every name carries the prefix `dpt-` plus the test's tag, the process id
//! and a counter, so tests run in parallel (and in parallel test binaries)
//! without colliding, and anything left behind by a killed run is
//! attributed to its dead process and swept by the next test process.
//!
//! Traffic stays inside namespaces the tests create or on loopback.

pub mod agent;
pub mod app_tunnel;
pub mod bench;
pub mod capture;
pub mod cgroup;
pub mod chart;
pub mod cni;
pub mod cni_deploy;
pub mod cni_kubeapi;
pub mod counters;
pub mod dns;
pub mod external_proxy;
pub mod gateway;
pub mod istio_resources;
pub mod istiod;
pub mod istiod_kube;
pub mod istiod_serviceentry;
pub mod known_mesh;
pub mod kube_rbac;
pub mod mesh;
pub mod netns;
pub mod observe;
pub mod process;
pub mod prometheus;
pub mod proxy_protocol;
pub mod redirector_node;
pub mod responder;
pub mod stale;
pub mod stranger;
pub mod topology;
pub mod traffic;
pub mod transfer;
pub mod upgrade;
pub mod waypoint;
pub mod zds_client;
pub mod ztunnel;
pub mod ztunnel_client;

use std::{
    path::{Path, PathBuf},
    sync::atomic::{AtomicU32, Ordering},
};

pub use agent::Agent;
pub use cgroup::Cgroup;
pub use netns::Netns;
pub use process::{
    ChildGuard, agent_binary, probe_binary, spawn_in, spawn_in_passing, spawn_logged_in,
};
pub use responder::Responder;

/// A name unique to this process and call: `dpt-<tag>-<pid>-<n>`.
/// The first call sweeps what killed test processes left behind
/// ([`stale`]).
pub fn unique_name(tag: &str) -> String {
    stale::sweep_once();
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    format!("dpt-{tag}-{}-{n}", std::process::id())
}

/// A temporary directory the test owns: `/tmp/dpt-<tag>-...`, removed
/// recursively on drop.
#[derive(Debug)]
pub struct TempDir {
    path: PathBuf,
}

impl TempDir {
    /// Creates the directory.
    pub fn new(tag: &str) -> anyhow::Result<Self> {
        let path = std::env::temp_dir().join(unique_name(tag));
        std::fs::create_dir_all(&path)?;
        Ok(Self { path })
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// A directory on bpffs that the test owns; removed recursively on drop.
#[derive(Debug)]
pub struct BpffsDir {
    path: PathBuf,
}

impl BpffsDir {
    /// Creates `/sys/fs/bpf/<unique name>`.
    pub fn new(tag: &str) -> anyhow::Result<Self> {
        let path = Path::new("/sys/fs/bpf").join(unique_name(tag));
        std::fs::create_dir_all(&path).map_err(|e| {
            anyhow::anyhow!(
                "cannot create {} ({e}); is bpffs mounted? run `cargo xtask setup`",
                path.display()
            )
        })?;
        Ok(Self { path })
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for BpffsDir {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_dir_all(&self.path)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            eprintln!("cleanup: cannot remove {}: {e}", self.path.display());
        }
    }
}

/// Runs a command to completion and fails with its output if it fails.
pub fn run(program: &str, args: &[&str]) -> anyhow::Result<String> {
    let out = std::process::Command::new(program)
        .args(args)
        .output()
        .map_err(|e| anyhow::anyhow!("cannot run {program}: {e}"))?;
    if !out.status.success() {
        anyhow::bail!(
            "`{program} {}` failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
