//! The rustls side of [`CertStore`]: a resolver that presents an identity's
//! current certificate in each handshake.

use std::sync::Arc;

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
#[derive(Debug)]
pub struct IdentityCertResolver {
    pub(super) store: Arc<CertStore>,
    pub(super) identity: Identity,
}

impl IdentityCertResolver {
    /// The identity this resolver presents.
    pub fn identity(&self) -> &Identity {
        &self.identity
    }

    fn current(&self) -> Option<Arc<CertifiedKey>> {
        match self.store.current_or_issue(&self.identity) {
            Ok(current) => Some(current.certified.clone()),
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
