//! The proxy inside each enrolled pod: listeners that live in the pod's
//! network namespace, split by the direction of what they accept.
//!
//! - [`outbound`] (15001): the pod's apps' connections, redirected by the
//!   kernel. A pure [`outbound::plan()`] decides each one's way (an HBONE
//!   tunnel from the pod's pool, a direct connection, a service's
//!   endpoints in failover order, or a refusal); the listener carries it
//!   out.
//! - [`inbound`] (15006): plaintext connections from outside the pod,
//!   authorized by address, relayed to the app.
//! - [`inbound_hbone`] (15008): mutual TLS, then the HBONE server's CONNECT
//!   streams, each authorized by the client's verified identity; until a
//!   client has finished its handshake it counts against the node's
//!   [`handshakes`] bounds.
//!
//! [`PodTlsDialer`] opens the pool's TLS connections from inside the pod;
//! [`orig_dst`] says where a captured connection was going (the kernel
//! programs' record, or netfilter under the iptables baseline);
//! [`PodNetns`] makes sockets inside the pod. Bytes move through
//! [`crate::relay`]; decisions come from [`crate::policy`]; the mesh-wide
//! state is [`crate::mesh::MeshContext`].

mod dialer;
mod engine;
pub mod handshakes;
pub mod inbound;
pub mod inbound_hbone;
#[cfg(test)]
mod listener_tests;
mod netfilter;
pub mod orig_dst;
pub mod outbound;
mod revocation;

use std::{
    io,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    sync::Arc,
    time::Duration,
};

use dataplane_common::{HBONE_PORT, INBOUND_PLAINTEXT_PORT, OUTBOUND_PORT};
use tokio::{
    net::{TcpListener, TcpStream},
    task::JoinSet,
};
use tracing::{debug, warn};

/// Moved to `dataplane_kernel::in_pod`; named here for the modules that
/// still import them from `proxy`.
pub use dataplane_kernel::in_pod::{PodNetns, keepalive, original_source, pod_netns};
pub use dialer::PodTlsDialer;
pub use engine::{PodEngine, RetiredEngine};

use crate::{
    addr::canonical,
    logging::Chain,
    mesh::MeshContext,
    relay::{Transferred, plain::Relay as PlainRelay, relay_plain, reset_on_close},
    telemetry::{FailReason, Flow, OpenFlow},
};

/// How long a connection to the destination may take before the client's
/// connection is reset.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Errors starting a pod's listeners.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// A listener could not be created inside the pod.
    #[error(
        "cannot listen on {addr} inside pod network namespace {netns} (is the port taken by the app or another agent?)"
    )]
    Listen {
        /// The listen address.
        addr: SocketAddr,
        /// The pod's namespace path.
        netns: String,
        /// The OS error.
        #[source]
        source: io::Error,
    },
}

/// Who a pod is, for logs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodIdentity {
    /// Workload uid.
    pub uid: String,
    /// Pod name.
    pub name: String,
    /// Kubernetes namespace.
    pub namespace: String,
}

/// What every connection handler of one pod needs.
pub struct PodContext {
    /// Who the pod is.
    pub identity: PodIdentity,
    /// The pod's SPIFFE identity (its certificate's).
    pub spiffe: crate::identity::Identity,
    /// The pod's IPs.
    pub ips: Vec<IpAddr>,
    /// The pod's own fast-path setting, from its enrollment (its
    /// annotation); `None`: its workload's, else the agent's.
    pub fast_path: Option<bool>,
    /// The pod as a connection end in metrics and access records.
    pub peer: Arc<crate::telemetry::Peer>,
    /// The pod's network namespace.
    pub netns: PodNetns,
    /// Its cookie (how the kernel programs name it).
    pub netns_cookie: u64,
    /// Socket mark of the engine's own sockets.
    pub mark: u32,
    /// How the engine connects to the pod's apps from their clients'
    /// addresses; `None` when original source is off for this pod (the
    /// pod's own address is used).
    pub original_source: Option<original_source::Transparent>,
    /// Mesh-wide state.
    pub mesh: Arc<MeshContext>,
    /// The pod's HBONE client pool.
    pub pool: Arc<crate::hbone::HbonePool<PodTlsDialer>>,
    /// The pod's HBONE server TLS configuration.
    pub server_tls: Arc<rustls::ServerConfig>,
    /// The `baggage` its tunnels carry, formatted once per view of it.
    pub baggage: crate::hbone::wire::BaggageCache,
    /// Flips to `true` when the pod's engine stops accepting: the agent
    /// drains, or a re-enrollment put another engine on the same sockets
    /// ([`PodEngine::retire`]). Listeners close, HBONE peers get GOAWAY,
    /// open connections finish.
    pub stopping: tokio::sync::watch::Sender<bool>,
}

