//! A SPIFFE Workload API server for tests (feature `test-util`): serves
//! `SpiffeWorkloadAPI/FetchX509SVID` on a real unix socket, with SVIDs
//! issued by a real CA, and refuses what SPIRE's agent refuses:
//!
//! - a request without the metadata `workload.spiffe.io: true` (exactly
//!   one value): `InvalidArgument`, "security header missing from request"
//!   (spire `pkg/agent/endpoints/middleware.go` `verifySecurityHeader`);
//! - a caller with no SVID: the stream ends with `PermissionDenied`, "no
//!   identity issued" (spire `pkg/agent/endpoints/workload/handler.go`
//!   `sendX509SVIDResponse`).
//!
//! Like SPIRE's `FetchX509SVID` it sends the current SVIDs at once, then a
//! new message whenever they change ([`WorkloadApiServer::serve`]).
//! Set-up failures panic (a broken fixture is a broken test).

use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use dataplane_istio_api::spiffe_workload::spiffe_workload_api_server::{
    SpiffeWorkloadApi, SpiffeWorkloadApiServer,
};
use dataplane_istio_api::spiffe_workload::{X509svid, X509svidRequest, X509svidResponse};
use futures::Stream;
use tokio::sync::watch;

use crate::identity::{Ca, IssuedCert};

/// What one stream sends: the message, or the stream's end with
/// "no identity issued".
type Update = Option<X509svidResponse>;

/// A Workload API server on a unix socket in a directory of its own; the
/// server stops and the directory goes when it is dropped.
#[derive(Debug)]
pub struct WorkloadApiServer {
    dir: PathBuf,
    socket: PathBuf,
    updates: watch::Sender<Update>,
    counters: Arc<Counters>,
    task: tokio::task::JoinHandle<()>,
}

/// Requests seen, by outcome.
#[derive(Debug, Default)]
struct Counters {
    served: AtomicUsize,
    refused_header: AtomicUsize,
}

#[derive(Debug, Clone)]
struct Service {
    updates: watch::Receiver<Update>,
    counters: Arc<Counters>,
}

type SvidStream = Pin<Box<dyn Stream<Item = Result<X509svidResponse, tonic::Status>> + Send>>;

#[tonic::async_trait]
impl SpiffeWorkloadApi for Service {
    type FetchX509SVIDStream = SvidStream;

    async fn fetch_x509svid(
        &self,
        request: tonic::Request<X509svidRequest>,
    ) -> Result<tonic::Response<SvidStream>, tonic::Status> {
        let values: Vec<_> = request
            .metadata()
            .get_all("workload.spiffe.io")
            .iter()
            .collect();
        if values.len() != 1 || values[0] != "true" {
            self.counters.refused_header.fetch_add(1, Ordering::Relaxed);
            return Err(tonic::Status::invalid_argument(
                "security header missing from request",
            ));
        }
        self.counters.served.fetch_add(1, Ordering::Relaxed);
        let mut updates = self.updates.clone();
        updates.mark_changed();
        let stream = futures::stream::unfold(Some(updates), |state| async move {
            let mut updates = state?;
            updates.changed().await.ok()?;
            let update = updates.borrow_and_update().clone();
            match update {
                Some(message) => Some((Ok(message), Some(updates))),
                None => Some((
                    Err(tonic::Status::permission_denied("no identity issued")),
                    None,
                )),
            }
        });
        Ok(tonic::Response::new(Box::pin(stream)))
    }
}

impl WorkloadApiServer {
    /// Serves `first` (`None`: no identity issued) on a new socket.
    ///
    /// # Panics
    ///
    /// When the socket cannot be made; outside a tokio runtime.
    pub fn serve(first: Update) -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let dir = std::env::temp_dir().join(format!(
            "dp-spiffe-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).expect("create the socket directory");
        let socket = dir.join("agent.sock");
        let listener = tokio::net::UnixListener::bind(&socket).expect("bind the socket");
        let (updates, receiver) = watch::channel(first);
        let counters = Arc::new(Counters::default());
        let service = Service {
            updates: receiver,
            counters: Arc::clone(&counters),
        };
        let incoming = futures::stream::unfold(listener, |listener| async move {
            let accepted = listener.accept().await.map(|(stream, _)| stream);
            Some((accepted, listener))
        });
        let task = tokio::spawn(async move {
            let served = tonic::transport::Server::builder()
                .add_service(SpiffeWorkloadApiServer::new(service))
                .serve_with_incoming(incoming)
                .await;
            if let Err(e) = served {
                tracing::warn!(error = %e, "test Workload API server stopped");
            }
        });
        Self {
            dir,
            socket,
            updates,
            counters,
            task,
        }
    }

    /// The socket's path.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// `unix://<socket>`, as `SPIFFE_ENDPOINT_SOCKET` holds it.
    pub fn endpoint(&self) -> String {
        format!("unix://{}", self.socket.display())
    }

    /// Pushes a new message to every open stream (a rotation); `None`
    /// ends them with "no identity issued".
    pub fn push(&self, update: Update) {
        self.updates.send_replace(update);
    }

    /// Requests answered, and requests refused for the security header.
    pub fn requests(&self) -> (usize, usize) {
        (
            self.counters.served.load(Ordering::Relaxed),
            self.counters.refused_header.load(Ordering::Relaxed),
        )
    }
}

impl Drop for WorkloadApiServer {
    fn drop(&mut self) {
        self.task.abort();
        // Best effort: the directory is this server's alone.
        drop(std::fs::remove_dir_all(&self.dir));
    }
}

/// A message carrying `certs` (from `ca`), each as SPIRE sends an SVID:
/// the leaf (the chain without the root), the PKCS#8 key, and the CA's
/// root as the trust domain's bundle.
pub fn message(ca: &Ca, certs: &[&IssuedCert]) -> X509svidResponse {
    X509svidResponse {
        svids: certs.iter().map(|cert| svid(ca, cert)).collect(),
        crl: Vec::new(),
        federated_bundles: Default::default(),
    }
}

/// One SVID of `cert`, bundle `ca`'s root.
pub fn svid(ca: &Ca, cert: &IssuedCert) -> X509svid {
    let root = ca.root_der();
    let chain: Vec<u8> = cert
        .chain
        .iter()
        .filter(|c| *c != root)
        .flat_map(|c| c.to_vec())
        .collect();
    X509svid {
        spiffe_id: cert.identity.to_uri(),
        x509_svid: chain,
        x509_svid_key: cert.key.secret_der().to_vec(),
        bundle: root.to_vec(),
        hint: String::new(),
    }
}
