//! Sockets that live inside a pod's network namespace.
//!
//! A socket belongs to the network namespace its creating thread was in at
//! `socket(2)` time, for its whole life. So the engine briefly switches the
//! current thread into the pod's namespace, creates the socket, and switches
//! back; binding, connecting and all I/O then happen from any thread.

use std::{
    fs::File,
    io,
    net::SocketAddr,
    os::fd::{AsFd, BorrowedFd},
    path::{Path, PathBuf},
    sync::{Arc, OnceLock},
};

use nix::sched::{CloneFlags, setns};
use socket2::{Domain, Protocol, SockRef, Socket, Type};

use super::keepalive::Keepalive;

/// Backlog of the in-pod listeners.
const LISTEN_BACKLOG: i32 = 1024;

/// The agent's own network namespace, opened once so every switch into a
/// pod can switch back.
fn host_netns() -> io::Result<&'static File> {
    static HOST: OnceLock<File> = OnceLock::new();
    if let Some(file) = HOST.get() {
        return Ok(file);
    }
    let file = File::open("/proc/self/ns/net")?;
    Ok(HOST.get_or_init(|| file))
}

/// A handle on a pod's network namespace.
#[derive(Debug, Clone)]
pub struct PodNetns {
    file: Arc<File>,
    path: PathBuf,
}

impl PodNetns {
    /// Opens the namespace at `path` (e.g. `/var/run/netns/NAME`,
    /// `/proc/PID/ns/net`). Also pins the agent's own namespace for the
    /// switches back.
    pub fn open(path: &Path) -> io::Result<Self> {
        host_netns()?;
        Ok(Self {
            file: Arc::new(File::open(path)?),
            path: path.to_path_buf(),
        })
    }

    /// The path the namespace was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The namespace file.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }

    /// `(device, inode)` of the open namespace: its identity, to compare
    /// with what `path` points to later.
    pub fn identity(&self) -> io::Result<(u64, u64)> {
        use std::os::unix::fs::MetadataExt as _;
        let meta = self.file.metadata()?;
        Ok((meta.dev(), meta.ino()))
    }

    /// Runs `f` with the current thread inside the pod's namespace.
    pub(super) fn within<T>(&self, f: impl FnOnce() -> io::Result<T>) -> io::Result<T> {
        let host = host_netns()?;
        setns(self.file.as_fd(), CloneFlags::CLONE_NEWNET).map_err(io::Error::from)?;
        let result = f();
        if let Err(err) = setns(host.as_fd(), CloneFlags::CLONE_NEWNET) {
            // A thread left in a pod's namespace would silently put every
            // later socket of this runtime there: stop rather than corrupt.
            tracing::error!(error = %err, "cannot return to the agent's network namespace; aborting");
            std::process::abort();
        }
        result
    }

    /// A socket created inside the pod's namespace.
    fn socket(&self, domain: Domain) -> io::Result<Socket> {
        self.within(|| {
            Socket::new(
                domain,
                Type::STREAM.nonblocking().cloexec(),
                Some(Protocol::TCP),
            )
        })
    }

    /// The namespace's cookie (how the kernel programs name it).
    pub fn cookie(&self) -> io::Result<u64> {
        // Any socket tells the namespace; a Unix one touches no network state.
        let socket = self.within(|| Socket::new(Domain::UNIX, Type::DGRAM.cloexec(), None))?;
        crate::netns::socket_netns_cookie(socket.as_fd())
    }

    /// A non-blocking listening socket bound to `addr` inside the pod.
    /// `v6only` matters for `[::]` binds: `false` accepts IPv4 too.
    pub fn listen(&self, addr: SocketAddr, v6only: bool) -> io::Result<std::net::TcpListener> {
        let socket = self.socket(Domain::for_address(addr))?;
        if addr.is_ipv6() {
            socket.set_only_v6(v6only)?;
        }
        socket.set_reuse_address(true)?;
        socket.bind(&addr.into())?;
        socket.listen(LISTEN_BACKLOG)?;
        Ok(socket.into())
    }

