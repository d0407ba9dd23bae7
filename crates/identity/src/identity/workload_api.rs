//! Certificates from the SPIFFE Workload API (e.g. the SPIRE agent's
//! socket): `SpiffeWorkloadAPI/FetchX509SVID`, a server stream whose every
//! message holds all the X.509-SVIDs the caller is entitled to.
//!
//! One task per source keeps the stream open: it dials the unix socket
//! (`SPIFFE_ENDPOINT_SOCKET`, `unix:///run/spire/sockets/agent.sock`), sends
//! the request with the metadata `workload.spiffe.io: true` that the
//! specification requires (spiffe/spiffe `standards/SPIFFE_Workload_API.md`,
//! "Transport"; SPIRE refuses a request without it with `InvalidArgument`,
//! `pkg/agent/endpoints/middleware.go` `verifySecurityHeader`), and keeps
//! the latest message. Rotation is the server sending a new message; the
//! store reads the kept message on every poll (like mounted files), so a
//! rotated SVID is in use within [`super::FILES_POLL`]. A broken stream is
//! dialled again with exponential backoff; the SVIDs already held stay in
//! use meanwhile.
//!
//! The server decides which SVIDs the caller gets by attesting the calling
//! process: the agent gets the SVIDs registered for its own selectors.
//! Trust: only the bundle of the SVID's own trust domain goes into the
//! trust bundle. Federated bundles are read and bounded but not trusted,
//! because the trust bundle is one flat set of roots: a foreign domain's
//! root in it could vouch for identities of ours.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use dataplane_istio_api::spiffe_workload::X509svidRequest;
use dataplane_istio_api::spiffe_workload::spiffe_workload_api_client::SpiffeWorkloadApiClient;
use hyper_util::rt::TokioIo;
use rustls::pki_types::CertificateDer;
use tokio::sync::watch;
use tonic::transport::{Channel, Endpoint, Uri};

use super::source::Fetched;
use super::spiffe::Identity;
use super::svid::Snapshot;

/// Largest message accepted (a node agent's SVIDs and bundles).
pub const MAX_MESSAGE: usize = 8 * 1024 * 1024;
/// Longest wait for the socket to accept.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest wait for the server to answer the request (the first message
/// may wait for attestation; SPIRE answers within seconds).
const FIRST_MESSAGE_TIMEOUT: Duration = Duration::from_secs(30);
/// HTTP/2 pings on an idle stream, to find a server that hangs.
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(30);
/// First retry after a broken stream; doubled on each failure.
const BACKOFF_FIRST: Duration = Duration::from_millis(200);
/// Longest wait between two attempts.
const BACKOFF_MAX: Duration = Duration::from_secs(30);
/// The SPIFFE IDs named in a "no SVID for" error, at most.
const OFFERED_IN_ERRORS: usize = 8;

