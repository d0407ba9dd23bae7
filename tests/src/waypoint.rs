//! A waypoint stand-in: an HBONE server in a test pod that terminates each
//! tunnel (mutual TLS with a mesh certificate for its own identity, HTTP/2
//! CONNECT) and carries it on in a new HBONE tunnel, with its own identity,
//! to the `:authority` it was asked for, as an ambient waypoint does after
//! its L7 work. It counts what it forwarded, so tests can prove traffic
//! went through it.
//!
//! It verifies its clients against the mesh root and the destination's
//! node against the identity the test names for each address.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::Context as _;
use bytes::Bytes;
use dataplane_user::identity::Identity;
use dataplane_user::tls;
use h2::{RecvStream, SendStream};
use http::{Method, Request, Response, StatusCode};
use tokio::runtime::Runtime;

use crate::stranger::MeshCredentials;
use crate::topology::Pod;

/// How long any one step may take before the stand-in gives up on it.
const STEP: Duration = Duration::from_secs(20);

/// A running stand-in; dropping it stops it.
pub struct WaypointStandIn {
    /// Tunnels it carried on to their destination.
    pub forwarded: Arc<AtomicUsize>,
    /// Its identity.
    pub identity: Identity,
    runtime: Option<Runtime>,
}

impl std::fmt::Debug for WaypointStandIn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WaypointStandIn")
            .field("identity", &self.identity)
            .finish()
    }
}

struct Shared {
    /// Client configurations by destination IP (each expects the identity
    /// the test named for that address).
    clients: HashMap<IpAddr, Arc<rustls::ClientConfig>>,
    netns: std::path::PathBuf,
    forwarded: Arc<AtomicUsize>,
}

impl WaypointStandIn {
    /// Serves `[::]:15008` in `pod` as `spiffe://cluster.local/ns/<namespace>/sa/<account>`
    /// with a certificate from the mesh CA in `ca_dir`; forwards to the
    /// addresses of `destinations`, each expected to present its identity.
    pub fn start(
        pod: &Pod,
        ca_dir: &Path,
        namespace: &str,
        account: &str,
        destinations: &[(IpAddr, Identity)],
    ) -> anyhow::Result<Self> {
        Self::start_on(pod, 15008, ca_dir, (namespace, account), destinations)
    }

    /// As [`WaypointStandIn::start`], serving `[::]:<port>` (a waypoint
    /// whose service maps its HBONE port elsewhere).
    pub fn start_on(
        pod: &Pod,
        port: u16,
        ca_dir: &Path,
        (namespace, account): (&str, &str),
        destinations: &[(IpAddr, Identity)],
    ) -> anyhow::Result<Self> {
        let me = MeshCredentials::issue(ca_dir, namespace, account)?;
        let server = tls::server_config(me.resolver(), Arc::clone(&me.roots), "cluster.local")?;
        let mut clients = HashMap::new();
        for (ip, identity) in destinations {
            let config =
                tls::client_config(me.resolver(), Arc::clone(&me.roots), vec![identity.clone()])?;
            clients.insert(*ip, config);
        }
        let forwarded = Arc::new(AtomicUsize::new(0));
        let shared = Arc::new(Shared {
            clients,
            netns: pod.netns.path().to_path_buf(),
            forwarded: Arc::clone(&forwarded),
        });
        let listener = pod.netns.run(move || {
            let listener = std::net::TcpListener::bind(SocketAddr::from(([0u16; 8], port)))?;
            listener.set_nonblocking(true)?;
            Ok::<_, std::io::Error>(listener)
        })??;
        let runtime = serve_connects(listener, server, shared, forward)?;
        Ok(Self {
            forwarded,
            identity: me.identity,
            runtime: Some(runtime),
        })
    }

    /// Tunnels carried on so far.
    pub fn forwarded(&self) -> usize {
        self.forwarded.load(Ordering::Acquire)
    }
}

