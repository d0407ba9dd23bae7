//! Strangers to the mesh attacking a node from a pod that is not enrolled:
//! a [`Flood`] of idle TCP connections to pods' HBONE ports, re-opened as
//! fast as the agent closes them, and [`StrangerTls`] clients that hold a
//! valid mesh certificate, finish TLS and then say nothing (or only part
//! of the HTTP/2 handshake).

use std::{
    io::{ErrorKind, Read, Write},
    net::{IpAddr, SocketAddr, TcpStream},
    os::fd::AsRawFd,
    path::PathBuf,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use dataplane_user::{
    identity::{Ca, CertSource, CertStore, Identity, TrustBundle},
    tls,
};
use socket2::{Domain, Socket, Type};

use crate::topology::Pod;

/// How long one flood connect may wait for the agent (its backlog may be
/// full; the flood then moves on and tries again).
const CONNECT_WAIT: Duration = Duration::from_millis(200);

/// Idle connections from inside a pod, from its source addresses to the
/// targets in turn (each pair alike; repeat an entry to weight it), held
/// open; each one the server closes is timed and opened again, until
/// [`Flood::stop`].
#[derive(Debug)]
pub struct Flood {
    stop: Arc<AtomicBool>,
    held: Arc<AtomicUsize>,
    opened: Arc<AtomicUsize>,
    thread: Option<JoinHandle<anyhow::Result<FloodReport>>>,
}

/// What a flood saw.
#[derive(Debug, Default, Clone)]
pub struct FloodReport {
    /// Connections established.
    pub opened: u64,
    /// Connects that failed or found the backlog full.
    pub connect_failures: u64,
    /// How long each connection the server ended (reset or closed) had
    /// been open.
    pub lifetimes: Vec<Duration>,
    /// Of those, how many ended with a reset.
    pub resets: u64,
    /// The most connections held at once.
    pub most_held: usize,
}

impl FloodReport {
    /// The `q` quantile (0..=1) of [`FloodReport::lifetimes`].
    pub fn lifetime_quantile(&self, q: f64) -> Option<Duration> {
        let mut sorted = self.lifetimes.clone();
        sorted.sort_unstable();
        let last = sorted.len().checked_sub(1)?;
        sorted.get(((last as f64) * q).round() as usize).copied()
    }
}

impl Flood {
    /// Starts holding `count` connections from `pod` (from `sources`, which
    /// must be the pod's addresses) to `targets`.
    pub fn start(
        pod: &Pod,
        sources: Vec<IpAddr>,
        targets: Vec<SocketAddr>,
        count: usize,
    ) -> anyhow::Result<Self> {
        anyhow::ensure!(
            !sources.is_empty() && !targets.is_empty(),
            "a flood needs sources and targets"
        );
        let stop = Arc::new(AtomicBool::new(false));
        let held = Arc::new(AtomicUsize::new(0));
        let opened = Arc::new(AtomicUsize::new(0));
        let netns: PathBuf = pod.netns.path().to_path_buf();
        let thread = {
            let counts = Counts {
                stop: Arc::clone(&stop),
                held: Arc::clone(&held),
                opened: Arc::clone(&opened),
            };
            std::thread::spawn(move || {
                dataplane_user::netns::run_in_netns(&netns, move || {
                    flood(&sources, &targets, count, &counts)
                })?
            })
        };
        Ok(Self {
            stop,
            held,
            opened,
            thread: Some(thread),
        })
    }

    /// Connections held now.
    pub fn held(&self) -> usize {
        self.held.load(Ordering::Relaxed)
    }

    /// Connections opened so far.
    pub fn opened(&self) -> usize {
        self.opened.load(Ordering::Relaxed)
    }

    /// Stops, closes every connection and reports.
    pub fn stop(mut self) -> anyhow::Result<FloodReport> {
        self.stop.store(true, Ordering::Relaxed);
        match self.thread.take() {
            Some(thread) => thread
                .join()
                .map_err(|_| anyhow::anyhow!("the flood thread panicked"))?,
            None => Ok(FloodReport::default()),
        }
    }
}

impl Drop for Flood {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// What the flood thread shares with the test.
struct Counts {
    stop: Arc<AtomicBool>,
    held: Arc<AtomicUsize>,
    opened: Arc<AtomicUsize>,
}

/// Runs inside the pod's namespace until `stop`.
fn flood(
    sources: &[IpAddr],
    targets: &[SocketAddr],
    count: usize,
    counts: &Counts,
) -> anyhow::Result<FloodReport> {
    let (stop, held) = (&counts.stop, &counts.held);
    let mut report = FloodReport::default();
    let mut open: Vec<Option<(TcpStream, Instant)>> = (0..count).map(|_| None).collect();
    let mut next = 0usize;
    while !stop.load(Ordering::Relaxed) {
        for slot in open.iter_mut().filter(|slot| slot.is_none()) {
            if stop.load(Ordering::Relaxed) {
                break;
            }
            // Every source meets every target: the lists may weight both.
            let source = sources[(next / targets.len()) % sources.len()];
            let target = targets[next % targets.len()];
            next = next.wrapping_add(1);
            match connect_from(source, target) {
                Ok(stream) => {
                    report.opened += 1;
                    counts.opened.fetch_add(1, Ordering::Relaxed);
                    *slot = Some((stream, Instant::now()));
                }
                Err(_) => report.connect_failures += 1,
            }
        }
        let now_held = open.iter().flatten().count();
        held.store(now_held, Ordering::Relaxed);
        report.most_held = report.most_held.max(now_held);
        reap_closed(&mut open, &mut report)?;
    }
    Ok(report)
}

fn connect_from(source: IpAddr, target: SocketAddr) -> std::io::Result<TcpStream> {
    let socket = Socket::new(Domain::for_address(target), Type::STREAM, None)?;
    socket.bind(&SocketAddr::new(source, 0).into())?;
    socket.connect_timeout(&target.into(), CONNECT_WAIT)?;
    socket.set_nonblocking(true)?;
    Ok(socket.into())
}

/// Waits a little for any held connection to end, and empties the slots
/// of those that did.
fn reap_closed(
    open: &mut [Option<(TcpStream, Instant)>],
    report: &mut FloodReport,
) -> anyhow::Result<()> {
    let mut fds: Vec<libc::pollfd> = Vec::with_capacity(open.len());
    let mut index = Vec::with_capacity(open.len());
    for (i, slot) in open.iter().enumerate() {
        if let Some((stream, _)) = slot {
            fds.push(libc::pollfd {
                fd: stream.as_raw_fd(),
                events: libc::POLLIN | libc::POLLRDHUP,
                revents: 0,
            });
            index.push(i);
        }
    }
    // SAFETY: `fds` is a valid array of `fds.len()` pollfd structs whose
    // descriptors stay open for the call.
    let ready = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 20) };
    if ready < 0 {
        let err = std::io::Error::last_os_error();
        anyhow::ensure!(err.kind() == ErrorKind::Interrupted, "poll: {err}");
        return Ok(());
    }
    for (pfd, i) in fds.iter().zip(index) {
        if pfd.revents == 0 {
            continue;
        }
        let Some((stream, since)) = open[i].as_mut() else {
            continue;
        };
        let mut buf = [0u8; 512];
        let ended = match stream.read(&mut buf) {
            Ok(0) => Some(false),
            Ok(_) => None,
            Err(e) if e.kind() == ErrorKind::WouldBlock => None,
            Err(e) => Some(e.kind() == ErrorKind::ConnectionReset),
        };
        if let Some(reset) = ended {
            report.lifetimes.push(since.elapsed());
            report.resets += u64::from(reset);
            open[i] = None;
        }
    }
    Ok(())
}

