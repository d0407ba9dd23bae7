//! Reading a peer's identity from the DER certificate it presents.
#![no_main]

use dataplane_user::identity::Identity;
use libfuzzer_sys::fuzz_target;
use rustls::pki_types::CertificateDer;

fuzz_target!(|data: &[u8]| {
    let _ = Identity::from_certificate(&CertificateDer::from(data));
});
