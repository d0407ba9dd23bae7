//! One simulated node with an in-process [`Redirector`] attached at its
//! cgroup, and the test playing the engine: the kernel side of the
//! redirection model without an agent process.
//!
//! The node has three pods: `app` (the pod under test, enrolled when a test
//! says so), `peer` and `other` (plain pods). The test's engine makes the
//! listeners in the app pod's namespace and answers each captured
//! connection with what it saw; apps answer with their name, so each reply
//! says where a connection went. Guards detach the redirector and remove
//! namespaces, cgroups, pins and child processes even when a test fails.
//! Nothing waits on time: every wait is for an event, bounded by a
//! generous limit that only guards against hangs.

use std::{
    collections::HashMap,
    fs::File,
    io::IoSliceMut,
    net::{IpAddr, Ipv6Addr, SocketAddr, TcpListener, TcpStream},
    os::{
        fd::{AsFd, AsRawFd, FromRawFd, OwnedFd},
        linux::fs::MetadataExt,
        unix::net::UnixStream,
    },
    process::Command,
    time::Duration,
};

use aya::maps::{HashMap as BpfHashMap, LpmTrie, Map, MapData, SockHash};
use dataplane_common::{
    EnrolledNetns, IpAddr16, ListenerKey, NetnsAddr, NetnsPort, PodInbound, PodPort, maps as m,
};
use dataplane_user::redirect::{
    Exclusions, ExitMode, ExternalPodCapture, OrigDstTable, PinLayout, PodCapture, Redirector,
    RedirectorOptions,
};

use crate::{
    BpffsDir, Netns, Responder, probe_binary, spawn_in, spawn_in_passing,
    topology::{Node, Pod},
};

/// Guard against hangs only; nothing asserts on time.
pub const LIMIT: Duration = Duration::from_secs(20);
/// Port every app listens on.
pub const APP_PORT: u16 = 8080;

/// What a `dp-probe connect` run produced: its stdout on success, its
/// stderr (the error) on failure.
pub type Dial = Result<String, String>;

/// A pod's plain servers: each answers `<name>` on every port it serves.
pub struct AppServers {
    _servers: Vec<Responder>,
}