/// Why the Workload API gave no usable certificate.
#[derive(Debug, Clone, thiserror::Error)]
pub enum WorkloadApiError {
    /// The endpoint is not a unix socket address.
    #[error(
        "SPIFFE endpoint `{endpoint}` is not a unix socket address ({reason}); give e.g. unix:///run/spire/sockets/agent.sock"
    )]
    Endpoint {
        /// What was given.
        endpoint: String,
        /// What is wrong.
        reason: &'static str,
    },
    /// Nothing is at the socket path.
    #[error(
        "the SPIFFE Workload API socket {path} does not exist; is the SPIRE agent running, and its socket directory mounted into this container?"
    )]
    SocketMissing {
        /// The socket.
        path: PathBuf,
    },
    /// The socket did not accept, or the connection broke.
    #[error("cannot reach the SPIFFE Workload API at {path}: {reason}")]
    Connect {
        /// The socket.
        path: PathBuf,
        /// What failed.
        reason: String,
    },
    /// The server refused the request's `workload.spiffe.io` header.
    #[error(
        "the SPIFFE Workload API at {path} refused the request's security header (workload.spiffe.io: true): {message}; is this a Workload API socket (not SPIRE's admin socket)?"
    )]
    HeaderRefused {
        /// The socket.
        path: PathBuf,
        /// The server's message.
        message: String,
    },
    /// The server attested the agent but has no SVID for it.
    #[error(
        "the SPIFFE Workload API at {path} issued this agent no identity ({message}); register entries whose selectors match the agent's process (e.g. its Kubernetes namespace and service account)"
    )]
    NoIdentity {
        /// The socket.
        path: PathBuf,
        /// The server's message.
        message: String,
    },
    /// Any other gRPC failure.
    #[error("the SPIFFE Workload API at {path} failed FetchX509SVID: {code:?}: {message}")]
    Rpc {
        /// The socket.
        path: PathBuf,
        /// The gRPC code.
        code: tonic::Code,
        /// The server's message.
        message: String,
    },
    /// A message broke a bound or was not what the specification says.
    #[error("the SPIFFE Workload API at {path} sent an unusable message: {reason}")]
    BadMessage {
        /// The socket.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// No message has arrived yet.
    #[error("no answer yet from the SPIFFE Workload API at {path}{}", last_error.as_ref().map(|e| format!(" (last attempt: {e})")).unwrap_or_default())]
    NotYet {
        /// The socket.
        path: PathBuf,
        /// Why the last attempt failed.
        last_error: Option<String>,
    },
    /// The server sends SVIDs, none for this identity.
    #[error(
        "the SPIFFE Workload API at {path} sends no SVID for {identity} (it sends {offered:?}); register an entry for it whose selectors match this agent"
    )]
    NoSvid {
        /// The identity wanted.
        identity: String,
        /// The socket.
        path: PathBuf,
        /// SPIFFE IDs it sends (the first few).
        offered: Vec<String>,
    },
    /// The SVID for the identity is unusable.
    #[error("the SPIFFE Workload API at {path} sent an unusable SVID for {identity}: {reason}")]
    BadSvid {
        /// The identity.
        identity: String,
        /// The socket.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
}

/// What the stream task and the source share.
#[derive(Debug)]
struct Shared {
    path: PathBuf,
    latest: watch::Sender<Option<Arc<Snapshot>>>,
    last_error: Mutex<Option<WorkloadApiError>>,
    task: Mutex<Option<tokio::task::AbortHandle>>,
}

impl Drop for Shared {
    fn drop(&mut self) {
        if let Some(task) = self
            .task
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        {
            task.abort();
        }
    }
}

/// A client of the SPIFFE Workload API; clones share one stream.
#[derive(Debug, Clone)]
pub struct WorkloadApi {
    shared: Arc<Shared>,
}

impl WorkloadApi {
    /// A client of the Workload API at `endpoint`: `unix:///path`,
    /// `unix:/path` (`SPIFFE_ENDPOINT_SOCKET`'s forms) or an absolute path.
    /// Nothing is dialled until [`Self::start`] or the first fetch.
    pub fn new(endpoint: &str) -> Result<Self, WorkloadApiError> {
        let path = socket_path(endpoint)?;
        Ok(Self {
            shared: Arc::new(Shared {
                path,
                latest: watch::Sender::new(None),
                last_error: Mutex::new(None),
                task: Mutex::new(None),
            }),
        })
    }

    /// The socket.
    pub fn path(&self) -> &Path {
        &self.shared.path
    }

    /// Starts the stream task if it is not running. It ends with the last
    /// clone of this client.
    ///
    /// # Panics
    ///
    /// Outside a tokio runtime, like [`tokio::spawn`].
    pub fn start(&self) {
        let mut task = self
            .shared
            .task
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if task.is_none() {
            let weak = Arc::downgrade(&self.shared);
            *task = Some(tokio::spawn(stream_task(weak)).abort_handle());
        }
    }

