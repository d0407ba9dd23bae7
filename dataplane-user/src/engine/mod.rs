//! The tunnel engine's in-pod side: listeners that live inside each enrolled
//! pod's network namespace, and what happens to the connections they accept.
//!
//! Outbound (15001): a destination that is a mesh workload speaking HBONE
//! is reached through a pooled mutual-TLS HTTP/2 tunnel to its pod's 15008;
//! anything else is passed through as plain TCP, dialled from inside the pod
//! with the proxy mark. Inbound plaintext (15006) connects to the app.
//! Inbound HBONE (15008) terminates TLS and serves CONNECT streams.

mod connection;
mod hbone_inbound;
mod live;
mod mesh;
mod netfilter;
mod pod_netns;
mod relay;

use std::{
    io,
    net::{IpAddr, Ipv6Addr, SocketAddr},
    sync::Arc,
};

use dataplane_common::{HBONE_PORT, INBOUND_PLAINTEXT_PORT, OUTBOUND_PORT};
use tokio::task::JoinSet;
use tracing::{info, warn};

pub use live::{LiveConnections, LiveGuard};
pub use mesh::{MeshContext, PodTlsDialer, hbone_addr, workload_peer};
pub use pod_netns::PodNetns;
pub use relay::{Meter, RelayError, Transferred, relay};
pub(crate) use relay::{flush, reset_on_close};

use crate::redirect::OrigDstTable;

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
    /// The pod as a connection end in metrics and access records.
    pub peer: Arc<crate::telemetry::Peer>,
    /// The pod's network namespace.
    pub netns: PodNetns,
    /// Socket mark of the engine's own sockets.
    pub mark: u32,
    /// Mesh-wide state.
    pub mesh: Arc<MeshContext>,
    /// The pod's HBONE client pool.
    pub pool: Arc<crate::hbone::HbonePool<PodTlsDialer>>,
    /// The pod's HBONE server TLS configuration.
    pub server_tls: Arc<rustls::ServerConfig>,
}

impl PodContext {
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
    /// [::1]:15001, when the pod has IPv6.
    pub outbound_v6: Option<std::net::TcpListener>,
    /// [::]:15006, dual-stack: inbound plaintext capture.
    pub inbound: std::net::TcpListener,
    /// [::]:15008, dual-stack: HBONE.
    pub hbone: std::net::TcpListener,
}

impl PodListeners {
    /// Creates the listeners inside the pod's namespace.
    pub fn create(netns: &PodNetns) -> Result<Self, EngineError> {
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
        let outbound_v6 = match listen(loopback6, true) {
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
        };
        let any6 = |port| SocketAddr::new(Ipv6Addr::UNSPECIFIED.into(), port);
        Ok(Self {
            outbound_v4: listen(SocketAddr::new([127, 0, 0, 1].into(), OUTBOUND_PORT), false)?,
            outbound_v6,
            inbound: listen(any6(INBOUND_PLAINTEXT_PORT), false)?,
            hbone: listen(any6(HBONE_PORT), false)?,
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

/// A pod's running listeners and their connections; dropping it (or
/// calling [`PodEngine::stop`]) closes every listener and connection.
#[derive(Debug)]
pub struct PodEngine {
    tasks: JoinSet<()>,
}

impl PodEngine {
    /// Starts serving. Must run inside a tokio runtime. `orig_dst` is the
    /// kernel programs' record; without it (iptables capture, for the
    /// benchmarks' baseline) original destinations come from netfilter.
    pub fn start(
        ctx: Arc<PodContext>,
        listeners: PodListeners,
        orig_dst: Option<OrigDstTable>,
    ) -> io::Result<Self> {
        let mut tasks = JoinSet::new();
        let to_tokio = |l: std::net::TcpListener| {
            l.set_nonblocking(true)?;
            tokio::net::TcpListener::from_std(l)
        };
        let mut outbound = vec![to_tokio(listeners.outbound_v4)?];
        if let Some(v6) = listeners.outbound_v6 {
            outbound.push(to_tokio(v6)?);
        }
        let orig_dst = Arc::new(std::sync::Mutex::new(orig_dst));
        for listener in outbound {
            tasks.spawn(connection::serve_outbound(
                listener,
                Arc::clone(&ctx),
                Arc::clone(&orig_dst),
            ));
        }
        tasks.spawn(connection::serve_inbound(
            to_tokio(listeners.inbound)?,
            Arc::clone(&ctx),
        ));
        tasks.spawn(hbone_inbound::serve(
            to_tokio(listeners.hbone)?,
            Arc::clone(&ctx),
        ));
        let eviction = ctx.pool.spawn_eviction();
        tasks.spawn(async move {
            // Ties the eviction task's life to the pod's.
            let _ = eviction.await;
        });
        info!(pod = %ctx.identity.name, namespace = %ctx.identity.namespace, "in-pod listeners serving");
        Ok(Self { tasks })
    }

    /// Closes every listener and connection of the pod.
    pub fn stop(mut self) {
        self.tasks.abort_all();
    }
}

impl Drop for PodEngine {
    fn drop(&mut self) {
        if !self.tasks.is_empty() {
            self.tasks.abort_all();
        }
    }
}

/// The address as the application used it: IPv4-mapped IPv6 becomes IPv4.
pub fn canonical(addr: SocketAddr) -> SocketAddr {
    match addr.ip() {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => SocketAddr::new(v4.into(), addr.port()),
            None => addr,
        },
        IpAddr::V4(_) => addr,
    }
}

/// Whether `port` is one of the engine's own capture ports, which must
/// never be a forwarding destination (that would loop).
pub fn is_engine_port(port: u16) -> bool {
    matches!(port, OUTBOUND_PORT | INBOUND_PLAINTEXT_PORT | HBONE_PORT)
}

/// The next connection on `listener`, or `None` once the agent starts
/// draining (or can no longer say). Accept errors (a full backlog, no
/// file descriptors) are logged and accepting goes on.
async fn accept(
    listener: &tokio::net::TcpListener,
    shutdown: &mut tokio::sync::watch::Receiver<bool>,
    name: &str,
) -> Option<(tokio::net::TcpStream, SocketAddr)> {
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => return Some(accepted),
                Err(err) => log_accept_error(&err, name),
            },
            _ = shutdown.wait_for(|draining| *draining) => return None,
        }
    }
}

fn log_accept_error(err: &io::Error, listener: &str) {
    warn!(listener, error = %err, "accept failed");
}
