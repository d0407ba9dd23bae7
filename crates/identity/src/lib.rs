//! Who a workload is and how it proves it: SPIFFE identities, their
//! certificates, the roots peers are verified against, HBONE's TLS, and the
//! TLS channel to istiod.
//!
//! Its modules, lowest first (each uses only those before it):
//!
//! - [`crypto`]: the rustls crypto provider every configuration names
//!   (aws-lc-rs restricted to the HBONE suites and groups).
//! - [`istiod`]: the gRPC channel to istiod over TLS, authenticated with the
//!   agent's service-account token; xDS and Istio's CA both use it.
//! - [`identity`]: SPIFFE identities, the certificate sources (built-in CA,
//!   Istio's CA, mounted files, the SPIFFE Workload API), the store that keeps them fresh, and the
//!   trust bundle.
//! - [`tls`]: HBONE's rustls client and server configurations and their
//!   SPIFFE verifiers.
//! - `test_util` (feature `test-util`, for other crates' tests): the
//!   shared test CA and the configurations it gives; `workload_api_server`
//!   (same feature): a SPIFFE Workload API server on a unix socket.
//!
//! It depends on `dataplane-core` and `dataplane-istio-api` (Istio's CA
//! service) only: nothing of the kernel, the mesh model, the engine or the
//! node above it, and not on clap. `dataplane-user` re-exports its modules
//! under their old paths.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod crypto;
#[cfg(test)]
mod fuzz_seeds;
pub mod identity;
pub mod istiod;
#[cfg(any(test, feature = "test-util"))]
pub mod test_util;
pub mod tls;
#[cfg(any(test, feature = "test-util"))]
pub mod workload_api_server;
