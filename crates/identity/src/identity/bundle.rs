//! The mesh's trust bundle: the root certificates peers are verified
//! against, shared by every TLS verifier and swapped as a whole when the
//! CA's roots change.
//!
//! A CA may send several roots at once (a bundle), and may move to a new
//! root. Peers do not all rotate at the same moment: for a while some
//! present certificates from the old root and some from the new one. So a
//! root that leaves the CA's set is not dropped at once: it stays trusted,
//! marked as retiring, for an overlap (normally the workload certificate
//! lifetime, by which time every peer has rotated onto the new root), and
//! is pruned after. Verifiers read the current set at each handshake, so a
//! change needs no rebuild of any TLS configuration and open connections
//! are never touched.
//!
//! ```
//! # use std::time::{Duration, SystemTime};
//! # use dataplane_identity::identity::{Ca, TrustBundle};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let (old, new) = (Ca::generate()?, Ca::generate()?);
//! let bundle = TrustBundle::new(vec![old.root_der().clone()])?;
//! let now = SystemTime::now();
//! assert!(bundle.update(vec![new.root_der().clone()], Duration::from_secs(60), now)?);
//! assert_eq!(bundle.roots().len(), 2); // the old root is retiring, still trusted
//! bundle.prune(now + Duration::from_secs(61));
//! assert_eq!(bundle.roots().len(), 1);
//! # Ok(()) }
//! ```

use std::sync::{Arc, PoisonError, RwLock};
use std::time::{Duration, SystemTime};

use dataplane_core::timestamp::rfc3339;
use rustls::RootCertStore;
use rustls::pki_types::CertificateDer;
use rustls::server::WebPkiClientVerifier;
use rustls::server::danger::ClientCertVerifier;

/// Most roots a bundle holds (active and retiring together).
pub const MAX_ROOTS: usize = 32;

/// Why a set of roots cannot become the trust bundle.
#[derive(Debug, thiserror::Error)]
pub enum TrustBundleError {
    /// No root at all: nothing could be verified.
    #[error("the trust bundle would hold no root; give the CA's root certificate(s)")]
    Empty,
    /// More roots than [`MAX_ROOTS`].
    #[error("the trust bundle would hold {count} roots, more than {MAX_ROOTS}")]
    TooMany {
        /// How many there would be.
        count: usize,
    },
    /// A certificate is not usable as a trust anchor.
    #[error("root {index} of the bundle is not a usable trust anchor: {source}")]
    Unusable {
        /// Its position in the set given.
        index: usize,
        /// rustls' error.
        #[source]
        source: rustls::Error,
    },
}

/// One root of the bundle.
#[derive(Debug, Clone)]
struct Entry {
    der: CertificateDer<'static>,
    /// When a root the CA no longer sends stops being trusted.
    retire_at: Option<SystemTime>,
}

/// One consistent view of the bundle, what a handshake verifies against.
struct Snapshot {
    entries: Vec<Entry>,
    store: Arc<RootCertStore>,
    /// rustls' client-certificate verifier over `store`.
    client: Arc<dyn ClientCertVerifier>,
}

/// A root of the bundle as shown to operators.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RootInfo {
    /// The root's subject.
    pub subject: String,
    /// The root's notAfter (RFC 3339).
    pub not_after: String,
    /// When it stops being trusted (RFC 3339), if the CA no longer sends
    /// it; `None` for a current root.
    pub retiring_at: Option<String>,
}

/// The roots every HBONE verifier trusts, swappable at run time.
pub struct TrustBundle {
    current: RwLock<Arc<Snapshot>>,
    /// Bumped whenever the set of active roots changes (not when a retiring
    /// root is pruned): certificates issued under an older generation are
    /// re-issued.
    generation: std::sync::atomic::AtomicU64,
    /// The CRLs every HBONE verifier also checks peers against, if any.
    revocations: RwLock<Option<Arc<super::RevocationList>>>,
}

impl std::fmt::Debug for TrustBundle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TrustBundle")
            .field("roots", &self.snapshot().entries.len())
            .field("generation", &self.generation())
            .finish()
    }
}

impl TrustBundle {
    /// A bundle of `roots`, all current.
    pub fn new(roots: Vec<CertificateDer<'static>>) -> Result<Self, TrustBundleError> {
        let entries = dedup(roots.into_iter().map(|der| Entry {
            der,
            retire_at: None,
        }));
        Ok(Self {
            current: RwLock::new(Arc::new(build(entries)?)),
            generation: std::sync::atomic::AtomicU64::new(0),
            revocations: RwLock::new(None),
        })
    }

    /// Makes every HBONE verifier that trusts this bundle also refuse peers
    /// `list` revokes (`None`: no revocation checks, the default).
    pub fn set_revocations(&self, list: Option<Arc<super::RevocationList>>) {
        *self
            .revocations
            .write()
            .unwrap_or_else(PoisonError::into_inner) = list;
    }

