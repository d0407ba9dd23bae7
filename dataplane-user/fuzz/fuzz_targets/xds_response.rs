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
            if let Some(field) = response.mismatch(&decoded) {
                panic!("the in-place reader and prost differ in {field}");
            }
            response
        }
        (Err(_), Err(_)) => return,
        // The one refusal prost does not make: a response naming more
        // entries than its size allows (memory bound; never seen from
        // istiod, and out of reach of inputs under 16 KiB).
        (Err(dataplane_user::xds::WireError::TooManyEntries { .. }), Ok(_)) => return,
        (ours, prost) => panic!("the in-place reader and prost disagree: {ours:?} / {prost:?}"),
    };
    let mut held = XdsResources::default();
    let _ = held.apply(&response);
    let translated = translate(&held, "xds://fuzz");
    if let Err(err) = MeshState::from_config(&translated.config) {
        panic!("istiod's resources translated into a state that does not index: {err}");
    }
});
