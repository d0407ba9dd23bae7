//! A real Prometheus server (Debian's `prometheus`, which `cargo xtask
//! setup` installs) scraping test agents on loopback, queried through its
//! HTTP API as Grafana and Kiali query it.
//!
//! Each test runs its own process: its own config file, its own TSDB in a
//! temporary directory and a free loopback port, so neither a Debian
//! `prometheus.service` the init system may run (`:9090`,
//! `/var/lib/prometheus`) nor a parallel test is touched. The process is
//! killed on drop, before its directory is removed.

use std::{
    collections::BTreeMap,
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpListener, TcpStream},
    path::PathBuf,
    process::Command,
    time::{Duration, Instant},
};

use anyhow::Context as _;

use crate::{ChildGuard, TempDir, spawn_logged_in};

/// Guard against hangs (not a timing assertion): start-up, one query, and
/// waiting for a scrape to show a value.
const LIMIT: Duration = Duration::from_secs(60);

/// How often Prometheus scrapes the agents: short, so a test waits about
/// a second for a counter's final value.
pub const SCRAPE_INTERVAL: &str = "1s";

/// Start-ups tried before giving up (see [`Prometheus::start`]).
const START_ATTEMPTS: u32 = 3;

/// One agent to scrape: its metrics address and the target labels service
/// discovery would attach (as Kubernetes SD attaches `pod`, `namespace`).
#[derive(Debug, Clone)]
pub struct Target {
    /// `host:port` of `/metrics`.
    pub addr: SocketAddr,
    /// Extra target labels.
    pub labels: Vec<(String, String)>,
}

/// One series of an instant query's result: its labels and value.
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    /// The series' labels (without `__name__` when the query aggregated).
    pub labels: BTreeMap<String, String>,
    /// The value at the query's time.
    pub value: f64,
}

/// A running Prometheus, killed on drop.
#[derive(Debug)]
pub struct Prometheus {
    // Declared (so dropped) before `dir`: the process goes before its TSDB.
    _child: ChildGuard,
    addr: SocketAddr,
    log: PathBuf,
    dir: TempDir,
}

impl Prometheus {
    /// Starts Prometheus scraping `targets` (job `dataplane`) every
    /// [`SCRAPE_INTERVAL`] and waits until it is ready.
    pub fn start(tag: &str, targets: &[Target]) -> anyhow::Result<Self> {
        let dir = TempDir::new(tag)?;
        let config = dir.path().join("prometheus.yml");
        std::fs::write(&config, scrape_config(targets))?;
        let log = dir.path().join("prometheus.log");
        let mut attempt = 0;
        loop {
            attempt += 1;
            // A free port, released for Prometheus to bind (it cannot be
            // handed a socket): a parallel test's socket can take it in
            // between, and Prometheus then exits at start-up. That is the
            // only way it exits there with a config known to be good, so
            // it is retried on another port.
            let addr = TcpListener::bind("127.0.0.1:0")?.local_addr()?;
            let mut cmd = Command::new(binary()?);
            cmd.arg(format!("--config.file={}", config.display()))
                .arg(format!(
                    "--storage.tsdb.path={}",
                    dir.path().join(format!("data-{attempt}")).display()
                ))
                .arg(format!("--web.listen-address={addr}"))
                .arg("--log.level=warn");
            let mut child = spawn_logged_in(cmd, None, None, &log)?;
            match wait_ready(&mut child, addr) {
                Ok(()) => {
                    return Ok(Self {
                        _child: child,
                        addr,
                        log,
                        dir,
                    });
                }
                Err(StartFailure::Exited) if attempt < START_ATTEMPTS => {}
                Err(failure) => {
                    let log = std::fs::read_to_string(&log).unwrap_or_default();
                    anyhow::bail!("prometheus on {addr} {failure} (attempt {attempt}): {log}");
                }
            }
        }
    }

    /// The server's log (for failure messages).
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The working directory (config, TSDB, log).
    pub fn dir(&self) -> &std::path::Path {
        self.dir.path()
    }

    /// Runs `promql` as an instant query (`/api/v1/query`) and returns the
    /// vector, or Prometheus' error (a query that does not parse, say).
    pub fn query(&self, promql: &str) -> anyhow::Result<Vec<Series>> {
        let path = format!("/api/v1/query?query={}", percent_encode(promql));
        let (status, body) = get(self.addr, &path)?;
        let reply: serde_json::Value = serde_json::from_str(&body)
            .with_context(|| format!("prometheus answered {status} with {body:?}"))?;
        anyhow::ensure!(
            reply["status"] == "success",
            "prometheus refused {promql:?} ({status}): {} {}",
            reply["errorType"],
            reply["error"]
        );
        let data = &reply["data"];
        anyhow::ensure!(
            data["resultType"] == "vector",
            "{promql:?} is not an instant vector: {data}"
        );
        let result = data["result"]
            .as_array()
            .with_context(|| format!("no result in {data}"))?;
        result.iter().map(series).collect()
    }