/// How long a connection of a pod the control plane does not know waits
/// for it to (ztunnel's `get_workload`, `src/proxy.rs`: 5 s), so that a
/// pod the CNI plugin enrolled just before istiod's push is not refused.
const UNKNOWN_WORKLOAD_WAIT: Duration = Duration::from_secs(5);
/// How often the mesh state is looked at meanwhile.
const UNKNOWN_WORKLOAD_POLL: Duration = Duration::from_millis(100);

impl PodContext {
    /// Whether the mesh state lists this pod: one of its IPs under its
    /// identity.
    pub fn known_in(&self, state: &crate::state::MeshState) -> bool {
        self.ips
            .iter()
            .filter_map(|ip| state.workloads.by_ip(*ip))
            .any(|w| w.identity == self.spiffe)
    }

    /// `None` when the pod may be served; else why not: with a control
    /// plane (`--xds`) an enrolled pod it does not list is never served in
    /// plaintext, as ztunnel refuses a local workload it cannot fetch
    /// (`UnknownSourceWorkload`). Waits up to [`UNKNOWN_WORKLOAD_WAIT`] for
    /// the state to learn of it.
    pub async fn unknown_workload(&self) -> Option<String> {
        if !self.mesh.require_known_workloads || self.known_in(&self.mesh.state()) {
            return None;
        }
        let deadline = tokio::time::Instant::now() + UNKNOWN_WORKLOAD_WAIT;
        while tokio::time::Instant::now() < deadline {
            tokio::time::sleep(UNKNOWN_WORKLOAD_POLL).await;
            if self.known_in(&self.mesh.state()) {
                return None;
            }
        }
        Some(format!(
            "pod {}/{} is unknown to the control plane: it lists no workload at {:?} with identity {}",
            self.identity.namespace,
            self.identity.name,
            self.ips,
            self.spiffe.to_uri()
        ))
    }

    /// The pod as a connection end: the mesh's description of it (owner
    /// workload, canonical service and revision, cluster, locality) when
    /// the mesh lists it under its address and identity, else what
    /// enrollment said (name, namespace, identity).
    pub fn own_peer(&self, state: &crate::state::MeshState) -> Arc<crate::telemetry::Peer> {
        self.ips
            .iter()
            .find_map(|ip| state.workloads.by_ip(*ip))
            .filter(|w| w.identity == self.spiffe)
            .map_or_else(|| Arc::clone(&self.peer), |w| Arc::clone(&w.peer))
    }

    /// How the pod takes its inbound tunnels when it takes them itself (a
    /// sandwiched waypoint): its workload's `applicationTunnel`, when the
    /// mesh lists it under its address and identity (as [`Self::own_peer`]).
    pub fn app_tunnel(
        &self,
        state: &crate::state::MeshState,
    ) -> Option<crate::config::ApplicationTunnel> {
        self.own_workload(state)
            .and_then(|w| w.workload.application_tunnel)
    }

