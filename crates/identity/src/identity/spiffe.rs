//! SPIFFE workload identities as Istio names them:
//! `spiffe://<trust-domain>/ns/<namespace>/sa/<service-account>`.
//!
//! The URI is the only name a mesh certificate carries (a URI SAN; no DNS or
//! IP names), so this is what HBONE peers check each other against. Parsing
//! follows the SPIFFE ID rules (lowercase trust domain of `[a-z0-9._-]`, path
//! segments of `[A-Za-z0-9._-]`, no empty, `.` or `..` segments, no query,
//! fragment, port or user info) plus Istio's fixed `/ns/../sa/..` path.
//!
//! ```
//! use dataplane_identity::identity::Identity;
//!
//! let id: Identity = "spiffe://cluster.local/ns/default/sa/web".parse()?;
//! assert_eq!(id.namespace, "default");
//! assert_eq!(id.to_uri(), "spiffe://cluster.local/ns/default/sa/web");
//! # Ok::<(), dataplane_identity::identity::IdentityError>(())
//! ```

use std::fmt;
use std::hash::{Hash, Hasher};
use std::ops::Deref;
use std::str::FromStr;
use std::sync::Arc;

use rustls::pki_types::CertificateDer;
use x509_parser::extensions::GeneralName;
use x509_parser::prelude::{FromDer, X509Certificate};

/// The longest SPIFFE ID the specification allows, in bytes.
const MAX_URI_LEN: usize = 2048;
/// The longest trust domain the specification allows, in bytes.
const MAX_TRUST_DOMAIN_LEN: usize = 255;
const SCHEME: &str = "spiffe://";

/// A workload identity: one Kubernetes service account in one namespace of one
/// trust domain.
///
/// Build it with [`Identity::new`] or by parsing a URI, which both validate;
/// the parts are readable through [`IdentityParts`] (`id.namespace`), and
/// the URI is formatted once, when the identity is built.
///
/// Cheap to clone (one shared allocation): connections carry it from the
/// peer's certificate, parsed once per TLS connection, to the pool key, the
/// dialer, policy and the re-check of open connections, and no URI is
/// parsed or formatted on the way.
#[derive(Clone, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Identity(Arc<IdentityParts>);

/// The parts of an [`Identity`], and its URI.
#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct IdentityParts {
    /// The trust domain, e.g. `cluster.local`.
    pub trust_domain: String,
    /// The Kubernetes namespace.
    pub namespace: String,
    /// The Kubernetes service account.
    pub service_account: String,
    /// `spiffe://<trust_domain>/ns/<namespace>/sa/<service_account>`.
    uri: String,
}

impl Deref for Identity {
    type Target = IdentityParts;

    fn deref(&self) -> &IdentityParts {
        &self.0
    }
}

/// Clones share one allocation, so a table of shared identities can tell
/// when it holds the last one.
impl dataplane_core::intern::Shared for Identity {
    fn is_shared(&self) -> bool {
        Arc::strong_count(&self.0) > 1
    }
}

impl fmt::Debug for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Identity").field(&self.uri).finish()
    }
}

impl PartialEq for Identity {
    fn eq(&self, other: &Self) -> bool {
        // Clones of one identity share their parts: no string compare.
        Arc::ptr_eq(&self.0, &other.0) || self.uri == other.uri
    }
}

impl Eq for Identity {}

impl Hash for Identity {
    fn hash<H: Hasher>(&self, state: &mut H) {
        // The URI is a function of the parts: equal identities hash alike.
        self.uri.hash(state);
    }
}

impl PartialOrd for Identity {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Identity {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.cmp(&other.0)
    }
}

/// Why a string, a set of parts or a certificate does not give an [`Identity`].
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    /// The text is not a SPIFFE ID of the form Istio uses.
    #[error(
        "invalid SPIFFE identity {uri:?}: {reason}; expected spiffe://<trust-domain>/ns/<namespace>/sa/<service-account>"
    )]
    InvalidUri {
        /// The text as given (cut to 200 characters).
        uri: String,
        /// What is wrong with it.
        reason: String,
    },
    /// One part of an identity breaks the SPIFFE character rules.
    #[error("invalid {part} {value:?} in SPIFFE identity: {reason}")]
    InvalidPart {
        /// Which part: trust domain, namespace or service account.
        part: &'static str,
        /// The offending value (cut to 200 characters).
        value: String,
        /// The rule it breaks and how to fix it.
        reason: String,
    },
    /// The bytes are not a DER X.509 certificate.
    #[error(
        "cannot read the SPIFFE identity of a certificate: it is not valid DER X.509 ({reason})"
    )]
    BadCertificate {
        /// The parser's message.
        reason: String,
    },
    /// The certificate does not carry exactly one SPIFFE URI SAN.
    #[error(
        "certificate carries {found} SPIFFE URI subject alternative names, a workload certificate carries exactly one"
    )]
    UriSanCount {
        /// How many `spiffe://` URI SANs it has.
        found: usize,
    },
    /// The certificate's SPIFFE URI SAN does not parse.
    #[error("certificate's SPIFFE URI SAN is invalid: {source}")]
    BadUriSan {
        /// Why the URI was refused.
        #[source]
        source: Box<IdentityError>,
    },
}

