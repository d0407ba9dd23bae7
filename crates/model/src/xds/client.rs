//! The delta ADS stream to istiod: subscribe to workloads/services and
//! authorizations, apply each response ([`super::resources`]), publish
//! what is held, ACK or NACK it by nonce, and on any failure reconnect
//! with jittered exponential backoff, resuming with the versions held.
//!
//! As ztunnel does, a response is ACKed once the agent's state holds it
//! (when a consumer reports what it applied, [`XdsClient::ack_when_applied`]),
//! so istiod's view of when this proxy converged is true. The stream never
//! waits for that: responses go on being read and applied to what is held
//! (cheap: see [`super::resources`]) while the state is rebuilt, and their
//! answers go out, in order, as the state catches up.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime};

use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tracing::{debug, info, warn};

use super::grpc::AdsCall;
use super::metrics::{Termination, XdsMetrics};
use super::resources::{Verdict, XdsResources};
use super::{XdsConfig, XdsError};
use crate::istio_api::{
    ADDRESS_TYPE, AUTHORIZATION_TYPE,
    discovery::{DeltaDiscoveryRequest, Status},
};

/// The types subscribed to, in the order they are asked for.
pub const TYPES: [&str; 2] = [ADDRESS_TYPE, AUTHORIZATION_TYPE];
/// First pause after a failed connection; doubles up to [`MAX_BACKOFF`].
const INITIAL_BACKOFF: Duration = Duration::from_millis(100);
/// Longest pause between two connection attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(15);
/// Largest response accepted from istiod. istiod sends a proxy's whole
/// first state in one response, about 245 bytes a workload, so this
/// bounds the mesh the agent can join: 512 MiB takes about 2M workloads.
/// ztunnel's limit (`src/xds/client.rs`,
/// `max_decoding_message_size(200 * 1024 * 1024)`) refuses the first push
/// of a mesh past about 850k. A response is held once, as received
/// ([`super::wire`]), so the bound is the memory it costs.
const MAX_MESSAGE: usize = 512 * 1024 * 1024;
/// The delta ADS method (Envoy's `AggregatedDiscoveryService`).
const ADS_METHOD: &str =
    "/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources";
/// gRPC status code sent in a NACK's `error_detail` (INVALID_ARGUMENT).
const INVALID_ARGUMENT: i32 = 3;
/// Answers held for a state not yet applied; past this the oldest goes out
/// at once, so a stalled consumer cannot grow the queue without bound.
const MAX_PENDING_ANSWERS: usize = 1024;

/// What is held, as published to consumers after every response.
#[derive(Debug, Clone, Default)]
pub struct XdsSnapshot {
    /// The resources.
    pub resources: Arc<XdsResources>,
    /// Whether every type has had its first response since the agent
    /// started (the state is complete enough to serve from).
    pub synced: bool,
    /// Responses applied since the client started: the consumer reports
    /// this back once its state holds them ([`Applied`]).
    pub generation: u64,
    /// Resource names those responses carried (added, changed or
    /// removed): the difference between two snapshots bounds how much
    /// changed between them, before anything is compared.
    pub names: u64,
}

/// What the consumer of the snapshots reports back: how far its state has
/// caught up.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Applied {
    /// The newest [`XdsSnapshot::generation`] the state reflects, or that
    /// the consumer gave up on (with `error`).
    pub generation: u64,
    /// Why that snapshot could not become the state (the previous one
    /// stays): its responses are NACKed with this.
    pub error: Option<String>,
}

/// The consumer's side of [`Applied`].
#[derive(Debug)]
pub struct AppliedReporter(watch::Sender<Applied>);

impl AppliedReporter {
    /// The state now reflects `generation` (or could not: `error`).
    pub fn report(&self, generation: u64, error: Option<String>) {
        self.0.send_replace(Applied { generation, error });
    }
}

