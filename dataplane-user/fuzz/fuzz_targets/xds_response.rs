//! A delta xDS response from istiod: read in place (`xds::wire`), which
//! must accept exactly what prost's decoding accepts and see the same
//! fields in it; then per-resource decoding and checks, then the
//! translation of what is held into the mesh model, which must always
//! index into a state the agent can run (conflicts are resolved, never
//! fatal).
#![no_main]

use dataplane_user::istio_api::discovery::DeltaDiscoveryResponse;
use dataplane_user::state::MeshState;
use dataplane_user::xds::{Response, XdsResources, translate};
use libfuzzer_sys::fuzz_target;
use prost::Message as _;

fuzz_target!(|data: &[u8]| {
    let decoded = DeltaDiscoveryResponse::decode(data);
    let response = match (Response::decode(data.to_vec().into()), decoded) {
        (Ok(response), Ok(decoded)) => {
            assert_same(&response, &decoded);
            response
        }
        (Err(_), Err(_)) => return,
        (ours, prost) => panic!("the in-place reader and prost disagree: {ours:?} / {prost:?}"),
    };
    let mut held = XdsResources::default();
    let _ = held.apply(&response);
    let translated = translate(&held, "xds://fuzz");
    if let Err(err) = MeshState::from_config(&translated.config) {
        panic!("istiod's resources translated into a state that does not index: {err}");
    }
});

fn assert_same(response: &Response, decoded: &DeltaDiscoveryResponse) {
    assert_eq!(response.type_url(), decoded.type_url);
    assert_eq!(response.nonce(), decoded.nonce);
    assert!(
        response
            .removed()
            .eq(decoded.removed_resources.iter().map(String::as_str))
    );
    assert_eq!(response.resource_count(), decoded.resources.len());
    for (view, resource) in response.resources().zip(&decoded.resources) {
        assert_eq!(view.name, resource.name);
        assert_eq!(view.version, resource.version);
        assert_eq!(
            view.body.map(|any| (any.type_url, any.value)),
            resource
                .resource
                .as_ref()
                .map(|any| (any.type_url.as_str(), any.value.as_slice()))
        );
    }
}
