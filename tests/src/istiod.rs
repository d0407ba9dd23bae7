//! A test control plane: Istio's delta xDS service and its CA
//! (`IstioCertificateService`, signing with a test root) served over real gRPC and TLS on loopback, with the protobuf types the
//! agent itself is built from, so tests can push workloads, services and
//! policies, see every request the agent sends (node, token, ACK/NACK,
//! resume versions), and restart the server under a connected client.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use anyhow::{Context as _, Result};
use dataplane_user::istio_api::ca::istio_certificate_service_server::IstioCertificateServiceServer;
use dataplane_user::istio_api::discovery::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, Resource,
    aggregated_discovery_service_server::{
        AggregatedDiscoveryService, AggregatedDiscoveryServiceServer,
    },
};
use dataplane_user::istio_api::{ADDRESS_TYPE, AUTHORIZATION_TYPE};
use futures::Stream;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

mod ca;
pub use ca::{CaMode, SeenCsr};
use ca::{CaService, CaSigner, NamedRoot, new_root};

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

/// A mesh root and a serving certificate for [`SERVER_NAME`] signed by it.
pub struct TestPki {
    /// The root, DER (what clients trust).
    pub root: CertificateDer<'static>,
    /// The root, PEM.
    pub root_pem: String,
    chain: Vec<CertificateDer<'static>>,
    key: PrivatePkcs8KeyDer<'static>,
    issuer: Arc<rcgen::Issuer<'static, rcgen::KeyPair>>,
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
            issuer: Arc::new(issuer),
        })
    }

    /// A certificate for the SPIFFE URI `identity` signed by the root, its
    /// chain (leaf, root) and key: what a mesh peer that istiod's CA signed
    /// presents, for stand-ins of a node proxy.
    pub fn issue(
        &self,
        identity: &str,
    ) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>)> {
        let key = rcgen::KeyPair::generate()?;
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new())?;
        params.subject_alt_names = vec![rcgen::SanType::URI(identity.try_into()?)];
        params.extended_key_usages = vec![
            rcgen::ExtendedKeyUsagePurpose::ServerAuth,
            rcgen::ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let leaf = params.signed_by(&key, &self.issuer)?;
        Ok((
            vec![leaf.der().clone(), self.root.clone()],
            PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
        ))
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
    /// The stream's other ASCII metadata, the client's own (not gRPC's,
    /// nor `authorization`), sorted by name.
    pub metadata: Vec<(String, String)>,
    /// The request.
    pub request: DeltaDiscoveryRequest,
}

type Push = mpsc::Sender<Result<DeltaDiscoveryResponse, Status>>;

/// The metadata a client added itself: not gRPC's, HTTP's or the
/// `authorization` header.
pub(crate) fn custom_metadata(metadata: &tonic::metadata::MetadataMap) -> Vec<(String, String)> {
    const STANDARD: &[&str] = &[
        "authorization",
        "content-type",
        "te",
        "user-agent",
        "grpc-accept-encoding",
        "grpc-encoding",
        "grpc-timeout",
    ];
    let mut out: Vec<(String, String)> = metadata
        .clone()
        .into_headers()
        .iter()
        .filter(|(name, _)| !STANDARD.contains(&name.as_str()))
        .filter_map(|(name, value)| {
            Some((name.as_str().to_owned(), value.to_str().ok()?.to_owned()))
        })
        .collect();
    out.sort();
    out
}

#[derive(Default)]
struct Shared {
    streams: usize,
    /// Where responses for the newest stream go.
    push: Option<Push>,
    /// Every stream opened (closed ones are skipped when publishing).
    all: Vec<Push>,
    /// Once [`TestIstiod::publish`] was called: the resources served to
    /// every stream, by type and name, as istiod serves its state.
    served: Option<BTreeMap<String, BTreeMap<String, Resource>>>,
    nonces: u64,
}

impl Shared {
    fn nonce(&mut self) -> String {
        self.nonces += 1;
        format!("served-{}", self.nonces)
    }

