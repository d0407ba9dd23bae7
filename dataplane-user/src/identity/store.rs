//! Current certificates per workload identity, issued on first use by the
//! built-in [`Ca`] and replaced at half-life.
//!
//! Handshakes never wait on rotation: a rustls resolver
//! ([`IdentityCertResolver`]) reads the identity's current certificate under
//! a read lock each time a handshake asks for one, and rotation swaps in a
//! new certificate under a short write lock. Connections already established
//! keep the keys they negotiated; only new handshakes see the new
//! certificate.
//!
//! ```no_run
//! use std::sync::Arc;
//! use std::time::Duration;
//! use dataplane_user::identity::{Ca, CertStore, Identity};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let ca = Arc::new(Ca::generate()?);
//! let store = Arc::new(CertStore::new(ca, dataplane_user::tls::provider(), Duration::from_secs(24 * 3600)));
//! let _rotation = store.clone().spawn_rotation();
//! let id = Identity::new("cluster.local", "default", "web")?;
//! let resolver = store.resolver(id); // give to tls::server_config / tls::client_config
//! # Ok(()) }
//! ```

use std::collections::HashMap;
use std::sync::{Arc, PoisonError, RwLock};
use std::time::{Duration, SystemTime};

use rustls::SignatureScheme;
use rustls::client::ResolvesClientCert;
use rustls::crypto::CryptoProvider;
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use tokio::task::JoinHandle;

use super::ca::{Ca, CaError, IssuedCert};
use super::spiffe::Identity;

/// Validity of issued certificates unless configured otherwise (Istio's
/// default workload certificate lifetime).
pub const DEFAULT_VALIDITY: Duration = Duration::from_secs(24 * 3600);
/// Longest pause between two rotation checks.
const MAX_CHECK_INTERVAL: Duration = Duration::from_secs(1);
/// Shortest pause between two rotation checks, so a tiny validity cannot
/// make the task spin.
const MIN_CHECK_INTERVAL: Duration = Duration::from_millis(10);

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
}

/// One identity's current certificate, in both forms consumers want.
#[derive(Debug)]
struct Current {
    issued: Arc<IssuedCert>,
    /// What rustls presents; built once per issuance, not per handshake.
    certified: Arc<CertifiedKey>,
}

/// Per-identity certificates from a [`Ca`], rotated at half-life by
/// [`CertStore::spawn_rotation`].
#[derive(Debug)]
pub struct CertStore {
    ca: Arc<Ca>,
    provider: Arc<CryptoProvider>,
    validity: Duration,
    current: RwLock<HashMap<Identity, Arc<Current>>>,
}

impl CertStore {
    /// A store issuing certificates valid for `validity` (see
    /// [`DEFAULT_VALIDITY`]) from `ca`; `provider` loads their keys for
    /// signing handshakes (normally [`crate::tls::provider`]).
    pub fn new(ca: Arc<Ca>, provider: Arc<CryptoProvider>, validity: Duration) -> Self {
        Self {
            ca,
            provider,
            validity,
            current: RwLock::new(HashMap::new()),
        }
    }

    /// The CA this store issues from.
    pub fn ca(&self) -> &Arc<Ca> {
        &self.ca
    }

    /// The validity of the certificates this store issues.
    pub fn validity(&self) -> Duration {
        self.validity
    }

    /// The current certificate for `identity`, issuing one if there is none.
    pub fn get_or_issue(&self, identity: &Identity) -> Result<Arc<IssuedCert>, CertStoreError> {
        Ok(self.current_or_issue(identity)?.issued.clone())
    }

    /// The current certificate for `identity`, if one was issued.
    pub fn get(&self, identity: &Identity) -> Option<Arc<IssuedCert>> {
        self.lookup(identity).map(|c| c.issued.clone())
    }

    /// Every certificate held now, sorted by identity.
    pub fn issued(&self) -> Vec<Arc<IssuedCert>> {
        let mut all: Vec<Arc<IssuedCert>> = self
            .current
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
            .map(|c| c.issued.clone())
            .collect();
        all.sort_by_key(|c| c.identity.to_uri());
        all
    }

    /// Stops holding (and rotating) a certificate for `identity`, e.g. when
    /// its last workload leaves the node. Returns whether one was held.
    pub fn forget(&self, identity: &Identity) -> bool {
        self.current
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(identity)
            .is_some()
    }

    /// A rustls certificate resolver, for servers and clients, that presents
    /// `identity`'s current certificate in each new handshake.
    pub fn resolver(self: &Arc<Self>, identity: Identity) -> Arc<IdentityCertResolver> {
        Arc::new(IdentityCertResolver {
            store: self.clone(),
            identity,
        })
    }

