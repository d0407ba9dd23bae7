//! Two-way transfers that report how each direction ended, on both ends:
//! the client is `dp-stream transfer` run inside a pod, the server a
//! thread whose socket lives in a pod. Each end sends its own
//! deterministic byte stream (optionally paced, so that a kill or a
//! deadline lands mid-transfer), half-closes, and reads the other's to the
//! end, checking every byte.
//!
//! What an end reports for a direction is an [`Ended`]: the peer's FIN
//! after `n` bytes, a reset, or another failure. Tests of abnormal ends
//! require a reset where a clean FIN short of the full length is what an
//! application could not tell from success; tests of clean half-closes
//! require every byte and a FIN.

use std::{
    fmt,
    io::{ErrorKind, Read, Write},
    net::{Shutdown, SocketAddr, TcpListener, TcpStream},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use crate::{topology::Pod, traffic::try_stream};

/// Guard against hangs (not a timing assertion): how long an accept, a
/// read or a write may wait.
const LIMIT: Duration = Duration::from_secs(30);

/// Bytes per write (and largest read).
const CHUNK: usize = 64 * 1024;

/// The client's stream seed; the server checks what it reads against it.
const CLIENT_SEED: u64 = 0x00c1_1e47;
/// The server's stream seed.
const SERVER_SEED: u64 = 0x005e_4e72;

/// The byte stream one end sends (xorshift64): both ends generate it, so
/// the reader checks every byte without keeping a copy.
#[derive(Debug, Clone)]
pub struct Payload {
    state: u64,
}

impl Payload {
    /// The stream for `seed`.
    pub fn new(seed: u64) -> Self {
        Self { state: seed | 1 }
    }

    /// Fills `buf` with the stream's next bytes.
    pub fn fill(&mut self, buf: &mut [u8]) {
        for byte in buf {
            self.state ^= self.state << 13;
            self.state ^= self.state >> 7;
            self.state ^= self.state << 17;
            *byte = (self.state >> 24) as u8;
        }
    }
}

/// What one end sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Plan {
    /// Bytes to send before half-closing.
    pub send: u64,
    /// Pause after each 64 KiB written (zero: as fast as the peer takes
    /// them).
    pub pace: Duration,
    /// Send only once the peer's stream has ended cleanly (a request
    /// half-closed before its response).
    pub after_eof: bool,
}

impl Plan {
    /// Sends nothing and half-closes at once.
    pub const NOTHING: Self = Self {
        send: 0,
        pace: Duration::ZERO,
        after_eof: false,
    };

    /// `send` bytes as fast as the peer takes them.
    pub fn bytes(send: u64) -> Self {
        Self {
            send,
            ..Self::NOTHING
        }
    }

    /// `send` bytes, pausing `pace` after each 64 KiB.
    pub fn paced(send: u64, pace: Duration) -> Self {
        Self {
            send,
            pace,
            after_eof: false,
        }
    }

    /// The same, sent only after the peer half-closed.
    pub fn after_eof(self) -> Self {
        Self {
            after_eof: true,
            ..self
        }
    }
}

/// How one direction ended, as one end saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ended {
    /// Reading: the peer's FIN after `n` bytes, every one as sent.
    /// Writing: `n` bytes written and the direction half-closed.
    Clean(u64),
    /// ECONNRESET (or, writing, EPIPE) after `n` bytes.
    Reset(u64),
    /// Anything else after `n` bytes: a timeout, a wrong byte, ...
    Failed(u64, String),
}

impl Ended {
    /// Whether this is a reset.
    pub fn is_reset(&self) -> bool {
        matches!(self, Self::Reset(_))
    }
}

impl fmt::Display for Ended {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Clean(n) => write!(f, "clean {n}"),
            Self::Reset(n) => write!(f, "reset {n}"),
            Self::Failed(n, why) => write!(f, "failed {n} {why}"),
        }
    }
}

impl std::str::FromStr for Ended {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> anyhow::Result<Self> {
        let mut parts = s.splitn(3, ' ');
        let kind = parts.next().unwrap_or_default();
        let n: u64 = parts
            .next()
            .ok_or_else(|| anyhow::anyhow!("no byte count in {s:?}"))?
            .parse()?;
        match kind {
            "clean" => Ok(Self::Clean(n)),
            "reset" => Ok(Self::Reset(n)),
            "failed" => Ok(Self::Failed(n, parts.next().unwrap_or_default().to_owned())),
            _ => anyhow::bail!("unknown ending {s:?}"),
        }
    }
}

