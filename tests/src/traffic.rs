//! Traffic inside test pods: the `dp-stream` client run in a pod, and
//! servers bound inside a pod's network namespace.

use std::{
    io::Read,
    net::{SocketAddr, TcpListener},
    process::Command,
    time::{Duration, Instant},
};

use crate::{Responder, process::target_binary, spawn_in, topology::Pod};

/// Guard against hangs (not a timing assertion).
const LIMIT: Duration = Duration::from_secs(60);

/// What a `dp-stream` run ended with.
#[derive(Debug)]
pub struct StreamOutcome {
    /// Exit code.
    pub code: Option<i32>,
    /// Its stdout, trimmed.
    pub stdout: String,
    /// Its stderr.
    pub stderr: String,
}

/// Runs `dp-stream ARGS` inside `pod` (its netns and cgroup), whatever the
/// outcome.
pub fn try_stream(pod: &Pod, args: &[&str]) -> anyhow::Result<StreamOutcome> {
    let mut cmd = Command::new(target_binary(
        "dp-stream",
        "cargo builds it with this package's tests",
    )?);
    cmd.args(args);
    let out = spawn_in(cmd, Some(pod.netns.path()), Some(pod.cgroup.path()))?.wait(LIMIT)?;
    Ok(StreamOutcome {
        code: out.code,
        stdout: out.stdout.trim().to_owned(),
        stderr: out.stderr,
    })
}

/// Runs `dp-stream ARGS` inside `pod` and requires success.
pub fn stream(pod: &Pod, args: &[&str]) -> anyhow::Result<String> {
    let out = try_stream(pod, args)?;
    anyhow::ensure!(
        out.code == Some(0),
        "dp-stream {args:?} failed: {}",
        out.stderr
    );
    Ok(out.stdout)
}

/// `dp-stream echo` of `bytes` to `dst` from `pod`; requires an exact echo.
pub fn echo(pod: &Pod, dst: SocketAddr, bytes: usize, seed: u64) -> anyhow::Result<()> {
    let out = stream(
        pod,
        &[
            "echo",
            &dst.to_string(),
            &bytes.to_string(),
            &seed.to_string(),
        ],
    )?;
    anyhow::ensure!(
        out == format!("ok {bytes}"),
        "unexpected dp-stream output {out}"
    );
    Ok(())
}

/// An echo server on `[::]:port` inside `pod`: answers each connection with
/// exactly what it received, after the client half-closes.
pub fn echo_server(pod: &Pod, port: u16) -> anyhow::Result<Responder> {
    let listener = pod
        .netns
        .run(move || TcpListener::bind(SocketAddr::from(([0u16; 8], port))))??;
    Responder::start(listener, |req| req.body.clone())
}

/// A server on `[::]:port` inside `pod` that resets its first connection
/// after reading one byte.
pub fn resetting_server(pod: &Pod, port: u16) -> anyhow::Result<std::thread::JoinHandle<()>> {
    let listener = pod
        .netns
        .run(move || TcpListener::bind(SocketAddr::from(([0u16; 8], port))))??;
    Ok(std::thread::spawn(move || {
        if let Ok((mut stream, _)) = listener.accept() {
            let mut one = [0u8; 1];
            let _ = stream.read(&mut one);
            let _ = socket2::SockRef::from(&stream).set_linger(Some(Duration::ZERO));
        }
    }))
}

/// Polls `done` until it holds or the hang guard trips.
pub fn wait_until(
    what: &str,
    mut done: impl FnMut() -> anyhow::Result<bool>,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + LIMIT;
    while !done()? {
        anyhow::ensure!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

/// A server on `[::]:port` inside `pod` that accepts one connection and
/// holds it open, never answering, until the peer (or whoever cuts the
/// connection) ends it. Gives up waiting after the hang guard.
pub fn holding_server(pod: &Pod, port: u16) -> anyhow::Result<std::thread::JoinHandle<()>> {
    let listener = pod
        .netns
        .run(move || TcpListener::bind(SocketAddr::from(([0u16; 8], port))))??;
    listener.set_nonblocking(true)?;
    Ok(std::thread::spawn(move || {
        let deadline = Instant::now() + LIMIT;
        while Instant::now() < deadline {
            match listener.accept() {
                Ok((mut stream, _)) => {
                    let _ = stream.set_nonblocking(false);
                    let _ = stream.set_read_timeout(Some(LIMIT));
                    let mut buf = [0u8; 1024];
                    while matches!(stream.read(&mut buf), Ok(n) if n > 0) {}
                    return;
                }
                Err(_) => std::thread::sleep(Duration::from_millis(10)),
            }
        }
    }))
}

/// One HTTP/1.1 request without a body to one of the agent's endpoints
/// (readiness, metrics, admin): returns the status code and the body.
pub fn http(addr: SocketAddr, method: &str, path: &str) -> anyhow::Result<(u16, String)> {
    let (status, body) = http_bytes(addr, method, path)?;
    Ok((status, String::from_utf8(body)?))
}

/// [`http`], the body as bytes (a profile, say).
pub fn http_bytes(addr: SocketAddr, method: &str, path: &str) -> anyhow::Result<(u16, Vec<u8>)> {
    use std::io::Write as _;
    let mut conn = std::net::TcpStream::connect_timeout(&addr, LIMIT)?;
    conn.set_read_timeout(Some(LIMIT))?;
    write!(
        conn,
        "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    )?;
    let mut reply = Vec::new();
    conn.read_to_end(&mut reply)?;
    let split = reply
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| anyhow::anyhow!("no HTTP head in {:?}", String::from_utf8_lossy(&reply)))?;
    let head = String::from_utf8_lossy(&reply[..split]);
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no status in {head:?}"))?;
    Ok((status, reply[split + 4..].to_vec()))
}