    /// istiod's answer to a subscription (istio/istio 86c9f01f,
    /// `pilot/pkg/xds/delta.go` `processDeltaRequest`, which marks it a
    /// forced push carrying the client's `initial_resource_versions`):
    /// - addresses (`pilot/pkg/xds/workload.go` `GenerateDeltas`,
    ///   `appendAddress`): every resource but those the client holds at
    ///   the same non-empty version, and the removal of what it holds
    ///   that is gone (`Subscribed.Difference(have)`);
    /// - authorizations (`WorkloadRBACGenerator::GenerateDeltas`, forced):
    ///   every policy, whatever the client holds (they carry no version),
    ///   and the removal of what it holds that is gone (its watched names,
    ///   which `deltaWatchedResources` fills from the initial versions).
    fn initial_answer(
        &mut self,
        request: &DeltaDiscoveryRequest,
    ) -> Option<DeltaDiscoveryResponse> {
        let of_type = self
            .served
            .as_ref()?
            .get(&request.type_url)
            .cloned()
            .unwrap_or_default();
        let held = &request.initial_resource_versions;
        let versioned = request.type_url == ADDRESS_TYPE;
        Some(DeltaDiscoveryResponse {
            type_url: request.type_url.clone(),
            nonce: self.nonce(),
            resources: of_type
                .values()
                .filter(|r| {
                    !versioned || r.version.is_empty() || held.get(&r.name) != Some(&r.version)
                })
                .cloned()
                .collect(),
            removed_resources: held
                .keys()
                .filter(|name| !of_type.contains_key(*name))
                .cloned()
                .collect(),
            ..Default::default()
        })
    }
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
        let metadata = custom_metadata(request.metadata());
        let (push, responses) = mpsc::channel(64);
        // Weak: stopping the test istiod drops the strong senders, which
        // ends the response stream (and with it the agent's stream).
        let weak = push.downgrade();
        let stream = {
            let mut shared = self.shared.lock().unwrap_or_else(PoisonError::into_inner);
            shared.streams += 1;
            shared.push = Some(push.clone());
            shared.all.push(push);
            shared.streams
        };
        let mut inbound = request.into_inner();
        let seen = self.seen.clone();
        let shared = Arc::clone(&self.shared);
        let push = weak;
        tokio::spawn(async move {
            while let Ok(Some(request)) = inbound.message().await {
                let answer = if request.response_nonce.is_empty() {
                    shared
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .initial_answer(&request)
                } else {
                    None
                };
                if let (Some(answer), Some(push)) = (answer, push.upgrade()) {
                    let _ = push.send(Ok(answer)).await;
                }
                let _ = seen.send(SeenRequest {
                    stream,
                    authorization: authorization.clone(),
                    metadata: metadata.clone(),
                    request,
                });
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(responses))))
    }
}

/// Publishes to a [`TestIstiod`]'s streams (see [`TestIstiod::publish`]);
/// publishing after the istiod stopped reaches no one.
#[derive(Clone)]
pub struct Publisher(Arc<Mutex<Shared>>);

impl Publisher {
    /// As [`TestIstiod::publish`].
    pub async fn publish(
        &self,
        type_url: &str,
        resources: Vec<Resource>,
        removed: &[&str],
    ) -> Result<String> {
        let mut resources = resources;
        if type_url == AUTHORIZATION_TYPE {
            // istiod sends policies without a version
            // (`pilot/pkg/xds/workload.go` `WorkloadRBACGenerator`).
            for resource in &mut resources {
                resource.version.clear();
            }
        }
        let (pushes, response) = {
            let mut shared = self.0.lock().unwrap_or_else(PoisonError::into_inner);
            let served = shared.served.get_or_insert_with(BTreeMap::new);
            let of_type = served.entry(type_url.to_owned()).or_default();
            for resource in &resources {
                of_type.insert(resource.name.clone(), resource.clone());
            }
            for name in removed {
                of_type.remove(*name);
            }
            let response = DeltaDiscoveryResponse {
                type_url: type_url.to_owned(),
                nonce: shared.nonce(),
                resources,
                removed_resources: removed.iter().map(|s| (*s).to_owned()).collect(),
                ..Default::default()
            };
            shared.all.retain(|push| !push.is_closed());
            (shared.all.clone(), response)
        };
        let nonce = response.nonce.clone();
        for push in pushes {
            let _ = push.send(Ok(response.clone())).await;
        }
        Ok(nonce)
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn served(name: &str, version: &str) -> (String, Resource) {
        let resource = Resource {
            name: name.to_owned(),
            version: version.to_owned(),
            ..Resource::default()
        };
        (name.to_owned(), resource)
    }

    fn answer(
        shared: &mut Shared,
        type_url: &str,
        held: &[(&str, &str)],
    ) -> (Vec<String>, Vec<String>) {
        let request = DeltaDiscoveryRequest {
            type_url: type_url.to_owned(),
            initial_resource_versions: held
                .iter()
                .map(|(n, v)| ((*n).to_owned(), (*v).to_owned()))
                .collect(),
            ..DeltaDiscoveryRequest::default()
        };
        let response = shared.initial_answer(&request).unwrap_or_default();
        let names = response.resources.into_iter().map(|r| r.name).collect();
        (names, response.removed_resources)
    }

    /// A resume gets what istiod would send: addresses the client holds
    /// at their non-empty version are skipped, every policy is sent
    /// again, and what the client holds that is gone is removed.
    #[test]
    fn a_resume_is_answered_by_istiods_rules_per_type() {
        let mut shared = Shared {
            served: Some(BTreeMap::from([
                (
                    ADDRESS_TYPE.to_owned(),
                    BTreeMap::from([
                        served("same", "v1"),
                        served("newer", "v2"),
                        served("bare", ""),
                    ]),
                ),
                (
                    AUTHORIZATION_TYPE.to_owned(),
                    BTreeMap::from([served("ns/p", "")]),
                ),
            ])),
            ..Shared::default()
        };
        let held = [
            ("same", "v1"),
            ("newer", "v1"),
            ("bare", ""),
            ("gone", "v1"),
        ];
        assert_eq!(
            answer(&mut shared, ADDRESS_TYPE, &held),
            (
                vec!["bare".to_owned(), "newer".to_owned()],
                vec!["gone".to_owned()]
            )
        );
        assert_eq!(
            answer(
                &mut shared,
                AUTHORIZATION_TYPE,
                &[("ns/p", ""), ("ns/gone", "")]
            ),
            (vec!["ns/p".to_owned()], vec!["ns/gone".to_owned()])
        );
    }
}
