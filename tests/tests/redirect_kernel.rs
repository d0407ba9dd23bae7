//! The kernel side of the redirection model, end to end in the running
//! kernel: `connect4`/`connect6` + `sockops` (outbound capture and original
//! destination), `getsockopt(SO_ORIGINAL_DST)`, `getpeername`, and the
//! per-pod `sk_lookup` (inbound capture), driven through the redirector's
//! enrollment API.
//!
//! Topology per test: one simulated node (a network namespace with a
//! bridge) with three pods on it: `app` (the pod under test, enrolled unless
//! a test says otherwise), `peer` and `other` (plain pods). A redirector
//! instance is attached at the node's cgroup, under which every pod's cgroup
//! lives. The test plays the engine: it makes the listeners in the app
//! pod's namespace and answers each captured connection with what it saw.
//! Apps answer with their name, so each reply says where a connection went.
//!
//! Guards remove namespaces, cgroups, bpffs pins and child processes even
//! when a test fails. Nothing waits on time: every wait is for an event,
//! bounded by a generous limit that only guards against hangs.

use std::{
    collections::HashMap,
    fs::File,
    io::{IoSliceMut, Read, Write},
    net::{IpAddr, Ipv6Addr, SocketAddr, TcpListener, TcpStream},
    os::{
        fd::{AsFd, AsRawFd, FromRawFd, OwnedFd},
        linux::fs::MetadataExt,
        unix::{net::UnixStream, process::CommandExt},
    },
    process::Command,
    time::{Duration, Instant},
};

use aya::maps::{HashMap as BpfHashMap, LpmTrie, Map, MapData, SockHash};
use dataplane_common::{
    DEFAULT_PROXY_MARK, EnrolledNetns, IpAddr16, ListenerKey, NetnsAddr, NetnsPort, OrigDst,
    PodInbound, PodPort, SO_ORIGINAL_DST, SOL_IP, SOL_IPV6, SockTuple, maps as m,
};
use dataplane_tests::{
    BpffsDir, Netns, Responder, probe_binary, spawn_in,
    topology::{Node, Pod},
};
use dataplane_user::redirect::{
    Exclusions, ExitMode, OrigDstTable, PinLayout, PodCapture, Redirector, RedirectorOptions,
    read_counters,
};

/// Guard against hangs only; nothing asserts on time.
const LIMIT: Duration = Duration::from_secs(20);
/// Port every app listens on.
const APP_PORT: u16 = 8080;

/// What a `dp-probe connect` run produced: its stdout on success, its
/// stderr (the error) on failure.
type Dial = Result<String, String>;

/// A pod's plain servers: each answers `<name>` on every port it serves.
struct Apps {
    _servers: Vec<Responder>,
}

impl Apps {
    fn start(pod: &Pod, name: &'static str, ports: &[u16]) -> anyhow::Result<Self> {
        let mut servers = Vec::new();
        for &port in ports {
            let any = SocketAddr::new(Ipv6Addr::UNSPECIFIED.into(), port);
            let listener = pod.netns.run(move || TcpListener::bind(any))??;
            servers.push(Responder::start(listener, move |_| {
                name.as_bytes().to_vec()
            })?);
        }
        Ok(Self { _servers: servers })
    }
}

/// The engine of the app pod, played by the test.
struct Engine {
    /// Outbound capture listener ([::]:15001), created by a process in the
    /// app pod's cgroup so the cgroup programs see its sockets. Taken by
    /// [`Engine::serve_outbound`] or by a test that accepts itself.
    outbound_listener: Option<TcpListener>,
    /// Answers `orig=<original destination>` on each captured connection.
    outbound: Option<Responder>,
    /// Inbound plaintext listener ([::]:15006): answers `inbound local=...`.
    inbound: Option<Responder>,
    /// HBONE listener ([::]:15008): answers `hbone local=...`.
    hbone: Option<Responder>,
    /// Second descriptors of the three listeners: for (re-)enrollment, and
    /// to stop them for certain (see [`stop_listening`]).
    outbound_fd: Option<OwnedFd>,
    inbound_fd: Option<OwnedFd>,
    hbone_fd: Option<OwnedFd>,
}

impl Engine {
    fn start(app: &Pod) -> anyhow::Result<Self> {
        let outbound_listener = listener_in_pod(app, "[::]:15001")?;
        let outbound_fd = outbound_listener.try_clone()?.into();
        let inbound = app.netns.run(|| TcpListener::bind("[::]:15006"))??;
        let hbone = app.netns.run(|| TcpListener::bind("[::]:15008"))??;
        let inbound_fd = inbound.try_clone()?.into();
        let hbone_fd = hbone.try_clone()?.into();
        let describe = |role: &'static str| {
            move |req: &dataplane_tests::responder::Request| {
                format!(
                    "{role} local={} peer={}",
                    canonical(req.local),
                    canonical(req.peer).ip()
                )
                .into_bytes()
            }
        };
        Ok(Self {
            outbound_listener: Some(outbound_listener),
            outbound: None,
            inbound: Some(Responder::start(inbound, describe("inbound"))?),
            hbone: Some(Responder::start(hbone, describe("hbone"))?),
            outbound_fd: Some(outbound_fd),
            inbound_fd: Some(inbound_fd),
            hbone_fd: Some(hbone_fd),
        })
    }

    /// Serves the outbound listener: each captured connection is answered
    /// with the original destination user space recovers for it.
    fn serve_outbound(&mut self, pins: &PinLayout) -> anyhow::Result<()> {
        let listener = self
            .outbound_listener
            .take()
            .ok_or_else(|| anyhow::anyhow!("outbound listener already taken"))?;
        let mut table = OrigDstTable::open(pins)?;
        self.outbound = Some(Responder::start(listener, move |req| {
            match table.take(req.peer, req.local) {
                Ok(Some(orig)) => format!("orig={orig}").into_bytes(),
                Ok(None) => b"orig=none".to_vec(),
                Err(e) => format!("error={e}").into_bytes(),
            }
        })?);
        Ok(())
    }

    /// Stops the inbound and HBONE listeners (the engine went away).
    fn close_inbound(&mut self) -> anyhow::Result<()> {
        stop_listening(self.inbound_fd.take())?;
        stop_listening(self.hbone_fd.take())?;
        self.inbound = None;
        self.hbone = None;
        Ok(())
    }

    /// Stops the outbound listener.
    fn close_outbound(&mut self) -> anyhow::Result<()> {
        stop_listening(self.outbound_fd.take())?;
        self.outbound = None;
        self.outbound_listener = None;
        Ok(())
    }
}

