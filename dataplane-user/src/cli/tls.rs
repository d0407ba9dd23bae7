//! TLS compliance flags, named as ztunnel names its environment variables:
//! `COMPLIANCE_POLICY`, `TLS12_ENABLED` and `CRL_PATH` (ztunnel `src/lib.rs`,
//! `src/config.rs`; the
//! policy names are istio `pkg/features/security.go`'s). They convert into
//! the identity crate's [`TlsPolicy`], checked.

use clap::Args;

use crate::tls::TlsPolicy;

/// TLS compliance settings.
#[derive(Debug, Clone, Args)]
pub struct TlsArgs {
    /// Istio's compliance policy. `pqc`: key exchange by X25519MLKEM768
    /// only, on HBONE (both directions) and towards istiod; peers that
    /// offer no post-quantum group are refused. Empty or unset: X25519,
    /// P-256, P-384 and X25519MLKEM768. Istio's other policies,
    /// `fips-140-2` and `fips-140-3`, are refused: this build has no
    /// FIPS-validated crypto provider.
    #[arg(long, env = "COMPLIANCE_POLICY", default_value = "")]
    pub compliance_policy: String,
    /// Also allow TLS 1.2 (ECDHE with AES-GCM) on HBONE and towards istiod,
    /// for peers that cannot do TLS 1.3 (ztunnel's `TLS12_ENABLED=true`).
    /// Default: TLS 1.3 only.
    #[arg(long, env = "TLS12_ENABLED")]
    pub tls12: bool,
    /// Certificate revocation lists (PEM `X509 CRL` blocks, or one DER
    /// CRL), as ztunnel's `CRL_PATH`: HBONE peers, clients and servers,
    /// whose chain a CRL revokes are refused at the handshake. Re-read
    /// every 2 s; a file not there yet revokes nothing until it appears.
    /// Default: no revocation checks.
    #[arg(long, env = "CRL_PATH")]
    pub crl_path: Option<std::path::PathBuf>,
}

/// Errors of the TLS compliance flags.
#[derive(Debug, thiserror::Error)]
pub enum TlsArgsError {
    /// A compliance policy this build cannot honour, or does not know.
    #[error(
        "--compliance-policy (COMPLIANCE_POLICY) {0:?}: {reason}; use `pqc`, or leave it empty",
        reason = if .0.starts_with("fips-") {
            "this build has no FIPS-validated crypto provider"
        } else {
            "unknown policy"
        }
    )]
    CompliancePolicy(String),
}

impl TlsArgs {
    /// The TLS policy the flags ask for.
    pub fn to_policy(&self) -> Result<TlsPolicy, TlsArgsError> {
        let post_quantum_only = match self.compliance_policy.trim() {
            "" => false,
            "pqc" => true,
            other => return Err(TlsArgsError::CompliancePolicy(other.to_owned())),
        };
        Ok(TlsPolicy {
            post_quantum_only,
            tls12: self.tls12,
        })
    }
}