/// How both directions ended at one end.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    /// What this end read.
    pub read: Ended,
    /// What this end wrote.
    pub write: Ended,
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "read {}\nwrite {}", self.read, self.write)
    }
}

impl std::str::FromStr for Outcome {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> anyhow::Result<Self> {
        let line = |prefix: &str| -> anyhow::Result<Ended> {
            s.lines()
                .find_map(|l| l.strip_prefix(prefix))
                .ok_or_else(|| anyhow::anyhow!("no {prefix:?} line in {s:?}"))?
                .parse()
        };
        Ok(Self {
            read: line("read ")?,
            write: line("write ")?,
        })
    }
}

/// Bytes moved so far, readable while the transfer runs.
#[derive(Debug, Default)]
pub struct Progress {
    read: AtomicU64,
    written: AtomicU64,
}

impl Progress {
    /// Bytes read so far.
    pub fn read(&self) -> u64 {
        self.read.load(Ordering::Relaxed)
    }

    /// Bytes written so far (taken by the kernel).
    pub fn written(&self) -> u64 {
        self.written.load(Ordering::Relaxed)
    }
}

/// Runs one end of a transfer on `stream`: sends `plan` with `send_seed`'s
/// bytes and reads the peer's stream (`recv_seed`) to its end.
pub fn run_end(
    stream: &TcpStream,
    plan: Plan,
    send_seed: u64,
    recv_seed: u64,
    progress: &Progress,
) -> std::io::Result<Outcome> {
    stream.set_read_timeout(Some(LIMIT))?;
    stream.set_write_timeout(Some(LIMIT))?;
    if plan.after_eof {
        let read = read_all(stream, recv_seed, progress);
        let write = match read {
            Ended::Clean(_) => write_all(stream, plan, send_seed, progress),
            _ => Ended::Failed(0, "not sent: the peer's stream did not end cleanly".into()),
        };
        return Ok(Outcome { read, write });
    }
    let writer = stream.try_clone()?;
    std::thread::scope(|scope| {
        let write = scope.spawn(|| write_all(&writer, plan, send_seed, progress));
        let read = read_all(stream, recv_seed, progress);
        let write = write
            .join()
            .unwrap_or_else(|_| Ended::Failed(0, "writer panicked".into()));
        Ok(Outcome { read, write })
    })
}

fn write_all(mut stream: &TcpStream, plan: Plan, seed: u64, progress: &Progress) -> Ended {
    let mut payload = Payload::new(seed);
    let mut buf = vec![0u8; CHUNK];
    let mut sent = 0u64;
    while sent < plan.send {
        let len = (plan.send - sent).min(CHUNK as u64) as usize;
        payload.fill(&mut buf[..len]);
        if let Err(e) = stream.write_all(&buf[..len]) {
            return ended_by(e, sent);
        }
        sent += len as u64;
        progress.written.store(sent, Ordering::Relaxed);
        if !plan.pace.is_zero() {
            std::thread::sleep(plan.pace);
        }
    }
    match stream.shutdown(Shutdown::Write) {
        Ok(()) => Ended::Clean(sent),
        Err(e) => ended_by(e, sent),
    }
}

fn read_all(mut stream: &TcpStream, seed: u64, progress: &Progress) -> Ended {
    let mut payload = Payload::new(seed);
    let mut buf = vec![0u8; CHUNK];
    let mut expected = vec![0u8; CHUNK];
    let mut got = 0u64;
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return Ended::Clean(got),
            Ok(n) => {
                payload.fill(&mut expected[..n]);
                if let Some(at) = buf[..n].iter().zip(&expected).position(|(a, b)| a != b) {
                    return Ended::Failed(got, format!("byte {} differs", got + at as u64));
                }
                got += n as u64;
                progress.read.store(got, Ordering::Relaxed);
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return ended_by(e, got),
        }
    }
}

