//! Connections to an app from the client's own address ("original source").
//!
//! Istio's node proxy connects to the app from the client's address, so
//! the app's access logs, rate limits and allow lists see the real client;
//! this module gives our engine the same, without iptables.
//!
//! How a connection is made: an `IP_TRANSPARENT` socket in the pod, bound to
//! the client's address and carrying the transparent mark, connects to the
//! pod's own address. The SYN never leaves the pod: it goes over `lo`. It
//! carries a foreign source, so `sk_lookup` would capture it like the
//! client's own connections; `connect4`/`connect6` see the transparent mark
//! and record the connection's tuple, and `sk_lookup` lets exactly that
//! tuple's first SYN through (no per-connection work in user space). A
//! check of the ingress device would be cheaper but cannot work: the kernel
//! reports a locally delivered packet as arriving on the device that owns
//! the destination address (`eth0`), like one from outside. The app's replies are
//! addressed to the client, which the pod would route out of its interface
//! to nobody; so inside the pod, installed per pod by [`SourceRouting`]:
//!
//! - `net.ipv4.tcp_fwmark_accept = 1` (IPv4 and IPv6): a socket accepted
//!   from a marked SYN takes the mark, and so does everything it sends, the
//!   SYN-ACK included;
//! - `net.ipv4.fwmark_reflect = 1` and `net.ipv6.fwmark_reflect = 1`: a
//!   reply the kernel makes without a socket (the RST of a port nobody
//!   listens on) takes the mark of what it answers, so the engine learns
//!   the app is down at once instead of its SYN timing out;
//! - `ip rule add fwmark <mark> lookup <table>` and `ip route add local
//!   default dev lo table <table>`, for both families: marked packets are
//!   delivered locally, to the engine's transparent socket.
//!
//! Only the app's end of these connections carries the mark. The engine's
//! own connections out of the pod carry the proxy mark, which no rule
//! matches, so nothing else in the pod is routed differently. No packet with
//! the client's address leaves the pod: the transparent socket only ever
//! connects to the pod's own address.
//!
//! Why policy routing and not eBPF: a `tc` program on the pod's interface
//! could turn the replies around too, but it would run on every packet of
//! the pod; two rules and two routes per pod cost nothing per packet, and
//! are what Istio's in-pod rules do (there with a connmark, which needs
//! netfilter; `tcp_fwmark_accept` gives the same without it).

use std::{io, net::IpAddr, sync::Arc, time::Duration};

use netlink_packet_core::{
    NLM_F_ACK, NLM_F_CREATE, NLM_F_EXCL, NLM_F_REQUEST, NetlinkHeader, NetlinkMessage,
    NetlinkPayload,
};
use netlink_packet_route::{
    AddressFamily, RouteNetlinkMessage,
    route::{RouteAttribute, RouteHeader, RouteMessage, RouteProtocol, RouteScope, RouteType},
    rule::{RuleAction, RuleAttribute, RuleMessage},
};
use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_ROUTE};

use super::{PodNetns, source_ports::SourcePorts};

/// The pod's settings that carry a marked SYN's mark into everything
/// answering it: the accepted socket's packets, and the kernel's own
/// replies (RSTs). The IPv6 one is absent where the pod has no IPv6.
const SYSCTLS: [&str; 3] = [
    "/proc/sys/net/ipv4/tcp_fwmark_accept",
    "/proc/sys/net/ipv4/fwmark_reflect",
    "/proc/sys/net/ipv6/fwmark_reflect",
];

/// Every namespace's loopback device has this index: it is registered first.
const LOOPBACK_IFINDEX: u32 = 1;

/// The kernel answers a route request at once; this only bounds a bug.
const NETLINK_TIMEOUT: Duration = Duration::from_secs(5);

/// Errors of [`SourceRouting`].
#[derive(Debug, thiserror::Error)]
pub enum OriginalSourceError {
    /// The pod's namespace could not be entered or a socket made in it.
    #[error("cannot open a route netlink socket in the pod's network namespace: {source}")]
    Socket {
        /// Underlying error.
        source: io::Error,
    },
    /// The kernel refused a rule or route.
    #[error(
        "cannot {action} in the pod's network namespace: {source} (the agent needs CAP_NET_ADMIN; \
         --original-source off turns the feature off)"
    )]
    Route {
        /// What was asked, e.g. `add rule fwmark 0x53a lookup 1338 (IPv4)`.
        action: String,
        /// The kernel's answer.
        source: io::Error,
    },
    /// A setting could not be read or set in the pod.
    #[error("cannot set {path} in the pod's network namespace: {source}")]
    Sysctl {
        /// The setting's file.
        path: &'static str,
        /// Underlying error.
        source: io::Error,
    },
}

