//! An HBONE CONNECT request head as h2 hands it to the server: method,
//! authority, `forwarded`, `baggage`, `traceparent` (one per line).
#![no_main]

use dataplane_user::hbone::head::RequestHead;
use http::{HeaderMap, HeaderValue, Method, Uri};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut fields = data.splitn(5, |&b| b == b'\n');
    let method = fields.next().unwrap_or_default();
    let authority = fields.next().unwrap_or_default();
    // Only what h2 would deliver: a valid method token and authority.
    let Ok(method) = Method::from_bytes(method) else {
        return;
    };
    let Ok(uri) = Uri::builder().authority(authority).build() else {
        return;
    };
    let mut headers = HeaderMap::new();
    for name in ["forwarded", "baggage", "traceparent"] {
        if let Some(Ok(value)) = fields.next().map(HeaderValue::from_bytes) {
            headers.insert(name, value);
        }
    }
    if let Ok(head) = RequestHead::parse(&method, &uri, &headers) {
        // What the server logs must be printable.
        let _ = head.authority.to_string();
    }
});
