//! Certificate revocation lists: peers whose certificate (or an intermediate
//! of its chain) a CRL revokes are refused at the handshake, on both sides
//! of HBONE, as ztunnel does with `CRL_PATH` (`src/tls/crl.rs`,
//! `src/tls/revocation.rs` `verify_cert_chain`).
//!
//! The file holds one or more CRLs, PEM (`X509 CRL` blocks, concatenated)
//! or a single DER; an empty file, or one without CRL blocks, revokes
//! nothing. Each CRL counts only if its issuer's signature verifies
//! (webpki checks it against the peer's chain). A certificate no loaded CRL
//! speaks for is accepted, and a CRL past its `nextUpdate` still counts:
//! ztunnel's `UnknownStatusPolicy::Allow` and `ExpirationPolicy::Ignore`.
//!
//! [`RevocationList::reload`] re-reads the file; [`RevocationList::watch`]
//! does so every [`CRL_POLL`] and swaps in what changed. A file that
//! cannot be read or parsed leaves the last good lists in force.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock, Weak};
use std::time::Duration;

use rustls::pki_types::{CertificateDer, SignatureVerificationAlgorithm, UnixTime};
use rustls::{CertificateError, OtherError, RootCertStore};
use tracing::{info, warn};
use webpki::{
    CertRevocationList, EndEntityCert, ExpirationPolicy, KeyUsage, OwnedCertRevocationList,
    RevocationCheckDepth, RevocationOptionsBuilder, UnknownStatusPolicy,
};

/// How often [`RevocationList::watch`] re-reads the file (ztunnel debounces
/// file events by 2 s).
pub const CRL_POLL: Duration = Duration::from_secs(2);

/// Largest revocation list file read: 8 MiB. The file is re-read every
/// [`CRL_POLL`] and held twice while in force (its bytes, to see whether it
/// changed, and the parsed lists), so whatever lands at `CRL_PATH` must not
/// decide the agent's memory. A revoked certificate takes about 40 bytes of
/// DER (some 55 in PEM), so this holds well over 100,000 revocations: far
/// more than a mesh CA, whose workload certificates live for a day, lists.
pub const MAX_CRL_FILE: usize = 8 * 1024 * 1024;

/// Why a revocation list file could not be used.
#[derive(Debug, thiserror::Error)]
pub enum CrlError {
    /// The file could not be read.
    #[error("cannot read the revocation list {path}: {source}; check CRL_PATH (--crl-path)")]
    Read {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The file is larger than [`MAX_CRL_FILE`]; it is not read further.
    #[error(
        "cannot read the revocation list {path}: it is larger than {MAX_CRL_FILE} bytes; give a smaller file at CRL_PATH (--crl-path), dropping entries for certificates that have expired"
    )]
    TooLarge {
        /// The file.
        path: PathBuf,
    },
    /// A block of the file is not a CRL webpki can use.
    #[error(
        "revocation list {path}, CRL {index}: {reason}; give PEM `X509 CRL` blocks or one DER CRL"
    )]
    Parse {
        /// The file.
        path: PathBuf,
        /// Which CRL of the file (from 1).
        index: usize,
        /// What is wrong with it.
        reason: String,
    },
}

/// Which end of a connection a certificate authenticates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerRole {
    /// A server's certificate (serverAuth).
    Server,
    /// A client's certificate (clientAuth).
    Client,
}

/// The CRLs of one file, as last read.
pub struct RevocationList {
    path: PathBuf,
    current: RwLock<Loaded>,
    generation: AtomicU64,
    /// The generation, for [`Self::revoked`]'s waiters.
    changed: tokio::sync::watch::Sender<u64>,
}

/// What an established connection's peer presented, kept to check it again
/// when the lists change ([`RevocationList::revoked`]).
#[derive(Debug, Clone)]
pub struct PeerChain {
    /// The peer's certificate, then the intermediates it sent.
    pub certificates: Vec<CertificateDer<'static>>,
    /// The roots it was verified against at the handshake.
    pub roots: Arc<RootCertStore>,
    /// When the handshake verified it: checked again as of then, so that
    /// only a revocation (not expiry) ends the connection.
    pub verified_at: UnixTime,
    /// Which end the peer is.
    pub role: PeerRole,
}

struct Loaded {
    bytes: Vec<u8>,
    crls: Arc<Vec<CertRevocationList<'static>>>,
}

impl fmt::Debug for RevocationList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RevocationList")
            .field("path", &self.path)
            .field("crls", &self.len())
            .field("generation", &self.generation())
            .finish()
    }
}

