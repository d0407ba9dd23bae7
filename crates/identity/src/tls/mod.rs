//! TLS for HBONE: rustls client and server configurations with SPIFFE
//! identity verification.
//!
//! What the wire needs (as Istio's ztunnel speaks it): TLS 1.3 only, cipher
//! suites `TLS13_AES_128_GCM_SHA256` and `TLS13_AES_256_GCM_SHA384`, ALPN
//! `h2`, ECDSA P-256 certificates whose only name is a SPIFFE URI SAN, and
//! a client certificate on every connection. The client checks the server is
//! the identity it dialled ([`client_config`]); the server checks the client
//! is in its trust domain ([`server_config`]); both verify chains against the
//! roots of a [`crate::identity::TrustBundle`] as they are at the handshake,
//! so a root change needs no new configuration; both read the other's identity
//! with [`peer_identity`].
//!
//! The crypto provider, aws-lc-rs restricted to the HBONE suites and groups,
//! is [`crate::crypto`]'s, re-exported here, with the process's
//! [`TlsPolicy`] (post-quantum key exchange only; TLS 1.2 allowed).
//!
//! ```no_run
//! use std::sync::Arc;
//! use std::time::Duration;
//! use dataplane_identity::identity::{Ca, CertSource, CertStore, Identity, TrustBundle};
//! use dataplane_identity::tls;
//!
//! # fn run() -> Result<(), Box<dyn std::error::Error>> {
//! tls::install_provider();
//! let ca = Arc::new(Ca::generate()?);
//! let roots = Arc::new(TrustBundle::new(vec![ca.root_der().clone()])?);
//! let store = Arc::new(CertStore::new(
//!     CertSource::Builtin(ca),
//!     roots.clone(),
//!     tls::provider(),
//!     Duration::from_secs(24 * 3600),
//! ));
//! let server = Identity::new("cluster.local", "ns1", "server")?;
//! let client = Identity::new("cluster.local", "ns1", "client")?;
//! let server_config = tls::server_config(store.resolver(server.clone()), roots.clone(), "cluster.local")?;
//! let client_config = tls::client_config(store.resolver(client), roots, vec![server])?;
//! # Ok(()) }
//! ```

mod config;
mod verify;

#[cfg(test)]
mod tests;

pub use config::{
    ClientConfigCache, client_config, client_config_with, server_config, server_config_with,
};
pub use verify::{PeerIdentityError, peer_identity};

// The provider lives below `crate::identity` (which signs with it and
// verifies chains with it) and this module (which builds on identity); it is
// re-exported here, where HBONE's callers have always found it.
pub use crate::crypto::{
    PolicyError, TlsPolicy, install_provider, policy, provider, provider_for, restrict_to_hbone,
    set_policy,
};

/// The one application protocol HBONE speaks.
pub const ALPN_H2: &[u8] = b"h2";

/// Why an HBONE TLS configuration could not be built.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// rustls refused the client-certificate verifier, e.g. because the root
    /// store is empty.
    #[error(
        "cannot build the HBONE client-certificate verifier: {source}; give it the mesh CA's root"
    )]
    ClientVerifier {
        /// rustls' error.
        #[source]
        source: rustls::server::VerifierBuilderError,
    },
    /// The crypto provider cannot do TLS 1.3 with the HBONE suites.
    #[error(
        "the crypto provider cannot do TLS 1.3 with AES-GCM: {source}; build it with tls::restrict_to_hbone"
    )]
    Provider {
        /// rustls' error.
        #[source]
        source: rustls::Error,
    },
    /// A client configuration was asked for with no identity to accept.
    #[error(
        "an HBONE client configuration needs at least one expected server identity; pass the destination workload's identity or the service's subjectAltNames"
    )]
    NoExpectedIdentity,
}