/// A certificate for a test identity from the mesh's own CA (the one the
/// agents created in `ca_dir`), as a stranger or a waypoint presents it.
pub struct MeshCredentials {
    /// `spiffe://cluster.local/ns/<namespace>/sa/<account>`.
    pub identity: Identity,
    /// The mesh root.
    pub roots: Arc<TrustBundle>,
    store: Arc<CertStore>,
}

impl MeshCredentials {
    /// Issues the identity's certificate (valid for an hour).
    pub fn issue(ca_dir: &std::path::Path, namespace: &str, account: &str) -> anyhow::Result<Self> {
        tls::install_provider();
        let ca = Arc::new(Ca::load_or_generate(ca_dir)?);
        let roots = Arc::new(TrustBundle::new(vec![ca.root_der().clone()])?);
        let store = Arc::new(CertStore::new(
            CertSource::Builtin(ca),
            Arc::clone(&roots),
            tls::provider(),
            Duration::from_secs(3600),
        ));
        let identity = Identity::new("cluster.local", namespace, account)?;
        store.get_or_issue(&identity)?;
        Ok(Self {
            identity,
            roots,
            store,
        })
    }

    /// What presents the certificate in handshakes.
    pub fn resolver(&self) -> Arc<dataplane_user::identity::IdentityCertResolver> {
        self.store.resolver(self.identity.clone())
    }
}

/// A TLS client that holds a valid mesh certificate for a stranger's
/// identity (issued by the mesh's own CA) and verifies the server.
#[derive(Debug, Clone)]
pub struct StrangerTls {
    config: Arc<rustls::ClientConfig>,
}

/// How a [`StrangerTls`] connection ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ended {
    /// The HTTP/2 frame types the server sent before the end (4 SETTINGS,
    /// 7 GOAWAY, 8 WINDOW_UPDATE, ...), when the client sent the preface.
    pub frame_types: Vec<u8>,
    /// Whether the server ended with a TCP reset (rather than a close).
    pub reset: bool,
}

