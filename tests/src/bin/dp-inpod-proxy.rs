//! `dp-inpod-proxy`: a stand-in for Istio's ztunnel in in-pod mode, for the
//! external-proxy tests. It runs in its own (the node's) network namespace
//! and opens its listeners inside each pod's namespace, as ztunnel does
//! once the node agent handed it the namespace:
//!
//! - `[::]:15001`, `[::]:15006`, `[::]:15008`, dual-stack, `IP_TRANSPARENT`,
//!   `SO_REUSEPORT`, every socket marked 0x539;
//! - **15001** (outbound): the original destination from
//!   `getsockopt(SOL_IP, SO_ORIGINAL_DST)`, then `SOL_IPV6`, then the local
//!   address; writes `outbound orig=<dst> via=<SOL_IP|SOL_IPV6|local>
//!   client=<peer IP>` (the client address the accepted socket shows, which
//!   ztunnel logs and forwards) and a newline to the client, connects to
//!   the destination from the pod (mark 0x539) and relays;
//! - **15006** (inbound plaintext): the destination as above; writes
//!   `inbound pod=<name> local=<local address>` and a newline, connects to
//!   the destination from the client's own address (`IP_TRANSPARENT`, mark
//!   0x539) and relays;
//! - **15008** (HBONE, no TLS here): writes `hbone pod=<name>
//!   local=<local address>` and a newline and closes after the client did.
//!
//! Usage: `dp-inpod-proxy NAME=NETNS_PATH...`. Prints `ready` on stdout once
//! every listener is bound. A failed connect is written to the client as
//! `error=<reason>`.
//!
//! Or `dp-inpod-proxy --zds SOCKET [--refuse NAME]...`: the pods come from
//! the node agent over ZDS, as ztunnel's do ([`dataplane_tests::zds_client`]:
//! hello, then every request acked). An Add opens the pod's listeners in
//! the namespace that came with it and is acked once they are bound
//! (refused with an error for the pods named by `--refuse`); a Del closes
//! them. When the agent closes the connection the stand-in connects again
//! (every 20 ms, as ztunnel's first backoff step) and keeps its pods'
//! listeners meanwhile. Prints `connected` on stdout after the first hello.

use std::{
    io::Write,
    net::{Shutdown, SocketAddr, TcpListener, TcpStream},
    os::fd::AsRawFd,
    process::ExitCode,
};

use nix::sched::{CloneFlags, setns};
use socket2::{Domain, Socket, Type};

/// ztunnel's mark on every socket it opens in a pod.
const MARK: u32 = 0x539;
const SO_ORIGINAL_DST: libc::c_int = 80;

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("dp-inpod-proxy: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().is_some_and(|a| a == "--zds") {
        return zds::run(&args[1..]);
    }
    let pods: Vec<(String, String)> = args
        .into_iter()
        .map(|arg| {
            arg.split_once('=')
                .map(|(n, p)| (n.to_string(), p.to_string()))
                .ok_or_else(|| format!("expected NAME=NETNS_PATH, got {arg:?}"))
        })
        .collect::<Result<_, _>>()?;
    if pods.is_empty() {
        return Err("usage: dp-inpod-proxy NAME=NETNS_PATH...".into());
    }
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    for (name, path) in pods.clone() {
        let ready = ready_tx.clone();
        // One thread per pod joins the pod's namespace; the threads it
        // starts inherit it, so every socket of the pod is made there.
        std::thread::spawn(move || {
            let result = serve_pod(&name, &path, &ready);
            if let Err(e) = result {
                let _ = ready.send(Err(format!("{name}: {e}")));
            }
        });
    }
    drop(ready_tx);
    for _ in &pods {
        ready_rx
            .recv()
            .map_err(|_| "a pod thread ended".to_string())??;
    }
    println!("ready");
    std::io::stdout().flush().map_err(|e| e.to_string())?;
    // Serve until killed.
    loop {
        std::thread::park();
    }
}

fn serve_pod(
    name: &str,
    netns: &str,
    ready: &std::sync::mpsc::Sender<Result<(), String>>,
) -> Result<(), String> {
    let file = std::fs::File::open(netns).map_err(|e| format!("open {netns}: {e}"))?;
    setns(&file, CloneFlags::CLONE_NEWNET).map_err(|e| format!("setns {netns}: {e}"))?;
    let listeners = open_listeners()?;
    let _ = ready.send(Ok(()));
    serve_listeners(name, listeners);
    Ok(())
}

/// The three listeners, in the calling thread's namespace.
fn open_listeners() -> Result<Vec<(u16, TcpListener)>, String> {
    let mut listeners = Vec::new();
    for port in [15001, 15006, 15008] {
        listeners.push((
            port,
            listen(port).map_err(|e| format!("listen {port}: {e}"))?,
        ));
    }
    Ok(listeners)
}

/// Accepts on every listener until each fails (closed by a Del).
fn serve_listeners(name: &str, listeners: Vec<(u16, TcpListener)>) {
    let mut handles = Vec::new();
    for (port, listener) in listeners {
        let name = name.to_string();
        handles.push(std::thread::spawn(move || {
            // Ends when the listener is shut down (a Del): the listener
            // closes with the thread.
            for stream in listener.incoming() {
                let Ok(stream) = stream else { break };
                let name = name.clone();
                std::thread::spawn(move || handle(port, &name, stream));
            }
        }));
    }
    for h in handles {
        let _ = h.join();
    }
}

