//! Current certificates per workload identity, from a [`CertSource`], kept
//! fresh by a task of the store's own.
//!
//! Enrollment only says an identity is wanted ([`CertStore::want`]); the
//! store's task ([`CertStore::spawn_rotation`]) fetches what is missing,
//! re-fetches at half-life and when the trust bundle's roots change, and
//! re-reads mounted files on every poll. A failure keeps the current
//! certificate (still valid for the other half of its life), is recorded
//! for status, readiness and metrics, and is retried with exponential
//! backoff. The built-in CA signs locally, so for it `want` issues at once,
//! as before. The task lives in [`refresh`]; this module holds the slots
//! and what handshakes and enrollment call.
//!
//! Handshakes never wait: a rustls resolver ([`IdentityCertResolver`])
//! reads the identity's current certificate each time a handshake asks for
//! one. An identity without one yet (its CA is down) makes the handshake
//! fail at once, which the peer sees as a handshake failure, never a hang.
//!
//! ```no_run
//! use std::sync::Arc;
//! use std::time::Duration;
//! use dataplane_identity::identity::{Ca, CertSource, CertStore, Identity, TrustBundle};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let ca = Arc::new(Ca::generate()?);
//! let bundle = Arc::new(TrustBundle::new(vec![ca.root_der().clone()])?);
//! let store = Arc::new(CertStore::new(
//!     CertSource::Builtin(ca),
//!     bundle,
//!     dataplane_identity::tls::provider(),
//!     Duration::from_secs(24 * 3600),
//! ));
//! let _task = store.clone().spawn_rotation();
//! let id = Identity::new("cluster.local", "default", "web")?;
//! store.want(&id)?;
//! let resolver = store.resolver(id); // give to tls::server_config / tls::client_config
//! # Ok(()) }
//! ```

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Duration, Instant, SystemTime};

use dataplane_core::timestamp::rfc3339;
use rustls::crypto::CryptoProvider;
use rustls::sign::CertifiedKey;
use tokio::sync::Notify;

use super::bundle::TrustBundle;
use super::ca::{CaError, IssuedCert};
use super::resolver::IdentityCertResolver;
use super::source::{CertSource, CertSourceStatus};
use super::spiffe::Identity;

mod refresh;

pub use refresh::FILES_POLL;

/// Validity of issued certificates unless configured otherwise (Istio's
/// default workload certificate lifetime).
pub const DEFAULT_VALIDITY: Duration = Duration::from_secs(24 * 3600);

/// Why the store could not give a certificate for an identity.
#[derive(Debug, thiserror::Error)]
pub enum CertStoreError {
    /// The CA refused to issue.
    #[error("cannot issue a certificate for {identity}: {source}")]
    Issue {
        /// The identity's SPIFFE URI.
        identity: String,
        /// The CA's error (boxed: it is large and errors are rare).
        #[source]
        source: Box<CaError>,
    },
    /// The issued certificate and key could not be turned into a rustls
    /// signing key.
    #[error("cannot load the key issued for {identity} into the TLS provider: {source}")]
    LoadKey {
        /// The identity's SPIFFE URI.
        identity: String,
        /// rustls' error.
        #[source]
        source: rustls::Error,
    },
    /// The source is remote and has not given one yet.
    #[error("no certificate for {identity} yet from {source_name}{}", last_error.as_ref().map(|e| format!(": {e}")).unwrap_or_default())]
    NotYet {
        /// The identity's SPIFFE URI.
        identity: String,
        /// The source.
        source_name: String,
        /// The source's last error for it.
        last_error: Option<String>,
    },
}

/// One identity's current certificate, in both forms consumers want.
#[derive(Debug)]
pub(super) struct Current {
    issued: Arc<IssuedCert>,
    /// What rustls presents; built once per issuance, not per handshake.
    pub(super) certified: Arc<CertifiedKey>,
    /// The bundle generation it was issued under.
    generation: u64,
    /// Files only: a digest of the files it was read from.
    fingerprint: Option<u64>,
}

/// A wanted identity.
#[derive(Debug, Default)]
struct Slot {
    current: Option<Arc<Current>>,
    /// Failures since the last success.
    failures: u32,
    /// No new request before this.
    retry_at: Option<Instant>,
    /// Why the last request failed, until one succeeds.
    last_error: Option<String>,
    /// Files only: the digest of files refused, not checked again.
    refused: Option<u64>,
    /// Files only: when the files were last read.
    checked_at: Option<Instant>,
}

/// Requests to the source and their outcome, for status and metrics.
#[derive(Debug, Default)]
struct Stats {
    last_issued: Option<(SystemTime, String)>,
    last_failure: Option<(SystemTime, String)>,
}