/// The in-pod policy routing that brings an app's replies to a transparent
/// connection back to the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SourceRouting {
    /// Mark of the engine's transparent sockets (and so of the app's end).
    pub mark: u32,
    /// Routing table holding the `local` default routes.
    pub table: u32,
    /// Priority of the rules: before the main table's (32766).
    pub priority: u32,
}

/// What [`SourceRouting::install`] changed, so that removal undoes only that.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Installed {
    /// Bit `i` set: [`SYSCTLS`]`[i]` was 0 and the agent set it to 1.
    pub set_sysctls: u8,
}

impl SourceRouting {
    /// Installs the rules and routes in the pod (idempotent: what is
    /// already there is kept). IPv6 is skipped where the pod has none.
    pub fn install(&self, netns: &PodNetns) -> Result<Installed, OriginalSourceError> {
        let mut set_sysctls = 0;
        for (bit, path) in SYSCTLS.into_iter().enumerate() {
            let set = netns
                .within(|| match std::fs::read_to_string(path) {
                    Ok(current) if current.trim() == "1" => Ok(false),
                    Ok(_) => std::fs::write(path, "1").map(|()| true),
                    Err(err) if err.kind() == io::ErrorKind::NotFound && bit > 0 => Ok(false),
                    Err(err) => Err(err),
                })
                .map_err(|source| OriginalSourceError::Sysctl { path, source })?;
            set_sysctls |= u8::from(set) << bit;
        }
        let socket = route_socket(netns)?;
        for family in [AddressFamily::Inet, AddressFamily::Inet6] {
            let rule = self.rule(family);
            match request(&socket, RouteNetlinkMessage::NewRule(rule), CREATE) {
                Ok(()) => {}
                Err(err) if err.raw_os_error() == Some(libc::EEXIST) => {}
                Err(err) if family == AddressFamily::Inet6 && no_ipv6(&err) => continue,
                Err(source) => {
                    return Err(OriginalSourceError::Route {
                        action: self.describe("add rule", family),
                        source,
                    });
                }
            }
            let route = self.local_default(family);
            match request(&socket, RouteNetlinkMessage::NewRoute(route), CREATE) {
                Ok(()) => {}
                Err(err) if err.raw_os_error() == Some(libc::EEXIST) => {}
                Err(source) => {
                    return Err(OriginalSourceError::Route {
                        action: self.describe("add local default route", family),
                        source,
                    });
                }
            }
        }
        Ok(Installed { set_sysctls })
    }

    /// Removes what [`SourceRouting::install`] added. Missing state is not
    /// an error (the pod may have removed it, or never had IPv6).
    pub fn remove(
        &self,
        netns: &PodNetns,
        installed: Installed,
    ) -> Result<(), OriginalSourceError> {
        let socket = route_socket(netns)?;
        for family in [AddressFamily::Inet, AddressFamily::Inet6] {
            let rule = RouteNetlinkMessage::DelRule(self.rule(family));
            let route = RouteNetlinkMessage::DelRoute(self.local_default(family));
            for (message, what) in [(rule, "delete rule"), (route, "delete local default route")] {
                match request(&socket, message, 0) {
                    Ok(()) => {}
                    Err(err) if gone(&err) || no_ipv6(&err) => {}
                    Err(source) => {
                        return Err(OriginalSourceError::Route {
                            action: self.describe(what, family),
                            source,
                        });
                    }
                }
            }
        }
        for (bit, path) in SYSCTLS.into_iter().enumerate() {
            if installed.set_sysctls & (1 << bit) != 0 {
                netns
                    .within(|| std::fs::write(path, "0"))
                    .map_err(|source| OriginalSourceError::Sysctl { path, source })?;
            }
        }
        Ok(())
    }

    fn describe(&self, what: &str, family: AddressFamily) -> String {
        let family = if family == AddressFamily::Inet {
            "IPv4"
        } else {
            "IPv6"
        };
        format!(
            "{what} fwmark {:#x} lookup {} ({family})",
            self.mark, self.table
        )
    }

    /// `fwmark <mark> lookup <table> pref <priority>`.
    fn rule(&self, family: AddressFamily) -> RuleMessage {
        let mut rule = RuleMessage::default();
        rule.header.family = family;
        rule.header.table = RouteHeader::RT_TABLE_UNSPEC;
        rule.header.action = RuleAction::ToTable;
        rule.attributes = vec![
            RuleAttribute::FwMark(self.mark),
            RuleAttribute::FwMask(u32::MAX),
            RuleAttribute::Table(self.table),
            RuleAttribute::Priority(self.priority),
        ];
        rule
    }