impl Identity {
    /// An identity from its parts, validated against the SPIFFE rules.
    pub fn new(
        trust_domain: impl Into<String>,
        namespace: impl Into<String>,
        service_account: impl Into<String>,
    ) -> Result<Self, IdentityError> {
        let id = Self::unchecked(trust_domain, namespace, service_account);
        id.validate()?;
        Ok(id)
    }

    /// An identity from parts that were not validated: only for checking
    /// that the places that must validate do ([`Identity::validate`]).
    pub(crate) fn unchecked(
        trust_domain: impl Into<String>,
        namespace: impl Into<String>,
        service_account: impl Into<String>,
    ) -> Self {
        let (trust_domain, namespace, service_account) = (
            trust_domain.into(),
            namespace.into(),
            service_account.into(),
        );
        let uri = format!("{SCHEME}{trust_domain}/ns/{namespace}/sa/{service_account}");
        Self(Arc::new(IdentityParts {
            trust_domain,
            namespace,
            service_account,
            uri,
        }))
    }

    /// Parses `spiffe://<td>/ns/<ns>/sa/<sa>`; the same as [`str::parse`].
    pub fn parse(uri: &str) -> Result<Self, IdentityError> {
        let invalid = |reason: &str| IdentityError::InvalidUri {
            uri: clip(uri),
            reason: reason.to_owned(),
        };
        if uri.len() > MAX_URI_LEN {
            return Err(invalid("longer than 2048 bytes"));
        }
        let rest = uri
            .strip_prefix(SCHEME)
            .ok_or_else(|| invalid("it does not start with spiffe://"))?;
        if rest.contains(['?', '#']) {
            return Err(invalid("it has a query or fragment"));
        }
        let (trust_domain, path) = rest
            .split_once('/')
            .ok_or_else(|| invalid("it has no path after the trust domain"))?;
        let segments: Vec<&str> = path.split('/').collect();
        let [ns_key, namespace, sa_key, service_account] = segments.as_slice() else {
            return Err(invalid(
                "its path does not have the four segments ns/<namespace>/sa/<service-account>",
            ));
        };
        if *ns_key != "ns" || *sa_key != "sa" {
            return Err(invalid(
                "its path is not ns/<namespace>/sa/<service-account>",
            ));
        }
        Self::new(trust_domain, *namespace, *service_account)
    }

    /// The SPIFFE URI, `spiffe://<td>/ns/<ns>/sa/<sa>`, as an owned string.
    pub fn to_uri(&self) -> String {
        self.uri.clone()
    }

    /// The SPIFFE URI, borrowed (formatted once, when the identity was
    /// built).
    pub fn as_uri(&self) -> &str {
        &self.uri
    }

    /// Checks every part against the SPIFFE character rules.
    pub fn validate(&self) -> Result<(), IdentityError> {
        validate_trust_domain(&self.trust_domain)?;
        validate_segment("namespace", &self.namespace)?;
        validate_segment("service account", &self.service_account)?;
        if self.uri.len() > MAX_URI_LEN {
            return Err(IdentityError::InvalidUri {
                uri: clip(&self.uri),
                reason: "longer than 2048 bytes".to_owned(),
            });
        }
        Ok(())
    }

    /// The identity a DER certificate names in its one SPIFFE URI SAN.
    ///
    /// Only parses: it does not verify the certificate (rustls has done that
    /// for a peer's certificate by the time a handshake completes).
    pub fn from_certificate(der: &CertificateDer<'_>) -> Result<Self, IdentityError> {
        let (_, cert) =
            X509Certificate::from_der(der).map_err(|e| IdentityError::BadCertificate {
                reason: e.to_string(),
            })?;
        let san = cert
            .subject_alternative_name()
            .map_err(|e| IdentityError::BadCertificate {
                reason: format!("subjectAltName extension: {e}"),
            })?;
        let uris: Vec<&str> = san
            .iter()
            .flat_map(|ext| ext.value.general_names.iter())
            .filter_map(|name| match name {
                GeneralName::URI(uri) if uri.starts_with(SCHEME) => Some(*uri),
                _ => None,
            })
            .collect();
        match uris.as_slice() {
            [uri] => Self::parse(uri).map_err(|e| IdentityError::BadUriSan {
                source: Box::new(e),
            }),
            other => Err(IdentityError::UriSanCount { found: other.len() }),
        }
    }
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.uri)
    }
}

