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
//! The crypto provider is aws-lc-rs: on this project's reference machine it
//! completed mutual ECDSA P-256 handshakes and AES-GCM bulk encryption
//! faster than ring (`cargo bench -p dataplane-user --bench tls_provider`).
//!
//! ```no_run
//! use std::sync::Arc;
//! use std::time::Duration;
//! use dataplane_user::identity::{Ca, CertSource, CertStore, Identity, TrustBundle};
//! use dataplane_user::tls;
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

use std::sync::{Arc, OnceLock};

use rustls::crypto::CryptoProvider;
use rustls::{CipherSuite, NamedGroup};

pub use config::{
    ClientConfigCache, client_config, client_config_with, server_config, server_config_with,
};
pub use verify::{PeerIdentityError, peer_identity};

/// The one application protocol HBONE speaks.
pub const ALPN_H2: &[u8] = b"h2";

/// The cipher suites HBONE allows, in our order of preference. AES-128 first:
/// it is the faster of the two (see the provider benchmark) and ample for
/// session keys. Servers follow the client's order, so a peer that prefers
/// AES-256 still gets it.
const CIPHER_SUITES: &[CipherSuite] = &[
    CipherSuite::TLS13_AES_128_GCM_SHA256,
    CipherSuite::TLS13_AES_256_GCM_SHA384,
];

/// Key exchange groups, in order of preference. X25519 and P-256 are what
/// Istio offers by default; X25519MLKEM768 (where the provider has it) lets
/// peers that insist on post-quantum key exchange connect. Set explicitly so
/// that another crate turning on rustls' `prefer-post-quantum` feature does
/// not change what we send.
const KX_GROUPS: &[NamedGroup] = &[
    NamedGroup::X25519,
    NamedGroup::secp256r1,
    NamedGroup::secp384r1,
    NamedGroup::X25519MLKEM768,
];

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

/// The crypto provider every HBONE configuration of this crate uses:
/// aws-lc-rs restricted to the HBONE suites and groups.
pub fn provider() -> Arc<CryptoProvider> {
    static PROVIDER: OnceLock<Arc<CryptoProvider>> = OnceLock::new();
    PROVIDER
        .get_or_init(|| {
            Arc::new(restrict_to_hbone(
                rustls::crypto::aws_lc_rs::default_provider(),
            ))
        })
        .clone()
}

/// `base` with only the HBONE cipher suites and key exchange groups, in our
/// order of preference; signature verification and key loading unchanged.
pub fn restrict_to_hbone(base: CryptoProvider) -> CryptoProvider {
    let cipher_suites = CIPHER_SUITES
        .iter()
        .filter_map(|want| {
            base.cipher_suites
                .iter()
                .find(|cs| cs.suite() == *want)
                .copied()
        })
        .collect();
    let kx_groups = KX_GROUPS
        .iter()
        .filter_map(|want| base.kx_groups.iter().find(|g| g.name() == *want).copied())
        .collect();
    CryptoProvider {
        cipher_suites,
        kx_groups,
        ..base
    }
}

/// Makes [`provider`] the process-wide default rustls provider, for code
/// that builds rustls configurations without naming one. Idempotent. If
/// something else installed a default first it stays (rustls allows one);
/// this crate's HBONE configurations name [`provider`] explicitly anyway.
pub fn install_provider() {
    static INSTALLED: OnceLock<()> = OnceLock::new();
    INSTALLED.get_or_init(|| {
        if CryptoProvider::install_default(CryptoProvider::clone(&provider())).is_err() {
            tracing::debug!(
                "a process-wide rustls crypto provider was already installed; keeping it (HBONE configurations use tls::provider() regardless)"
            );
        }
    });
}