/// Stops a listening socket at once and closes our descriptor. Closing
/// alone is not enough while parallel tests fork: a child between fork and
/// exec briefly holds a copy of every descriptor, keeping the socket
/// listening. `shutdown()` acts on the socket itself (which also takes it
/// out of `LISTENERS`).
fn stop_listening(fd: Option<OwnedFd>) -> anyhow::Result<()> {
    if let Some(fd) = fd {
        nix::sys::socket::shutdown(fd.as_raw_fd(), nix::sys::socket::Shutdown::Both)?;
    }
    Ok(())
}

/// One node, three pods, an engine for `app`, a redirector at the node's
/// cgroup. Field order is drop order: the redirector detaches first, pods
/// go before their node, pins last.
struct World {
    redirector: Option<Redirector>,
    engine: Engine,
    _apps: Vec<Apps>,
    app: Pod,
    peer: Pod,
    other: Pod,
    node: Node,
    pins: PinLayout,
    _bpffs: BpffsDir,
}

impl World {
    /// Builds the world, with the engine serving its outbound listener;
    /// `configure` adjusts the redirector options.
    fn new(tag: &str, configure: impl FnOnce(&mut RedirectorOptions)) -> anyhow::Result<Self> {
        let mut world = Self::unserved(tag, configure)?;
        world.engine.serve_outbound(&world.pins)?;
        Ok(world)
    }

    /// Builds the world with the outbound listener left to the test.
    fn unserved(tag: &str, configure: impl FnOnce(&mut RedirectorOptions)) -> anyhow::Result<Self> {
        let bpffs = BpffsDir::new(tag)?;
        let mut node = Node::new(tag, 1)?;
        let app = node.add_pod(tag)?;
        let peer = node.add_pod(tag)?;
        let other = node.add_pod(tag)?;
        let apps = vec![
            Apps::start(&app, "app", &[APP_PORT, 9090])?,
            Apps::start(&peer, "peer", &[APP_PORT, 8081, 15001, 15006])?,
            Apps::start(&other, "other", &[APP_PORT])?,
        ];
        let pins = PinLayout::new(bpffs.path(), "rk");
        let mut options = RedirectorOptions::new(node.cgroup().path().to_path_buf(), pins.clone());
        configure(&mut options);
        let redirector = Redirector::attach(&options)?;
        let engine = Engine::start(&app)?;
        Ok(Self {
            redirector: Some(redirector),
            engine,
            _apps: apps,
            app,
            peer,
            other,
            node,
            pins,
            _bpffs: bpffs,
        })
    }

    fn redirector(&mut self) -> anyhow::Result<&mut Redirector> {
        self.redirector
            .as_mut()
            .ok_or_else(|| anyhow::anyhow!("redirector gone"))
    }

    /// Enrolls the app pod with both IPs and `exclusions`.
    fn enroll(&mut self, exclusions: &Exclusions) -> anyhow::Result<()> {
        let ips = [IpAddr::V4(self.app.ip4), IpAddr::V6(self.app.ip6)];
        self.enroll_ips(&ips, exclusions)
    }

    fn enroll_ips(&mut self, ips: &[IpAddr], exclusions: &Exclusions) -> anyhow::Result<()> {
        let netns = File::open(self.app.netns.path())?;
        let cookie = self.app.netns.cookie()?;
        let inbound = self
            .engine
            .inbound_fd
            .as_ref()
            .ok_or_else(|| anyhow::anyhow!("inbound listener closed"))?
            .try_clone()?;
        let hbone = self
            .engine
            .hbone_fd
            .as_ref()
            .ok_or_else(|| anyhow::anyhow!("hbone listener closed"))?
            .try_clone()?;
        let capture = PodCapture {
            netns_cookie: cookie,
            netns: netns.as_fd(),
            ips,
            node_addr: Some(self.app.node_side),
            exclusions,
            inbound_listener: inbound.as_fd(),
            hbone_listener: hbone.as_fd(),
        };
        self.redirector()?.enroll_pod(&capture)?;
        Ok(())
    }

    fn app_cookie(&self) -> anyhow::Result<u64> {
        self.app.netns.cookie()
    }

    fn counters(&self) -> anyhow::Result<HashMap<&'static str, u64>> {
        Ok(read_counters(&self.pins)?
            .into_iter()
            .map(|c| (c.name, c.value))
            .collect())
    }

    fn counter(&self, name: &str) -> anyhow::Result<u64> {
        self.counters()?
            .get(name)
            .copied()
            .ok_or_else(|| anyhow::anyhow!("no counter {name}"))
    }
}

impl Drop for World {
    fn drop(&mut self) {
        if let Some(r) = self.redirector.take()
            && let Err(e) = r.shutdown(ExitMode::Detach)
        {
            eprintln!("cleanup: {e}");
        }
    }
}

/// The canonical form of an address (IPv4-mapped shown as IPv4).
fn canonical(addr: SocketAddr) -> SocketAddr {
    SocketAddr::new(addr.ip().to_canonical(), addr.port())
}

/// Runs `dp-probe connect DST hello EXTRA...` in `netns` (and `cgroup`).
fn dial_in(
    netns: &Netns,
    cgroup: Option<&dataplane_tests::Cgroup>,
    dst: &str,
    extra: &[&str],
) -> anyhow::Result<Dial> {
    let mut cmd = Command::new(probe_binary()?);
    cmd.args(["connect", dst, "hello"]).args(extra);
    let out = spawn_in(cmd, Some(netns.path()), cgroup.map(|c| c.path()))?.wait(LIMIT)?;
    Ok(if out.code == Some(0) {
        Ok(out.stdout)
    } else {
        Err(out.stderr)
    })
}