impl FromStr for Identity {
    type Err = IdentityError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

impl TryFrom<String> for Identity {
    type Error = IdentityError;

    fn try_from(s: String) -> Result<Self, Self::Error> {
        Self::parse(&s)
    }
}

impl From<Identity> for String {
    fn from(id: Identity) -> Self {
        id.to_uri()
    }
}

fn validate_trust_domain(td: &str) -> Result<(), IdentityError> {
    let invalid = |reason: &str| IdentityError::InvalidPart {
        part: "trust domain",
        value: clip(td),
        reason: reason.to_owned(),
    };
    if td.is_empty() {
        return Err(invalid("it is empty"));
    }
    if td.len() > MAX_TRUST_DOMAIN_LEN {
        return Err(invalid("longer than 255 bytes"));
    }
    if !td
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'.' | b'-' | b'_'))
    {
        return Err(invalid(
            "only lowercase letters, digits, '.', '-' and '_' are allowed (no port, user info or upper case)",
        ));
    }
    Ok(())
}

fn validate_segment(part: &'static str, value: &str) -> Result<(), IdentityError> {
    let invalid = |reason: &str| IdentityError::InvalidPart {
        part,
        value: clip(value),
        reason: reason.to_owned(),
    };
    if value.is_empty() {
        return Err(invalid("it is empty"));
    }
    if value == "." || value == ".." {
        return Err(invalid("'.' and '..' are not allowed as path segments"));
    }
    if !value
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_'))
    {
        return Err(invalid(
            "only letters, digits, '.', '-' and '_' are allowed",
        ));
    }
    Ok(())
}

/// Error messages quote input; keep a hostile megabyte out of the logs.
fn clip(s: &str) -> String {
    s.chars().take(200).collect()
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "tests fail loudly on unexpected errors")]
mod tests {
    use super::*;

    #[test]
    fn round_trips() {
        let uri = "spiffe://cluster.local/ns/default/sa/my-app_1.v2";
        crate::fuzz_seeds::seed("spiffe_id", uri);
        let id: Identity = uri.parse().unwrap();
        assert_eq!(id.trust_domain, "cluster.local");
        assert_eq!(id.namespace, "default");
        assert_eq!(id.service_account, "my-app_1.v2");
        assert_eq!(id.to_uri(), uri);
        assert_eq!(
            Identity::new("cluster.local", "default", "my-app_1.v2").unwrap(),
            id
        );
    }

    #[test]
    fn refuses_malformed_uris() {
        for bad in [
            "",
            "http://cluster.local/ns/a/sa/b",
            "spiffe://cluster.local",
            "spiffe://cluster.local/",
            "spiffe:///ns/a/sa/b",
            "spiffe://Cluster.local/ns/a/sa/b",
            "spiffe://cluster.local:8080/ns/a/sa/b",
            "spiffe://user@cluster.local/ns/a/sa/b",
            "spiffe://cluster.local/ns/a/sa/b/",
            "spiffe://cluster.local/ns/a/sa/b/c",
            "spiffe://cluster.local/ns//sa/b",
            "spiffe://cluster.local/ns/../sa/b",
            "spiffe://cluster.local/ns/a/sa/.",
            "spiffe://cluster.local/ns/a/sa/b?x=1",
            "spiffe://cluster.local/ns/a/sa/b#frag",
            "spiffe://cluster.local/namespace/a/sa/b",
            "spiffe://cluster.local/ns/a/serviceaccount/b",
            "spiffe://cluster.local/ns/a b/sa/b",
            "spiffe://cluster.local/ns/a/sa/%41",
        ] {
            crate::fuzz_seeds::seed("spiffe_id", bad);
            assert!(Identity::parse(bad).is_err(), "{bad:?} parsed");
        }
        let long = format!("spiffe://td/ns/{}/sa/b", "a".repeat(2100));
        assert!(Identity::parse(&long).is_err());
    }

    #[test]
    fn error_names_the_input_and_the_expected_form() {
        let err = Identity::parse("spiffe://cluster.local/ns/a")
            .unwrap_err()
            .to_string();
        assert!(err.contains("spiffe://cluster.local/ns/a"), "{err}");
        assert!(err.contains("ns/<namespace>/sa/<service-account>"), "{err}");
    }

    #[test]
    fn serde_uses_the_uri() {
        let id = Identity::new("td", "ns1", "sa1").unwrap();
        let json = serde_json::to_string(&id).unwrap();
        assert_eq!(json, "\"spiffe://td/ns/ns1/sa/sa1\"");
        let back: Identity = serde_json::from_str(&json).unwrap();
        assert_eq!(back, id);
        assert!(serde_json::from_str::<Identity>("\"spiffe://td/x\"").is_err());
    }
}
