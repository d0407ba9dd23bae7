//! The rustls side of [`CertStore`]: a resolver that presents an identity's
//! current certificate in each handshake.

use std::sync::{Arc, Mutex, PoisonError};

use rustls::SignatureScheme;
use rustls::client::ResolvesClientCert;
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;

use super::spiffe::Identity;
use super::store::CertStore;

/// Presents one identity's current certificate from a [`CertStore`]; a
/// rustls [`ResolvesServerCert`] and [`ResolvesClientCert`].
///
/// With the built-in CA, the first handshake for an identity issues its
/// certificate; call [`CertStore::want`] when a workload is enrolled to
/// move that off the connection path. With a remote source, a handshake
/// for an identity whose certificate has not arrived fails at once.
///
/// Once the store has forgotten the identity (no pod has it any more), the
/// resolver keeps presenting the last certificate it presented instead of
/// wanting the identity again: the connections a re-enrolled pod's
/// previous engine still finishes are the only ones that ask then.
#[derive(Debug)]
pub struct IdentityCertResolver {
    pub(super) store: Arc<CertStore>,
    pub(super) identity: Identity,
    /// The certificate last presented.
    pub(super) last: Mutex<Option<Arc<CertifiedKey>>>,
}

impl IdentityCertResolver {
    /// The identity this resolver presents.
    pub fn identity(&self) -> &Identity {
        &self.identity
    }

    /// The certificate to present now (see the type's doc).
    pub(super) fn current(&self) -> Option<Arc<CertifiedKey>> {
        let mut last = self.last.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(current) = self.store.lookup(&self.identity) {
            *last = Some(current.certified.clone());
            return last.clone();
        }
        if last.is_some() && !self.store.wants(&self.identity) {
            return last.clone();
        }
        drop(last);
        match self.store.current_or_issue(&self.identity) {
            Ok(current) => {
                let certified = current.certified.clone();
                *self.last.lock().unwrap_or_else(PoisonError::into_inner) = Some(certified.clone());
                Some(certified)
            }
            // rustls turns `None` into a handshake failure; say why here.
            // Not yet from a remote source: the store already reports it
            // (status, readiness, its own warning), so not once a handshake.
            Err(e @ super::store::CertStoreError::NotYet { .. }) => {
                tracing::debug!(error = %e, "no certificate to present in TLS handshake");
                None
            }
            Err(e) => {
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