fn ended_by(err: std::io::Error, n: u64) -> Ended {
    match err.kind() {
        ErrorKind::ConnectionReset | ErrorKind::BrokenPipe => Ended::Reset(n),
        ErrorKind::WouldBlock | ErrorKind::TimedOut => Ended::Failed(n, "timed out".into()),
        _ => Ended::Failed(n, err.to_string()),
    }
}

/// The client end, run by `dp-stream transfer` inside its pod.
pub fn client_end(addr: SocketAddr, plan: Plan) -> std::io::Result<Outcome> {
    let stream = TcpStream::connect_timeout(&addr, LIMIT)?;
    run_end(
        &stream,
        plan,
        CLIENT_SEED,
        SERVER_SEED,
        &Progress::default(),
    )
}

/// Runs the client end in `pod` toward `dst` (`dp-stream transfer`) and
/// returns how it ended.
pub fn transfer(pod: &Pod, dst: SocketAddr, plan: Plan) -> anyhow::Result<Outcome> {
    let out = try_stream(
        pod,
        &[
            "transfer",
            &dst.to_string(),
            &plan.send.to_string(),
            &plan.pace.as_micros().to_string(),
            if plan.after_eof {
                "after-eof"
            } else {
                "at-once"
            },
        ],
    )?;
    anyhow::ensure!(
        out.code == Some(0),
        "dp-stream transfer to {dst} failed: {}",
        out.stderr
    );
    out.stdout.parse()
}

/// The server end: accepts one connection on `[::]:port` inside a pod and
/// runs [`run_end`] on it in a thread. Dropping it cuts a transfer still
/// under way and joins the thread.
#[derive(Debug)]
pub struct TransferServer {
    progress: Arc<Progress>,
    stop: Arc<AtomicBool>,
    conn: Arc<Mutex<Option<TcpStream>>>,
    thread: Option<JoinHandle<anyhow::Result<Outcome>>>,
}

impl TransferServer {
    /// Listens on `[::]:port` in `pod` and serves one connection with
    /// `plan`.
    pub fn start(pod: &Pod, port: u16, plan: Plan) -> anyhow::Result<Self> {
        let listener = pod
            .netns
            .run(move || TcpListener::bind(SocketAddr::from(([0u16; 8], port))))??;
        listener.set_nonblocking(true)?;
        let progress = Arc::new(Progress::default());
        let stop = Arc::new(AtomicBool::new(false));
        let conn = Arc::new(Mutex::new(None));
        let thread = {
            let (progress, stop, conn) =
                (Arc::clone(&progress), Arc::clone(&stop), Arc::clone(&conn));
            std::thread::spawn(move || -> anyhow::Result<Outcome> {
                let deadline = Instant::now() + 2 * LIMIT;
                let stream = loop {
                    match listener.accept() {
                        Ok((stream, _)) => break stream,
                        Err(e) if e.kind() == ErrorKind::WouldBlock => {
                            anyhow::ensure!(
                                !stop.load(Ordering::Relaxed),
                                "stopped before a connection came"
                            );
                            anyhow::ensure!(
                                Instant::now() < deadline,
                                "no connection came to port {port}"
                            );
                            std::thread::sleep(Duration::from_millis(5));
                        }
                        Err(e) => return Err(e.into()),
                    }
                };
                drop(listener);
                stream.set_nonblocking(false)?;
                if let Ok(mut slot) = conn.lock() {
                    *slot = Some(stream.try_clone()?);
                }
                Ok(run_end(&stream, plan, SERVER_SEED, CLIENT_SEED, &progress)?)
            })
        };
        Ok(Self {
            progress,
            stop,
            conn,
            thread: Some(thread),
        })
    }

    /// Bytes the server has read so far.
    pub fn read(&self) -> u64 {
        self.progress.read()
    }

    /// Bytes the server has written so far.
    pub fn written(&self) -> u64 {
        self.progress.written()
    }

    /// Waits for the server's end to finish and returns how it ended.
    pub fn finish(mut self) -> anyhow::Result<Outcome> {
        let thread = self
            .thread
            .take()
            .ok_or_else(|| anyhow::anyhow!("server already finished"))?;
        thread
            .join()
            .map_err(|_| anyhow::anyhow!("transfer server panicked"))?
    }
}

impl Drop for TransferServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Ok(slot) = self.conn.lock()
            && let Some(conn) = slot.as_ref()
        {
            let _ = conn.shutdown(Shutdown::Both);
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
