//! A test control plane: Istio's delta xDS service and its CA
//! (`IstioCertificateService`, signing with a test root) served over real gRPC and TLS on loopback, with the protobuf types the
//! agent itself is built from, so tests can push workloads, services and
//! policies, see every request the agent sends (node, token, ACK/NACK,
//! resume versions), and restart the server under a connected client.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use anyhow::{Context as _, Result};
use dataplane_user::istio_api::ca::istio_certificate_service_server::IstioCertificateServiceServer;
use dataplane_user::istio_api::discovery::{
    DeltaDiscoveryResponse, Resource,
    aggregated_discovery_service_server::AggregatedDiscoveryServiceServer,
};
use dataplane_user::istio_api::{ADDRESS_TYPE, AUTHORIZATION_TYPE};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;

mod ads;
mod ca;
mod pki;
pub(crate) use ads::custom_metadata;
pub use ads::{Publisher, SeenRequest};
use ads::{Service, Shared};
pub use ca::{CaMode, SeenCsr};
use ca::{CaService, CaSigner, NamedRoot, new_root};
pub use pki::TestPki;

/// The name the test istiod's certificate carries (as istiod's does).
pub const SERVER_NAME: &str = "istiod.istio-system.svc";

/// The agent's flags that reach the test istiod at `addr`: its server
/// name, the mesh root it is checked against (`root`, a PEM file) and the
/// token file the agent presents.
pub fn istiod_flags(
    addr: SocketAddr,
    root: &std::path::Path,
    token: &std::path::Path,
) -> Vec<String> {
    [
        "--istiod-address",
        &addr.to_string(),
        "--istiod-server-name",
        SERVER_NAME,
        "--istiod-root-cert",
        &root.display().to_string(),
        "--istiod-token",
        &token.display().to_string(),
    ]
    .map(str::to_owned)
    .to_vec()
}

/// A runtime of two threads, a fresh PKI, and a test istiod on a free
/// loopback port running on it.
pub fn loopback_istiod() -> Result<(tokio::runtime::Runtime, TestPki, TestIstiod)> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let pki = TestPki::generate()?;
    let istiod = rt.block_on(TestIstiod::start(&pki, "127.0.0.1:0".parse()?))?;
    Ok((rt, pki, istiod))
}

/// The files an agent that takes its mesh from istiod reads, written in
/// one directory: istiod's root (`root-cert.pem`), a bearer token
/// (`istio-token`) and an empty workloads file (`empty.yaml`).
#[derive(Debug, Clone)]
pub struct AgentFiles {
    /// istiod's root, PEM.
    pub root: std::path::PathBuf,
    /// The token, `token` and a newline.
    pub token: std::path::PathBuf,
    /// A config file without workloads.
    pub empty: std::path::PathBuf,
}

impl AgentFiles {
    /// Writes them in `dir`.
    pub fn write(dir: &std::path::Path, pki: &TestPki, token: &str) -> Result<Self> {
        let files = Self {
            root: dir.join("root-cert.pem"),
            token: dir.join("istio-token"),
            empty: dir.join("empty.yaml"),
        };
        std::fs::write(&files.root, &pki.root_pem)?;
        std::fs::write(&files.token, format!("{token}\n"))?;
        std::fs::write(&files.empty, "workloads: []\n")?;
        Ok(files)
    }
}

/// [`istiod_flags`] and `--xds`, the agent naming itself `pod` on
/// 127.0.0.1 (its xDS node: Istio's `ztunnel~<ip>~<pod>...`).
pub fn xds_flags(
    addr: SocketAddr,
    root: &std::path::Path,
    token: &std::path::Path,
    pod: &str,
) -> Vec<String> {
    let mut flags = vec!["--xds".to_owned()];
    flags.extend(istiod_flags(addr, root, token));
    flags.extend(["--pod-name", pod, "--instance-ip", "127.0.0.1"].map(str::to_owned));
    flags
}

