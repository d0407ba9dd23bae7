//! SPIFFE id parsing (config, control requests, peers' certificates); a
//! parsed id must print back as itself.
#![no_main]

use dataplane_user::identity::Identity;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(uri) = std::str::from_utf8(data) {
        if let Ok(id) = Identity::parse(uri) {
            assert_eq!(id.to_uri(), uri, "a parsed SPIFFE id prints back as itself");
        }
    }
});
