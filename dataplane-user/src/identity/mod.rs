//! Workload identities (SPIFFE) and the built-in certificate authority.
//!
//! Without an Istio control plane the agent is its own CA: [`Ca`] holds a
//! root (loaded from, or generated into, a directory) and issues one
//! short-lived certificate per [`Identity`]; [`CertStore`] keeps the current
//! certificate of each identity in use, rotates it at half-life and hands it
//! to rustls through [`IdentityCertResolver`]. The [`crate::tls`] module
//! builds the HBONE client and server configurations on top.

mod ca;
mod ca_files;
mod istio_ca;
mod spiffe;
mod store;

pub use ca::{Ca, CaError, GENERATED_ROOT_NAME, IssuedCert, ROOT_CERT_FILE, ROOT_KEY_FILE};
pub use istio_ca::{IstioCa, IstioCaError, IstioIssued, checked_chain};
pub use spiffe::{Identity, IdentityError, IdentityParts};
pub use store::{CertStore, CertStoreError, DEFAULT_VALIDITY, IdentityCertResolver};

#[cfg(test)]
mod tests;
