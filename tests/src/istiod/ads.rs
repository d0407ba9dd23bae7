//! The test istiod's delta xDS service: the streams agents open, the
//! requests they send, and the state published to them.

use std::collections::BTreeMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};

use anyhow::Result;
use dataplane_user::istio_api::discovery::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, Resource,
    aggregated_discovery_service_server::AggregatedDiscoveryService,
};
use dataplane_user::istio_api::{ADDRESS_TYPE, AUTHORIZATION_TYPE};
use futures::Stream;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

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

pub(super) type Push = mpsc::Sender<Result<DeltaDiscoveryResponse, Status>>;

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
pub(super) struct Shared {
    streams: usize,
    /// Where responses for the newest stream go.
    pub(super) push: Option<Push>,
    /// Every stream opened (closed ones are skipped when publishing).
    pub(super) all: Vec<Push>,
    /// Once [`TestIstiod::publish`](super::TestIstiod::publish) was
    /// called: the resources served to every stream, by type and name, as
    /// istiod serves its state.
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
pub(super) struct Service {
    pub(super) shared: Arc<Mutex<Shared>>,
    pub(super) seen: mpsc::UnboundedSender<SeenRequest>,
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

/// Publishes to a [`TestIstiod`](super::TestIstiod)'s streams (see
/// [`TestIstiod::publish`](super::TestIstiod::publish));
/// publishing after the istiod stopped reaches no one.
#[derive(Clone)]
pub struct Publisher(pub(super) Arc<Mutex<Shared>>);

impl Publisher {
    /// As [`TestIstiod::publish`](super::TestIstiod::publish).
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