/// Per-identity certificates from a [`CertSource`], kept fresh by
/// [`CertStore::spawn_rotation`].
#[derive(Debug)]
pub struct CertStore {
    source: CertSource,
    bundle: Arc<TrustBundle>,
    provider: Arc<CryptoProvider>,
    validity: Duration,
    slots: RwLock<HashMap<Identity, Slot>>,
    stats: Mutex<Stats>,
    successes: AtomicU64,
    failures: AtomicU64,
    wake: Notify,
}

impl CertStore {
    /// A store of certificates from `source`, valid for `validity` (see
    /// [`DEFAULT_VALIDITY`]; what CAs are asked for), updating `bundle`
    /// with the roots the source sends; `provider` loads their keys for
    /// signing handshakes (normally [`crate::crypto::provider`]).
    pub fn new(
        source: CertSource,
        bundle: Arc<TrustBundle>,
        provider: Arc<CryptoProvider>,
        validity: Duration,
    ) -> Self {
        Self {
            source,
            bundle,
            provider,
            validity,
            slots: RwLock::new(HashMap::new()),
            stats: Mutex::new(Stats::default()),
            successes: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            wake: Notify::new(),
        }
    }

    /// Where the certificates come from.
    pub fn source(&self) -> &CertSource {
        &self.source
    }

    /// The trust bundle the source's roots go into.
    pub fn bundle(&self) -> &Arc<TrustBundle> {
        &self.bundle
    }

    /// The validity of the certificates this store asks for.
    pub fn validity(&self) -> Duration {
        self.validity
    }

    /// Requests to the source that gave a certificate, and that failed.
    pub fn request_counts(&self) -> (u64, u64) {
        (
            self.successes.load(Ordering::Relaxed),
            self.failures.load(Ordering::Relaxed),
        )
    }

    /// Marks `identity` as needed by a workload of this node. A local
    /// source issues now (its error returned); a remote one is asked by the
    /// store's task, and this returns at once.
    pub fn want(&self, identity: &Identity) -> Result<(), CertStoreError> {
        if self.source.is_local() {
            return self.current_or_issue(identity).map(drop);
        }
        let added = {
            let mut slots = self.slots.write().unwrap_or_else(PoisonError::into_inner);
            let before = slots.len();
            slots.entry(identity.clone()).or_default();
            slots.len() != before
        };
        if added {
            self.wake.notify_one();
        }
        Ok(())
    }

    /// The current certificate for `identity`: issued now by a local
    /// source if there is none; from a remote source, only if it has
    /// arrived.
    pub fn get_or_issue(&self, identity: &Identity) -> Result<Arc<IssuedCert>, CertStoreError> {
        Ok(self.current_or_issue(identity)?.issued.clone())
    }

    /// The current certificate for `identity`, if there is one.
    pub fn get(&self, identity: &Identity) -> Option<Arc<IssuedCert>> {
        self.lookup(identity).map(|c| c.issued.clone())
    }

    /// Every certificate held now, sorted by identity.
    pub fn issued(&self) -> Vec<Arc<IssuedCert>> {
        let mut all: Vec<Arc<IssuedCert>> = self
            .slots
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
            .filter_map(|s| s.current.as_ref().map(|c| c.issued.clone()))
            .collect();
        all.sort_by_key(|c| c.identity.to_uri());
        all
    }

    /// Stops holding (and refreshing) a certificate for `identity`, e.g.
    /// when its last workload leaves the node. Returns whether it was
    /// wanted.
    pub fn forget(&self, identity: &Identity) -> bool {
        self.slots
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(identity)
            .is_some()
    }

    /// How many wanted identities hold a certificate, and how many are
    /// wanted.
    pub fn counts(&self) -> (usize, usize) {
        let slots = self.slots.read().unwrap_or_else(PoisonError::into_inner);
        let held = slots.values().filter(|s| s.current.is_some()).count();
        (held, slots.len())
    }

    /// What keeps readiness back: wanted identities without a certificate,
    /// with the source and its last error; `None` when every one has one.
    pub fn missing(&self) -> Option<String> {
        let slots = self.slots.read().unwrap_or_else(PoisonError::into_inner);
        let mut missing: Vec<String> = slots
            .iter()
            .filter(|(_, s)| s.current.is_none())
            .map(|(id, s)| match &s.last_error {
                Some(e) => format!("{id}: {e}"),
                None => format!("{id}: requested"),
            })
            .collect();
        if missing.is_empty() {
            return None;
        }
        missing.sort();
        Some(format!(
            "workload certificates ({} of {} missing) from {}: {}",
            missing.len(),
            slots.len(),
            self.source.describe(),
            missing.join("; ")
        ))
    }