    /// Starts the stream and waits up to `timeout` for its first message;
    /// returns the bundle of `trust_domain` (the roots the agent's trust
    /// bundle starts with). The error is the last attempt's.
    pub async fn first_roots(
        &self,
        trust_domain: &str,
        timeout: Duration,
    ) -> Result<Vec<CertificateDer<'static>>, WorkloadApiError> {
        self.start();
        let mut latest = self.shared.latest.subscribe();
        let arrived = tokio::time::timeout(timeout, latest.wait_for(Option::is_some)).await;
        let snapshot = match arrived {
            Ok(Ok(snapshot)) => snapshot.clone(),
            _ => None,
        };
        let Some(snapshot) = snapshot else {
            return Err(self.not_yet());
        };
        let prefix = format!("spiffe://{trust_domain}/");
        snapshot
            .svids
            .iter()
            .find(|(id, _)| id.starts_with(&prefix))
            .map(|(_, svid)| svid.bundle().to_vec())
            .ok_or_else(|| WorkloadApiError::NoSvid {
                identity: format!("any identity of trust domain {trust_domain}"),
                path: self.shared.path.clone(),
                offered: snapshot.offered(OFFERED_IN_ERRORS),
            })
    }

    /// `identity`'s SVID from the latest message: `Unchanged` if its
    /// digest is `in_use`, checked otherwise.
    pub(super) fn fetch(
        &self,
        identity: &Identity,
        in_use: Option<u64>,
    ) -> Result<Fetched, WorkloadApiError> {
        self.start();
        let Some(snapshot) = self.shared.latest.borrow().clone() else {
            return Err(self.not_yet());
        };
        let Some(svid) = snapshot.svids.get(identity.as_uri()) else {
            return Err(WorkloadApiError::NoSvid {
                identity: identity.to_uri(),
                path: self.shared.path.clone(),
                offered: snapshot.offered(OFFERED_IN_ERRORS),
            });
        };
        if in_use == Some(svid.fingerprint) {
            return Ok(Fetched::Unchanged);
        }
        let checked = svid
            .check(identity)
            .map_err(|reason| WorkloadApiError::BadSvid {
                identity: identity.to_uri(),
                path: self.shared.path.clone(),
                reason,
            })?;
        Ok(Fetched::Issued {
            cert: checked.cert,
            roots: Some(checked.roots),
            fingerprint: Some(svid.fingerprint),
        })
    }

    fn not_yet(&self) -> WorkloadApiError {
        let last = self
            .shared
            .last_error
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        match last {
            // The precise failure (socket missing, header refused, no
            // identity) says more than "not yet".
            Some(error) => error,
            None => WorkloadApiError::NotYet {
                path: self.shared.path.clone(),
                last_error: None,
            },
        }
    }
}

/// The socket path of a `SPIFFE_ENDPOINT_SOCKET` value.
fn socket_path(endpoint: &str) -> Result<PathBuf, WorkloadApiError> {
    let refuse = |reason| WorkloadApiError::Endpoint {
        endpoint: endpoint.chars().take(256).collect(),
        reason,
    };
    let path = if let Some(rest) = endpoint.strip_prefix("unix://") {
        // `unix://host/path` has an authority; the specification allows
        // none.
        if !rest.starts_with('/') {
            return Err(refuse("unix:// must be followed by an absolute path"));
        }
        rest
    } else if let Some(rest) = endpoint.strip_prefix("unix:") {
        rest
    } else if endpoint.starts_with("tcp:") {
        return Err(refuse("TCP endpoints are not supported"));
    } else {
        endpoint
    };
    if !path.starts_with('/') {
        return Err(refuse("the path must be absolute"));
    }
    if path.contains(['?', '#']) {
        return Err(refuse("it has a query or fragment"));
    }
    Ok(PathBuf::from(path))
}

/// Keeps the stream open while the source lives; stores every message.
async fn stream_task(shared: Weak<Shared>) {
    let mut backoff = BACKOFF_FIRST;
    loop {
        let Some(strong) = shared.upgrade() else {
            return;
        };
        let path = strong.path.clone();
        drop(strong);
        let error = follow(&shared, &path, &mut backoff).await;
        let Some(strong) = shared.upgrade() else {
            return;
        };
        tracing::warn!(socket = %path.display(), error = %error, retry_in_ms = backoff.as_millis(), "SPIFFE Workload API stream failed; keeping the SVIDs held and dialling again");
        *strong
            .last_error
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(error);
        drop(strong);
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(BACKOFF_MAX);
    }
}