/// One response's answer, sent once its generation is applied.
#[derive(Debug)]
struct Answer {
    generation: u64,
    type_url: String,
    nonce: String,
    /// Why the response itself was NACKed.
    rejected: Option<String>,
}

/// Per-type counts of the last ACK and NACK.
#[derive(Debug, Clone, Default, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct TypeStatus {
    /// The resource type URL.
    pub type_url: String,
    /// When the last response was ACKed.
    pub last_ack: Option<SystemTime>,
    /// When the last response was NACKed, and why.
    pub last_nack: Option<(SystemTime, String)>,
    /// Resources held.
    pub held: usize,
}

/// The connection as `status` shows it.
#[derive(Debug, Clone, Default, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct XdsStatus {
    /// The address dialled.
    pub address: String,
    /// Since when the current stream is up; `None` while disconnected.
    pub connected_since: Option<SystemTime>,
    /// The last connection failure.
    pub last_error: Option<String>,
    /// Streams opened since start (1 + reconnects).
    pub streams: u64,
    /// Per type.
    pub types: Vec<TypeStatus>,
}

/// The client; [`XdsClient::run`] keeps it connected until dropped.
#[derive(Debug)]
pub struct XdsClient {
    config: XdsConfig,
    /// Shared with the published snapshot (copied once per response, when
    /// it changes, never per reader).
    resources: Arc<XdsResources>,
    synced: [bool; TYPES.len()],
    generation: u64,
    /// Resource names the responses carried ([`XdsSnapshot::names`]).
    names: u64,
    snapshot: watch::Sender<XdsSnapshot>,
    /// Set by [`Self::ack_when_applied`]: answers wait for the state.
    applied: Option<watch::Receiver<Applied>>,
    status: Arc<Mutex<XdsStatus>>,
    metrics: XdsMetrics,
}

impl XdsClient {
    /// A client for `config`; subscribe to the returned receiver for the
    /// resources.
    pub fn new(config: XdsConfig) -> (Self, watch::Receiver<XdsSnapshot>, Arc<Mutex<XdsStatus>>) {
        let (snapshot, receiver) = watch::channel(XdsSnapshot::default());
        let status = Arc::new(Mutex::new(XdsStatus {
            address: config.istiod.address.clone(),
            types: TYPES
                .iter()
                .map(|t| TypeStatus {
                    type_url: (*t).to_owned(),
                    ..TypeStatus::default()
                })
                .collect(),
            ..XdsStatus::default()
        }));
        let client = Self {
            config,
            resources: Arc::default(),
            synced: [false; TYPES.len()],
            generation: 0,
            names: 0,
            snapshot,
            applied: None,
            status: Arc::clone(&status),
            metrics: XdsMetrics::default(),
        };
        (client, receiver, status)
    }

    /// Counts into `metrics` (registered on `/metrics`) instead of
    /// counters nobody reads.
    pub fn with_metrics(mut self, metrics: XdsMetrics) -> Self {
        self.metrics = metrics;
        self
    }

    /// Answers each response only once the consumer reports (through the
    /// returned reporter) that its state holds it, NACKing it if the
    /// consumer could not apply it. Without this, responses are answered
    /// as soon as they are held.
    pub fn ack_when_applied(mut self) -> (Self, AppliedReporter) {
        let (sender, receiver) = watch::channel(Applied::default());
        self.applied = Some(receiver);
        (self, AppliedReporter(sender))
    }

