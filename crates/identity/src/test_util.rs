//! The shared test CA (feature `test-util`): one built-in [`Ca`], the trust
//! bundle of its root, a [`CertStore`] that issues from it, and HBONE's
//! rustls configurations built from them the way the agent builds them
//! (`dataplane-user`'s `agent::mesh` and enrollment). Other crates enable
//! the feature from their dev-dependencies only, so the agent never
//! compiles it; this crate's own tests use it unconditionally.
//!
//! Set-up failures panic (a fixture that cannot be built is a broken test,
//! not a case to handle).

use std::{sync::Arc, time::Duration};

use rustls::{ClientConfig, ServerConfig};

use crate::identity::{
    Ca, CertSource, CertStore, DEFAULT_VALIDITY, Identity, IssuedCert, TrustBundle,
};

/// The trust domain the fixture's identities are in (Istio's default).
pub const TRUST_DOMAIN: &str = "cluster.local";

/// A freshly generated CA, the bundle of its root and a store issuing
/// from it: the built-in certificate source of one agent.
#[derive(Debug)]
pub struct TestCa {
    /// The CA (ECDSA P-256 root, generated in memory).
    pub ca: Arc<Ca>,
    /// A bundle holding the CA's root alone.
    pub roots: Arc<TrustBundle>,
    /// A store whose source is the CA ([`CertSource::Builtin`]).
    pub store: Arc<CertStore>,
}

impl Default for TestCa {
    fn default() -> Self {
        Self::new()
    }
}

impl TestCa {
    /// A CA whose store issues certificates for [`DEFAULT_VALIDITY`].
    ///
    /// # Panics
    ///
    /// When the CA cannot be generated or its root is refused.
    pub fn new() -> Self {
        Self::with_validity(DEFAULT_VALIDITY)
    }

    /// A CA whose store issues certificates valid for `validity` (rotated
    /// at half of it).
    ///
    /// # Panics
    ///
    /// When the CA cannot be generated or its root is refused.
    pub fn with_validity(validity: Duration) -> Self {
        let ca = Arc::new(Ca::generate().expect("generate the test CA"));
        let roots = Arc::new(
            TrustBundle::new(vec![ca.root_der().clone()]).expect("a bundle of the test CA's root"),
        );
        let store = Arc::new(CertStore::new(
            CertSource::Builtin(Arc::clone(&ca)),
            Arc::clone(&roots),
            crate::crypto::provider(),
            validity,
        ));
        Self { ca, roots, store }
    }

    /// `spiffe://cluster.local/ns/{namespace}/sa/{account}`.
    ///
    /// # Panics
    ///
    /// When the namespace or account is not a valid SPIFFE path segment.
    pub fn identity(namespace: &str, account: &str) -> Identity {
        Identity::new(TRUST_DOMAIN, namespace, account).expect("a valid test identity")
    }

    /// The workload certificate of `identity` (chain and key), issued by
    /// the store on first use and the same one afterwards, as a pod's
    /// handshakes present it.
    ///
    /// # Panics
    ///
    /// When the CA cannot issue it.
    pub fn certificate(&self, identity: &Identity) -> Arc<IssuedCert> {
        self.store
            .get_or_issue(identity)
            .expect("a certificate from the test CA")
    }

    /// HBONE's server configuration presenting `server`'s certificate
    /// (issued by the store on first use) and accepting clients of
    /// [`TRUST_DOMAIN`] with a chain to the CA's root, as a pod's inbound
    /// HBONE listener has it.
    ///
    /// # Panics
    ///
    /// When rustls refuses the configuration.
    pub fn server_config(&self, server: &Identity) -> Arc<ServerConfig> {
        crate::tls::server_config(
            self.store.resolver(server.clone()),
            Arc::clone(&self.roots),
            TRUST_DOMAIN,
        )
        .expect("the test server configuration")
    }

    /// HBONE's client configuration presenting `client`'s certificate and
    /// accepting only a server that proves `expected`, as a pod's HBONE
    /// pool has it.
    ///
    /// # Panics
    ///
    /// When rustls refuses the configuration.
    pub fn client_config(&self, client: &Identity, expected: &Identity) -> Arc<ClientConfig> {
        crate::tls::client_config(
            self.store.resolver(client.clone()),
            Arc::clone(&self.roots),
            vec![expected.clone()],
        )
        .expect("the test client configuration")
    }
}