impl StrangerTls {
    /// A client `spiffe://cluster.local/ns/<namespace>/sa/<account>` with
    /// a certificate from the CA in `ca_dir` (the mesh's, which the agents
    /// created), that accepts a server presenting `server`.
    pub fn new(ca_dir: &std::path::Path, account: &str, server: &str) -> anyhow::Result<Self> {
        let me = MeshCredentials::issue(ca_dir, crate::mesh::NAMESPACE, account)?;
        let server = Identity::parse(server)?;
        let config = tls::client_config(me.resolver(), Arc::clone(&me.roots), vec![server])?;
        Ok(Self { config })
    }

    /// As [`StrangerTls::new`], offering only what `provider` has (e.g.
    /// one key exchange group).
    pub fn with_provider(
        ca_dir: &std::path::Path,
        account: &str,
        server: &str,
        provider: Arc<rustls::crypto::CryptoProvider>,
    ) -> anyhow::Result<Self> {
        let me = MeshCredentials::issue(ca_dir, crate::mesh::NAMESPACE, account)?;
        let server = Identity::parse(server)?;
        let config =
            tls::client_config_with(provider, me.resolver(), Arc::clone(&me.roots), vec![server])?;
        Ok(Self { config })
    }

    /// Connects from inside `pod` to `addr` and finishes the TLS handshake;
    /// then sends `first` (nothing, the HTTP/2 preface, ...).
    pub fn connect(
        &self,
        pod: &Pod,
        addr: SocketAddr,
        first: &[u8],
    ) -> anyhow::Result<rustls::StreamOwned<rustls::ClientConnection, TcpStream>> {
        let tcp = pod.netns.run(move || TcpStream::connect(addr))??;
        tcp.set_read_timeout(Some(Duration::from_millis(500)))?;
        let conn = rustls::ClientConnection::new(
            Arc::clone(&self.config),
            rustls::pki_types::ServerName::IpAddress(addr.ip().into()),
        )?;
        let mut tls = rustls::StreamOwned::new(conn, tcp);
        let deadline = Instant::now() + Duration::from_secs(30);
        while tls.conn.is_handshaking() {
            anyhow::ensure!(Instant::now() < deadline, "TLS handshake to {addr} hung");
            match tls.conn.complete_io(&mut tls.sock) {
                Ok(_) => {}
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
                Err(e) => anyhow::bail!("TLS handshake to {addr}: {e}"),
            }
        }
        if !first.is_empty() {
            tls.write_all(first)?;
            tls.flush()?;
        }
        Ok(tls)
    }

    /// The serial number (hex, as `x509_parser` writes it) of the leaf
    /// certificate the server at `addr` presents to a client in `pod`.
    pub fn presented_serial(&self, pod: &Pod, addr: SocketAddr) -> anyhow::Result<String> {
        let tls = self.connect(pod, addr, &[])?;
        let leaf = tls
            .conn
            .peer_certificates()
            .and_then(|c| c.first().cloned())
            .ok_or_else(|| anyhow::anyhow!("{addr} presented no certificate"))?;
        let (_, parsed) = x509_parser::parse_x509_certificate(&leaf)?;
        Ok(parsed.raw_serial_as_string())
    }
}

/// Reads what the server sends until it ends the connection, or `None` if
/// it is still open after `limit` (a guard against hangs).
pub fn wait_for_end(
    tls: &mut rustls::StreamOwned<rustls::ClientConnection, TcpStream>,
    limit: Duration,
) -> anyhow::Result<Option<Ended>> {
    let deadline = Instant::now() + limit;
    let mut received = Vec::new();
    let mut buf = [0u8; 4096];
    let reset = loop {
        if Instant::now() >= deadline {
            return Ok(None);
        }
        match tls.read(&mut buf) {
            Ok(0) => break false,
            Ok(n) => received.extend_from_slice(&buf[..n]),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(e) if e.kind() == ErrorKind::ConnectionReset => break true,
            // A close without TLS close_notify.
            Err(e) if e.kind() == ErrorKind::UnexpectedEof => break false,
            Err(e) => anyhow::bail!("reading from the agent: {e}"),
        }
    };
    Ok(Some(Ended {
        frame_types: frame_types(&received),
        reset,
    }))
}

/// The types of the complete HTTP/2 frames in `bytes`.
fn frame_types(mut bytes: &[u8]) -> Vec<u8> {
    let mut types = Vec::new();
    while bytes.len() >= 9 {
        let len =
            (usize::from(bytes[0]) << 16) | (usize::from(bytes[1]) << 8) | usize::from(bytes[2]);
        if bytes.len() < 9 + len {
            break;
        }
        types.push(bytes[3]);
        bytes = &bytes[9 + len..];
    }
    types
}

/// The HTTP/2 client connection preface.
pub const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// An empty SETTINGS frame, then an acknowledgement of the server's.
pub const SETTINGS_AND_ACK: &[u8] = &[0, 0, 0, 4, 0, 0, 0, 0, 0, 0, 0, 0, 4, 1, 0, 0, 0, 0];

/// The number of descriptors process `pid` has open.
pub fn open_fds(pid: u32) -> anyhow::Result<usize> {
    Ok(std::fs::read_dir(format!("/proc/{pid}/fd"))?.count())
}
