//! A delta xDS response from istiod: per-resource decoding and checks,
//! then the translation of what is held into the mesh model, which must
//! always index into a state the agent can run (conflicts are resolved,
//! never fatal).
#![no_main]

use dataplane_user::istio_api::discovery::DeltaDiscoveryResponse;
use dataplane_user::state::MeshState;
use dataplane_user::xds::{XdsResources, translate};
use libfuzzer_sys::fuzz_target;
use prost::Message as _;

fuzz_target!(|data: &[u8]| {
    let Ok(response) = DeltaDiscoveryResponse::decode(data) else {
        return;
    };
    let mut held = XdsResources::default();
    let _ = held.apply(&response);
    let translated = translate(&held, "xds://fuzz");
    if let Err(err) = MeshState::from_config(&translated.config) {
        panic!("istiod's resources translated into a state that does not index: {err}");
    }
});