    /// `local default dev lo table <table>`.
    fn local_default(&self, family: AddressFamily) -> RouteMessage {
        let mut route = RouteMessage::default();
        route.header.address_family = family;
        route.header.destination_prefix_length = 0;
        route.header.table = RouteHeader::RT_TABLE_UNSPEC;
        route.header.protocol = RouteProtocol::Static;
        route.header.scope = RouteScope::Host;
        route.header.kind = RouteType::Local;
        route.attributes = vec![
            RouteAttribute::Table(self.table),
            RouteAttribute::Oif(LOOPBACK_IFINDEX),
        ];
        route
    }
}

const CREATE: u16 = NLM_F_CREATE | NLM_F_EXCL;

fn gone(err: &io::Error) -> bool {
    matches!(err.raw_os_error(), Some(libc::ENOENT | libc::ESRCH))
}

fn no_ipv6(err: &io::Error) -> bool {
    matches!(
        err.raw_os_error(),
        Some(libc::EAFNOSUPPORT | libc::EOPNOTSUPP)
    )
}

/// A route netlink socket that lives in the pod's namespace.
fn route_socket(netns: &PodNetns) -> Result<Socket, OriginalSourceError> {
    let socket = netns
        .within(|| {
            let mut socket = Socket::new(NETLINK_ROUTE)?;
            socket.bind_auto()?;
            socket.connect(&SocketAddr::new(0, 0))?;
            Ok(socket)
        })
        .map_err(|source| OriginalSourceError::Socket { source })?;
    socket2::SockRef::from(&socket)
        .set_read_timeout(Some(NETLINK_TIMEOUT))
        .map_err(|source| OriginalSourceError::Socket { source })?;
    Ok(socket)
}

/// Sends one request and waits for the kernel's acknowledgement.
fn request(socket: &Socket, message: RouteNetlinkMessage, flags: u16) -> io::Result<()> {
    let mut header = NetlinkHeader::default();
    header.flags = NLM_F_REQUEST | NLM_F_ACK | flags;
    let mut message = NetlinkMessage::new(header, NetlinkPayload::from(message));
    message.finalize();
    let mut buf = vec![0; message.buffer_len()];
    message.serialize(&mut buf);
    socket.send(&buf, 0)?;
    let mut reply = Vec::with_capacity(8192);
    socket.recv(&mut reply, 0)?;
    let reply = NetlinkMessage::<RouteNetlinkMessage>::deserialize(&reply)
        .map_err(|err| io::Error::new(io::ErrorKind::InvalidData, err.to_string()))?;
    match reply.payload {
        NetlinkPayload::Error(err) if err.code.is_none() => Ok(()),
        NetlinkPayload::Error(err) => Err(err.to_io()),
        other => Err(io::Error::other(format!(
            "unexpected netlink reply of type {}",
            other.message_type()
        ))),
    }
}

/// Original source as the engine applies it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OriginalSource {
    /// The in-pod routing each pod gets.
    pub routing: SourceRouting,
    /// A pod whose routing cannot be installed is refused (`on`) rather
    /// than served from its own address (`auto`).
    pub required: bool,
}

/// Original source for one enrolled pod.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodOriginalSource {
    /// The routing installed in the pod; `None` = off for this pod.
    pub routing: Option<SourceRouting>,
    /// What installing it changed.
    pub installed: Installed,
    /// Why it is off although the agent wanted it on.
    pub error: Option<String>,
}

impl PodOriginalSource {
    /// Sets original source up in the pod per `setting`. An installation
    /// failure refuses the pod only when original source is required;
    /// otherwise the pod is served from its own address and the error kept.
    pub fn set_up(
        setting: Option<&OriginalSource>,
        netns: &PodNetns,
    ) -> Result<Self, OriginalSourceError> {
        let Some(setting) = setting else {
            return Ok(Self::default());
        };
        match setting.routing.install(netns) {
            Ok(installed) => Ok(Self {
                routing: Some(setting.routing),
                installed,
                error: None,
            }),
            Err(err) if setting.required => Err(err),
            Err(err) => {
                let error = dataplane_core::error::Chain(&err).to_string();
                tracing::warn!(netns = %netns.path().display(), %error, "original source off for this pod");
                Ok(Self {
                    error: Some(error),
                    ..Self::default()
                })
            }
        }
    }

    /// What the pod's engine needs to connect from clients' addresses;
    /// `None` when original source is off for the pod. `pins`: the
    /// instance's pinned maps (`None` under iptables capture).
    pub fn transparent(
        &self,
        pins: Option<&crate::redirect::PinLayout>,
    ) -> Result<Option<Transparent>, crate::redirect::RedirectError> {
        let Some(routing) = self.routing else {
            return Ok(None);
        };
        let tuples = match pins {
            Some(pins) => Some(std::sync::Mutex::new(crate::redirect::TproxyTable::open(
                pins,
            )?)),
            None => None,
        };
        Ok(Some(Transparent {
            mark: routing.mark,
            tuples,
            ports: Arc::new(SourcePorts::new()),
        }))
    }

