//! Where workload certificates come from: one interface over the built-in
//! CA, Istio's CA, mounted files and the SPIFFE Workload API, chosen by
//! `--cert-source`.
//!
//! [`super::CertStore`] asks its source for a certificate when an enrolled
//! workload needs one, again at half-life (CAs) or on every poll (files),
//! and whenever the trust bundle's roots change; mounted files and the
//! Workload API's latest message are read again on every poll. The built-in CA answers at
//! once (local signing); Istio's CA answers over the network and may fail,
//! so the store asks from a task of its own, never from the enrollment
//! actor or a handshake.

use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::CertificateDer;

use super::ca::{Ca, CaError, IssuedCert};
use super::cert_dir::{CertDir, CertDirError};
use super::istio_ca::{IstioCa, IstioCaError};
use super::spiffe::Identity;
use super::workload_api::{WorkloadApi, WorkloadApiError};

/// A source of workload certificates.
#[derive(Debug, Clone)]
pub enum CertSource {
    /// The agent's own CA.
    Builtin(Arc<Ca>),
    /// Istio's CA (`CreateCertificate`), asking on behalf of the pods.
    Istio(IstioCa),
    /// A directory of mounted certificates.
    Files(CertDir),
    /// The SPIFFE Workload API (e.g. the SPIRE agent's socket).
    Spiffe(WorkloadApi),
}

/// Why a source gave no certificate.
#[derive(Debug, thiserror::Error)]
pub enum CertSourceError {
    /// The built-in CA refused.
    #[error(transparent)]
    Builtin(#[from] CaError),
    /// Istio's CA was unreachable, refused, or answered something unusable.
    #[error(transparent)]
    Istio(#[from] IstioCaError),
    /// The SPIFFE Workload API gave no usable SVID.
    #[error(transparent)]
    Spiffe(#[from] WorkloadApiError),
    /// The source did not answer in time.
    #[error("{source_name} did not answer within {after:?}; is it overloaded or unreachable?")]
    Timeout {
        /// The source.
        source_name: String,
        /// How long the agent waited.
        after: Duration,
    },
    /// The roots the source sent cannot be trusted.
    #[error("the roots from {source_name} cannot form the trust bundle: {source}")]
    Roots {
        /// The source.
        source_name: String,
        /// Why.
        #[source]
        source: super::bundle::TrustBundleError,
    },
    /// The mounted files are missing or unusable.
    #[error("{source}")]
    Files {
        /// What is wrong.
        #[source]
        source: CertDirError,
        /// A digest of the refused files' contents, when they were read, so
        /// the same refused files are not refused (and counted) again.
        fingerprint: Option<u64>,
    },
}

/// What a source answered.
#[derive(Debug)]
pub enum Fetched {
    /// A new certificate, with the roots it chains to when the source says
    /// (Istio's CA and files do; the built-in CA's root never changes).
    Issued {
        /// The certificate.
        cert: IssuedCert,
        /// The source's roots (the trust bundle), if it sent any.
        roots: Option<Vec<CertificateDer<'static>>>,
        /// A digest of the files read (files only).
        fingerprint: Option<u64>,
    },
    /// The files are the ones already in use (files only).
    Unchanged,
}

impl CertSource {
    /// `builtin`, `istio`, `files` or `spiffe`, as `--cert-source` names
    /// it.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Builtin(_) => "builtin",
            Self::Istio(_) => "istio",
            Self::Files(_) => "files",
            Self::Spiffe(_) => "spiffe",
        }
    }

    /// What the source is, for status and errors: "the built-in CA",
    /// "Istio's CA at <address>", "the certificate files in <dir>".
    pub fn describe(&self) -> String {
        match self {
            Self::Builtin(_) => "the built-in CA".to_owned(),
            Self::Istio(ca) => format!("Istio's CA at {}", ca.istiod.address),
            Self::Files(dir) => format!("the certificate files in {}", dir.path().display()),
            Self::Spiffe(api) => {
                format!("the SPIFFE Workload API at {}", api.path().display())
            }
        }
    }

    /// Whether the store reads the source on every poll rather than at
    /// half-life: mounted files, and the Workload API, whose server pushes
    /// rotations (the store reads its latest message).
    pub fn is_polled(&self) -> bool {
        matches!(self, Self::Files(_) | Self::Spiffe(_))
    }

    /// Whether certificates are made locally, fast enough to do it inline
    /// (when a workload is enrolled, or in a handshake).
    pub fn is_local(&self) -> bool {
        matches!(self, Self::Builtin(_))
    }

    /// Issues with the built-in CA, synchronously; `None` for other
    /// sources.
    pub(super) fn issue_local(
        &self,
        identity: &Identity,
        validity: Duration,
    ) -> Option<Result<IssuedCert, CaError>> {
        match self {
            Self::Builtin(ca) => Some(ca.issue(identity, validity)),
            _ => None,
        }
    }

    /// Asks for `identity`'s certificate valid for `validity` (CAs). For
    /// files, reads them: `Unchanged` if their digest is `in_use`, and
    /// the same error again without re-checking if it is `refused`.
    pub(super) async fn fetch(
        &self,
        identity: &Identity,
        validity: Duration,
        in_use: Option<u64>,
    ) -> Result<Fetched, CertSourceError> {
        match self {
            Self::Builtin(ca) => Ok(Fetched::Issued {
                cert: ca.issue(identity, validity)?,
                roots: None,
                fingerprint: None,
            }),
            Self::Istio(ca) => {
                let issued = ca.issue(identity, validity).await?;
                Ok(Fetched::Issued {
                    cert: issued.cert,
                    roots: Some(issued.roots),
                    fingerprint: None,
                })
            }
            Self::Files(dir) => {
                let raw = dir
                    .read_raw(identity)
                    .map_err(|source| CertSourceError::Files {
                        source,
                        fingerprint: None,
                    })?;
                let fingerprint = raw.fingerprint();
                if in_use == Some(fingerprint) {
                    return Ok(Fetched::Unchanged);
                }
                let checked = raw
                    .check(identity)
                    .map_err(|source| CertSourceError::Files {
                        source,
                        fingerprint: Some(fingerprint),
                    })?;
                Ok(Fetched::Issued {
                    cert: checked.cert,
                    roots: Some(checked.roots),
                    fingerprint: Some(fingerprint),
                })
            }
            Self::Spiffe(api) => Ok(api.fetch(identity, in_use)?),
        }
    }
}

impl CertSourceError {
    /// The digest of refused files, if files were read.
    pub fn fingerprint(&self) -> Option<u64> {
        match self {
            Self::Files { fingerprint, .. } => *fingerprint,
            _ => None,
        }
    }
}

/// What the store's source has done, for `dataplane status` and the admin
/// API.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CertSourceStatus {
    /// `builtin`, `istio`, `files` or `spiffe`.
    pub source: String,
    /// What the source is ("Istio's CA at ...").
    pub description: String,
    /// Certificates held / identities wanted.
    pub held: usize,
    /// Identities wanted.
    pub wanted: usize,
    /// The last certificate received: when (RFC 3339) and for whom.
    pub last_issued: Option<String>,
    /// The next refresh due (RFC 3339), if any certificate is held.
    pub next_refresh: Option<String>,
    /// The last failure: when (RFC 3339) and why.
    pub last_failure: Option<String>,
    /// Requests that failed since start.
    pub failures: u64,
    /// Requests that gave a certificate since start.
    pub successes: u64,
    /// The trust bundle.
    pub roots: Vec<super::bundle::RootInfo>,
}