    /// The revocation lists peers are checked against, if any.
    pub fn revocations(&self) -> Option<Arc<super::RevocationList>> {
        self.revocations
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The roots trusted now (current and retiring), for verifying a
    /// server's chain.
    pub fn store(&self) -> Arc<RootCertStore> {
        Arc::clone(&self.snapshot().store)
    }

    /// rustls' verifier of client chains against the roots trusted now.
    pub fn client_verifier(&self) -> Arc<dyn ClientCertVerifier> {
        Arc::clone(&self.snapshot().client)
    }

    /// Every root trusted now, DER, current ones first.
    pub fn roots(&self) -> Vec<CertificateDer<'static>> {
        let snapshot = self.snapshot();
        let (current, retiring): (Vec<&Entry>, Vec<&Entry>) =
            snapshot.entries.iter().partition(|e| e.retire_at.is_none());
        current
            .into_iter()
            .chain(retiring)
            .map(|e| e.der.clone())
            .collect()
    }

    /// The current (not retiring) roots, DER.
    pub fn current_roots(&self) -> Vec<CertificateDer<'static>> {
        self.snapshot()
            .entries
            .iter()
            .filter(|e| e.retire_at.is_none())
            .map(|e| e.der.clone())
            .collect()
    }

    /// How many times the set of current roots has changed.
    pub fn generation(&self) -> u64 {
        self.generation.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Makes `roots` the current roots. A current root missing from `roots`
    /// stays trusted until `now + overlap` (so peers still presenting
    /// certificates from it are verified until they rotate); a retiring
    /// root sent again becomes current. Returns whether the current set
    /// changed; an unusable set leaves the bundle as it was.
    pub fn update(
        &self,
        roots: Vec<CertificateDer<'static>>,
        overlap: Duration,
        now: SystemTime,
    ) -> Result<bool, TrustBundleError> {
        let mut guard = self.current.write().unwrap_or_else(PoisonError::into_inner);
        let wanted = dedup(roots.into_iter().map(|der| Entry {
            der,
            retire_at: None,
        }));
        let same = {
            let current: Vec<&CertificateDer<'static>> = guard
                .entries
                .iter()
                .filter(|e| e.retire_at.is_none())
                .map(|e| &e.der)
                .collect();
            current.len() == wanted.len() && wanted.iter().all(|w| current.contains(&&w.der))
        };
        if same {
            return Ok(false);
        }
        if wanted.is_empty() {
            return Err(TrustBundleError::Empty);
        }
        let retire_at = now.checked_add(overlap).unwrap_or(now);
        let mut entries = wanted;
        for old in &guard.entries {
            if entries.iter().any(|e| e.der == old.der) {
                continue;
            }
            entries.push(Entry {
                der: old.der.clone(),
                retire_at: Some(old.retire_at.unwrap_or(retire_at)),
            });
        }
        *guard = Arc::new(build(entries)?);
        self.generation
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        Ok(true)
    }

    /// Stops trusting retiring roots whose overlap ended at or before
    /// `now`; returns how many were dropped.
    pub fn prune(&self, now: SystemTime) -> usize {
        let mut guard = self.current.write().unwrap_or_else(PoisonError::into_inner);
        let before = guard.entries.len();
        let kept: Vec<Entry> = guard
            .entries
            .iter()
            .filter(|e| e.retire_at.is_none_or(|at| at > now))
            .cloned()
            .collect();
        if kept.len() == before {
            return 0;
        }
        match build(kept) {
            Ok(snapshot) => {
                *guard = Arc::new(snapshot);
                before - guard.entries.len()
            }
            // Cannot happen (a subset of usable roots, with the current
            // ones kept); keep trusting rather than trusting nothing.
            Err(_) => 0,
        }
    }

    /// The roots for operators: subject, expiry, and when a retiring one
    /// stops being trusted.
    pub fn describe(&self) -> Vec<RootInfo> {
        self.snapshot()
            .entries
            .iter()
            .map(|e| {
                let (subject, not_after) = x509_parser::parse_x509_certificate(&e.der)
                    .map(|(_, c)| {
                        (
                            c.subject().to_string(),
                            rfc3339(SystemTime::from(c.validity().not_after.to_datetime())),
                        )
                    })
                    .unwrap_or_else(|_| ("unknown".to_owned(), String::new()));
                RootInfo {
                    subject,
                    not_after,
                    retiring_at: e.retire_at.map(rfc3339),
                }
            })
            .collect()
    }

    fn snapshot(&self) -> Arc<Snapshot> {
        Arc::clone(&self.current.read().unwrap_or_else(PoisonError::into_inner))
    }
}

fn dedup(entries: impl Iterator<Item = Entry>) -> Vec<Entry> {
    let mut out: Vec<Entry> = Vec::new();
    for entry in entries {
        if !out.iter().any(|e| e.der == entry.der) {
            out.push(entry);
        }
    }
    out
}

fn build(entries: Vec<Entry>) -> Result<Snapshot, TrustBundleError> {
    if entries.is_empty() {
        return Err(TrustBundleError::Empty);
    }
    if entries.len() > MAX_ROOTS {
        return Err(TrustBundleError::TooMany {
            count: entries.len(),
        });
    }
    let mut store = RootCertStore::empty();
    for (index, entry) in entries.iter().enumerate() {
        store
            .add(entry.der.clone())
            .map_err(|source| TrustBundleError::Unusable { index, source })?;
    }
    let store = Arc::new(store);
    let client =
        WebPkiClientVerifier::builder_with_provider(Arc::clone(&store), crate::crypto::provider())
            .build()
            .map_err(|e| TrustBundleError::Unusable {
                index: 0,
                source: rustls::Error::General(e.to_string()),
            })?;
    Ok(Snapshot {
        entries,
        store,
        client,
    })
}
