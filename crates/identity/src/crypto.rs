//! The rustls crypto provider every TLS configuration of the agent names:
//! aws-lc-rs restricted to what HBONE allows (TLS 1.3 AES-GCM suites, the
//! key exchange groups Istio offers).
//!
//! aws-lc-rs because on this project's reference machine it completed mutual
//! ECDSA P-256 handshakes and AES-GCM bulk encryption faster than ring
//! (`cargo bench -p dataplane-user --bench tls_provider`).
//!
//! It is the lowest module of this crate: [`crate::istiod`] dials with it,
//! [`crate::identity`] signs and verifies chains with it, and [`crate::tls`]
//! builds HBONE's configurations with it (and re-exports it). It uses none of
//! them.

use std::sync::{Arc, OnceLock};

use rustls::crypto::CryptoProvider;
use rustls::{CipherSuite, NamedGroup};

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn provider_is_restricted_to_hbone_suites() {
        let p = provider();
        let suites: Vec<_> = p.cipher_suites.iter().map(|cs| cs.suite()).collect();
        assert_eq!(suites, CIPHER_SUITES);
        assert_eq!(
            p.kx_groups.first().map(|g| g.name()),
            Some(NamedGroup::X25519)
        );
        install_provider();
        install_provider();
        assert!(CryptoProvider::get_default().is_some());
    }
}