    /// This pod's workload in `state`: the one the mesh lists under its
    /// address and identity (as [`Self::own_peer`]).
    pub fn own_workload<'a>(
        &self,
        state: &'a crate::state::MeshState,
    ) -> Option<&'a Arc<crate::state::MeshWorkload>> {
        self.ips
            .iter()
            .find_map(|ip| state.workloads.by_ip(*ip))
            .filter(|w| w.identity == self.spiffe)
    }

    /// Where a captured outbound connection really comes from: the capture
    /// listener sees the client on loopback (the kernel redirected its
    /// connect to 127.0.0.1 / ::1), so the pod's own IP of the same family
    /// stands in, with the client's port.
    pub fn client_addr(&self, peer: SocketAddr) -> SocketAddr {
        let peer = canonical(peer);
        if !peer.ip().is_loopback() {
            return peer;
        }
        self.ips
            .iter()
            .find(|ip| ip.is_ipv4() == peer.is_ipv4())
            .or_else(|| self.ips.first())
            .map_or(peer, |ip| SocketAddr::new(*ip, peer.port()))
    }

    /// Connects to the app at `dst` from inside the pod: from the address
    /// of `client` when original source is on for this pod and applies to
    /// it, else from the pod's own.
    pub async fn connect_app(
        &self,
        client: Option<IpAddr>,
        dst: SocketAddr,
    ) -> std::io::Result<TcpStream> {
        match (&self.original_source, client) {
            (Some(transparent), Some(client)) if original_source::applies(client, dst.ip()) => {
                transparent
                    .connect(&self.netns, client, dst, self.mesh.keepalive)
                    .await
            }
            _ => {
                let socket = self.netns.connector(dst, self.mark, self.mesh.keepalive)?;
                pod_netns::connect(socket, dst).await
            }
        }
    }
}

impl std::fmt::Debug for PodContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PodContext")
            .field("identity", &self.identity)
            .field("spiffe", &self.spiffe)
            .finish()
    }
}

/// The in-pod listeners of one pod, before they serve.
#[derive(Debug)]
pub struct PodListeners {
    /// 127.0.0.1:15001.
    pub outbound_v4: std::net::TcpListener,
    /// `[::1]:15001`, when IPv6 is on and the pod has it.
    pub outbound_v6: Option<std::net::TcpListener>,
    /// `[::]:15006`, dual-stack (`0.0.0.0:15006` with IPv6 off): inbound
    /// plaintext capture.
    pub inbound: std::net::TcpListener,
    /// `[::]:15008`, dual-stack (`0.0.0.0:15008` with IPv6 off): HBONE.
    pub hbone: std::net::TcpListener,
}

/// The address every wildcard listener binds: `[::]` (dual-stack) or, with
/// IPv6 off (`--ipv6-enabled false`), `0.0.0.0`, as ztunnel's
/// `bind_wildcard` (`src/config.rs` `construct_config`, `IPV6_ENABLED`).
pub fn bind_wildcard(ipv6: bool) -> IpAddr {
    if ipv6 {
        Ipv6Addr::UNSPECIFIED.into()
    } else {
        Ipv4Addr::UNSPECIFIED.into()
    }
}

impl PodListeners {
    /// Creates the listeners inside the pod's namespace: with `ipv6` off,
    /// IPv4 ones alone, so that a kernel booted with `ipv6.disable=1`
    /// (where any IPv6 socket fails with `EAFNOSUPPORT`) can serve pods.
    pub fn create(netns: &PodNetns, ipv6: bool) -> Result<Self, EngineError> {
        let listen = |addr: SocketAddr, v6only: bool| {
            netns
                .listen(addr, v6only)
                .map_err(|source| EngineError::Listen {
                    addr,
                    netns: netns.path().display().to_string(),
                    source,
                })
        };
        let loopback6 = SocketAddr::new(Ipv6Addr::LOCALHOST.into(), OUTBOUND_PORT);
        let outbound_v6 = if ipv6 {
            match listen(loopback6, true) {
                Ok(l) => Some(l),
                // A pod without IPv6 (disabled, or no ::1) captures IPv4 only.
                Err(EngineError::Listen { source, .. })
                    if matches!(
                        source.raw_os_error(),
                        Some(libc::EADDRNOTAVAIL | libc::EAFNOSUPPORT)
                    ) =>
                {
                    None
                }
                Err(e) => return Err(e),
            }
        } else {
            None
        };
        let any = |port| SocketAddr::new(bind_wildcard(ipv6), port);
        Ok(Self {
            outbound_v4: listen(
                SocketAddr::new(Ipv4Addr::LOCALHOST.into(), OUTBOUND_PORT),
                false,
            )?,
            outbound_v6,
            inbound: listen(any(INBOUND_PLAINTEXT_PORT), false)?,
            hbone: listen(any(HBONE_PORT), false)?,
        })
    }

