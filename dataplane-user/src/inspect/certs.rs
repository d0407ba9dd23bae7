//! `dataplane certs`: the workload certificates held, without keys.

use std::time::SystemTime;

use dataplane_core::timestamp::rfc3339;
use serde::{Deserialize, Serialize};

use super::AgentView;

/// A workload certificate, without its key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CertInfo {
    /// The SPIFFE identity (URI SAN).
    pub identity: String,
    /// Serial number, colon-separated hex.
    pub serial: String,
    /// The issuer's distinguished name.
    pub issuer: String,
    /// notBefore, RFC 3339.
    pub not_before: String,
    /// notAfter, RFC 3339.
    pub not_after: String,
    /// Seconds until notAfter (negative once expired).
    pub expires_in_secs: i64,
    /// Where it came from: `builtin`, `istio` or `files`.
    #[serde(default)]
    pub source: String,
}

impl AgentView {
    /// Every workload certificate held, without keys.
    pub fn certs(&self) -> Vec<CertInfo> {
        let source = self.mesh.certs.source().kind();
        let now = SystemTime::now();
        self.mesh
            .certs
            .issued()
            .iter()
            .map(|cert| {
                let expires_in_secs = match cert.not_after.duration_since(now) {
                    Ok(left) => i64::try_from(left.as_secs()).unwrap_or(i64::MAX),
                    Err(past) => -i64::try_from(past.duration().as_secs()).unwrap_or(i64::MAX),
                };
                CertInfo {
                    identity: cert.identity.to_uri(),
                    serial: cert.serial(),
                    issuer: cert
                        .leaf()
                        .map_or_else(|| "unknown".to_owned(), |leaf| issuer_name(leaf)),
                    source: source.to_owned(),
                    not_before: rfc3339(cert.not_before),
                    not_after: rfc3339(cert.not_after),
                    expires_in_secs,
                }
            })
            .collect()
    }
}

/// The issuer's name as the leaf states it.
fn issuer_name(leaf: &[u8]) -> String {
    x509_parser::parse_x509_certificate(leaf)
        .map(|(_, cert)| cert.issuer().to_string())
        .unwrap_or_else(|_| "unknown".to_owned())
}