    /// Removes the pod's routing (the pod leaves the mesh). Best effort: a
    /// namespace that is gone took its routing with it.
    pub fn tear_down(&self, netns: &PodNetns) {
        let Some(routing) = self.routing else {
            return;
        };
        if let Err(err) = routing.remove(netns, self.installed) {
            tracing::warn!(netns = %netns.path().display(), error = %dataplane_core::error::Chain(&err), "cannot remove the pod's original-source routing");
        }
    }
}

/// What the engine needs to connect to one pod's apps from their clients'
/// addresses.
#[derive(Debug)]
pub struct Transparent {
    /// Mark of the transparent sockets.
    pub mark: u32,
    /// Where each connection's tuple goes before it is made; `None` under
    /// iptables capture (no `sk_lookup` to tell).
    pub tuples: Option<std::sync::Mutex<crate::redirect::TproxyTable>>,
    /// The source ports the pod's transparent sockets take in turn; the
    /// pod's captured connections register with it while open
    /// ([`SourcePorts::hold`]).
    pub ports: Arc<SourcePorts>,
}

impl Transparent {
    /// Connects to the app at `app` from a socket in the pod bound to
    /// `client`'s address, its tuple recorded for `sk_lookup` first.
    ///
    /// The source port is the pod's next in turn but those of its open
    /// captured connections from the client to the app ([`SourcePorts`]); one
    /// in use with the client's address (`bind`), or whose whole tuple is
    /// (`connect`, e.g. still in `TIME_WAIT`), gives way to the next, at
    /// most [`PORT_TRIES`] times.
    pub async fn connect(
        &self,
        netns: &PodNetns,
        client: IpAddr,
        app: std::net::SocketAddr,
        keepalive: Option<super::keepalive::Keepalive>,
    ) -> io::Result<tokio::net::TcpStream> {
        let mut tries = 0;
        loop {
            tries += 1;
            let src = std::net::SocketAddr::new(client, self.ports.next_for(client, app));
            match self.connect_from(netns, src, app, keepalive).await {
                Err(err) if tries < PORT_TRIES && port_taken(&err) => continue,
                result => return result,
            }
        }
    }

    async fn connect_from(
        &self,
        netns: &PodNetns,
        src: std::net::SocketAddr,
        app: std::net::SocketAddr,
        keepalive: Option<super::keepalive::Keepalive>,
    ) -> io::Result<tokio::net::TcpStream> {
        let socket = netns.transparent_connector(src, app, (self.mark, keepalive))?;
        let Some(tuples) = &self.tuples else {
            return super::pod_netns::connect(socket, app).await;
        };
        tuples
            .lock()
            .map_err(|_| io::Error::other("transparent tuple table poisoned"))?
            .record(src, app)
            .map_err(|e| io::Error::other(dataplane_core::error::Chain(&e).to_string()))?;
        // A SYN that reached the app consumed the entry; one that never
        // got there (a local failure, a cancelled connect) must not leave
        // it behind, or a later outside SYN with this tuple would pass.
        let mut pending = PendingTuple {
            tuples,
            tuple: Some((src, app)),
        };
        let stream = super::pod_netns::connect(socket, app).await?;
        pending.tuple = None;
        Ok(stream)
    }
}

/// How many source ports one transparent connection tries.
pub const PORT_TRIES: u32 = 16;

/// Whether `err` says the source port (or the whole tuple) is taken.
fn port_taken(err: &io::Error) -> bool {
    matches!(
        err.raw_os_error(),
        Some(libc::EADDRINUSE | libc::EADDRNOTAVAIL)
    )
}

/// A recorded tuple whose connect has not succeeded; forgotten on drop.
struct PendingTuple<'a> {
    tuples: &'a std::sync::Mutex<crate::redirect::TproxyTable>,
    tuple: Option<(std::net::SocketAddr, std::net::SocketAddr)>,
}

impl Drop for PendingTuple<'_> {
    fn drop(&mut self) {
        if let Some((client, app)) = self.tuple
            && let Ok(mut table) = self.tuples.lock()
        {
            table.forget(client, app);
        }
    }
}

/// Whether a connection from `client` to the app at `app` can be made from
/// the client's address: same family, and a real remote address.
pub fn applies(client: IpAddr, app: IpAddr) -> bool {
    client.is_ipv4() == app.is_ipv4() && !client.is_loopback() && !client.is_unspecified()
}