impl RevocationList {
    /// Reads `path`. A file that does not exist yet revokes nothing until
    /// it appears (a ConfigMap mounted later, as ztunnel allows); one that
    /// exists but does not parse is an error.
    pub fn load(path: PathBuf) -> Result<Self, CrlError> {
        let list = Self {
            path,
            current: RwLock::new(Loaded {
                bytes: Vec::new(),
                crls: Arc::new(Vec::new()),
            }),
            generation: AtomicU64::new(0),
            changed: tokio::sync::watch::Sender::new(0),
        };
        match list.reload() {
            Ok(_) => Ok(list),
            Err(CrlError::Read { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
                warn!(path = %list.path.display(), "revocation list not found; nothing is revoked until it appears");
                Ok(list)
            }
            Err(e) => Err(e),
        }
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// How many CRLs are in force.
    pub fn len(&self) -> usize {
        self.crls().len()
    }

    /// Whether no CRL is in force.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bumped each time the file's content changes.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    fn crls(&self) -> Arc<Vec<CertRevocationList<'static>>> {
        Arc::clone(
            &self
                .current
                .read()
                .unwrap_or_else(PoisonError::into_inner)
                .crls,
        )
    }

    /// Re-reads the file; `true` if its content changed (and the new lists
    /// are in force). On error the lists in force stay.
    pub fn reload(&self) -> Result<bool, CrlError> {
        let (bytes, more) =
            dataplane_core::fs::read_at_most(&self.path, MAX_CRL_FILE).map_err(|source| {
                CrlError::Read {
                    path: self.path.clone(),
                    source,
                }
            })?;
        if more {
            return Err(CrlError::TooLarge {
                path: self.path.clone(),
            });
        }
        if bytes
            == self
                .current
                .read()
                .unwrap_or_else(PoisonError::into_inner)
                .bytes
            && self.generation() > 0
        {
            return Ok(false);
        }
        let crls = parse(&self.path, &bytes)?;
        let count = crls.len();
        *self.current.write().unwrap_or_else(PoisonError::into_inner) = Loaded {
            bytes,
            crls: Arc::new(crls),
        };
        let generation = self.generation.fetch_add(1, Ordering::AcqRel) + 1;
        self.changed.send_replace(generation);
        info!(path = %self.path.display(), crls = count, "revocation list loaded");
        Ok(true)
    }

    /// Re-reads the file every [`CRL_POLL`] while `list` is alive
    /// elsewhere; a change is logged, an unreadable file too (once per
    /// change of error) and the last good lists stay.
    pub fn watch(list: &Arc<Self>) -> tokio::task::JoinHandle<()> {
        let weak: Weak<Self> = Arc::downgrade(list);
        tokio::spawn(async move {
            let mut last_error = None;
            loop {
                tokio::time::sleep(CRL_POLL).await;
                let Some(list) = weak.upgrade() else { return };
                match list.reload() {
                    Ok(_) => last_error = None,
                    Err(e) => {
                        let message = e.to_string();
                        if last_error.as_ref() != Some(&message) {
                            warn!(error = %message, "revocation list not reloaded; the previous one stays in force");
                            last_error = Some(message);
                        }
                    }
                }
            }
        })
    }

    /// Checks that no CRL in force revokes `end_entity` or an intermediate
    /// of the chain it builds to `roots`. Cheap when no CRL is loaded;
    /// otherwise it verifies the chain again, with revocation (webpki).
    pub fn check(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        roots: &RootCertStore,
        now: UnixTime,
        role: PeerRole,
        algorithms: &[&dyn SignatureVerificationAlgorithm],
    ) -> Result<(), rustls::Error> {
        let crls = self.crls();
        let refs: Vec<&CertRevocationList<'_>> = crls.iter().collect();
        let Ok(builder) = RevocationOptionsBuilder::new(&refs) else {
            // No CRL loaded: nothing is revoked.
            return Ok(());
        };
        let revocation = builder
            .with_depth(RevocationCheckDepth::Chain)
            .with_status_policy(UnknownStatusPolicy::Allow)
            .with_expiration_policy(ExpirationPolicy::Ignore)
            .build();
        let usage = match role {
            PeerRole::Server => KeyUsage::server_auth(),
            PeerRole::Client => KeyUsage::client_auth(),
        };
        let cert = EndEntityCert::try_from(end_entity).map_err(to_rustls)?;
        cert.verify_for_usage(
            algorithms,
            &roots.roots,
            intermediates,
            now,
            usage,
            Some(revocation),
            None,
        )
        .map(|_| ())
        .map_err(to_rustls)
    }
}

impl RevocationList {
    /// Resolves once lists loaded after now revoke `peer`'s chain (never
    /// if they do not): an established connection selects on it and is
    /// reset (ztunnel `src/tls/revocation.rs` `wait_for_revocation`). Any
    /// other failure of the re-check (a root since removed) does not end it.
    pub async fn revoked(
        &self,
        peer: &PeerChain,
        algorithms: &[&dyn SignatureVerificationAlgorithm],
    ) {
        let mut changed = self.changed.subscribe();
        let Some((end_entity, intermediates)) = peer.certificates.split_first() else {
            return std::future::pending().await;
        };
        loop {
            if changed.changed().await.is_err() {
                return std::future::pending().await;
            }
            let verdict = self.check(
                end_entity,
                intermediates,
                &peer.roots,
                peer.verified_at,
                peer.role,
                algorithms,
            );
            if matches!(
                verdict,
                Err(rustls::Error::InvalidCertificate(CertificateError::Revoked))
            ) {
                return;
            }
        }
    }
}

/// `CertRevoked` as rustls' own `Revoked` (what ztunnel matches to count a
/// revoked peer); anything else webpki says, kept as it is.
fn to_rustls(error: webpki::Error) -> rustls::Error {
    match error {
        webpki::Error::CertRevoked => CertificateError::Revoked.into(),
        other => CertificateError::Other(OtherError(Arc::new(other))).into(),
    }
}

fn parse(path: &Path, bytes: &[u8]) -> Result<Vec<CertRevocationList<'static>>, CrlError> {
    let bad = |index: usize, reason: String| CrlError::Parse {
        path: path.to_owned(),
        index,
        reason,
    };
    let ders: Vec<Vec<u8>> = if bytes.trim_ascii().is_empty() {
        Vec::new()
    } else if bytes.trim_ascii_start().starts_with(b"-----BEGIN") {
        pem::parse_many(bytes)
            .map_err(|e| bad(1, format!("not PEM: {e}")))?
            .into_iter()
            .filter(|block| block.tag() == "X509 CRL")
            .map(pem::Pem::into_contents)
            .collect()
    } else {
        vec![bytes.to_vec()]
    };
    ders.iter()
        .enumerate()
        .map(|(i, der)| {
            OwnedCertRevocationList::from_der(der)
                .map(CertRevocationList::from)
                .map_err(|e| bad(i + 1, e.to_string()))
        })
        .collect()
}