    /// A non-blocking socket of type `ty` bound to `addr` inside the pod
    /// (IPv6 only for an IPv6 address), with `SO_REUSEPORT` so that a
    /// re-enrolled pod's new sockets bind before the old ones close. Used
    /// by the in-pod DNS resolver (UDP and TCP on loopback).
    pub fn bind_reusable(
        &self,
        addr: SocketAddr,
        ty: Type,
        protocol: Protocol,
    ) -> io::Result<Socket> {
        let socket = self.within(|| {
            Socket::new(
                Domain::for_address(addr),
                ty.nonblocking().cloexec(),
                Some(protocol),
            )
        })?;
        if addr.is_ipv6() {
            socket.set_only_v6(true)?;
        }
        socket.set_reuse_port(true)?;
        socket.bind(&addr.into())?;
        Ok(socket)
    }

    /// A socket inside the pod, carrying the proxy `mark` so the kernel
    /// programs let it through, with `keepalive` when on, ready to connect
    /// to `dst`.
    pub fn connector(
        &self,
        dst: SocketAddr,
        mark: u32,
        keepalive: Option<Keepalive>,
    ) -> io::Result<Socket> {
        let socket = self.socket(Domain::for_address(dst))?;
        socket.set_mark(mark)?;
        socket.set_tcp_nodelay(true)?;
        super::keepalive::apply(keepalive, SockRef::from(&socket))?;
        Ok(socket)
    }

    /// A socket inside the pod bound to the client's address and `port`
    /// (`src` is not an address of the pod: `IP_TRANSPARENT`), carrying
    /// the transparent `mark` (and `keepalive` when on), ready to connect to
    /// the app at `dst` (see
    /// [`super::original_source`]). `src` and `dst` are of one family.
    ///
    /// The caller picks the port: the whole tuple must be known before the
    /// SYN leaves, for `sk_lookup`, and a port the kernel picks at `bind`
    /// costs a search over every port in use on that address (each
    /// connection to the app leaves one in `TIME_WAIT`), which took more
    /// than a third of the agent's CPU at a few thousand connections per
    /// second. `SO_REUSEADDR` lets the port of a `TIME_WAIT` socket be
    /// bound again; `connect` still refuses a tuple that is in use.
    pub fn transparent_connector(
        &self,
        src: SocketAddr,
        dst: SocketAddr,
        (mark, keepalive): (u32, Option<Keepalive>),
    ) -> io::Result<Socket> {
        let socket = self.socket(Domain::for_address(dst))?;
        socket.set_mark(mark)?;
        super::keepalive::apply(keepalive, SockRef::from(&socket))?;
        if dst.is_ipv4() {
            socket.set_ip_transparent_v4(true)?;
        } else {
            socket.set_ip_transparent_v6(true)?;
        }
        socket.set_tcp_nodelay(true)?;
        socket.set_reuse_address(true)?;
        socket.bind(&src.into())?;
        Ok(socket)
    }
}

/// Connects `socket` (a [`PodNetns::connector`] or
/// [`PodNetns::transparent_connector`]) to `dst`.
///
/// A connection to an address of the host's own (the app behind the pod's
/// loopback) is established before `connect` returns: the handshake runs
/// within the call. It is used at once, instead of after the runtime's
/// next look at readiness, which under load comes only once every other
/// ready task has run. Anything else is awaited as `TcpSocket::connect`
/// awaits it.
pub async fn connect(socket: Socket, dst: SocketAddr) -> io::Result<tokio::net::TcpStream> {
    match socket.connect(&dst.into()) {
        Ok(()) => {}
        Err(err) if err.raw_os_error() == Some(libc::EINPROGRESS) => {}
        Err(err) => return Err(err),
    }
    let stream = tokio::net::TcpStream::from_std(socket.into())?;
    if stream.peer_addr().is_err() {
        stream.writable().await?;
        if let Some(err) = stream.take_error()? {
            return Err(err);
        }
    }
    Ok(stream)
}