    /// The source's status.
    pub fn status(&self) -> CertSourceStatus {
        let (held, wanted, next_refresh) = {
            let slots = self.slots.read().unwrap_or_else(PoisonError::into_inner);
            let held: Vec<&Arc<Current>> =
                slots.values().filter_map(|s| s.current.as_ref()).collect();
            let next = if self.source.is_polled() {
                None
            } else {
                held.iter().map(|c| c.issued.refresh_at()).min()
            };
            (held.len(), slots.len(), next)
        };
        let stats = self.stats.lock().unwrap_or_else(PoisonError::into_inner);
        let (successes, failures) = self.request_counts();
        CertSourceStatus {
            source: self.source.kind().to_owned(),
            description: self.source.describe(),
            held,
            wanted,
            last_issued: stats
                .last_issued
                .as_ref()
                .map(|(at, id)| format!("{} for {id}", rfc3339(*at))),
            next_refresh: next_refresh.map(rfc3339),
            last_failure: stats
                .last_failure
                .as_ref()
                .map(|(at, why)| format!("{}: {why}", rfc3339(*at))),
            failures,
            successes,
            roots: self.bundle.describe(),
        }
    }

    /// A rustls certificate resolver, for servers and clients, that presents
    /// `identity`'s current certificate in each new handshake.
    pub fn resolver(self: &Arc<Self>, identity: Identity) -> Arc<IdentityCertResolver> {
        Arc::new(IdentityCertResolver {
            store: self.clone(),
            identity,
            last: Default::default(),
        })
    }

    /// Puts `fresh` in `identity`'s slot, if it is still wanted.
    fn install(&self, identity: &Identity, fresh: Arc<Current>, now: SystemTime) -> bool {
        let serial = fresh.issued.serial();
        let mut installed = false;
        {
            let mut slots = self.slots.write().unwrap_or_else(PoisonError::into_inner);
            // Forgotten meanwhile: do not bring it back.
            if let Some(slot) = slots.get_mut(identity) {
                *slot = Slot {
                    current: Some(fresh),
                    checked_at: Some(Instant::now()),
                    ..Slot::default()
                };
                installed = true;
            }
        }
        if installed {
            tracing::info!(identity = %identity, serial = %serial, source = self.source.kind(), "workload certificate in use");
            self.stats
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .last_issued = Some((now, identity.to_uri()));
        }
        installed
    }

    fn with_slot(&self, identity: &Identity, f: impl FnOnce(&mut Slot)) {
        let mut slots = self.slots.write().unwrap_or_else(PoisonError::into_inner);
        if let Some(slot) = slots.get_mut(identity) {
            f(slot);
        }
    }

    /// Whether `identity` is wanted (not forgotten), with or without a
    /// certificate yet.
    pub(super) fn wants(&self, identity: &Identity) -> bool {
        self.slots
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .contains_key(identity)
    }

    pub(super) fn lookup(&self, identity: &Identity) -> Option<Arc<Current>> {
        self.slots
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(identity)
            .and_then(|s| s.current.clone())
    }

    pub(super) fn current_or_issue(
        &self,
        identity: &Identity,
    ) -> Result<Arc<Current>, CertStoreError> {
        if let Some(current) = self.lookup(identity) {
            return Ok(current);
        }
        if !self.source.is_local() {
            let last_error = {
                let mut slots = self.slots.write().unwrap_or_else(PoisonError::into_inner);
                slots
                    .entry(identity.clone())
                    .or_default()
                    .last_error
                    .clone()
            };
            self.wake.notify_one();
            return Err(CertStoreError::NotYet {
                identity: identity.to_uri(),
                source_name: self.source.describe(),
                last_error,
            });
        }
        // Issue outside the lock (key generation and signing take a while);
        // if another caller won the race, keep theirs so every handshake
        // agrees on one certificate.
        let fresh = self.issue_local(identity)?;
        let mut slots = self.slots.write().unwrap_or_else(PoisonError::into_inner);
        let slot = slots.entry(identity.clone()).or_default();
        let current = slot.current.get_or_insert(fresh).clone();
        drop(slots);
        Ok(current)
    }

    fn issue_local(&self, identity: &Identity) -> Result<Arc<Current>, CertStoreError> {
        let issue_error = |source| CertStoreError::Issue {
            identity: identity.to_uri(),
            source: Box::new(source),
        };
        let issued = match self.source.issue_local(identity, self.validity) {
            Some(result) => result.map_err(issue_error)?,
            None => {
                return Err(CertStoreError::NotYet {
                    identity: identity.to_uri(),
                    source_name: self.source.describe(),
                    last_error: None,
                });
            }
        };
        self.load(issued, None)
    }

    fn load(
        &self,
        issued: IssuedCert,
        fingerprint: Option<u64>,
    ) -> Result<Arc<Current>, CertStoreError> {
        let key = self
            .provider
            .key_provider
            .load_private_key(issued.key.clone_key())
            .map_err(|source| CertStoreError::LoadKey {
                identity: issued.identity.to_uri(),
                source,
            })?;
        let certified = CertifiedKey::new(issued.chain.clone(), key);
        Ok(Arc::new(Current {
            issued: Arc::new(issued),
            certified: Arc::new(certified),
            generation: self.bundle.generation(),
            fingerprint,
        }))
    }
}