    /// Duplicates of the same listening sockets (new descriptors, same
    /// sockets): a connection queued on one is accepted through either.
    pub fn try_clone(&self) -> io::Result<Self> {
        Ok(Self {
            outbound_v4: self.outbound_v4.try_clone()?,
            outbound_v6: self
                .outbound_v6
                .as_ref()
                .map(std::net::TcpListener::try_clone)
                .transpose()?,
            inbound: self.inbound.try_clone()?,
            hbone: self.hbone.try_clone()?,
        })
    }
}

/// How long a listener pauses after an accept failed for lack of
/// descriptors or memory: the connection stays queued and would fail again
/// at once, so retrying without a pause would spin.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// Prepares a listener of client connections (15001, 15006): every
/// socket it accepts is then born reset-on-close
/// ([`crate::relay::reset_on_close`]), without Nagle's delay and with TCP
/// keepalive ([`keepalive`], when on), because
/// the kernel copies a listener's socket options into each connection it
/// accepts. That is one `setsockopt` per listener and start instead of two
/// per connection, and it leaves no moment between accept and the first
/// `setsockopt` in which a killed agent would close the client with a FIN.
/// Done at every start, since a listener handed over by an older agent
/// may lack them. `false` if the kernel refused: each accepted socket must
/// then be prepared by [`prepare_accepted`].
fn prepare_listener(
    listener: &TcpListener,
    name: &'static str,
    keepalive: Option<keepalive::Keepalive>,
) -> bool {
    let socket = socket2::SockRef::from(listener);
    let prepared = socket
        .set_linger(Some(Duration::ZERO))
        .and_then(|()| socket.set_tcp_nodelay(true))
        .and_then(|()| keepalive::apply(keepalive, socket2::SockRef::from(listener)));
    if let Err(err) = &prepared {
        warn!(listener = name, error = %err, "cannot set the listener's socket options; setting them on each connection");
    }
    prepared.is_ok()
}

/// What [`prepare_listener`] gives accepted sockets, for one accepted from
/// a listener it could not prepare (`inherited` false).
fn prepare_accepted(stream: &TcpStream, inherited: bool, keepalive: Option<keepalive::Keepalive>) {
    if !inherited {
        reset_on_close(stream);
        let _ = stream.set_nodelay(true);
        let _ = keepalive::apply(keepalive, socket2::SockRef::from(stream));
    }
}

/// The next connection on `listener`, or `None` once the pod's engine
/// stops accepting ([`PodContext::stopping`]; or no one can say any more). Accept errors (a full backlog, no
/// file descriptors) are logged and accepting goes on.
async fn accept(
    listener: &TcpListener,
    stopping: &mut tokio::sync::watch::Receiver<bool>,
    name: &'static str,
    metrics: &crate::telemetry::Metrics,
) -> Option<(TcpStream, SocketAddr)> {
    loop {
        let failed = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => return Some(accepted),
                Err(err) => err,
            },
            _ = stopping.wait_for(|stopped| *stopped) => return None,
        };
        warn!(listener = name, error = %failed, "accept failed");
        let reason = match failed.raw_os_error() {
            Some(libc::EMFILE | libc::ENFILE) => "descriptors",
            Some(libc::ENOBUFS | libc::ENOMEM) => "memory",
            _ => "other",
        };
        metrics.accept_failed(name, reason);
        if reason != "other" {
            tokio::time::sleep(ACCEPT_BACKOFF).await;
        }
    }
}