    /// Starts a task that, every `min(1s, validity/20)`, re-issues each
    /// certificate past half its lifetime. It stops by itself when the store
    /// is dropped; abort the handle to stop it sooner.
    ///
    /// # Panics
    ///
    /// Outside a tokio runtime, like [`tokio::spawn`].
    pub fn spawn_rotation(self: Arc<Self>) -> JoinHandle<()> {
        let interval = (self.validity / 20).clamp(MIN_CHECK_INTERVAL, MAX_CHECK_INTERVAL);
        let store = Arc::downgrade(&self);
        drop(self);
        tokio::spawn(async move {
            let mut ticker = tokio::time::interval(interval);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                ticker.tick().await;
                let Some(store) = store.upgrade() else { break };
                store.rotate_due(SystemTime::now());
            }
        })
    }

    /// Re-issues every certificate whose refresh time (half-life) is at or
    /// before `now`; returns how many were replaced. A failure keeps the old
    /// certificate (still valid for the other half of its life) and is
    /// retried on the next call.
    pub fn rotate_due(&self, now: SystemTime) -> usize {
        let due: Vec<Identity> = self
            .current
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .filter(|(_, c)| c.issued.refresh_at() <= now)
            .map(|(id, _)| id.clone())
            .collect();
        let mut rotated = 0;
        for identity in due {
            match self.issue(&identity) {
                Ok(fresh) => {
                    let mut current = self.current.write().unwrap_or_else(PoisonError::into_inner);
                    // Forgotten meanwhile: do not bring it back.
                    if let Some(slot) = current.get_mut(&identity) {
                        tracing::info!(
                            identity = %identity,
                            serial = %fresh.issued.serial(),
                            "rotated workload certificate"
                        );
                        *slot = fresh;
                        rotated += 1;
                    }
                }
                Err(e) => tracing::warn!(
                    identity = %identity,
                    error = %e,
                    "certificate rotation failed; keeping the current certificate and retrying"
                ),
            }
        }
        rotated
    }

    fn lookup(&self, identity: &Identity) -> Option<Arc<Current>> {
        self.current
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(identity)
            .cloned()
    }

    fn current_or_issue(&self, identity: &Identity) -> Result<Arc<Current>, CertStoreError> {
        if let Some(current) = self.lookup(identity) {
            return Ok(current);
        }
        // Issue outside the lock (key generation and signing take a while);
        // if another caller won the race, keep theirs so every handshake
        // agrees on one certificate.
        let fresh = self.issue(identity)?;
        let mut current = self.current.write().unwrap_or_else(PoisonError::into_inner);
        Ok(current.entry(identity.clone()).or_insert(fresh).clone())
    }

    fn issue(&self, identity: &Identity) -> Result<Arc<Current>, CertStoreError> {
        let issued =
            self.ca
                .issue(identity, self.validity)
                .map_err(|source| CertStoreError::Issue {
                    identity: identity.to_uri(),
                    source: Box::new(source),
                })?;
        let key = self
            .provider
            .key_provider
            .load_private_key(issued.key.clone_key())
            .map_err(|source| CertStoreError::LoadKey {
                identity: identity.to_uri(),
                source,
            })?;
        let certified = CertifiedKey::new(issued.chain.clone(), key);
        Ok(Arc::new(Current {
            issued: Arc::new(issued),
            certified: Arc::new(certified),
        }))
    }
}

/// Presents one identity's current certificate from a [`CertStore`]; a
/// rustls [`ResolvesServerCert`] and [`ResolvesClientCert`].
///
/// The first handshake for an identity issues its certificate (a key
/// generation and a signature); call [`CertStore::get_or_issue`] when a
/// workload is enrolled to move that off the connection path.
#[derive(Debug)]
pub struct IdentityCertResolver {
    store: Arc<CertStore>,
    identity: Identity,
}

impl IdentityCertResolver {
    /// The identity this resolver presents.
    pub fn identity(&self) -> &Identity {
        &self.identity
    }

    fn current(&self) -> Option<Arc<CertifiedKey>> {
        match self.store.current_or_issue(&self.identity) {
            Ok(current) => Some(current.certified.clone()),
            Err(e) => {
                // rustls turns `None` into a handshake failure; say why here.
                tracing::warn!(error = %e, "no certificate to present in TLS handshake");
                None
            }
        }
    }
}

impl ResolvesServerCert for IdentityCertResolver {
    fn resolve(&self, _client_hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        self.current()
    }
}

impl ResolvesClientCert for IdentityCertResolver {
    fn resolve(
        &self,
        _root_hint_subjects: &[&[u8]],
        _sigschemes: &[SignatureScheme],
    ) -> Option<Arc<CertifiedKey>> {
        self.current()
    }

    fn has_certs(&self) -> bool {
        true
    }
}