/// Dials, asks, and stores messages until the stream breaks; the reason.
/// A good message resets `backoff`.
async fn follow(shared: &Weak<Shared>, path: &Path, backoff: &mut Duration) -> WorkloadApiError {
    let channel = match connect(path).await {
        Ok(channel) => channel,
        Err(error) => return error,
    };
    let mut request = tonic::Request::new(X509svidRequest {});
    request.metadata_mut().insert(
        "workload.spiffe.io",
        tonic::metadata::MetadataValue::from_static("true"),
    );
    request.set_timeout(FIRST_MESSAGE_TIMEOUT);
    let mut client = SpiffeWorkloadApiClient::new(channel).max_decoding_message_size(MAX_MESSAGE);
    let answer = tokio::time::timeout(FIRST_MESSAGE_TIMEOUT, client.fetch_x509svid(request));
    let mut stream = match answer.await {
        Ok(Ok(response)) => response.into_inner(),
        Ok(Err(status)) => return from_status(path, &status),
        Err(_) => return timed_out(path),
    };
    let mut first = true;
    loop {
        // SPIRE sends nothing between rotations, so only the first message
        // has a deadline; keepalive pings find a hung server after it.
        let next = if first {
            match tokio::time::timeout(FIRST_MESSAGE_TIMEOUT, stream.message()).await {
                Ok(next) => next,
                Err(_) => return timed_out(path),
            }
        } else {
            stream.message().await
        };
        let message = match next {
            Ok(Some(message)) => message,
            Ok(None) => {
                return WorkloadApiError::Connect {
                    path: path.to_owned(),
                    reason: "the server ended the stream".into(),
                };
            }
            Err(status) => return from_status(path, &status),
        };
        first = false;
        let snapshot = match Snapshot::from_message(message) {
            Ok(snapshot) => snapshot,
            Err(reason) => {
                return WorkloadApiError::BadMessage {
                    path: path.to_owned(),
                    reason,
                };
            }
        };
        let Some(strong) = shared.upgrade() else {
            return WorkloadApiError::NotYet {
                path: path.to_owned(),
                last_error: None,
            };
        };
        tracing::info!(socket = %path.display(), svids = snapshot.svids.len(), federated_domains = snapshot.federated.len(), "SPIFFE Workload API update");
        *strong
            .last_error
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = None;
        strong.latest.send_replace(Some(Arc::new(snapshot)));
        *backoff = BACKOFF_FIRST;
    }
}

/// One HTTP/2 connection over the unix socket.
async fn connect(path: &Path) -> Result<Channel, WorkloadApiError> {
    if !path.exists() {
        return Err(WorkloadApiError::SocketMissing {
            path: path.to_owned(),
        });
    }
    let connect_error = |reason: String| WorkloadApiError::Connect {
        path: path.to_owned(),
        reason,
    };
    let socket = path.to_owned();
    // The URI is never dialled: the connector opens the socket.
    let endpoint = Endpoint::from_static("http://localhost")
        .connect_timeout(CONNECT_TIMEOUT)
        .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
        .keep_alive_timeout(CONNECT_TIMEOUT)
        .keep_alive_while_idle(true);
    let dial = tower::service_fn(move |_: Uri| {
        let socket = socket.clone();
        async move {
            let stream =
                tokio::time::timeout(CONNECT_TIMEOUT, tokio::net::UnixStream::connect(&socket))
                    .await
                    .map_err(|_| {
                        std::io::Error::new(std::io::ErrorKind::TimedOut, "connect timed out")
                    })??;
            Ok::<_, std::io::Error>(TokioIo::new(stream))
        }
    });
    endpoint
        .connect_with_connector(dial)
        .await
        .map_err(|e| connect_error(error_chain(&e)))
}

/// The error named by a gRPC status. `FetchX509SVID` has no parameters, so
/// `InvalidArgument` can only be the security header (SPIRE's
/// `verifySecurityHeader`); `PermissionDenied` is SPIRE's "no identity
/// issued" (`handler.go` `sendX509SVIDResponse`).
fn from_status(path: &Path, status: &tonic::Status) -> WorkloadApiError {
    let message: String = status.message().chars().take(512).collect();
    let path = path.to_owned();
    match status.code() {
        tonic::Code::InvalidArgument => WorkloadApiError::HeaderRefused { path, message },
        tonic::Code::PermissionDenied => WorkloadApiError::NoIdentity { path, message },
        code => WorkloadApiError::Rpc {
            path,
            code,
            message,
        },
    }
}

fn timed_out(path: &Path) -> WorkloadApiError {
    WorkloadApiError::Connect {
        path: path.to_owned(),
        reason: format!("no answer within {FIRST_MESSAGE_TIMEOUT:?}"),
    }
}

/// An error and its sources, one line (tonic's transport error says only
/// "transport error" at the top).
fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(inner) = source {
        text.push_str(": ");
        text.push_str(&inner.to_string());
        source = inner.source();
    }
    text
}