    /// Polls `promql` until its vector is `want` (compared as sorted sets)
    /// or the hang guard trips; returns the last answer either way.
    pub fn wait_for(&self, promql: &str, want: &[Series]) -> anyhow::Result<Vec<Series>> {
        let deadline = Instant::now() + LIMIT;
        let want = sorted(want.to_vec());
        loop {
            let have = sorted(self.query(promql)?);
            if have == want || Instant::now() > deadline {
                return Ok(have);
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

/// Why a start-up did not give a ready server.
#[derive(Debug)]
enum StartFailure {
    /// The process exited (its port taken, as the log says).
    Exited,
    /// Still running but not ready within [`LIMIT`].
    NotReady,
}

impl std::fmt::Display for StartFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Exited => "exited at start-up",
            Self::NotReady => "was not ready in time",
        })
    }
}

/// Waits until the server at `addr` answers `/-/ready`, or `child` exits.
fn wait_ready(child: &mut ChildGuard, addr: SocketAddr) -> Result<(), StartFailure> {
    let deadline = Instant::now() + LIMIT;
    loop {
        if !child.is_running() {
            return Err(StartFailure::Exited);
        }
        if matches!(get(addr, "/-/ready"), Ok((200, _))) {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(StartFailure::NotReady);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `series` sorted by labels, so that two results compare as sets.
pub fn sorted(mut series: Vec<Series>) -> Vec<Series> {
    series.sort_by(|a, b| a.labels.cmp(&b.labels));
    series
}

/// A series with `labels` and `value`.
pub fn series_of(labels: &[(&str, &str)], value: f64) -> Series {
    Series {
        labels: labels
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
        value,
    }
}

/// The Debian package's binary, or `prometheus` on `PATH`.
fn binary() -> anyhow::Result<PathBuf> {
    let debian = PathBuf::from("/usr/bin/prometheus");
    if debian.exists() {
        return Ok(debian);
    }
    std::env::var_os("PATH")
        .and_then(|paths| {
            std::env::split_paths(&paths)
                .map(|dir| dir.join("prometheus"))
                .find(|path| path.exists())
        })
        .context("prometheus is not installed: run `cargo xtask setup` (Debian's `prometheus`)")
}

/// The config file: one job over every target, scraped every
/// [`SCRAPE_INTERVAL`].
fn scrape_config(targets: &[Target]) -> String {
    let mut text = format!(
        "global:\n  scrape_interval: {SCRAPE_INTERVAL}\n  scrape_timeout: {SCRAPE_INTERVAL}\n\
         scrape_configs:\n  - job_name: dataplane\n    static_configs:\n"
    );
    for target in targets {
        text.push_str(&format!("      - targets: ['{}']\n", target.addr));
        if !target.labels.is_empty() {
            text.push_str("        labels:\n");
            for (key, value) in &target.labels {
                text.push_str(&format!("          {key}: '{value}'\n"));
            }
        }
    }
    text
}

/// One result entry: `{"metric": {...}, "value": [time, "number"]}`.
fn series(entry: &serde_json::Value) -> anyhow::Result<Series> {
    let labels = entry["metric"]
        .as_object()
        .with_context(|| format!("no labels in {entry}"))?
        .iter()
        .map(|(k, v)| {
            Ok((
                k.clone(),
                v.as_str().context("label not a string")?.to_owned(),
            ))
        })
        .collect::<anyhow::Result<_>>()?;
    let value = entry["value"][1]
        .as_str()
        .with_context(|| format!("no value in {entry}"))?
        .parse()?;
    Ok(Series { labels, value })
}

/// `GET path` over HTTP/1.0, which Prometheus' Go server answers without
/// chunked encoding, so the body is everything after the head.
fn get(addr: SocketAddr, path: &str) -> anyhow::Result<(u16, String)> {
    let mut conn = TcpStream::connect_timeout(&addr, LIMIT)?;
    conn.set_read_timeout(Some(LIMIT))?;
    write!(conn, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
    let mut reply = String::new();
    conn.read_to_string(&mut reply)?;
    let (head, body) = reply
        .split_once("\r\n\r\n")
        .with_context(|| format!("no HTTP head in {reply:?}"))?;
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("no status in {head:?}"))?;
    Ok((status, body.to_owned()))
}

/// Percent-encodes all but RFC 3986's unreserved characters.
fn percent_encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len() * 3);
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || b"-_.~".contains(&byte) {
            out.push(byte as char);
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queries_are_encoded_whole() {
        assert_eq!(
            percent_encode(r#"sum(x{a=~"b|c"}[1m])"#),
            "sum%28x%7Ba%3D~%22b%7Cc%22%7D%5B1m%5D%29"
        );
    }
}
