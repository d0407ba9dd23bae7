//! HBONE TLS configurations: TLS 1.3 only (TLS 1.2 too when the provider
//! has a TLS 1.2 suite, i.e. under [`crate::crypto::TlsPolicy::tls12`]),
//! AES-GCM suites, ALPN `h2`, mutual authentication by SPIFFE identity.
//!
//! Session resumption is off on both sides. HBONE connections are pooled
//! and long-lived (one carries up to 100 tunnels), so full handshakes are
//! already rare, and a resumed session would carry the peer identity of an
//! earlier handshake instead of the certificate the peer holds now, which
//! rotation and policy both want to see.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use rustls::client::{ResolvesClientCert, Resumption};
use rustls::crypto::CryptoProvider;
use rustls::server::{NoServerSessionStorage, ResolvesServerCert};
use rustls::{ClientConfig, ServerConfig};

use super::verify::{ServerIdentityVerifier, TrustDomainClientVerifier};
use super::{ALPN_H2, TlsError, provider};
use crate::identity::{CertStore, Identity, TrustBundle};

static TLS13_ONLY: &[&rustls::SupportedProtocolVersion] = &[&rustls::version::TLS13];
static TLS13_AND_12: &[&rustls::SupportedProtocolVersion] =
    &[&rustls::version::TLS13, &rustls::version::TLS12];

/// The protocol versions `provider` allows: TLS 1.2 as well only when it has
/// a TLS 1.2 suite (ztunnel `src/tls/lib.rs` `tls_versions()`, under the same
/// switch as the suites).
fn versions(provider: &CryptoProvider) -> &'static [&'static rustls::SupportedProtocolVersion] {
    let tls12 = provider
        .cipher_suites
        .iter()
        .any(|cs| cs.version() == &rustls::version::TLS12);
    if tls12 { TLS13_AND_12 } else { TLS13_ONLY }
}

/// The HBONE server configuration, with the crate's [`provider`].
///
/// `resolver` presents the server workload's certificate (e.g.
/// [`CertStore::resolver`]); a client must present a certificate that chains
/// to `roots` and names an identity in `trust_domain`, or the handshake
/// fails. A client that offers ALPN without `h2` is refused; one that offers
/// no ALPN at all is let through (HTTP/2 with prior knowledge still works).
pub fn server_config(
    resolver: Arc<dyn ResolvesServerCert>,
    roots: Arc<TrustBundle>,
    trust_domain: &str,
) -> Result<Arc<ServerConfig>, TlsError> {
    server_config_with(provider(), resolver, roots, trust_domain)
}

/// [`server_config`] with another crypto provider (benchmarks compare them).
/// `provider` is used as given, so restrict it with
/// [`super::restrict_to_hbone`] first.
pub fn server_config_with(
    provider: Arc<CryptoProvider>,
    resolver: Arc<dyn ResolvesServerCert>,
    roots: Arc<TrustBundle>,
    trust_domain: &str,
) -> Result<Arc<ServerConfig>, TlsError> {
    // The verifier reads the bundle's roots at each handshake: a root
    // change needs no new configuration.
    let verifier = Arc::new(TrustDomainClientVerifier::new(
        roots,
        trust_domain,
        provider.signature_verification_algorithms,
    ));
    let versions = versions(&provider);
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(versions)
        .map_err(|source| TlsError::Provider { source })?
        .with_client_cert_verifier(verifier)
        .with_cert_resolver(resolver);
    config.alpn_protocols = vec![ALPN_H2.to_vec()];
    config.session_storage = Arc::new(NoServerSessionStorage {});
    config.send_tls13_tickets = 0;
    Ok(Arc::new(config))
}

/// The HBONE client configuration, with the crate's [`provider`].
///
/// `resolver` presents the source workload's certificate; the server must
/// present a certificate that chains to `roots` and names one of `expected`
/// (the destination workload's identity, or a service's subjectAltNames).
/// Host names and IP addresses are not checked, so connect with
/// `ServerName::IpAddress(destination)` (no SNI is sent). Building a
/// configuration costs far more than a lookup: reuse it, e.g. through
/// [`ClientConfigCache`].
pub fn client_config(
    resolver: Arc<dyn ResolvesClientCert>,
    roots: Arc<TrustBundle>,
    expected: Vec<Identity>,
) -> Result<Arc<ClientConfig>, TlsError> {
    client_config_with(provider(), resolver, roots, expected)
}