impl AppServers {
    /// Starts `name`'s servers on `ports` (every address) in `pod`.
    pub fn start(pod: &Pod, name: &'static str, ports: &[u16]) -> anyhow::Result<Self> {
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
pub struct PlayedEngine {
    /// Outbound capture listener ([::]:15001), created by a process in the
    /// app pod's cgroup so the cgroup programs see its sockets. Taken by
    /// [`PlayedEngine::serve_outbound`] or by a test that accepts itself.
    pub outbound_listener: Option<TcpListener>,
    /// Answers `orig=<original destination>` on each captured connection.
    pub outbound: Option<Responder>,
    /// Inbound plaintext listener ([::]:15006): answers `inbound local=...`.
    pub inbound: Option<Responder>,
    /// HBONE listener ([::]:15008): answers `hbone local=...`.
    pub hbone: Option<Responder>,
    /// Second descriptors of the three listeners: for (re-)enrollment, and
    /// to stop them for certain (see `stop_listening`).
    pub outbound_fd: Option<OwnedFd>,
    /// See `outbound_fd`.
    pub inbound_fd: Option<OwnedFd>,
    /// See `outbound_fd`.
    pub hbone_fd: Option<OwnedFd>,
    /// The app pod's namespace, whose original destinations the outbound
    /// listener reads.
    netns_cookie: u64,
}

impl PlayedEngine {
    /// Starts the three listeners in `app`; the outbound one is not served yet.
    pub fn start(app: &Pod) -> anyhow::Result<Self> {
        let outbound_listener = listener_in_pod(app, "[::]:15001")?;
        let outbound_fd = outbound_listener.try_clone()?.into();
        let inbound = app.netns.run(|| TcpListener::bind("[::]:15006"))??;
        let hbone = app.netns.run(|| TcpListener::bind("[::]:15008"))??;
        let inbound_fd = inbound.try_clone()?.into();
        let hbone_fd = hbone.try_clone()?.into();
        let describe = |role: &'static str| {
            move |req: &crate::responder::Request| {
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
            netns_cookie: app.netns.cookie()?,
        })
    }

    /// Serves the outbound listener: each captured connection is answered
    /// with the original destination user space recovers for it.
    pub fn serve_outbound(&mut self, pins: &PinLayout) -> anyhow::Result<()> {
        let listener = self
            .outbound_listener
            .take()
            .ok_or_else(|| anyhow::anyhow!("outbound listener already taken"))?;
        let mut table = OrigDstTable::open(pins, self.netns_cookie)?;
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
    pub fn close_inbound(&mut self) -> anyhow::Result<()> {
        stop_listening(self.inbound_fd.take())?;
        stop_listening(self.hbone_fd.take())?;
        self.inbound = None;
        self.hbone = None;
        Ok(())
    }

    /// Stops the outbound listener.
    pub fn close_outbound(&mut self) -> anyhow::Result<()> {
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
pub struct RedirectorNode {
    /// The in-process redirector (`None` once a test shut it down).
    pub redirector: Option<Redirector>,
    /// The app pod's engine, played by the test.
    pub engine: PlayedEngine,
    _apps: Vec<AppServers>,
    /// The pod under test.
    pub app: Pod,
    /// A plain pod (servers on 8080, 8081, 15001, 15006).
    pub peer: Pod,
    /// Another plain pod (a server on 8080).
    pub other: Pod,
    /// The node.
    pub node: Node,
    /// Where the redirector's maps and links are pinned.
    pub pins: PinLayout,
    _bpffs: BpffsDir,
}

impl RedirectorNode {
    /// Builds the world, with the engine serving its outbound listener;
    /// `configure` adjusts the redirector options.
    pub fn new(tag: &str, configure: impl FnOnce(&mut RedirectorOptions)) -> anyhow::Result<Self> {
        let mut world = Self::unserved(tag, configure)?;
        world.engine.serve_outbound(&world.pins)?;
        Ok(world)
    }

    /// Builds the world with the outbound listener left to the test.
    pub fn unserved(
        tag: &str,
        configure: impl FnOnce(&mut RedirectorOptions),
    ) -> anyhow::Result<Self> {
        let bpffs = BpffsDir::new(tag)?;
        let mut node = Node::new(tag, 1)?;
        let app = node.add_pod(tag)?;
        let peer = node.add_pod(tag)?;
        let other = node.add_pod(tag)?;
        let apps = vec![
            AppServers::start(&app, "app", &[APP_PORT, 9090])?,
            AppServers::start(&peer, "peer", &[APP_PORT, 8081, 15001, 15006])?,
            AppServers::start(&other, "other", &[APP_PORT])?,
        ];
        let pins = PinLayout::new(bpffs.path(), "rk");
        let mut options = RedirectorOptions::new(node.cgroup().path().to_path_buf(), pins.clone());
        configure(&mut options);
        let redirector = Redirector::attach(&options)?;
        let engine = PlayedEngine::start(&app)?;
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

    /// The attached redirector (an error once a test shut it down).
    pub fn redirector(&mut self) -> anyhow::Result<&mut Redirector> {
        self.redirector
            .as_mut()
            .ok_or_else(|| anyhow::anyhow!("redirector gone"))
    }

    /// Enrolls the app pod with both IPs and `exclusions`.
    pub fn enroll(&mut self, exclusions: &Exclusions) -> anyhow::Result<()> {
        let ips = [IpAddr::V4(self.app.ip4), IpAddr::V6(self.app.ip6)];
        self.enroll_ips(&ips, exclusions)
    }

    /// Enrolls the app pod with `ips` and `exclusions`.
    pub fn enroll_ips(&mut self, ips: &[IpAddr], exclusions: &Exclusions) -> anyhow::Result<()> {
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
            dns_capture: false,
        };
        self.redirector()?.enroll_pod(&capture)?;
        Ok(())
    }

    /// Enrolls the pod `pick` chooses, with both IPs, as a pod served by an
    /// external proxy (whose original destinations are read with
    /// `getsockopt(SO_ORIGINAL_DST)`), its outbound capture on. Its inbound
    /// listeners are not registered.
    pub fn enroll_external(&mut self, pick: impl Fn(&Self) -> &Pod) -> anyhow::Result<()> {
        let pod = pick(self);
        let ips = [IpAddr::V4(pod.ip4), IpAddr::V6(pod.ip6)];
        let netns = File::open(pod.netns.path())?;
        let (netns_cookie, node_side) = (pod.netns.cookie()?, pod.node_side);
        let capture = ExternalPodCapture {
            netns_cookie,
            netns: netns.as_fd(),
            ips: &ips,
            node_addr: Some(node_side),
            exclusions: &Exclusions::default(),
            dns_capture: false,
        };
        let redirector = self.redirector()?;
        redirector.enroll_external_pod(&capture)?;
        redirector.set_engine_ready(true)?;
        Ok(())
    }

    /// The app pod's netns cookie.
    pub fn app_cookie(&self) -> anyhow::Result<u64> {
        self.app.netns.cookie()
    }

    /// The redirector's kernel counters by name.
    pub fn counters(&self) -> anyhow::Result<HashMap<&'static str, u64>> {
        crate::counters::all(&self.pins)
    }

    /// One kernel counter.
    pub fn counter(&self, name: &str) -> anyhow::Result<u64> {
        crate::counters::one(&self.pins, name)
    }
}

impl Drop for RedirectorNode {
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
pub fn dial_in(
    netns: &Netns,
    cgroup: Option<&crate::Cgroup>,
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
pub fn dial(pod: &Pod, dst: &str, extra: &[&str]) -> anyhow::Result<Dial> {
    dial_in(&pod.netns, Some(&pod.cgroup), dst, extra)
}

/// `ip:port` as a probe argument.
pub fn at(ip: impl Into<IpAddr>, port: u16) -> String {
    SocketAddr::new(ip.into(), port).to_string()
}

/// `[::ffff:a.b.c.d]:port`.
pub fn mapped(ip: std::net::Ipv4Addr, port: u16) -> String {
    SocketAddr::new(IpAddr::V6(ip.to_ipv6_mapped()), port).to_string()
}

/// Asserts the dial was refused (`ECONNREFUSED`).
pub fn assert_refused(dial: &Dial, what: &str) {
    match dial {
        Err(e) => assert!(e.contains("Connection refused"), "{what}: {e}"),
        Ok(out) => panic!("{what}: expected a refused connection, got {out:?}"),
    }
}

/// Asserts the dial failed with `EPERM`.
pub fn assert_eperm(dial: &Dial, what: &str) {
    match dial {
        Err(e) => assert!(e.contains("Operation not permitted"), "{what}: {e}"),
        Ok(out) => panic!("{what}: expected EPERM, got {out:?}"),
    }
}

/// A TCP listener on `addr` created by a `dp-probe listen` process inside
/// the pod's namespace and cgroup and handed back over a Unix socket: its
/// sockets (and the connections it accepts) belong to the pod's cgroup, as
/// the engine's own would on a node.
pub fn listener_in_pod(pod: &Pod, addr: &str) -> anyhow::Result<TcpListener> {
    let (ours, theirs) = UnixStream::pair()?;
    ours.set_read_timeout(Some(LIMIT))?;
    let mut cmd = Command::new(probe_binary()?);
    cmd.args(["listen", addr]);
    let child = spawn_in_passing(
        cmd,
        Some(pod.netns.path()),
        Some(pod.cgroup.path()),
        theirs.as_fd(),
    )?;
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

/// Accepts one connection, blocking at most [`LIMIT`] (SO_RCVTIMEO bounds
/// `accept()`).
pub fn accept_one(listener: &TcpListener) -> anyhow::Result<TcpStream> {
    listener.set_nonblocking(false)?;
    let timeout = nix::sys::time::TimeVal::new(LIMIT.as_secs() as _, 0);
    nix::sys::socket::setsockopt(
        listener,
        nix::sys::socket::sockopt::ReceiveTimeout,
        &timeout,
    )?;
    Ok(listener.accept()?.0)
}

/// `sk_lookup` links attached to the network namespace at `netns`, from the
/// kernel's own view (`bpftool link show`).
pub fn sk_lookup_links(netns: &Netns) -> anyhow::Result<usize> {
    let ino = std::fs::metadata(netns.path())?.st_ino();
    // bpftool walks link IDs and then opens each one: a link that parallel
    // tests remove in between makes it fail. Such a failure is transient.
    let mut attempt = 0;
    let out = loop {
        match crate::run("bpftool", &["link", "show", "--json"]) {
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

/// A pinned map of `pins`, opened as `T`.
pub fn open_map<T>(pins: &PinLayout, name: &str) -> anyhow::Result<T>
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
pub fn pod_entries(pins: &PinLayout, cookie: u64, ips: &[IpAddr]) -> anyhow::Result<Vec<String>> {
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
