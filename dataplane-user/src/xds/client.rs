//! The delta ADS stream to istiod: subscribe to workloads/services and
//! authorizations, apply each response ([`super::resources`]), ACK or
//! NACK it by nonce, publish what is held, and on any failure reconnect
//! with jittered exponential backoff, resuming with the versions held.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime};

use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tracing::{debug, info, warn};

use super::metrics::{Termination, XdsMetrics};
use super::resources::{Verdict, XdsResources};
use super::{XdsConfig, XdsError};
use crate::istio_api::{
    ADDRESS_TYPE, AUTHORIZATION_TYPE,
    discovery::{
        DeltaDiscoveryRequest, Status,
        aggregated_discovery_service_client::AggregatedDiscoveryServiceClient,
    },
};

/// The types subscribed to, in the order they are asked for.
pub const TYPES: [&str; 2] = [ADDRESS_TYPE, AUTHORIZATION_TYPE];
/// First pause after a failed connection; doubles up to [`MAX_BACKOFF`].
const INITIAL_BACKOFF: Duration = Duration::from_millis(100);
/// Longest pause between two connection attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(15);
/// Largest response accepted from istiod (a large cluster's full push).
const MAX_MESSAGE: usize = 64 * 1024 * 1024;
/// gRPC status code sent in a NACK's `error_detail` (INVALID_ARGUMENT).
const INVALID_ARGUMENT: i32 = 3;

/// What is held, as published to consumers after every response.
#[derive(Debug, Clone, Default)]
pub struct XdsSnapshot {
    /// The resources.
    pub resources: Arc<XdsResources>,
    /// Whether every type has had its first response since the agent
    /// started (the state is complete enough to serve from).
    pub synced: bool,
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
    snapshot: watch::Sender<XdsSnapshot>,
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
            snapshot,
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
                    crate::logging::Chain(&err).to_string(),
                ),
                Err(err) => (Termination::Error, crate::logging::Chain(&err).to_string()),
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
        let mut client =
            AggregatedDiscoveryServiceClient::new(channel).max_decoding_message_size(MAX_MESSAGE);
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
        let mut request = tonic::Request::new(ReceiverStream::new(outbound));
        let token = self.config.istiod.bearer_token()?;
        if let Some(token) = token {
            request.metadata_mut().insert("authorization", token);
        }
        let mut responses = client
            .delta_aggregated_resources(request)
            .await
            .map_err(|status| XdsError::Rpc {
                address: self.config.istiod.address.clone(),
                status: Box::new(status),
            })?
            .into_inner();
        info!(address = %self.config.istiod.address, "xDS stream up");
        self.update_status(|s| {
            s.connected_since = Some(SystemTime::now());
            s.last_error = None;
            s.streams += 1;
        });
        loop {
            let response = match responses.message().await {
                Ok(Some(response)) => response,
                Ok(None) => return Ok(()),
                Err(status) => {
                    return Err(XdsError::Rpc {
                        address: self.config.istiod.address.clone(),
                        status: Box::new(status),
                    });
                }
            };
            debug!(type_url = %response.type_url, resources = response.resources.len(), removed = response.removed_resources.len(), nonce = %response.nonce, "xDS response");
            self.metrics.received(&response);
            let verdict = Arc::make_mut(&mut self.resources).apply(&response);
            let index = TYPES.iter().position(|t| *t == response.type_url);
            let now = SystemTime::now();
            let held = self.resources.held(&response.type_url);
            self.update_status(|s| {
                if let Some(t) = index.and_then(|i| s.types.get_mut(i)) {
                    t.held = held;
                    match &verdict {
                        Verdict::Ack => t.last_ack = Some(now),
                        Verdict::Nack(reason) => t.last_nack = Some((now, reason.clone())),
                    }
                }
            });
            if let Some(i) = index {
                self.synced[i] = true;
            }
            let error_detail = match verdict {
                Verdict::Ack => None,
                Verdict::Nack(reason) => {
                    self.metrics.nacked(&response.type_url);
                    warn!(type_url = %response.type_url, %reason, "xDS response NACKed; the rest of it applied");
                    Some(Status {
                        code: INVALID_ARGUMENT,
                        message: reason,
                    })
                }
            };
            self.publish();
            let answer = DeltaDiscoveryRequest {
                type_url: response.type_url,
                response_nonce: response.nonce,
                error_detail,
                ..DeltaDiscoveryRequest::default()
            };
            if requests.send(answer).await.is_err() {
                return Err(XdsError::Protocol("the request stream closed".into()));
            }
            if self.snapshot.is_closed() {
                return Ok(());
            }
        }
    }

    fn publish(&self) {
        let snapshot = XdsSnapshot {
            resources: Arc::clone(&self.resources),
            synced: self.synced.iter().all(|s| *s),
        };
        self.snapshot.send_replace(snapshot);
    }

    fn update_status(&self, change: impl FnOnce(&mut XdsStatus)) {
        change(&mut self.status.lock().unwrap_or_else(PoisonError::into_inner));
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
