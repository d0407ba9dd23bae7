//! Builders of istiod's resources and responses for the xDS modules'
//! tests.

#![expect(
    clippy::unwrap_used,
    reason = "a bad fixture should fail the test loudly"
)]

use prost_types::Any;

use super::wire::Response;
use crate::istio_api::discovery::{DeltaDiscoveryResponse, Resource};

/// `body` as the resource `name` at `version`, of `type_url`.
pub(crate) fn resource(
    name: &str,
    version: &str,
    type_url: &str,
    body: &impl prost::Message,
) -> Resource {
    Resource {
        name: name.into(),
        version: version.into(),
        resource: Some(Any {
            type_url: type_url.into(),
            value: body.encode_to_vec(),
        }),
        ..Default::default()
    }
}

/// A delta response of `type_url` bringing `resources` and removing the
/// names `removed`.
pub(crate) fn response(type_url: &str, resources: Vec<Resource>, removed: &[&str]) -> Response {
    Response::from_message(&DeltaDiscoveryResponse {
        type_url: type_url.into(),
        resources,
        removed_resources: removed.iter().map(|s| (*s).to_owned()).collect(),
        nonce: "n1".into(),
        ..Default::default()
    })
    .unwrap()
}