impl Drop for WaypointStandIn {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

/// Serves the HTTP/2 CONNECTs of every TLS connection `listener` accepts
/// on a runtime of its own (returned: dropping it stops the server), each
/// request handed to `forward` on a task of its own: the accept loop of
/// the test's HBONE stand-ins (waypoints, network gateways).
pub(crate) fn serve_connects<S, F, Fut>(
    listener: std::net::TcpListener,
    server: Arc<rustls::ServerConfig>,
    shared: Arc<S>,
    forward: F,
) -> anyhow::Result<tokio::runtime::Runtime>
where
    S: Send + Sync + 'static,
    F: Fn(Request<RecvStream>, h2::server::SendResponse<Bytes>, Arc<S>) -> Fut
        + Copy
        + Send
        + 'static,
    Fut: std::future::Future<Output = anyhow::Result<()>> + Send + 'static,
{
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let acceptor = tokio_rustls::TlsAcceptor::from(server);
    runtime.spawn(async move {
        let Ok(listener) = tokio::net::TcpListener::from_std(listener) else {
            return;
        };
        while let Ok((tcp, _)) = listener.accept().await {
            let (acceptor, shared) = (acceptor.clone(), Arc::clone(&shared));
            tokio::spawn(async move {
                let tls = tokio::time::timeout(STEP, acceptor.accept(tcp)).await??;
                let mut conn = h2::server::handshake(tls).await?;
                while let Some(request) = conn.accept().await {
                    let (request, respond) = request?;
                    tokio::spawn(forward(request, respond, Arc::clone(&shared)));
                }
                anyhow::Ok(())
            });
        }
    });
    Ok(runtime)
}

/// Carries one CONNECT on to its authority through a new tunnel.
async fn forward(
    request: Request<RecvStream>,
    mut respond: h2::server::SendResponse<Bytes>,
    shared: Arc<Shared>,
) -> anyhow::Result<()> {
    let refuse = |respond: &mut h2::server::SendResponse<Bytes>, status| {
        let _ = respond.send_response(status_only(status), true);
    };
    let authority = request.uri().authority().map(|a| a.as_str().to_owned());
    let Some(dst) = authority
        .as_deref()
        .and_then(|a| a.parse::<SocketAddr>().ok())
    else {
        refuse(&mut respond, StatusCode::BAD_REQUEST);
        anyhow::bail!("authority {authority:?} is not ip:port");
    };
    let Some(client) = shared.clients.get(&dst.ip()).cloned() else {
        refuse(&mut respond, StatusCode::SERVICE_UNAVAILABLE);
        anyhow::bail!("no destination {dst} configured");
    };
    let upstream = match tokio::time::timeout(STEP, open(dst, client, &shared.netns)).await {
        Ok(Ok(upstream)) => upstream,
        _ => {
            refuse(&mut respond, StatusCode::SERVICE_UNAVAILABLE);
            anyhow::bail!("the destination {dst} did not accept the tunnel");
        }
    };
    let (up_send, up_recv) = upstream;
    let down_send = respond.send_response(status_only(StatusCode::OK), false)?;
    shared.forwarded.fetch_add(1, Ordering::AcqRel);
    let down_recv = request.into_body();
    let a = tokio::spawn(pipe(down_recv, up_send));
    let b = tokio::spawn(pipe(up_recv, down_send));
    let _ = tokio::join!(a, b);
    Ok(())
}

/// A tunnel to `dst` through its node's 15008, dialled from the stand-in's
/// pod.
async fn open(
    dst: SocketAddr,
    client: Arc<rustls::ClientConfig>,
    netns: &Path,
) -> anyhow::Result<(SendStream<Bytes>, RecvStream)> {
    let netns = netns.to_path_buf();
    let via = SocketAddr::new(dst.ip(), 15008);
    let tcp = tokio::task::spawn_blocking(move || {
        dataplane_user::netns::run_in_netns(&netns, move || std::net::TcpStream::connect(via))
    })
    .await???;
    tcp.set_nonblocking(true)?;
    let tcp = tokio::net::TcpStream::from_std(tcp)?;
    let name = rustls::pki_types::ServerName::IpAddress(dst.ip().into());
    let tls = tokio_rustls::TlsConnector::from(client)
        .connect(name, tcp)
        .await?;
    let (h2, connection) = h2::client::handshake(tls).await?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    let mut h2 = h2.ready().await?;
    let request = Request::builder()
        .method(Method::CONNECT)
        .uri(dst.to_string())
        .body(())?;
    let (response, send) = h2.send_request(request, false)?;
    let response = response.await?;
    anyhow::ensure!(
        response.status() == StatusCode::OK,
        "the destination answered {}",
        response.status()
    );
    Ok((send, response.into_body()))
}

/// Copies one direction until its end, then ends the other side's stream.
async fn pipe(mut from: RecvStream, mut to: SendStream<Bytes>) -> anyhow::Result<()> {
    while let Some(chunk) = from.data().await {
        let chunk = chunk?;
        let _ = from.flow_control().release_capacity(chunk.len());
        to.send_data(chunk, false)?;
    }
    to.send_data(Bytes::new(), true)?;
    Ok(())
}

fn status_only(status: StatusCode) -> Response<()> {
    let mut response = Response::new(());
    *response.status_mut() = status;
    response
}

/// The stand-in's identity as a SPIFFE URI, for configs.
pub fn waypoint_identity(namespace: &str, account: &str) -> anyhow::Result<Identity> {
    Identity::new("cluster.local", namespace, account).context("waypoint identity")
}