/// A process in `pod` (its namespace and cgroup) dials `dst`.
fn dial(pod: &Pod, dst: &str, extra: &[&str]) -> anyhow::Result<Dial> {
    dial_in(&pod.netns, Some(&pod.cgroup), dst, extra)
}

fn at(ip: impl Into<IpAddr>, port: u16) -> String {
    SocketAddr::new(ip.into(), port).to_string()
}

/// `[::ffff:a.b.c.d]:port`.
fn mapped(ip: std::net::Ipv4Addr, port: u16) -> String {
    SocketAddr::new(IpAddr::V6(ip.to_ipv6_mapped()), port).to_string()
}

fn assert_refused(dial: &Dial, what: &str) {
    match dial {
        Err(e) => assert!(e.contains("Connection refused"), "{what}: {e}"),
        Ok(out) => panic!("{what}: expected a refused connection, got {out:?}"),
    }
}

fn assert_eperm(dial: &Dial, what: &str) {
    match dial {
        Err(e) => assert!(e.contains("Operation not permitted"), "{what}: {e}"),
        Ok(out) => panic!("{what}: expected EPERM, got {out:?}"),
    }
}

/// A TCP listener on `addr` created by a `dp-probe listen` process inside
/// the pod's namespace and cgroup and handed back over a Unix socket: its
/// sockets (and the connections it accepts) belong to the pod's cgroup, as
/// the engine's own would on a node.
fn listener_in_pod(pod: &Pod, addr: &str) -> anyhow::Result<TcpListener> {
    let (ours, theirs) = UnixStream::pair()?;
    ours.set_read_timeout(Some(LIMIT))?;
    let theirs_fd = theirs.as_raw_fd();
    let mut cmd = Command::new(probe_binary()?);
    cmd.args(["listen", addr]);
    // SAFETY: dup2 and fcntl are async-signal-safe calls on a descriptor
    // opened before the fork.
    unsafe {
        cmd.pre_exec(move || {
            if libc::dup2(theirs_fd, 3) < 0 || libc::fcntl(3, libc::F_SETFD, 0) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = spawn_in(cmd, Some(pod.netns.path()), Some(pod.cgroup.path()))?;
    drop(theirs);
    let mut byte = [0u8; 1];
    let mut iov = [IoSliceMut::new(&mut byte)];
    let mut space = nix::cmsg_space!([std::os::fd::RawFd; 1]);
    let received = nix::sys::socket::recvmsg::<()>(
        ours.as_raw_fd(),
        &mut iov,
        Some(&mut space),
        nix::sys::socket::MsgFlags::empty(),
    )
    .map_err(anyhow::Error::from)
    .and_then(|msg| {
        msg.cmsgs()?
            .find_map(|c| match c {
                nix::sys::socket::ControlMessageOwned::ScmRights(fds) => fds.first().copied(),
                _ => None,
            })
            .ok_or_else(|| anyhow::anyhow!("dp-probe sent no descriptor"))
    });
    let out = child.wait(LIMIT)?;
    anyhow::ensure!(
        out.code == Some(0),
        "dp-probe listen failed: {}",
        out.stderr
    );
    let fd = received?;
    // SAFETY: SCM_RIGHTS installed this descriptor in our table for us.
    Ok(TcpListener::from(unsafe { OwnedFd::from_raw_fd(fd) }))
}

/// Waits until `done` holds, for kernel state that settles on its own
/// after a process exits (a socket's final close). Bounded by [`LIMIT`];
/// `false` if it never held.
fn eventually(mut done: impl FnMut() -> anyhow::Result<bool>) -> anyhow::Result<bool> {
    let deadline = Instant::now() + LIMIT;
    while !done()? {
        if Instant::now() > deadline {
            return Ok(false);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(true)
}

/// Accepts one connection, blocking at most [`LIMIT`] (SO_RCVTIMEO bounds
/// `accept()`).
fn accept_one(listener: &TcpListener) -> anyhow::Result<TcpStream> {
    listener.set_nonblocking(false)?;
    let timeout = nix::sys::time::TimeVal::new(LIMIT.as_secs() as _, 0);
    nix::sys::socket::setsockopt(
        listener,
        nix::sys::socket::sockopt::ReceiveTimeout,
        &timeout,
    )?;
    Ok(listener.accept()?.0)
}

/// `getsockopt(level, SO_ORIGINAL_DST)` with a buffer of `len` bytes.
fn original_dst(stream: &TcpStream, level: i32, len: usize) -> std::io::Result<SocketAddr> {
    let mut buf = [0u8; 64];
    let mut optlen = len.min(buf.len()) as libc::socklen_t;
    // SAFETY: the buffer outlives the call and `optlen` never exceeds it.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            level,
            SO_ORIGINAL_DST,
            buf.as_mut_ptr().cast(),
            &mut optlen,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let family = i32::from(u16::from_ne_bytes([buf[0], buf[1]]));
    let port = u16::from_be_bytes([buf[2], buf[3]]);
    match (family, optlen) {
        (libc::AF_INET, 16) => Ok(SocketAddr::new(
            IpAddr::from([buf[4], buf[5], buf[6], buf[7]]),
            port,
        )),
        (libc::AF_INET6, 28) => {
            let mut octets = [0u8; 16];
            octets.copy_from_slice(&buf[8..24]);
            Ok(SocketAddr::new(IpAddr::from(octets), port))
        }
        _ => Err(std::io::Error::other(format!(
            "unexpected answer: family {family}, length {optlen}"
        ))),
    }
}

/// An integer socket option.
fn int_option(stream: &TcpStream, level: i32, name: i32) -> std::io::Result<(i32, u32)> {
    let mut value: i32 = 0;
    let mut len = std::mem::size_of::<i32>() as libc::socklen_t;
    // SAFETY: a valid descriptor and a buffer of the size passed.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            level,
            name,
            (&raw mut value).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok((value, len))
}

/// `sk_lookup` links attached to the network namespace at `netns`, from the
/// kernel's own view (`bpftool link show`).
fn sk_lookup_links(netns: &Netns) -> anyhow::Result<usize> {
    let ino = std::fs::metadata(netns.path())?.st_ino();
    // bpftool walks link IDs and then opens each one: a link that parallel
    // tests remove in between makes it fail. Such a failure is transient.
    let mut attempt = 0;
    let out = loop {
        match dataplane_tests::run("bpftool", &["link", "show", "--json"]) {
            Ok(out) => break out,
            Err(e) if attempt >= 10 => return Err(e),
            Err(_) => attempt += 1,
        }
    };
    let links: serde_json::Value = serde_json::from_str(&out)?;
    Ok(links
        .as_array()
        .map(|links| {
            links
                .iter()
                .filter(|l| l["type"] == "netns" && l["netns_ino"].as_u64() == Some(ino))
                .count()
        })
        .unwrap_or(0))
}

fn open_map<T>(pins: &PinLayout, name: &str) -> anyhow::Result<T>
where
    T: TryFrom<Map, Error = aya::maps::MapError>,
{
    Ok(T::try_from(Map::from_map_data(MapData::from_pin(
        pins.map(name),
    )?)?)?)
}

fn addr16(ip: IpAddr) -> IpAddr16 {
    let v6 = match ip {
        IpAddr::V4(v4) => v4.to_ipv6_mapped(),
        IpAddr::V6(v6) => v6,
    };
    IpAddr16::from_octets(v6.octets())
}

/// The address a map key holds, IPv4-mapped shown as IPv4.
fn ip_of(addr: &IpAddr16) -> IpAddr {
    Ipv6Addr::from(addr.octets()).to_canonical()
}

/// Every map entry that belongs to the pod with `cookie` or to one of
/// `ips`, read straight from the pinned maps, as sorted readable lines.
fn pod_entries(pins: &PinLayout, cookie: u64, ips: &[IpAddr]) -> anyhow::Result<Vec<String>> {
    let ips: Vec<IpAddr16> = ips.iter().map(|ip| addr16(*ip)).collect();
    let mut found = Vec::new();
    let enrolled: BpfHashMap<MapData, u64, EnrolledNetns> = open_map(pins, m::ENROLLED_NETNS)?;
    for key in enrolled.keys() {
        if key? == cookie {
            found.push("enrolled_netns".to_string());
        }
    }
    let pods: BpfHashMap<MapData, IpAddr16, PodInbound> = open_map(pins, m::POD_INBOUND)?;
    for entry in pods.iter() {
        let (ip, pod) = entry?;
        if pod.netns_cookie == cookie || ips.contains(&ip) {
            found.push(format!("pod_inbound {}", ip_of(&ip)));
        }
    }
    let listeners: SockHash<MapData, ListenerKey> = open_map(pins, m::LISTENERS)?;
    for key in listeners.keys() {
        let key = key?;
        if ips.contains(&key.pod_addr) {
            found.push(format!(
                "listener {}",
                SocketAddr::new(ip_of(&key.pod_addr), key.port)
            ));
        }
    }
    let in_ports: BpfHashMap<MapData, PodPort, u8> = open_map(pins, m::IN_EXCL_PORTS)?;
    for key in in_ports.keys() {
        let key = key?;
        if ips.contains(&key.pod_addr) {
            found.push(format!(
                "inbound_excluded {}",
                SocketAddr::new(ip_of(&key.pod_addr), key.port)
            ));
        }
    }
    let out_ports: BpfHashMap<MapData, NetnsPort, u8> = open_map(pins, m::OUT_EXCL_PORTS)?;
    for key in out_ports.keys() {
        let key = key?;
        if key.netns_cookie == cookie {
            found.push(format!("outbound_excluded port {}", key.port));
        }
    }
    let cidrs: LpmTrie<MapData, NetnsAddr, u8> = open_map(pins, m::OUT_EXCL_CIDRS)?;
    for key in cidrs.keys() {
        let key = key?;
        let data = key.data();
        if u64::from_be_bytes(data.netns_cookie_be) == cookie {
            let ip = ip_of(&data.addr);
            // Prefix bits: 64 for the cookie, 96 more for an IPv4-mapped
            // address.
            let bits = key.prefix_len() - 64 - if ip.is_ipv4() { 96 } else { 0 };
            found.push(format!("outbound_excluded cidr {ip}/{bits}"));
        }
    }
    found.sort();
    Ok(found)
}

// ---------------------------------------------------------------- outbound

#[test]
fn outbound_v4_is_captured_with_its_original_destination() -> anyhow::Result<()> {
    let mut w = World::new("rko4", |_| {})?;
    w.enroll(&Exclusions::default())?;
    let dst = at(w.peer.ip4, APP_PORT);
    let reply = dial(&w.app, &dst, &["--print-peer"])?;
    assert_eq!(reply, Ok(format!("peer={dst}\norig={dst}")));
    let c = w.counters()?;
    assert_eq!(c["redirected_outbound"], 1);
    assert_eq!(c["orig_dst_recorded"], 1);
    assert_eq!(c["peer_rewritten"], 1);
    // The engine consumed the tuple record; the socket's cookie record goes
    // when the client socket reaches TCP_CLOSE, which happens in the kernel
    // shortly after the client exits.
    let records = || -> anyhow::Result<usize> {
        let by_cookie: BpfHashMap<MapData, u64, OrigDst> = open_map(&w.pins, m::ORIG_DST_COOKIE)?;
        let by_tuple: BpfHashMap<MapData, SockTuple, OrigDst> = open_map(&w.pins, m::ORIG_DST)?;
        Ok(by_cookie.keys().count() + by_tuple.keys().count())
    };
    assert!(eventually(|| Ok(records()? == 0))?, "records left behind");
    Ok(())
}

#[test]
fn outbound_v6_is_captured_with_its_original_destination() -> anyhow::Result<()> {
    let mut w = World::new("rko6", |_| {})?;
    w.enroll(&Exclusions::default())?;
    let dst = at(w.peer.ip6, APP_PORT);
    let reply = dial(&w.app, &dst, &["--print-peer"])?;
    assert_eq!(reply, Ok(format!("peer={dst}\norig={dst}")));
    assert_eq!(w.counter("redirected_outbound")?, 1);
    assert_eq!(w.counter("peer_rewritten")?, 1);
    Ok(())
}

#[test]
fn outbound_v4_mapped_is_captured_through_an_ipv6_socket() -> anyhow::Result<()> {
    let mut w = World::new("rkomap", |_| {})?;
    w.enroll(&Exclusions::default())?;
    // The app dials an IPv4 peer from an IPv6 socket: it sees the mapped
    // peer it asked for; the engine gets the IPv4 destination.
    let dst = mapped(w.peer.ip4, APP_PORT);
    let reply = dial(&w.app, &dst, &["--print-peer"])?;
    assert_eq!(
        reply,
        Ok(format!("peer={dst}\norig={}", at(w.peer.ip4, APP_PORT)))
    );
    assert_eq!(w.counter("redirected_outbound")?, 1);
    assert_eq!(w.counter("orig_dst_recorded")?, 1);
    Ok(())
}

#[test]
fn so_original_dst_is_answered_and_other_options_are_untouched() -> anyhow::Result<()> {
    let mut w = World::unserved("rkoptv", |_| {})?;
    w.enroll(&Exclusions::default())?;
    // An unmodified proxy: accept from the outbound listener and ask the
    // kernel where the connection was going.
    let listener = w
        .engine
        .outbound_listener
        .take()
        .ok_or_else(|| anyhow::anyhow!("no outbound listener"))?;
    let v4_dst: SocketAddr = SocketAddr::new(w.peer.ip4.into(), APP_PORT);
    let v6_dst: SocketAddr = SocketAddr::new(w.peer.ip6.into(), APP_PORT);
    let sockaddr_in = 16;
    let sockaddr_in6 = 28;

    for dst in [v4_dst, v6_dst] {
        let mut cmd = Command::new(probe_binary()?);
        cmd.args(["connect", &dst.to_string(), "hello"]);
        let client = spawn_in(cmd, Some(w.app.netns.path()), Some(w.app.cgroup.path()))?;
        let mut stream = accept_one(&listener)?;
        if dst.is_ipv4() {
            assert_eq!(original_dst(&stream, SOL_IP, sockaddr_in)?, dst);
            // The IPv6 form of an IPv4 destination is its mapped address.
            assert_eq!(
                original_dst(&stream, SOL_IPV6, sockaddr_in6)?,
                SocketAddr::new(IpAddr::V6(w.peer.ip4.to_ipv6_mapped()), APP_PORT)
            );
            // A buffer too small for a sockaddr_in gets no answer.
            assert!(original_dst(&stream, SOL_IP, 8).is_err());
        } else {
            assert_eq!(original_dst(&stream, SOL_IPV6, sockaddr_in6)?, dst);
            // An IPv6 destination has no sockaddr_in form.
            assert!(original_dst(&stream, SOL_IP, sockaddr_in).is_err());
        }
        // Other options pass through with their normal values.
        stream.set_nodelay(true)?;
        assert_eq!(
            int_option(&stream, libc::IPPROTO_TCP, libc::TCP_NODELAY)?,
            (1, 4)
        );
        let (rcvbuf, len) = int_option(&stream, libc::SOL_SOCKET, libc::SO_RCVBUF)?;
        assert!(rcvbuf > 0 && len == 4, "SO_RCVBUF {rcvbuf} ({len} bytes)");
        let mut body = Vec::new();
        stream.read_to_end(&mut body)?;
        assert_eq!(body, b"hello");
        stream.write_all(b"proxied")?;
        drop(stream);
        let out = client.wait(LIMIT)?;
        assert_eq!(out.code, Some(0), "{}", out.stderr);
        assert_eq!(out.stdout, "proxied");
    }
    assert_eq!(w.counter("orig_dst_answered")?, 3);
    Ok(())
}

#[test]
fn excluded_outbound_port_and_cidr_are_exempt() -> anyhow::Result<()> {
    let mut w = World::new("rkoexcl", |_| {})?;
    let exclusions = Exclusions {
        outbound_ports: vec![8081],
        outbound_cidrs: vec![
            format!("{}/32", w.other.ip4).parse()?,
            format!("{}/128", w.other.ip6).parse()?,
        ],
        inbound_ports: vec![],
    };
    w.enroll(&exclusions)?;
    assert_eq!(dial(&w.app, &at(w.peer.ip4, 8081), &[])?, Ok("peer".into()));
    assert_eq!(dial(&w.app, &at(w.peer.ip6, 8081), &[])?, Ok("peer".into()));
    assert_eq!(
        dial(&w.app, &at(w.other.ip4, APP_PORT), &[])?,
        Ok("other".into())
    );
    assert_eq!(
        dial(&w.app, &at(w.other.ip6, APP_PORT), &[])?,
        Ok("other".into())
    );
    assert_eq!(
        dial(&w.app, &mapped(w.other.ip4, APP_PORT), &[])?,
        Ok("other".into())
    );
    // Everything else is still captured.
    let dst = at(w.peer.ip4, APP_PORT);
    assert_eq!(dial(&w.app, &dst, &[])?, Ok(format!("orig={dst}")));
    let c = w.counters()?;
    assert_eq!(c["exempt_excluded_port"], 2);
    assert_eq!(c["exempt_excluded_cidr"], 3);
    assert_eq!(c["redirected_outbound"], 1);
    Ok(())
}

#[test]
fn loopback_and_proxy_marked_traffic_is_untouched() -> anyhow::Result<()> {
    let mut w = World::new("rklo", |_| {})?;
    w.enroll(&Exclusions::default())?;
    assert_eq!(
        dial(&w.app, &at([127, 0, 0, 1], APP_PORT), &[])?,
        Ok("app".into())
    );
    assert_eq!(
        dial(&w.app, &at(Ipv6Addr::LOCALHOST, APP_PORT), &[])?,
        Ok("app".into())
    );
    assert_eq!(w.counter("exempt_loopback")?, 2);
    // The engine's own sockets carry the proxy mark: not captured outbound,
    // and a connection to its own pod IP is not captured inbound either.
    let mark = format!("{DEFAULT_PROXY_MARK:#x}");
    assert_eq!(
        dial(&w.app, &at(w.app.ip4, APP_PORT), &["--mark", &mark])?,
        Ok("app".into())
    );
    assert_eq!(
        dial(&w.app, &at(w.peer.ip6, APP_PORT), &["--mark", &mark])?,
        Ok("peer".into())
    );
    let c = w.counters()?;
    assert_eq!(c["exempt_proxy_mark"], 2);
    assert_eq!(
        c["exempt_loopback"], 3,
        "pod to its own IP is exempt inbound"
    );
    assert_eq!(c["redirected_outbound"], 0);
    assert_eq!(c["redirected_inbound"], 0);
    Ok(())
}

#[test]
fn pod_not_enrolled_is_untouched() -> anyhow::Result<()> {
    let mut w = World::new("rknoenr", |_| {})?;
    w.enroll(&Exclusions::default())?;
    // `other` is in the node's cgroup but not enrolled, in both directions.
    assert_eq!(
        dial(&w.other, &at(w.peer.ip4, APP_PORT), &[])?,
        Ok("peer".into())
    );
    assert_eq!(
        dial(&w.other, &at(w.peer.ip6, APP_PORT), &[])?,
        Ok("peer".into())
    );
    assert_eq!(
        dial(&w.peer, &at(w.other.ip4, APP_PORT), &[])?,
        Ok("other".into())
    );
    let c = w.counters()?;
    assert_eq!(c["redirected_outbound"], 0);
    assert_eq!(c["redirected_inbound"], 0);
    assert!(c["skipped_not_enrolled"] >= 3);
    Ok(())
}

#[test]
fn engine_ports_are_refused_not_looped() -> anyhow::Result<()> {
    let mut w = World::new("rkself", |_| {})?;
    w.enroll(&Exclusions::default())?;
    // Outbound to a capture port: connect() fails with EPERM.
    assert_eperm(
        &dial(&w.app, &at(w.peer.ip4, 15001), &[])?,
        "app -> peer:15001",
    );
    assert_eperm(
        &dial(&w.app, &at(w.peer.ip6, 15006), &[])?,
        "app -> [peer]:15006",
    );
    // Inbound to a capture port from outside the pod: the lookup ends with
    // no match, so the client gets a reset.
    assert_refused(
        &dial(&w.peer, &at(w.app.ip4, 15006), &[])?,
        "peer -> app:15006",
    );
    assert_refused(
        &dial(&w.peer, &at(w.app.ip6, 15001), &[])?,
        "peer -> [app]:15001",
    );
    assert_eq!(w.counter("refused_engine_port")?, 4);
    assert!(
        w.engine
            .inbound
            .as_ref()
            .is_some_and(|r| r.drain().is_empty()),
        "nothing reached the inbound listener"
    );
    Ok(())
}

// ----------------------------------------------------------------- inbound

#[test]
fn inbound_from_another_pod_reaches_the_inbound_listener() -> anyhow::Result<()> {
    let mut w = World::new("rkin", |_| {})?;
    w.enroll(&Exclusions::default())?;
    for (dst, from) in [
        (
            SocketAddr::new(w.app.ip4.into(), APP_PORT),
            IpAddr::from(w.peer.ip4),
        ),
        (
            SocketAddr::new(w.app.ip6.into(), APP_PORT),
            IpAddr::from(w.peer.ip6),
        ),
    ] {
        // The accepted socket's local address is the original destination.
        assert_eq!(
            dial(&w.peer, &dst.to_string(), &[])?,
            Ok(format!("inbound local={dst} peer={from}"))
        );
    }
    assert_eq!(w.counter("redirected_inbound")?, 2);
    Ok(())
}

#[test]
fn hbone_port_reaches_the_hbone_listener() -> anyhow::Result<()> {
    let mut w = World::new("rkhbone", |_| {})?;
    w.enroll(&Exclusions::default())?;
    for ip in [IpAddr::from(w.app.ip4), IpAddr::from(w.app.ip6)] {
        let dst = SocketAddr::new(ip, 15008);
        let reply = dial(&w.peer, &dst.to_string(), &[])?;
        assert!(
            reply
                .as_ref()
                .is_ok_and(|r| r.starts_with(&format!("hbone local={dst} "))),
            "{reply:?}"
        );
    }
    // Tunnel traffic leaving an enrolled pod is not captured again.
    let reply = dial(&w.app, &at(w.peer.ip4, 15008), &[])?;
    assert!(reply.is_err(), "peer has no 15008 listener: {reply:?}");
    let c = w.counters()?;
    assert_eq!(c["inbound_hbone"], 2);
    assert_eq!(c["exempt_hbone_port"], 1);
    Ok(())
}

#[test]
fn probe_sources_are_exempt() -> anyhow::Result<()> {
    let mut w = World::new("rkprobe", |_| {})?;
    let probe_v6 = w.peer.ip6;
    let mut w2 = World::new("rkprobe2", |o| o.probe_sources = vec![probe_v6.into()])?;
    for w in [&mut w, &mut w2] {
        w.enroll(&Exclusions::default())?;
    }
    // The node's address toward the pod (kubelet) reaches the app directly.
    assert_eq!(
        dial_in(w.node.netns(), None, &at(w.app.ip4, APP_PORT), &[])?,
        Ok("app".into())
    );
    assert_eq!(w.counter("exempt_probe")?, 1);
    // So does a configured probe source, and only that one.
    assert_eq!(
        dial(&w2.peer, &at(w2.app.ip6, APP_PORT), &[])?,
        Ok("app".into())
    );
    let reply = dial(&w2.peer, &at(w2.app.ip4, APP_PORT), &[])?;
    assert!(
        reply.as_ref().is_ok_and(|r| r.starts_with("inbound ")),
        "{reply:?}"
    );
    assert_eq!(w2.counter("exempt_probe")?, 1);
    Ok(())
}

#[test]
fn excluded_inbound_port_is_exempt() -> anyhow::Result<()> {
    let mut w = World::new("rkinex", |_| {})?;
    let exclusions = Exclusions {
        inbound_ports: vec![9090],
        ..Exclusions::default()
    };
    w.enroll(&exclusions)?;
    assert_eq!(dial(&w.peer, &at(w.app.ip4, 9090), &[])?, Ok("app".into()));
    assert_eq!(dial(&w.peer, &at(w.app.ip6, 9090), &[])?, Ok("app".into()));
    let reply = dial(&w.peer, &at(w.app.ip4, APP_PORT), &[])?;
    assert!(
        reply.as_ref().is_ok_and(|r| r.starts_with("inbound ")),
        "{reply:?}"
    );
    assert_eq!(w.counter("exempt_excluded_port")?, 2);
    Ok(())
}

// ------------------------------------------------------------- engine down

#[test]
fn engine_down_fail_closed_refuses() -> anyhow::Result<()> {
    let mut w = World::new("rkfclose", |_| {})?;
    w.enroll(&Exclusions::default())?;
    // Orderly stop: readiness cleared and listeners closed.
    w.redirector()?.set_engine_ready(false)?;
    w.engine.close_outbound()?;
    w.engine.close_inbound()?;
    assert_refused(&dial(&w.app, &at(w.peer.ip4, APP_PORT), &[])?, "outbound");
    assert_refused(
        &dial(&w.app, &at(w.peer.ip6, APP_PORT), &[])?,
        "outbound v6",
    );
    assert_refused(&dial(&w.peer, &at(w.app.ip4, APP_PORT), &[])?, "inbound");
    assert_refused(&dial(&w.peer, &at(w.app.ip6, 15008), &[])?, "inbound hbone");
    let c = w.counters()?;
    assert_eq!(c["engine_down_refused"], 4);
    assert_eq!(c["redirected_outbound"], 0);
    Ok(())
}

#[test]
fn engine_down_fail_open_passes() -> anyhow::Result<()> {
    let mut w = World::new("rkfopen", |o| o.fail_open = true)?;
    w.enroll(&Exclusions::default())?;
    w.redirector()?.set_engine_ready(false)?;
    // Outbound goes direct even though the listener is still there.
    assert_eq!(
        dial(&w.app, &at(w.peer.ip4, APP_PORT), &[])?,
        Ok("peer".into())
    );
    w.engine.close_inbound()?;
    assert_eq!(
        dial(&w.peer, &at(w.app.ip4, APP_PORT), &[])?,
        Ok("app".into())
    );
    assert_eq!(w.counter("engine_down_passed")?, 2);
    // Ready again: captured again.
    w.redirector()?.set_engine_ready(true)?;
    let dst = at(w.peer.ip4, APP_PORT);
    assert_eq!(dial(&w.app, &dst, &[])?, Ok(format!("orig={dst}")));
    Ok(())
}

// ------------------------------------------------------------- life cycle

#[test]
fn unenroll_restores_direct_traffic_and_leaves_nothing() -> anyhow::Result<()> {
    let mut w = World::new("rkunenr", |_| {})?;
    let exclusions = Exclusions {
        outbound_ports: vec![8081],
        outbound_cidrs: vec!["10.9.0.0/16".parse()?, "fd09::/32".parse()?],
        inbound_ports: vec![9090],
    };
    w.enroll(&exclusions)?;
    let cookie = w.app_cookie()?;
    let ips = [IpAddr::V4(w.app.ip4), IpAddr::V6(w.app.ip6)];
    assert_eq!(sk_lookup_links(&w.app.netns)?, 1);
    let (a4, a6) = (w.app.ip4, w.app.ip6);
    let mut expected = vec![
        "enrolled_netns".to_string(),
        format!("inbound_excluded {a4}:9090"),
        format!("inbound_excluded [{a6}]:9090"),
        format!("listener {a4}:15006"),
        format!("listener {a4}:15008"),
        format!("listener [{a6}]:15006"),
        format!("listener [{a6}]:15008"),
        "outbound_excluded cidr 10.9.0.0/16".to_string(),
        "outbound_excluded cidr fd09::/32".to_string(),
        "outbound_excluded port 8081".to_string(),
        format!("pod_inbound {a4}"),
        format!("pod_inbound {a6}"),
    ];
    expected.sort();
    assert_eq!(pod_entries(&w.pins, cookie, &ips)?, expected);
    let dst = at(w.peer.ip4, APP_PORT);
    assert_eq!(dial(&w.app, &dst, &[])?, Ok(format!("orig={dst}")));

    w.redirector()?.unenroll_pod(cookie)?;
    w.redirector()?.unenroll_pod(cookie)?; // idempotent
    assert_eq!(dial(&w.app, &dst, &[])?, Ok("peer".into()));
    assert_eq!(
        dial(&w.peer, &at(w.app.ip4, APP_PORT), &[])?,
        Ok("app".into())
    );
    assert_eq!(sk_lookup_links(&w.app.netns)?, 0);
    assert!(!w.pins.sk_lookup_link(cookie).exists());
    assert_eq!(pod_entries(&w.pins, cookie, &ips)?, Vec::<String>::new());
    assert!(!w.redirector()?.enrolled_cookies()?.contains(&cookie));
    Ok(())
}

#[test]
fn reenroll_is_idempotent_and_drops_what_is_no_longer_wanted() -> anyhow::Result<()> {
    let mut w = World::new("rkreenr", |_| {})?;
    let exclusions = Exclusions {
        outbound_ports: vec![8081],
        inbound_ports: vec![9090],
        ..Exclusions::default()
    };
    w.enroll(&exclusions)?;
    w.enroll(&exclusions)?;
    let cookie = w.app_cookie()?;
    assert_eq!(sk_lookup_links(&w.app.netns)?, 1, "one link per pod");
    assert_eq!(w.redirector()?.enrolled_cookies()?, vec![cookie]);
    assert_eq!(dial(&w.app, &at(w.peer.ip4, 8081), &[])?, Ok("peer".into()));
    let inbound = dial(&w.peer, &at(w.app.ip6, APP_PORT), &[])?;
    assert!(
        inbound.as_ref().is_ok_and(|r| r.starts_with("inbound ")),
        "{inbound:?}"
    );

    // The pod loses its IPv6 address and its exclusions.
    w.enroll_ips(&[IpAddr::V4(w.app.ip4)], &Exclusions::default())?;
    assert_eq!(sk_lookup_links(&w.app.netns)?, 1);
    let dst = at(w.peer.ip4, 8081);
    assert_eq!(dial(&w.app, &dst, &[])?, Ok(format!("orig={dst}")));
    let inbound = dial(&w.peer, &at(w.app.ip4, 9090), &[])?;
    assert!(
        inbound.as_ref().is_ok_and(|r| r.starts_with("inbound ")),
        "{inbound:?}"
    );
    assert_eq!(
        dial(&w.peer, &at(w.app.ip6, APP_PORT), &[])?,
        Ok("app".into())
    );
    let ips = [IpAddr::V4(w.app.ip4), IpAddr::V6(w.app.ip6)];
    let a4 = w.app.ip4;
    assert_eq!(
        pod_entries(&w.pins, cookie, &ips)?,
        [
            "enrolled_netns".to_string(),
            format!("listener {a4}:15006"),
            format!("listener {a4}:15008"),
            format!("pod_inbound {a4}"),
        ],
        "stale entries left"
    );
    Ok(())
}

#[test]
fn restarted_agent_readopts_and_unenrolls_from_the_maps() -> anyhow::Result<()> {
    let mut w = World::new("rkrestart", |_| {})?;
    let exclusions = Exclusions {
        outbound_ports: vec![8081],
        outbound_cidrs: vec![format!("{}/32", w.other.ip4).parse()?],
        inbound_ports: vec![9090],
    };
    w.enroll(&exclusions)?;
    let cookie = w.app_cookie()?;
    let ips = [IpAddr::V4(w.app.ip4), IpAddr::V6(w.app.ip6)];
    let options = RedirectorOptions::new(w.node.cgroup().path().to_path_buf(), w.pins.clone());
    let restart = |w: &mut World| -> anyhow::Result<()> {
        if let Some(r) = w.redirector.take() {
            r.shutdown(ExitMode::Keep)?;
        }
        w.redirector = Some(Redirector::attach(&options)?);
        Ok(())
    };

    // Capture survives the restart: the previous generation's sk_lookup
    // link stays until the pod is enrolled again.
    restart(&mut w)?;
    assert_eq!(w.redirector()?.enrolled_cookies()?, vec![cookie]);
    let inbound = dial(&w.peer, &at(w.app.ip4, APP_PORT), &[])?;
    assert!(
        inbound.as_ref().is_ok_and(|r| r.starts_with("inbound ")),
        "{inbound:?}"
    );

    // Re-adoption replaces the link and drops an exclusion the new
    // registration lacks, though this agent never saw the old one.
    let fewer = Exclusions {
        outbound_ports: vec![],
        ..exclusions.clone()
    };
    w.enroll(&fewer)?;
    assert_eq!(sk_lookup_links(&w.app.netns)?, 1);
    let dst = at(w.peer.ip4, 8081);
    assert_eq!(dial(&w.app, &dst, &[])?, Ok(format!("orig={dst}")));
    assert_eq!(
        dial(&w.app, &at(w.other.ip4, APP_PORT), &[])?,
        Ok("other".into())
    );

    // A second restart, then unenroll with an empty registry.
    restart(&mut w)?;
    w.redirector()?.unenroll_pod(cookie)?;
    assert_eq!(sk_lookup_links(&w.app.netns)?, 0);
    assert_eq!(pod_entries(&w.pins, cookie, &ips)?, Vec::<String>::new());
    assert_eq!(
        dial(&w.peer, &at(w.app.ip4, APP_PORT), &[])?,
        Ok("app".into())
    );
    Ok(())
}

#[test]
fn enroll_refuses_listeners_sk_lookup_could_not_use() -> anyhow::Result<()> {
    let mut w = World::new("rkbadlsn", |_| {})?;
    let cookie = w.app_cookie()?;
    let ips = [IpAddr::V4(w.app.ip4), IpAddr::V6(w.app.ip6)];
    let netns = File::open(w.app.netns.path())?;
    let udp = w
        .app
        .netns
        .run(|| std::net::UdpSocket::bind("[::]:15006"))??;
    let v4_only = w.app.netns.run(|| TcpListener::bind("0.0.0.0:15016"))??;
    let good = w
        .engine
        .hbone_fd
        .as_ref()
        .ok_or_else(|| anyhow::anyhow!("no hbone listener"))?
        .try_clone()?;
    let exclusions = Exclusions::default();
    for (inbound, reason) in [
        (udp.as_fd(), "not a TCP socket"),
        (v4_only.as_fd(), "IPv6 connections"),
    ] {
        let capture = PodCapture {
            netns_cookie: cookie,
            netns: netns.as_fd(),
            ips: &ips,
            node_addr: None,
            exclusions: &exclusions,
            inbound_listener: inbound,
            hbone_listener: good.as_fd(),
        };
        let err = w
            .redirector()?
            .enroll_pod(&capture)
            .err()
            .ok_or_else(|| anyhow::anyhow!("enrolled with an unusable listener"))?;
        assert!(err.to_string().contains(reason), "{err}");
    }
    // Refused before anything was written.
    assert_eq!(pod_entries(&w.pins, cookie, &ips)?, Vec::<String>::new());
    assert_eq!(sk_lookup_links(&w.app.netns)?, 0);
    Ok(())
}

#[test]
fn detach_shutdown_removes_every_link() -> anyhow::Result<()> {
    let mut w = World::new("rkdetach", |_| {})?;
    w.enroll(&Exclusions::default())?;
    assert_eq!(sk_lookup_links(&w.app.netns)?, 1);
    if let Some(r) = w.redirector.take() {
        r.shutdown(ExitMode::Detach)?;
    }
    assert_eq!(sk_lookup_links(&w.app.netns)?, 0);
    assert!(!w.pins.dir().exists());
    assert_eq!(
        dial(&w.app, &at(w.peer.ip4, APP_PORT), &[])?,
        Ok("peer".into())
    );
    assert_eq!(
        dial(&w.peer, &at(w.app.ip4, APP_PORT), &[])?,
        Ok("app".into())
    );
    Ok(())
}
