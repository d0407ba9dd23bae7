//! A control-socket request, read as the agent reads it, then the pod
//! identity an `add` would derive.
#![no_main]

use dataplane_user::control::{Request, read_request};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(Request::Add { pod }) = read_request(data) {
        let _ = pod.identity();
    }
});