/// Connects to `dst` from inside the pod and returns the relay to run
/// with the connection's record, or refuses the connection (`None`):
/// outbound direct hops (`client` is `None`: the pod's own address) and
/// inbound plaintext (from the client's address when original source is
/// on, see [`PodContext::connect_app`]).
async fn connect_direct(
    downstream: TcpStream,
    flow: Flow,
    (client, dst): (Option<IpAddr>, SocketAddr),
    ctx: &PodContext,
) -> Option<(PlainRelay, OpenFlow)> {
    let connect = tokio::time::timeout(CONNECT_TIMEOUT, ctx.connect_app(client, dst));
    let upstream = match Box::pin(connect).await {
        Ok(Ok(stream)) => stream,
        Ok(Err(err)) => {
            let reason = format!("connect failed: {err}");
            refuse(downstream, &flow, ctx, FailReason::ConnectFailed, &reason);
            return None;
        }
        Err(_) => {
            let reason = "connect timed out";
            refuse(downstream, &flow, ctx, FailReason::ConnectTimeout, reason);
            return None;
        }
    };
    let open = flow.open(&ctx.mesh.metrics);
    debug!(%dst, "connected");
    let relay = relay_plain(downstream, upstream, open.meter_from_client());
    Some((relay, open))
}

/// Writes the record of a relay that ended, naming its failure if it
/// failed.
fn record<E: std::error::Error + 'static>(result: Result<Transferred, E>, open: OpenFlow) {
    match result {
        Ok(t) => open.close(t.sent, t.received, None),
        Err(err) => open.close(0, 0, Some(&Chain(&err).to_string())),
    }
}

/// Counts the refused connection, writes its record and resets it, in
/// that order: whoever sees the reset (the client, a test) then finds it
/// counted in every family.
fn refuse(stream: TcpStream, flow: &Flow, ctx: &PodContext, reason: FailReason, detail: &str) {
    flow.refuse(&ctx.mesh.metrics, reason, detail);
    reset_on_close(&stream);
    drop(stream);
}

/// Stops accepting (the listener closes) and lets the connections in flight
/// finish; the agent's drain deadline, or a retired engine's, aborts what
/// is left.
async fn finish(listener: TcpListener, mut connections: JoinSet<()>) {
    drop(listener);
    while connections.join_next().await.is_some() {}
}

/// Collects finished connection tasks so the set does not grow.
fn reap(connections: &mut JoinSet<()>) {
    while connections.try_join_next().is_some() {}
}

#[cfg(test)]
#[expect(
    clippy::unwrap_used,
    reason = "a failed set-up should fail the test loudly"
)]
mod tests {
    use std::io::Read as _;

    use super::*;

    /// What [`prepare_listener`] relies on: the kernel copies the
    /// listener's `SO_LINGER`, `TCP_NODELAY` and keepalive into each accepted socket,
    /// so a client closed before its relay started is reset.
    #[tokio::test]
    async fn a_prepared_listener_accepts_sockets_that_reset_do_not_delay_and_keep_alive() {
        for (prepared, ip) in [(true, "127.0.0.1"), (false, "127.0.0.1"), (true, "::1")] {
            let listener = TcpListener::bind((ip.parse::<IpAddr>().unwrap(), 0))
                .await
                .unwrap();
            let keepalive = Some(keepalive::Keepalive::ZTUNNEL);
            let inherited = prepared && prepare_listener(&listener, "test", keepalive);
            assert_eq!(inherited, prepared);
            let mut client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
            let (accepted, _) = listener.accept().await.unwrap();
            prepare_accepted(&accepted, inherited, keepalive);
            let socket = socket2::SockRef::from(&accepted);
            assert_eq!(socket.linger().unwrap(), Some(Duration::ZERO));
            assert!(socket.tcp_nodelay().unwrap());
            assert_eq!(keepalive::read_back(socket).unwrap(), keepalive, "{ip}");
            // Closed before any relay: the client sees a reset, not an end.
            drop(accepted);
            let err = client.read(&mut [0; 1]).unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::ConnectionReset, "{ip}");
        }
    }
}
