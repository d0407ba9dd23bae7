//! Workload certificates as ztunnel writes them (`certificates`).

use std::sync::Arc;

use rustls::pki_types::CertificateDer;
use serde::Serialize;

use crate::identity::IssuedCert;

/// ztunnel's `admin::CertsDump`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CertsDump {
    identity: String,
    state: &'static str,
    cert_chain: Vec<CertDump>,
    root_certs: Vec<CertDump>,
}

/// ztunnel's `admin::CertDump` (`dump_cert`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CertDump {
    /// The PEM text, base64 encoded again (`base64_encode(cert.as_pem())`).
    pem: String,
    /// Decimal (`x509_parser`'s `serial.to_string()`).
    serial_number: String,
    /// RFC 3339, whole seconds, `Z`.
    valid_from: String,
    expiration_time: String,
}

/// Every certificate `issued`, its chain checked against `roots`, sorted
/// by identity.
pub(super) fn sorted(
    issued: &[Arc<IssuedCert>],
    roots: &[CertificateDer<'static>],
) -> Vec<CertsDump> {
    let mut certificates: Vec<CertsDump> = issued.iter().map(|c| certs(c, roots)).collect();
    certificates.sort_by(|a, b| a.identity.cmp(&b.identity));
    certificates
}

/// ztunnel `dump_certs`: `Available` certificates list the leaf and its
/// intermediates (`cert_and_intermediates`, so not the roots) and the
/// roots trusted.
fn certs(cert: &IssuedCert, roots: &[CertificateDer<'static>]) -> CertsDump {
    CertsDump {
        identity: cert.identity.to_uri(),
        state: "Available",
        cert_chain: cert
            .chain
            .iter()
            .filter(|c| !roots.contains(c))
            .filter_map(|c| cert_dump(c))
            .collect(),
        root_certs: roots.iter().filter_map(|c| cert_dump(c)).collect(),
    }
}

/// ztunnel `dump_cert`; none for a certificate that does not parse (we
/// only hold ones that did).
fn cert_dump(der: &CertificateDer<'_>) -> Option<CertDump> {
    use base64::Engine as _;
    let (_, parsed) = x509_parser::parse_x509_certificate(der).ok()?;
    let validity = parsed.validity();
    Some(CertDump {
        pem: base64::engine::general_purpose::STANDARD.encode(der_to_pem(der)),
        serial_number: parsed.tbs_certificate.serial.to_string(),
        valid_from: rfc3339_secs(validity.not_before.timestamp()),
        expiration_time: rfc3339_secs(validity.not_after.timestamp()),
    })
}

/// ztunnel `tls::certificate::der_to_pem`: 60 base64 characters a line
/// (not PEM's usual 64), each line and the footer ending in `\n`.
pub(super) fn der_to_pem(der: &[u8]) -> String {
    let config = pem::EncodeConfig::new()
        .set_line_ending(pem::LineEnding::LF)
        .set_line_wrap(60);
    pem::encode_config(&pem::Pem::new("CERTIFICATE", der), config)
}

/// ztunnel `admin::rfc3339`: `to_rfc3339_opts(SecondsFormat::Secs, true)`,
/// e.g. `2026-01-02T03:04:05Z`. A certificate's times are whole seconds,
/// so the agent's formatter writes them the same way.
pub(super) fn rfc3339_secs(unix: i64) -> String {
    let at = u64::try_from(unix).map_or(std::time::UNIX_EPOCH, |secs| {
        std::time::UNIX_EPOCH + std::time::Duration::from_secs(secs)
    });
    dataplane_core::timestamp::rfc3339(at)
}