/// [`client_config`] with another crypto provider (benchmarks compare them).
/// `provider` is used as given, so restrict it with
/// [`super::restrict_to_hbone`] first.
pub fn client_config_with(
    provider: Arc<CryptoProvider>,
    resolver: Arc<dyn ResolvesClientCert>,
    roots: Arc<TrustBundle>,
    expected: Vec<Identity>,
) -> Result<Arc<ClientConfig>, TlsError> {
    if expected.is_empty() {
        return Err(TlsError::NoExpectedIdentity);
    }
    let verifier = Arc::new(ServerIdentityVerifier::new(
        roots,
        expected,
        provider.signature_verification_algorithms,
    ));
    let versions = versions(&provider);
    let mut config = ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(versions)
        .map_err(|source| TlsError::Provider { source })?
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_client_cert_resolver(resolver);
    config.alpn_protocols = vec![ALPN_H2.to_vec()];
    config.resumption = Resumption::disabled();
    // Mesh certificates name no hosts; an SNI would only leak the name.
    config.enable_sni = false;
    Ok(Arc::new(config))
}

/// Client configurations by (source identity, expected server identities),
/// built on first use and shared afterwards.
///
/// A cached configuration stays correct across certificate rotation and
/// root changes: its resolver reads the store's current certificate, and
/// its verifier the bundle's roots, at every handshake. Holds at most `capacity`
/// configurations and drops the least recently used beyond that.
#[derive(Debug)]
pub struct ClientConfigCache {
    store: Arc<CertStore>,
    roots: Arc<TrustBundle>,
    capacity: usize,
    entries: Mutex<Entries>,
}

type CacheKey = (Identity, Vec<Identity>);

#[derive(Debug, Default)]
struct Entries {
    by_key: HashMap<CacheKey, (Arc<ClientConfig>, u64)>,
    clock: u64,
}

impl ClientConfigCache {
    /// A cache of configurations presenting certificates from `store` and
    /// trusting `roots`, holding at most `capacity` (at least 1) of them.
    pub fn new(store: Arc<CertStore>, roots: Arc<TrustBundle>, capacity: usize) -> Self {
        Self {
            store,
            roots,
            capacity: capacity.max(1),
            entries: Mutex::new(Entries::default()),
        }
    }

    /// The configuration for connections from `source` to a server that must
    /// be one of `expected` (order and duplicates do not matter).
    pub fn get(
        &self,
        source: &Identity,
        expected: &[Identity],
    ) -> Result<Arc<ClientConfig>, TlsError> {
        let mut wanted = expected.to_vec();
        wanted.sort();
        wanted.dedup();
        let key = (source.clone(), wanted);
        {
            let mut entries = self.entries.lock().unwrap_or_else(PoisonError::into_inner);
            entries.clock += 1;
            let now = entries.clock;
            if let Some((config, used)) = entries.by_key.get_mut(&key) {
                *used = now;
                return Ok(config.clone());
            }
        }
        // Build outside the lock; a racing caller may build the same one,
        // which is harmless.
        let config = client_config(
            self.store.resolver(source.clone()),
            self.roots.clone(),
            key.1.clone(),
        )?;
        let mut entries = self.entries.lock().unwrap_or_else(PoisonError::into_inner);
        entries.clock += 1;
        let now = entries.clock;
        if entries.by_key.len() >= self.capacity && !entries.by_key.contains_key(&key) {
            let oldest = entries
                .by_key
                .iter()
                .min_by_key(|(_, (_, used))| *used)
                .map(|(k, _)| k.clone());
            if let Some(oldest) = oldest {
                entries.by_key.remove(&oldest);
            }
        }
        entries.by_key.insert(key, (config.clone(), now));
        Ok(config)
    }

    /// How many configurations are cached.
    pub fn len(&self) -> usize {
        self.entries
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .by_key
            .len()
    }

    /// Whether the cache is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