/// A running test istiod; dropping it stops the server and ends its
/// streams.
pub struct TestIstiod {
    /// Where it listens.
    pub addr: SocketAddr,
    /// How its CA answers; change it at any time.
    pub ca_mode: Arc<Mutex<CaMode>>,
    /// The certificate requests its CA received.
    pub csrs: Arc<Mutex<Vec<SeenCsr>>>,
    /// Identities (SPIFFE URIs) its CA answers UNAVAILABLE for, whatever
    /// the mode (a peer that has not refreshed yet).
    pub ca_refused: Arc<Mutex<Vec<String>>>,
    signer: Arc<Mutex<CaSigner>>,
    /// The roots made by [`TestIstiod::new_root`], and the first.
    roots: Arc<Mutex<Vec<NamedRoot>>>,
    shared: Arc<Mutex<Shared>>,
    seen: mpsc::UnboundedReceiver<SeenRequest>,
    stop: Option<oneshot::Sender<()>>,
    server: tokio::task::JoinHandle<()>,
    /// One per listener (see [`TestIstiod::listen_in`]).
    accept_loops: Vec<tokio::task::JoinHandle<()>>,
    acceptor: tokio_rustls::TlsAcceptor,
    conns: Conns,
}

type Conns = mpsc::Sender<std::io::Result<tokio_rustls::server::TlsStream<tokio::net::TcpStream>>>;

/// Accepts TLS connections on `listener` and hands them to the server.
fn accept_into(
    listener: TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
    conns: Conns,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            let conns = conns.clone();
            tokio::spawn(async move {
                if let Ok(tls) = acceptor.accept(tcp).await {
                    let _ = conns.send(Ok(tls)).await;
                }
            });
        }
    })
}

