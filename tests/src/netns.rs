//! A network namespace owned by a test (`ip netns add`), deleted on drop.

use std::path::{Path, PathBuf};

use crate::{run, unique_name};

/// A named network namespace with its loopback up.
#[derive(Debug)]
pub struct Netns {
    name: String,
    path: PathBuf,
}

impl Netns {
    /// Creates `dpt-<tag>-...` and brings its `lo` up.
    pub fn new(tag: &str) -> anyhow::Result<Self> {
        let name = unique_name(tag);
        run("ip", &["netns", "add", &name])?;
        let ns = Self {
            path: Path::new("/var/run/netns").join(&name),
            name,
        };
        ns.ip(&["link", "set", "lo", "up"])?;
        Ok(ns)
    }

    /// The namespace name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The namespace file (`/var/run/netns/<name>`).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Runs `ip -n <name> <args>`.
    pub fn ip(&self, args: &[&str]) -> anyhow::Result<String> {
        let mut full = vec!["-n", self.name.as_str()];
        full.extend_from_slice(args);
        run("ip", &full)
    }

    /// The namespace's established TCP sockets as `ss -tnopH` lists them
    /// (one line each: addresses, owning process, active timer).
    pub fn established_tcp(&self) -> anyhow::Result<Vec<String>> {
        let out = run(
            "ip",
            &[
                "netns",
                "exec",
                &self.name,
                "ss",
                "-tnopH",
                "state",
                "established",
            ],
        )?;
        Ok(out.lines().map(str::to_owned).collect())
    }

    /// Runs `f` on a thread inside the namespace; sockets it creates stay
    /// in the namespace.
    pub fn run<T, F>(&self, f: F) -> anyhow::Result<T>
    where
        T: Send + 'static,
        F: FnOnce() -> T + Send + 'static,
    {
        Ok(dataplane_user::netns::run_in_netns(&self.path, f)?)
    }

    /// The namespace's cookie, as the kernel programs see it.
    pub fn cookie(&self) -> anyhow::Result<u64> {
        Ok(dataplane_user::netns::netns_cookie_of_path(&self.path)?)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        if let Err(e) = run("ip", &["netns", "del", &self.name]) {
            eprintln!("cleanup: {e}");
        }
    }
}
