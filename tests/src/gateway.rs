//! An east-west gateway stand-in (Istio's multi-network gateway in ambient
//! mode): an HBONE server in a test pod that terminates each outer tunnel
//! of double HBONE (mutual TLS with a mesh certificate for its own
//! identity, HTTP/2 CONNECT to `hostname:port`) and carries the tunnel's
//! bytes, unread, to port 15008 of the address the test names for that
//! hostname, where the destination's node serves the inner tunnel. It
//! keeps each request's authority and headers, so tests can check what
//! the client sent it.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use dataplane_user::identity::Identity;
use dataplane_user::tls;
use h2::{RecvStream, SendStream};
use http::{Request, Response, StatusCode};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::runtime::Runtime;

use crate::stranger::MeshCredentials;
use crate::topology::Pod;

/// One CONNECT the gateway was asked for.
#[derive(Debug, Clone)]
pub struct GatewayRequest {
    /// The `:authority`.
    pub authority: String,
    /// Its headers, by lowercase name.
    pub headers: HashMap<String, String>,
}

/// A running stand-in; dropping it stops it.
pub struct GatewayStandIn {
    /// Its identity.
    pub identity: Identity,
    requests: Arc<Mutex<Vec<GatewayRequest>>>,
    runtime: Option<Runtime>,
}

impl std::fmt::Debug for GatewayStandIn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GatewayStandIn")
            .field("identity", &self.identity)
            .finish()
    }
}

struct Shared {
    /// Where each hostname's tunnels go (the node serving it, port 15008).
    routes: HashMap<String, IpAddr>,
    netns: std::path::PathBuf,
    requests: Arc<Mutex<Vec<GatewayRequest>>>,
}

impl GatewayStandIn {
    /// Serves `[::]:<port>` in `pod` as `spiffe://cluster.local/ns/<namespace>/sa/<account>`
    /// with a certificate from the mesh CA in `ca_dir`; a tunnel to
    /// `hostname:<any port>` is carried to `routes[hostname]:15008`.
    pub fn start(
        pod: &Pod,
        port: u16,
        ca_dir: &Path,
        (namespace, account): (&str, &str),
        routes: &[(&str, IpAddr)],
    ) -> anyhow::Result<Self> {
        let me = MeshCredentials::issue(ca_dir, namespace, account)?;
        let server = tls::server_config(me.resolver(), Arc::clone(&me.roots), "cluster.local")?;
        Self::start_with(pod, port, server, me.identity, routes)
    }

    /// As [`GatewayStandIn::start`], serving TLS with `server` (a
    /// certificate for `identity` from another CA, e.g. the test istiod's).
    pub fn start_with(
        pod: &Pod,
        port: u16,
        server: Arc<rustls::ServerConfig>,
        identity: Identity,
        routes: &[(&str, IpAddr)],
    ) -> anyhow::Result<Self> {
        let requests = Arc::new(Mutex::new(Vec::new()));
        let shared = Arc::new(Shared {
            routes: routes
                .iter()
                .map(|(h, ip)| ((*h).to_owned(), *ip))
                .collect(),
            netns: pod.netns.path().to_path_buf(),
            requests: Arc::clone(&requests),
        });
        let listener = pod.netns.run(move || {
            let listener = std::net::TcpListener::bind(SocketAddr::from(([0u16; 8], port)))?;
            listener.set_nonblocking(true)?;
            Ok::<_, std::io::Error>(listener)
        })??;
        let runtime = crate::waypoint::serve_connects(listener, server, shared, forward)?;
        Ok(Self {
            identity,
            requests,
            runtime: Some(runtime),
        })
    }

    /// The CONNECTs asked of it so far.
    pub fn requests(&self) -> Vec<GatewayRequest> {
        self.requests.lock().map(|r| r.clone()).unwrap_or_default()
    }
}

impl Drop for GatewayStandIn {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

/// Carries one outer tunnel's bytes to the node of its hostname.
async fn forward(
    request: Request<RecvStream>,
    mut respond: h2::server::SendResponse<Bytes>,
    shared: Arc<Shared>,
) -> anyhow::Result<()> {
    let authority = request
        .uri()
        .authority()
        .map(|a| a.as_str().to_owned())
        .unwrap_or_default();
    let headers = request
        .headers()
        .iter()
        .map(|(k, v)| (k.as_str().to_owned(), v.to_str().unwrap_or("").to_owned()))
        .collect();
    if let Ok(mut requests) = shared.requests.lock() {
        requests.push(GatewayRequest {
            authority: authority.clone(),
            headers,
        });
    }
    let host = authority.rsplit_once(':').map_or("", |(host, _)| host);
    let Some(ip) = shared.routes.get(host).copied() else {
        let _ = respond.send_response(status_only(StatusCode::SERVICE_UNAVAILABLE), true);
        anyhow::bail!("no route for {authority}");
    };
    let netns = shared.netns.clone();
    let via = SocketAddr::new(ip, 15008);
    let tcp = tokio::task::spawn_blocking(move || {
        dataplane_user::netns::run_in_netns(&netns, move || std::net::TcpStream::connect(via))
    })
    .await??;
    let tcp = match tcp {
        Ok(tcp) => tcp,
        Err(err) => {
            let _ = respond.send_response(status_only(StatusCode::SERVICE_UNAVAILABLE), true);
            return Err(err.into());
        }
    };
    tcp.set_nonblocking(true)?;
    let tcp = tokio::net::TcpStream::from_std(tcp)?;
    let send = respond.send_response(status_only(StatusCode::OK), false)?;
    let (read, write) = tcp.into_split();
    let a = tokio::spawn(to_tcp(request.into_body(), write));
    let b = tokio::spawn(from_tcp(read, send));
    let _ = tokio::join!(a, b);
    Ok(())
}

/// The tunnel's bytes to the node, then its end.
async fn to_tcp(
    mut from: RecvStream,
    mut to: tokio::net::tcp::OwnedWriteHalf,
) -> anyhow::Result<()> {
    while let Some(chunk) = from.data().await {
        let chunk = chunk?;
        let _ = from.flow_control().release_capacity(chunk.len());
        to.write_all(&chunk).await?;
    }
    to.shutdown().await?;
    Ok(())
}

/// The node's bytes into the tunnel, then its end.
async fn from_tcp(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: SendStream<Bytes>,
) -> anyhow::Result<()> {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = from.read(&mut buf).await?;
        if n == 0 {
            break;
        }
        to.send_data(Bytes::copy_from_slice(&buf[..n]), false)?;
    }
    to.send_data(Bytes::new(), true)?;
    Ok(())
}

fn status_only(status: StatusCode) -> Response<()> {
    let mut response = Response::new(());
    *response.status_mut() = status;
    response
}
