//! Workload identities (SPIFFE), where their certificates come from, and
//! the roots peers are verified against.
//!
//! A [`CertStore`] holds the current certificate of each identity a local
//! workload uses, from one [`CertSource`]: the built-in [`Ca`] (a root
//! loaded from, or generated into, a directory), Istio's CA ([`IstioCa`]),
//! mounted files ([`CertDir`]), or the SPIFFE Workload API
//! ([`WorkloadApi`]). It keeps them fresh from a task of its
//! own and hands them to rustls through [`IdentityCertResolver`]. The roots
//! live in a [`TrustBundle`] every verifier reads per handshake, so a root
//! rotation swaps them without rebuilding any TLS configuration. The
//! [`crate::tls`] module builds the HBONE client and server configurations
//! on top.

mod bundle;
mod ca;
mod ca_files;
mod cert_dir;
mod crl;
mod istio_ca;
mod resolver;
mod source;
mod spiffe;
mod store;
mod svid;
mod workload_api;

pub use bundle::{MAX_ROOTS, RootInfo, TrustBundle, TrustBundleError};
pub use ca::{Ca, CaError, GENERATED_ROOT_NAME, IssuedCert, ROOT_CERT_FILE, ROOT_KEY_FILE};
pub use cert_dir::{
    CHAIN_FILE, CertDir, CertDirError, FileCert, KEY_FILE, ROOT_BUNDLE_FILE, RawFiles, check_files,
    parse_certs,
};
pub use crl::{CRL_POLL, CrlError, MAX_CRL_FILE, PeerChain, PeerRole, RevocationList};
pub use istio_ca::{IstioCa, IstioCaError, IstioIssued, checked_chain};
pub use resolver::IdentityCertResolver;
pub use source::{CertSource, CertSourceError, CertSourceStatus, Fetched};
pub use spiffe::{Identity, IdentityError, IdentityParts};
pub use store::{CertStore, CertStoreError, DEFAULT_VALIDITY, FILES_POLL};
pub use svid::MAX_SVIDS;
pub use workload_api::{MAX_MESSAGE, WorkloadApi, WorkloadApiError};

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_sources;
#[cfg(test)]
mod tests_workload_api;
