//! The rustls crypto provider every TLS configuration of the agent names:
//! aws-lc-rs restricted to what HBONE allows (TLS 1.3 AES-GCM suites, the
//! key exchange groups Istio offers), as the process's [`TlsPolicy`] narrows
//! or widens it (post-quantum key exchange only; TLS 1.2 allowed).
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

/// The TLS 1.2 suites [`TlsPolicy::tls12`] adds, after the TLS 1.3 ones:
/// ztunnel's ("FIPS-compatible", `src/tls/lib.rs` `provider()` with
/// `TLS12_ENABLED`), ECDHE with AES-GCM only, AES-128 first as above.
const TLS12_CIPHER_SUITES: &[CipherSuite] = &[
    CipherSuite::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256,
    CipherSuite::TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384,
    CipherSuite::TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256,
    CipherSuite::TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384,
];

/// The one key exchange group a post-quantum-only policy allows (ztunnel
/// `src/tls/lib.rs`: `COMPLIANCE_POLICY=pqc` sets `kx_groups` to
/// `X25519MLKEM768` alone).
const PQC_KX_GROUPS: &[NamedGroup] = &[NamedGroup::X25519MLKEM768];

/// What the process's TLS may negotiate beyond, or instead of, the HBONE
/// defaults. The default changes nothing: TLS 1.3, X25519, P-256, P-384 and
/// X25519MLKEM768.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct TlsPolicy {
    /// Key exchange by X25519MLKEM768 only (Istio's `COMPLIANCE_POLICY=pqc`):
    /// a peer that offers no post-quantum group is refused. TLS 1.2 has no
    /// such group, so with [`Self::tls12`] too a TLS 1.2 peer still fails.
    pub post_quantum_only: bool,
    /// Also allow TLS 1.2 with ECDHE AES-GCM suites (ztunnel's
    /// `TLS12_ENABLED=true`), for peers that cannot do TLS 1.3. TLS 1.3 is
    /// still preferred.
    pub tls12: bool,
}

/// [`set_policy`] was called after the policy was already fixed otherwise.
#[derive(Debug, thiserror::Error)]
#[error(
    "the process's TLS policy is already {current:?} (set earlier, or fixed by a first TLS use), cannot change it to {wanted:?}; set it once, before any TLS configuration is built"
)]
pub struct PolicyError {
    /// The policy in force.
    pub current: TlsPolicy,
    /// The one asked for.
    pub wanted: TlsPolicy,
}

static POLICY: OnceLock<TlsPolicy> = OnceLock::new();

/// Fixes the process's [`TlsPolicy`], which [`provider`] (so every TLS
/// configuration of this crate) follows. Call it once, before the first
/// [`provider`]; setting the policy already in force again is allowed.
pub fn set_policy(policy: TlsPolicy) -> Result<(), PolicyError> {
    let current = *POLICY.get_or_init(|| policy);
    if current == policy {
        Ok(())
    } else {
        Err(PolicyError {
            current,
            wanted: policy,
        })
    }
}

/// The process's [`TlsPolicy`]: the one [`set_policy`] fixed, else the
/// default (which a first [`provider`] call then fixes).
pub fn policy() -> TlsPolicy {
    *POLICY.get_or_init(TlsPolicy::default)
}

/// The crypto provider every HBONE configuration of this crate uses:
/// aws-lc-rs restricted to the HBONE suites and groups, under the process's
/// [`policy`].
pub fn provider() -> Arc<CryptoProvider> {
    static PROVIDER: OnceLock<Arc<CryptoProvider>> = OnceLock::new();
    PROVIDER
        .get_or_init(|| Arc::new(provider_for(policy())))
        .clone()
}

/// aws-lc-rs restricted to the HBONE suites and groups under `policy`
/// ([`provider`] is this for the process's policy). The TLS configurations
/// of [`crate::tls`] allow TLS 1.2 exactly when the provider has a TLS 1.2
/// suite.
pub fn provider_for(policy: TlsPolicy) -> CryptoProvider {
    let mut provider = restrict_to_hbone(rustls::crypto::aws_lc_rs::default_provider());
    if policy.tls12 {
        let all = rustls::crypto::aws_lc_rs::default_provider().cipher_suites;
        provider.cipher_suites.extend(
            TLS12_CIPHER_SUITES
                .iter()
                .filter_map(|want| all.iter().find(|cs| cs.suite() == *want).copied()),
        );
    }
    if policy.post_quantum_only {
        provider
            .kx_groups
            .retain(|g| PQC_KX_GROUPS.contains(&g.name()));
    }
    provider
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
    fn policies_narrow_or_widen_the_provider() {
        let pqc = provider_for(TlsPolicy {
            post_quantum_only: true,
            tls12: false,
        });
        let groups: Vec<_> = pqc.kx_groups.iter().map(|g| g.name()).collect();
        assert_eq!(groups, PQC_KX_GROUPS);
        let tls12 = provider_for(TlsPolicy {
            post_quantum_only: false,
            tls12: true,
        });
        let suites: Vec<_> = tls12.cipher_suites.iter().map(|cs| cs.suite()).collect();
        assert_eq!(suites, [CIPHER_SUITES, TLS12_CIPHER_SUITES].concat());
        let default = provider_for(TlsPolicy::default());
        let suites: Vec<_> = default.cipher_suites.iter().map(|cs| cs.suite()).collect();
        assert_eq!(suites, CIPHER_SUITES);
    }

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