/// A listener as ztunnel makes it in a pod.
fn listen(port: u16) -> std::io::Result<TcpListener> {
    let socket = Socket::new(Domain::IPV6, Type::STREAM, None)?;
    socket.set_only_v6(false)?;
    socket.set_reuse_port(true)?;
    socket.set_ip_transparent_v4(true)?;
    socket.set_mark(MARK)?;
    socket.bind(&SocketAddr::from(([0u16; 8], port)).into())?;
    socket.listen(128)?;
    Ok(socket.into())
}

fn handle(port: u16, name: &str, mut client: TcpStream) {
    let canonical = |a: SocketAddr| SocketAddr::new(a.ip().to_canonical(), a.port());
    let (Ok(local), Ok(peer)) = (client.local_addr(), client.peer_addr()) else {
        return;
    };
    let (local, peer) = (canonical(local), canonical(peer));
    match port {
        15001 => {
            let (orig, via) = original_dst(&client).unwrap_or((local, "local"));
            let orig = canonical(orig);
            let _ = writeln!(
                client,
                "outbound orig={orig} via={via} client={}",
                peer.ip()
            );
            match connect(orig, None) {
                Ok(upstream) => relay(client, upstream),
                Err(e) => {
                    let _ = writeln!(client, "error={e}");
                }
            }
        }
        15006 => {
            let dst = original_dst(&client).map_or(local, |(d, _)| canonical(d));
            let _ = writeln!(client, "inbound pod={name} local={local}");
            match connect(dst, Some(peer)) {
                Ok(upstream) => relay(client, upstream),
                Err(e) => {
                    let _ = writeln!(client, "error={e}");
                }
            }
        }
        _ => {
            let _ = writeln!(client, "hbone pod={name} local={local}");
            let _ = client.shutdown(Shutdown::Write);
            let _ = std::io::copy(&mut client, &mut std::io::sink());
        }
    }
}

/// `SO_ORIGINAL_DST`, `SOL_IP` first (ztunnel's order), then `SOL_IPV6`.
fn original_dst(stream: &TcpStream) -> Option<(SocketAddr, &'static str)> {
    for (level, via) in [(libc::SOL_IP, "SOL_IP"), (libc::SOL_IPV6, "SOL_IPV6")] {
        // SAFETY: sockaddr_storage is plain data; zero is a valid value.
        let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
        let mut len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
        // SAFETY: a valid descriptor and a buffer of the size passed.
        let rc = unsafe {
            libc::getsockopt(
                stream.as_raw_fd(),
                level,
                SO_ORIGINAL_DST,
                (&raw mut storage).cast(),
                &mut len,
            )
        };
        if rc == 0
            && let Some(addr) = from_storage(&storage)
        {
            return Some((addr, via));
        }
    }
    None
}

/// The address a `sockaddr_in` or `sockaddr_in6` in `storage` holds.
fn from_storage(storage: &libc::sockaddr_storage) -> Option<SocketAddr> {
    match i32::from(storage.ss_family) {
        libc::AF_INET => {
            // SAFETY: the family says the storage holds a sockaddr_in.
            let sin =
                unsafe { &*(storage as *const libc::sockaddr_storage).cast::<libc::sockaddr_in>() };
            let ip = std::net::Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr));
            Some(SocketAddr::new(ip.into(), u16::from_be(sin.sin_port)))
        }
        libc::AF_INET6 => {
            // SAFETY: the family says the storage holds a sockaddr_in6.
            let sin6 = unsafe {
                &*(storage as *const libc::sockaddr_storage).cast::<libc::sockaddr_in6>()
            };
            let ip = std::net::Ipv6Addr::from(sin6.sin6_addr.s6_addr);
            Some(SocketAddr::new(ip.into(), u16::from_be(sin6.sin6_port)))
        }
        _ => None,
    }
}

/// Connects to `dst` from the pod with the mark, from `source`'s address
/// when given (transparently).
fn connect(dst: SocketAddr, source: Option<SocketAddr>) -> std::io::Result<TcpStream> {
    let socket = Socket::new(Domain::for_address(dst), Type::STREAM, None)?;
    socket.set_mark(MARK)?;
    if let Some(source) = source {
        if dst.is_ipv4() {
            socket.set_ip_transparent_v4(true)?;
        } else {
            set_ipv6_transparent(&socket)?;
        }
        socket.bind(&SocketAddr::new(source.ip(), 0).into())?;
    }
    socket.connect_timeout(&dst.into(), std::time::Duration::from_secs(10))?;
    Ok(socket.into())
}

