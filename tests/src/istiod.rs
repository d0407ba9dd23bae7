//! A test control plane: Istio's delta xDS service (and later its CA)
//! served over real gRPC and TLS on loopback, with the protobuf types the
//! agent itself is built from, so tests can push workloads, services and
//! policies, see every request the agent sends (node, token, ACK/NACK,
//! resume versions), and restart the server under a connected client.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use anyhow::{Context as _, Result};
use dataplane_user::istio_api::discovery::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse,
    aggregated_discovery_service_server::{
        AggregatedDiscoveryService, AggregatedDiscoveryServiceServer,
    },
};
use futures::Stream;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

/// The name the test istiod's certificate carries (as istiod's does).
pub const SERVER_NAME: &str = "istiod.istio-system.svc";

/// A mesh root and a serving certificate for [`SERVER_NAME`] signed by it.
pub struct TestPki {
    /// The root, DER (what clients trust).
    pub root: CertificateDer<'static>,
    /// The root, PEM.
    pub root_pem: String,
    chain: Vec<CertificateDer<'static>>,
    key: PrivatePkcs8KeyDer<'static>,
}

impl TestPki {
    /// A fresh root and serving certificate.
    pub fn generate() -> Result<Self> {
        use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
        let root_key = KeyPair::generate()?;
        let mut root_params = CertificateParams::new(Vec::<String>::new())?;
        root_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        root_params
            .distinguished_name
            .push(rcgen::DnType::OrganizationName, "test mesh root");
        let root = root_params.self_signed(&root_key)?;
        let issuer = Issuer::new(root_params, root_key);
        let key = KeyPair::generate()?;
        let leaf =
            CertificateParams::new(vec![SERVER_NAME.to_owned()])?.signed_by(&key, &issuer)?;
        Ok(Self {
            root: root.der().clone(),
            root_pem: root.pem(),
            chain: vec![leaf.der().clone(), root.der().clone()],
            key: PrivatePkcs8KeyDer::from(key.serialize_der()),
        })
    }

    /// The root as a rustls store.
    pub fn root_store(&self) -> Result<rustls::RootCertStore> {
        let mut store = rustls::RootCertStore::empty();
        store.add(self.root.clone())?;
        Ok(store)
    }

    fn server_config(&self) -> Result<rustls::ServerConfig> {
        let mut config =
            rustls::ServerConfig::builder_with_provider(dataplane_user::tls::provider())
                .with_safe_default_protocol_versions()?
                .with_no_client_auth()
                .with_single_cert(
                    self.chain.clone(),
                    PrivateKeyDer::Pkcs8(self.key.clone_key()),
                )?;
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(config)
    }
}

/// One request the agent sent, with the stream's `authorization` header.
#[derive(Debug, Clone)]
pub struct SeenRequest {
    /// Which stream (1 for the first connection, 2 after a reconnect...).
    pub stream: usize,
    /// The `authorization` metadata of the stream, if any.
    pub authorization: Option<String>,
    /// The request.
    pub request: DeltaDiscoveryRequest,
}

#[derive(Default)]
struct Shared {
    streams: usize,
    /// Where responses for the newest stream go.
    push: Option<mpsc::Sender<Result<DeltaDiscoveryResponse, Status>>>,
}

#[derive(Clone)]
struct Service {
    shared: Arc<Mutex<Shared>>,
    seen: mpsc::UnboundedSender<SeenRequest>,
}

type ResponseStream = Pin<Box<dyn Stream<Item = Result<DeltaDiscoveryResponse, Status>> + Send>>;

#[tonic::async_trait]
impl AggregatedDiscoveryService for Service {
    type DeltaAggregatedResourcesStream = ResponseStream;

    async fn delta_aggregated_resources(
        &self,
        request: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaAggregatedResourcesStream>, Status> {
        let authorization = request
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let (push, responses) = mpsc::channel(64);
        let stream = {
            let mut shared = self.shared.lock().unwrap_or_else(PoisonError::into_inner);
            shared.streams += 1;
            shared.push = Some(push);
            shared.streams
        };
        let mut inbound = request.into_inner();
        let seen = self.seen.clone();
        tokio::spawn(async move {
            while let Ok(Some(request)) = inbound.message().await {
                let _ = seen.send(SeenRequest {
                    stream,
                    authorization: authorization.clone(),
                    request,
                });
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(responses))))
    }
}

/// A running test istiod; dropping it stops the server and ends its
/// streams.
pub struct TestIstiod {
    /// Where it listens.
    pub addr: SocketAddr,
    shared: Arc<Mutex<Shared>>,
    seen: mpsc::UnboundedReceiver<SeenRequest>,
    stop: Option<oneshot::Sender<()>>,
    server: tokio::task::JoinHandle<()>,
    accept_loop: tokio::task::JoinHandle<()>,
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
        let accept_loop = tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let acceptor = acceptor.clone();
                let conns = conns.clone();
                tokio::spawn(async move {
                    if let Ok(tls) = acceptor.accept(tcp).await {
                        let _ = conns.send(Ok::<_, std::io::Error>(tls)).await;
                    }
                });
            }
        });
        let shared = Arc::new(Mutex::new(Shared::default()));
        let (seen_tx, seen) = mpsc::unbounded_channel();
        let service = Service {
            shared: Arc::clone(&shared),
            seen: seen_tx,
        };
        let (stop, stopped) = oneshot::channel::<()>();
        let server = tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(AggregatedDiscoveryServiceServer::new(service))
                .serve_with_incoming_shutdown(ReceiverStream::new(incoming), async {
                    let _ = stopped.await;
                })
                .await;
        });
        Ok(Self {
            addr,
            shared,
            seen,
            stop: Some(stop),
            server,
            accept_loop,
        })
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

    /// The next request the agent sends (fails after `timeout`).
    pub async fn next_request(&mut self, timeout: Duration) -> Result<SeenRequest> {
        tokio::time::timeout(timeout, self.seen.recv())
            .await
            .context("no request from the agent in time")?
            .context("the test istiod stopped")
    }

    /// Stops serving and ends every stream (as an istiod restart does).
    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        self.shared
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push = None;
        self.accept_loop.abort();
        let _ = (&mut self.accept_loop).await;
        self.server.abort();
        let _ = (&mut self.server).await;
    }
}

impl Drop for TestIstiod {
    fn drop(&mut self) {
        self.accept_loop.abort();
        self.server.abort();
    }
}
