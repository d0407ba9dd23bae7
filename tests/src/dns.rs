//! DNS for the DNS capture tests: a stand-in DNS server (the agent's
//! upstream, or a server a pod reaches directly) and queries from inside a
//! pod with `dp-dns`.
//!
//! The server answers, for any name under `up.test.`: `missing.up.test`
//! NXDOMAIN; `big.up.test` A with [`BIG_RECORDS`] addresses (over 4 KiB:
//! truncated over UDP unless the client takes that much); any other name
//! A with the server's own `tag` address. It counts queries and keeps the
//! EDNS payload size each one advertised.

use std::{
    io::{Read as _, Write as _},
    net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, UdpSocket},
    sync::{
        Arc, Mutex, PoisonError,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    thread::JoinHandle,
    time::Duration,
};

use hickory_proto::{
    op::{Message, MessageType, ResponseCode},
    rr::{RData, Record, RecordType, rdata::A},
};

use crate::{process::spawn_in, topology::Pod};

/// Addresses in the `big.up.test` answer: 256 A records, 4 KiB and more.
pub const BIG_RECORDS: usize = 256;

/// A DNS server on UDP and TCP at one address, stopped on drop.
#[derive(Debug)]
pub struct FakeDns {
    addr: SocketAddr,
    queries: Arc<AtomicUsize>,
    /// Each query's EDNS payload size (`None`: no OPT record), in arrival
    /// order.
    edns: Arc<Mutex<Vec<Option<u16>>>>,
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl FakeDns {
    /// Starts a server on `127.0.0.1` (a free port) in the test's own
    /// namespace, answering other names with `tag`.
    pub fn on_loopback(tag: Ipv4Addr) -> anyhow::Result<Self> {
        let udp = UdpSocket::bind("127.0.0.1:0")?;
        let tcp = TcpListener::bind(udp.local_addr()?)?;
        Self::serve(udp, tcp, tag)
    }

    /// Starts a server on `addr` inside `netns`.
    pub fn in_netns(netns: &crate::Netns, addr: SocketAddr, tag: Ipv4Addr) -> anyhow::Result<Self> {
        let (udp, tcp) = netns.run(move || -> std::io::Result<_> {
            Ok((UdpSocket::bind(addr)?, TcpListener::bind(addr)?))
        })??;
        Self::serve(udp, tcp, tag)
    }

    /// A UDP socket on loopback that never answers (an upstream that is
    /// down without saying so), with the guard that keeps it bound.
    pub fn silent() -> anyhow::Result<(UdpSocket, SocketAddr)> {
        let socket = UdpSocket::bind("127.0.0.1:0")?;
        let addr = socket.local_addr()?;
        Ok((socket, addr))
    }

    fn serve(udp: UdpSocket, tcp: TcpListener, tag: Ipv4Addr) -> anyhow::Result<Self> {
        let addr = udp.local_addr()?;
        let queries = Arc::new(AtomicUsize::new(0));
        let edns = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        udp.set_read_timeout(Some(Duration::from_millis(100)))?;
        tcp.set_nonblocking(true)?;
        let udp_thread = {
            let (queries, edns, stop) =
                (Arc::clone(&queries), Arc::clone(&edns), Arc::clone(&stop));
            std::thread::spawn(move || {
                let mut buf = vec![0u8; 65_535];
                while !stop.load(Ordering::Relaxed) {
                    let Ok((n, peer)) = udp.recv_from(&mut buf) else {
                        continue;
                    };
                    queries.fetch_add(1, Ordering::Relaxed);
                    record_edns(&edns, &buf[..n]);
                    if let Some(reply) = answer(&buf[..n], tag, true) {
                        let _ = udp.send_to(&reply, peer);
                    }
                }
            })
        };
        let tcp_thread = {
            let (queries, edns, stop) =
                (Arc::clone(&queries), Arc::clone(&edns), Arc::clone(&stop));
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let Ok((mut stream, _)) = tcp.accept() else {
                        std::thread::sleep(Duration::from_millis(20));
                        continue;
                    };
                    let _ = stream.set_nonblocking(false);
                    let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
                    let mut len = [0u8; 2];
                    if stream.read_exact(&mut len).is_err() {
                        continue;
                    }
                    let mut query = vec![0u8; usize::from(u16::from_be_bytes(len))];
                    if stream.read_exact(&mut query).is_err() {
                        continue;
                    }
                    queries.fetch_add(1, Ordering::Relaxed);
                    record_edns(&edns, &query);
                    if let Some(reply) = answer(&query, tag, false)
                        && let Ok(len) = u16::try_from(reply.len())
                    {
                        let _ = stream.write_all(&len.to_be_bytes());
                        let _ = stream.write_all(&reply);
                    }
                }
            })
        };
        Ok(Self {
            addr,
            queries,
            edns,
            stop,
            threads: vec![udp_thread, tcp_thread],
        })
    }

    /// Where it listens (UDP and TCP).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Queries received so far.
    pub fn queries(&self) -> usize {
        self.queries.load(Ordering::Relaxed)
    }

    /// The EDNS payload size of each query received so far, in order
    /// (`None` for a query without an OPT record).
    pub fn edns_payloads(&self) -> Vec<Option<u16>> {
        self.edns
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

/// Notes the EDNS payload size `raw` advertises (a query that does not
/// parse counts as one without EDNS).
fn record_edns(edns: &Mutex<Vec<Option<u16>>>, raw: &[u8]) {
    let payload = Message::from_vec(raw)
        .ok()
        .and_then(|m| m.edns.map(|e| e.max_payload()));
    edns.lock()
        .unwrap_or_else(PoisonError::into_inner)
        .push(payload);
}

impl Drop for FakeDns {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

/// The server's answer to `raw`; over UDP (`udp`) truncated to what the
/// client takes.
fn answer(raw: &[u8], tag: Ipv4Addr, udp: bool) -> Option<Vec<u8>> {
    let request = Message::from_vec(raw).ok()?;
    let query = request.queries.first()?.clone();
    let mut reply = Message::new(
        request.metadata.id,
        MessageType::Response,
        request.metadata.op_code,
    );
    reply.metadata.recursion_desired = request.metadata.recursion_desired;
    reply.metadata.recursion_available = true;
    reply.queries = request.queries.clone();
    reply.edns = request.edns.clone();
    let name = query.name().to_ascii().to_ascii_lowercase();
    if !name.ends_with("up.test.") || name == "missing.up.test." {
        reply.metadata.response_code = ResponseCode::NXDomain;
    } else if query.query_type() == RecordType::A {
        let addrs: Vec<Ipv4Addr> = if name == "big.up.test." {
            (0..BIG_RECORDS)
                .map(|i| Ipv4Addr::new(10, 200, (i / 256) as u8, (i % 256) as u8))
                .collect()
        } else {
            vec![tag]
        };
        for a in addrs {
            reply
                .answers
                .push(Record::from_rdata(query.name().clone(), 60, RData::A(A(a))));
        }
    }
    let full = reply.to_vec().ok()?;
    let limit = request
        .edns
        .as_ref()
        .map_or(512, |e| usize::from(e.max_payload()).max(512));
    if udp && full.len() > limit {
        return reply.truncate().to_vec().ok();
    }
    Some(full)
}

/// What `dp-dns` saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DnsReply {
    /// Response code as hickory names it (`No Error`, `Non-Existent Domain`,
    /// `Server Failure`, ...).
    pub rcode: String,
    /// The TC bit.
    pub truncated: bool,
    /// The address the answer came from (`recvfrom`).
    pub from: String,
    /// The connected peer (`getpeername`), `-` for unconnected UDP.
    pub peer: String,
    /// Size of the answer.
    pub bytes: usize,
    /// Answer records, one per line (`A 10.96.0.10`).
    pub answers: Vec<String>,
}

impl DnsReply {
    /// The addresses of the A and AAAA answers.
    pub fn addrs(&self) -> Vec<IpAddr> {
        self.answers
            .iter()
            .filter_map(|line| line.split_once(' '))
            .filter(|(kind, _)| *kind == "A" || *kind == "AAAA")
            .filter_map(|(_, addr)| addr.parse().ok())
            .collect()
    }
}

/// `dp-dns MODE SERVER NAME TYPE [EDNS]` inside `pod` (its namespace and
/// cgroup).
pub fn query(
    pod: &Pod,
    mode: &str,
    server: SocketAddr,
    name: &str,
    qtype: &str,
    edns: Option<u16>,
) -> anyhow::Result<DnsReply> {
    let mut cmd = std::process::Command::new(crate::process::target_binary(
        "dp-dns",
        "cargo builds it with this package's tests",
    )?);
    cmd.args([mode, &server.to_string(), name, qtype]);
    if let Some(edns) = edns {
        cmd.arg(edns.to_string());
    }
    let out = spawn_in(cmd, Some(pod.netns.path()), Some(pod.cgroup.path()))?
        .wait(Duration::from_secs(30))?;
    anyhow::ensure!(
        out.code == Some(0),
        "dp-dns {mode} {server} {name} {qtype} failed: {}",
        out.stderr
    );
    let mut lines = out.stdout.lines();
    let head = lines.next().unwrap_or_default();
    let field = |key: &str| {
        head.split_whitespace()
            .find_map(|kv| kv.strip_prefix(key))
            .unwrap_or_default()
            .to_owned()
    };
    // The response code may contain spaces: it runs up to ` tc=`.
    let rcode = head
        .strip_prefix("rcode=")
        .and_then(|rest| rest.split(" tc=").next())
        .unwrap_or_default()
        .to_owned();
    Ok(DnsReply {
        rcode,
        truncated: field("tc=") == "1",
        from: field("from="),
        peer: field("peer="),
        bytes: field("bytes=").parse().unwrap_or(0),
        answers: lines.map(str::to_owned).collect(),
    })
}

/// glibc's own resolver in `pod`: `getent ahosts NAME` in a private mount
/// namespace where `/etc/resolv.conf` is `resolv_conf` (nameservers, search
/// domains, options as a pod's). Returns the distinct addresses, in order,
/// or an empty list when the name does not resolve.
pub fn getent(pod: &Pod, resolv_conf: &std::path::Path, name: &str) -> anyhow::Result<Vec<IpAddr>> {
    let mut cmd = std::process::Command::new("unshare");
    cmd.args([
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        "mount --bind \"$0\" /etc/resolv.conf && exec getent ahosts \"$1\"",
    ])
    .arg(resolv_conf)
    .arg(name);
    let out = spawn_in(cmd, Some(pod.netns.path()), Some(pod.cgroup.path()))?
        .wait(Duration::from_secs(30))?;
    // getent exits 2 for a name that does not resolve.
    anyhow::ensure!(
        matches!(out.code, Some(0) | Some(2)),
        "getent ahosts {name} failed: {:?} {}",
        out.code,
        out.stderr
    );
    let mut addrs: Vec<IpAddr> = Vec::new();
    for addr in out
        .stdout
        .lines()
        .filter_map(|line| line.split_whitespace().next()?.parse().ok())
    {
        if !addrs.contains(&addr) {
            addrs.push(addr);
        }
    }
    Ok(addrs)
}