fn set_ipv6_transparent(socket: &Socket) -> std::io::Result<()> {
    let one: libc::c_int = 1;
    // SAFETY: a valid descriptor and an int option.
    let rc = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::SOL_IPV6,
            libc::IPV6_TRANSPARENT,
            (&raw const one).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Copies both ways; each direction's end is passed on as a half-close.
fn relay(client: TcpStream, upstream: TcpStream) {
    let (Ok(mut client_r), Ok(mut upstream_w)) = (client.try_clone(), upstream.try_clone()) else {
        return;
    };
    let up = std::thread::spawn(move || {
        let _ = std::io::copy(&mut client_r, &mut upstream_w);
        let _ = upstream_w.shutdown(Shutdown::Write);
    });
    let (mut upstream_r, mut client_w) = (upstream, client);
    let _ = std::io::copy(&mut upstream_r, &mut client_w);
    let _ = client_w.shutdown(Shutdown::Write);
    let _ = up.join();
}

/// The ZDS mode: pods handed over by the node agent.
mod zds {
    use std::{
        collections::HashMap,
        io::Write as _,
        os::fd::{AsRawFd as _, OwnedFd, RawFd},
        path::Path,
        time::Duration,
    };

    use dataplane_tests::zds_client::{ZdsClient, ZdsRequest};
    use nix::sched::{CloneFlags, setns};

    pub(super) fn run(args: &[String]) -> Result<(), String> {
        let (socket, refused) = match args {
            [socket, rest @ ..] => (Path::new(socket), refused_names(rest)?),
            [] => return Err("usage: dp-inpod-proxy --zds SOCKET [--refuse NAME]...".into()),
        };
        // uid -> the pod's listening descriptors (shut down on Del).
        let mut pods: HashMap<String, Vec<RawFd>> = HashMap::new();
        let mut announced = false;
        loop {
            let mut client = match ZdsClient::connect(socket) {
                Ok(client) => client,
                Err(_) => {
                    std::thread::sleep(Duration::from_millis(20));
                    continue;
                }
            };
            if !announced {
                println!("connected");
                std::io::stdout().flush().map_err(|e| e.to_string())?;
                announced = true;
            }
            serve_connection(&mut client, &refused, &mut pods)?;
        }
    }

    fn refused_names(args: &[String]) -> Result<Vec<String>, String> {
        let mut names = Vec::new();
        let mut rest = args.iter();
        while let Some(flag) = rest.next() {
            match (flag.as_str(), rest.next()) {
                ("--refuse", Some(name)) => names.push(name.clone()),
                _ => return Err(format!("unexpected argument {flag:?}")),
            }
        }
        Ok(names)
    }

    /// Answers requests until the agent closes the connection.
    fn serve_connection(
        client: &mut ZdsClient,
        refused: &[String],
        pods: &mut HashMap<String, Vec<RawFd>>,
    ) -> Result<(), String> {
        loop {
            let request = match client.recv() {
                Ok(Some(request)) => request,
                Ok(None) => return Ok(()),
                // The read timeout of an idle connection: keep waiting.
                Err(e) if e.to_string().contains("EAGAIN") => continue,
                Err(e) if e.to_string().contains("ECONNRESET") => return Ok(()),
                Err(e) => return Err(format!("ZDS: {e:#}")),
            };
            let answer = match request {
                ZdsRequest::Add {
                    uid, name, netns, ..
                } => {
                    match pods.entry(uid) {
                        _ if refused.contains(&name) => {
                            Err(format!("{name} is refused by the test"))
                        }
                        // A snapshot after a reconnect: already serving it.
                        std::collections::hash_map::Entry::Occupied(_) => Ok(()),
                        std::collections::hash_map::Entry::Vacant(slot) => start_pod(&name, netns)
                            .map(|fds| {
                                slot.insert(fds);
                            }),
                    }
                }
                ZdsRequest::Del { uid } => {
                    for fd in pods.remove(&uid).unwrap_or_default() {
                        // SAFETY: shutting down a listening descriptor the
                        // pod's thread owns; its accept fails and the
                        // thread closes it.
                        unsafe { libc::shutdown(fd, libc::SHUT_RDWR) };
                    }
                    Ok(())
                }
                ZdsRequest::Keep { .. } | ZdsRequest::SnapshotSent => Ok(()),
            };
            let sent = match answer {
                Ok(()) => client.ack(),
                Err(error) => client.nack(&error),
            };
            sent.map_err(|e| format!("ZDS: {e:#}"))?;
        }
    }

    /// Opens the pod's listeners in `netns` on a thread of its own that
    /// then serves them; returns their descriptors once bound.
    fn start_pod(name: &str, netns: OwnedFd) -> Result<Vec<RawFd>, String> {
        let (bound, result) = std::sync::mpsc::channel();
        let name = name.to_owned();
        std::thread::spawn(move || {
            let listeners = setns(&netns, CloneFlags::CLONE_NEWNET)
                .map_err(|e| format!("setns: {e}"))
                .and_then(|()| super::open_listeners());
            match listeners {
                Ok(listeners) => {
                    let fds = listeners.iter().map(|(_, l)| l.as_raw_fd()).collect();
                    let _ = bound.send(Ok(fds));
                    super::serve_listeners(&name, listeners);
                }
                Err(e) => {
                    let _ = bound.send(Err(e));
                }
            }
        });
        result
            .recv()
            .map_err(|_| "the pod's thread ended".to_owned())?
    }
}