    /// Connects, serves the stream, reconnects on failure; returns only
    /// when every receiver of the snapshot is gone.
    pub async fn run(mut self) {
        let mut backoff = INITIAL_BACKOFF;
        loop {
            let started = tokio::time::Instant::now();
            let (why, error) = match self.stream_once().await {
                Ok(()) => (Termination::Complete, "istiod closed the stream".to_owned()),
                Err(err @ XdsError::Istiod(_)) => (
                    Termination::ConnectionError,
                    dataplane_core::error::Chain(&err).to_string(),
                ),
                Err(err) => (
                    Termination::Error,
                    dataplane_core::error::Chain(&err).to_string(),
                ),
            };
            self.metrics.terminated(why);
            if self.snapshot.is_closed() {
                return;
            }
            self.update_status(|s| {
                s.connected_since = None;
                s.last_error = Some(error.clone());
            });
            // A stream that stayed up a while was healthy: start over.
            if started.elapsed() > MAX_BACKOFF {
                backoff = INITIAL_BACKOFF;
            }
            let pause = jittered(backoff);
            warn!(address = %self.config.istiod.address, %error, retry_in_ms = pause.as_millis() as u64, "xDS stream ended; reconnecting");
            tokio::time::sleep(pause).await;
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
    }

    /// One stream, from connection to failure.
    async fn stream_once(&mut self) -> Result<(), XdsError> {
        let channel: Channel = self.config.istiod.connect().await?;
        let (requests, outbound) = mpsc::channel::<DeltaDiscoveryRequest>(16);
        let node = self.config.node.node();
        for type_url in TYPES {
            let initial = DeltaDiscoveryRequest {
                node: Some(node.clone()),
                type_url: type_url.to_owned(),
                initial_resource_versions: self.resources.versions(type_url).into_iter().collect(),
                ..DeltaDiscoveryRequest::default()
            };
            requests
                .try_send(initial)
                .map_err(|_| XdsError::Protocol("request queue full at start".into()))?;
        }
        let mut metadata = tonic::metadata::MetadataMap::new();
        self.config.istiod.add_metadata(&mut metadata)?;
        // The call framed by hand, so each response is freed with it
        // ([`super::grpc`]).
        let mut responses = AdsCall::open(
            channel,
            ADS_METHOD,
            metadata,
            ReceiverStream::new(outbound),
            MAX_MESSAGE,
        )
        .await
        .map_err(|status| XdsError::Rpc {
            address: self.config.istiod.address.clone(),
            status: Box::new(status),
        })?;
        info!(address = %self.config.istiod.address, "xDS stream up");
        self.update_status(|s| {
            s.connected_since = Some(SystemTime::now());
            s.last_error = None;
            s.streams += 1;
        });
        // Answers of this stream waiting for the state (a new stream's
        // responses are answered on it, never an old one's).
        let mut pending: VecDeque<Answer> = VecDeque::new();
        let mut applied = self.applied.clone();
        loop {
            // Both branches are cancel-safe: `message()` polls the stream,
            // which keeps a partly read message in itself.
            let message = tokio::select! {
                message = responses.message() => message,
                changed = caught_up(&mut applied) => {
                    let reached = match changed {
                        Some(reached) => reached,
                        None => {
                            // The consumer is gone: answer as things arrive.
                            applied = None;
                            Applied { generation: u64::MAX, error: None }
                        }
                    };
                    while pending.front().is_some_and(|a| a.generation <= reached.generation) {
                        if let Some(answer) = pending.pop_front() {
                            self.answer(&requests, answer, reached.error.as_deref()).await?;
                        }
                    }
                    continue;
                }
            };
            let response = match message {
                Ok(Some(response)) => response,
                Ok(None) => return Ok(()),
                Err(status) => {
                    return Err(XdsError::Rpc {
                        address: self.config.istiod.address.clone(),
                        status: Box::new(status),
                    });
                }
            };
            debug!(type_url = %response.type_url(), resources = response.resource_count(), removed = response.removed_count(), nonce = %response.nonce(), "xDS response");
            self.metrics.received(&response);
            let verdict = Arc::make_mut(&mut self.resources).apply(&response);
            let index = TYPES.iter().position(|t| *t == response.type_url());
            let held = self.resources.held(response.type_url());
            self.update_status(|s| {
                if let Some(t) = index.and_then(|i| s.types.get_mut(i)) {
                    t.held = held;
                }
            });
            if let Some(i) = index {
                self.synced[i] = true;
            }
            self.generation += 1;
            self.names = self
                .names
                .saturating_add((response.resource_count() + response.removed_count()) as u64);
            self.publish();
            let answer = Answer {
                generation: self.generation,
                type_url: response.type_url().to_owned(),
                nonce: response.nonce().to_owned(),
                rejected: match verdict {
                    Verdict::Ack => None,
                    Verdict::Nack(reason) => Some(reason),
                },
            };
            if applied.is_none() {
                self.answer(&requests, answer, None).await?;
            } else {
                pending.push_back(answer);
                if pending.len() > MAX_PENDING_ANSWERS
                    && let Some(oldest) = pending.pop_front()
                {
                    self.answer(&requests, oldest, None).await?;
                }
            }
            if self.snapshot.is_closed() {
                return Ok(());
            }
        }
    }

    /// Sends `answer`: a NACK if the response was rejected or the state
    /// could not be built from it (`failed`), else an ACK.
    async fn answer(
        &self,
        requests: &mpsc::Sender<DeltaDiscoveryRequest>,
        answer: Answer,
        failed: Option<&str>,
    ) -> Result<(), XdsError> {
        let reason = answer.rejected.or_else(|| {
            failed.map(|error| format!("the agent's state could not be built: {error}"))
        });
        let now = SystemTime::now();
        let index = TYPES.iter().position(|t| *t == answer.type_url);
        self.update_status(|s| {
            if let Some(t) = index.and_then(|i| s.types.get_mut(i)) {
                match &reason {
                    None => t.last_ack = Some(now),
                    Some(reason) => t.last_nack = Some((now, reason.clone())),
                }
            }
        });
        let error_detail = reason.map(|reason| {
            self.metrics.nacked(&answer.type_url);
            warn!(type_url = %answer.type_url, %reason, "xDS response NACKed; the rest of it applied");
            Status {
                code: INVALID_ARGUMENT,
                message: reason,
            }
        });
        let request = DeltaDiscoveryRequest {
            type_url: answer.type_url,
            response_nonce: answer.nonce,
            error_detail,
            ..DeltaDiscoveryRequest::default()
        };
        requests
            .send(request)
            .await
            .map_err(|_| XdsError::Protocol("the request stream closed".into()))
    }

    fn publish(&self) {
        let snapshot = XdsSnapshot {
            resources: Arc::clone(&self.resources),
            synced: self.synced.iter().all(|s| *s),
            generation: self.generation,
            names: self.names,
        };
        self.snapshot.send_replace(snapshot);
    }

    fn update_status(&self, change: impl FnOnce(&mut XdsStatus)) {
        change(&mut self.status.lock().unwrap_or_else(PoisonError::into_inner));
    }
}

/// The consumer's next report, `None` once it is gone; never resolves
/// without one.
async fn caught_up(applied: &mut Option<watch::Receiver<Applied>>) -> Option<Applied> {
    match applied {
        Some(receiver) => match receiver.changed().await {
            Ok(()) => Some(receiver.borrow_and_update().clone()),
            Err(_) => None,
        },
        None => std::future::pending().await,
    }
}

/// `base` less up to half of it, at random: reconnecting agents spread out
/// instead of hitting a restarted istiod together.
fn jittered(base: Duration) -> Duration {
    use std::hash::{BuildHasher, RandomState};
    let random = RandomState::new().hash_one(SystemTime::now());
    let half = base.as_millis() as u64 / 2;
    let less = if half == 0 { 0 } else { random % half };
    base - Duration::from_millis(less)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jitter_stays_within_half_of_the_base() {
        for _ in 0..100 {
            let pause = jittered(Duration::from_secs(2));
            assert!(
                pause > Duration::from_millis(999) && pause <= Duration::from_secs(2),
                "{pause:?}"
            );
        }
        assert_eq!(jittered(Duration::from_millis(1)), Duration::from_millis(1));
    }
}