impl TestIstiod {
    /// Serves on `addr` (port 0: any) with `pki`'s serving certificate.
    pub async fn start(pki: &TestPki, addr: SocketAddr) -> Result<Self> {
        let listener = TcpListener::bind(addr)
            .await
            .context("binding the test istiod")?;
        let addr = listener.local_addr()?;
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(pki.server_config()?));
        let (conns, incoming) = mpsc::channel(16);
        let accept_loop = accept_into(listener, acceptor.clone(), conns.clone());
        let shared = Arc::new(Mutex::new(Shared::default()));
        let (seen_tx, seen) = mpsc::unbounded_channel();
        let service = Service {
            shared: Arc::clone(&shared),
            seen: seen_tx,
        };
        let ca_mode = Arc::new(Mutex::new(CaMode::Sign));
        let csrs = Arc::new(Mutex::new(Vec::new()));
        let signer = Arc::new(Mutex::new(CaSigner {
            issuer: Arc::clone(&pki.issuer),
            bundle_pem: pki.root_pem.clone(),
        }));
        let ca_refused = Arc::new(Mutex::new(Vec::new()));
        let ca = CaService {
            signer: Arc::clone(&signer),
            mode: Arc::clone(&ca_mode),
            seen: Arc::clone(&csrs),
            refused: Arc::clone(&ca_refused),
        };
        let roots = Arc::new(Mutex::new(vec![NamedRoot {
            name: "mesh".to_owned(),
            pem: pki.root_pem.clone(),
            issuer: Arc::clone(&pki.issuer),
        }]));
        let (stop, stopped) = oneshot::channel::<()>();
        let server = tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(AggregatedDiscoveryServiceServer::new(service))
                .add_service(IstioCertificateServiceServer::new(ca))
                .serve_with_incoming_shutdown(ReceiverStream::new(incoming), async {
                    let _ = stopped.await;
                })
                .await;
        });
        Ok(Self {
            addr,
            ca_mode,
            csrs,
            ca_refused,
            signer,
            roots,
            shared,
            seen,
            stop: Some(stop),
            server,
            accept_loops: vec![accept_loop],
            acceptor,
            conns,
        })
    }

    /// Serves also on loopback inside `netns` (a simulated node, whose
    /// processes cannot reach the test's own loopback), on any port;
    /// returns that address. Same service, same state, same records.
    pub async fn listen_in(&mut self, netns: &crate::Netns) -> Result<SocketAddr> {
        let listener = netns.run(|| -> std::io::Result<std::net::TcpListener> {
            let listener = std::net::TcpListener::bind(("127.0.0.1", 0))?;
            listener.set_nonblocking(true)?;
            Ok(listener)
        })??;
        let listener = TcpListener::from_std(listener)?;
        let addr = listener.local_addr()?;
        let accept_loop = accept_into(listener, self.acceptor.clone(), self.conns.clone());
        self.accept_loops.push(accept_loop);
        Ok(addr)
    }

    /// Makes a new root called `name` (the CA keeps signing as before);
    /// returns its PEM. The first root, the [`TestPki`]'s, is `mesh`.
    pub fn new_root(&self, name: &str) -> Result<String> {
        let (issuer, root) = new_root(name)?;
        let pem = root.pem();
        self.roots
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(NamedRoot {
                name: name.to_owned(),
                pem: pem.clone(),
                issuer: Arc::new(issuer),
            });
        Ok(pem)
    }

    /// From now on the CA signs with the root `sign_with` and sends the
    /// roots `bundle` (names given to [`TestIstiod::new_root`], or `mesh`)
    /// as the last element of every chain.
    pub fn ca_roots(&self, sign_with: &str, bundle: &[&str]) -> Result<()> {
        let roots = self.roots.lock().unwrap_or_else(PoisonError::into_inner);
        let find = |name: &str| {
            roots
                .iter()
                .find(|root| root.name == name)
                .with_context(|| format!("no test root named {name}"))
        };
        let issuer = Arc::clone(&find(sign_with)?.issuer);
        let bundle_pem = bundle
            .iter()
            .map(|name| Ok(find(name)?.pem.clone()))
            .collect::<Result<Vec<_>>>()?
            .concat();
        *self.signer.lock().unwrap_or_else(PoisonError::into_inner) =
            CaSigner { issuer, bundle_pem };
        Ok(())
    }

    /// Sends a response on the newest stream.
    pub async fn push(&self, response: DeltaDiscoveryResponse) -> Result<()> {
        let push = self
            .shared
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push
            .clone()
            .context("no agent has opened a stream")?;
        push.send(Ok(response))
            .await
            .map_err(|_| anyhow::anyhow!("the stream is gone"))
    }

    /// Serves `resources` of `type_url` (replacing those of the same name)
    /// and removes `removed`, to every connected agent now and to every
    /// agent that subscribes later, as istiod serves its state. From the
    /// first call on, subscriptions are answered by the test istiod itself.
    /// Returns the nonce of the push to the connected agents (what their
    /// ACK names).
    pub async fn publish(
        &self,
        type_url: &str,
        resources: Vec<Resource>,
        removed: &[&str],
    ) -> Result<String> {
        self.publisher().publish(type_url, resources, removed).await
    }

    /// Serves `mesh`'s workloads and services, then its policies, at
    /// `version`, as istiod describes them ([`crate::istio_resources`]).
    pub async fn publish_mesh(
        &self,
        mesh: &dataplane_user::config::LocalConfig,
        version: &str,
    ) -> Result<()> {
        let addresses = crate::istio_resources::address_resources(mesh, version);
        self.publish(ADDRESS_TYPE, addresses, &[]).await?;
        let policies = crate::istio_resources::authorization_resources(mesh, version);
        self.publish(AUTHORIZATION_TYPE, policies, &[]).await?;
        Ok(())
    }

    /// A handle that publishes as [`TestIstiod::publish`] does, for a task
    /// that feeds this istiod (see [`crate::istiod_kube`]).
    pub fn publisher(&self) -> Publisher {
        Publisher(Arc::clone(&self.shared))
    }

    /// The next request the agent sends (fails after `timeout`).
    pub async fn next_request(&mut self, timeout: Duration) -> Result<SeenRequest> {
        tokio::time::timeout(timeout, self.seen.recv())
            .await
            .context("no request from the agent in time")?
            .context("the test istiod stopped")
    }

    /// The next request the agent sends within `timeout`, `None` if none
    /// came (fails once the test istiod stopped).
    pub async fn try_next_request(&mut self, timeout: Duration) -> Result<Option<SeenRequest>> {
        match tokio::time::timeout(timeout, self.seen.recv()).await {
            Err(_) => Ok(None),
            Ok(seen) => seen.context("the test istiod stopped").map(Some),
        }
    }

    /// Stops serving and ends every stream (as an istiod restart does).
    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        {
            let mut shared = self.shared.lock().unwrap_or_else(PoisonError::into_inner);
            shared.push = None;
            shared.all.clear();
        }
        for accept_loop in std::mem::take(&mut self.accept_loops) {
            accept_loop.abort();
            let _ = accept_loop.await;
        }
        self.server.abort();
        let _ = (&mut self.server).await;
    }
}

impl Drop for TestIstiod {
    fn drop(&mut self) {
        for accept_loop in &self.accept_loops {
            accept_loop.abort();
        }
        self.server.abort();
    }
}
