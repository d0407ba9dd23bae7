//! Certificate verifiers that check SPIFFE identities instead of host names.
//!
//! Mesh certificates carry one URI SAN and no DNS or IP names, so rustls'
//! stock server verifier (which matches the `ServerName`) cannot be used:
//! [`ServerIdentityVerifier`] verifies the chain with webpki exactly as the
//! stock one does, then requires the server's SPIFFE ID to be one of the
//! identities the caller expects. On the server side rustls' stock client
//! verifier checks the chain and [`TrustDomainClientVerifier`] adds that the
//! client's SPIFFE ID is in the server's trust domain. Both then refuse a
//! peer whose chain a CRL of the bundle's
//! [`crate::identity::RevocationList`] revokes.

use std::fmt;
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::verify_server_cert_signed_by_trust_anchor;
use rustls::crypto::{WebPkiSupportedAlgorithms, verify_tls12_signature, verify_tls13_signature};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::server::ParsedCertificate;
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{
    CertificateError, CommonState, DigitallySignedStruct, DistinguishedName, OtherError,
    SignatureScheme,
};

use crate::identity::{Identity, IdentityError, PeerRole, TrustBundle};

/// Why a peer's certificate was refused after its chain verified.
///
/// Carried inside `rustls::Error::InvalidCertificate(CertificateError::Other)`,
/// so it shows up in the handshake error of the side that refused.
#[derive(thiserror::Error)]
pub enum PeerIdentityError {
    /// The server is not the workload (or service) the client dialled.
    #[error(
        "server certificate names {presented}, but the connection expects {}; the destination is not the workload it claims to be, or the workload's or service's identity in the mesh configuration is out of date",
        list(.expected)
    )]
    UnexpectedServer {
        /// The identity in the server's certificate.
        presented: Identity,
        /// The identities the client accepts.
        expected: Vec<Identity>,
    },
    /// The client belongs to another trust domain.
    #[error(
        "client certificate names {presented}, outside this server's trust domain {trust_domain:?}; only workloads of {trust_domain:?} may connect"
    )]
    ForeignTrustDomain {
        /// The identity in the client's certificate.
        presented: Identity,
        /// The server's trust domain.
        trust_domain: String,
    },
    /// The certificate has no (valid, single) SPIFFE ID.
    #[error("{side} certificate has no usable SPIFFE identity: {source}")]
    NoIdentity {
        /// "server" or "client".
        side: &'static str,
        /// What is wrong with it.
        #[source]
        source: IdentityError,
    },
}

// rustls formats `CertificateError::Other` with `{:?}`; make that the
// readable message rather than a struct dump.
impl fmt::Debug for PeerIdentityError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl From<PeerIdentityError> for rustls::Error {
    fn from(e: PeerIdentityError) -> Self {
        rustls::Error::InvalidCertificate(CertificateError::Other(OtherError(Arc::new(e))))
    }
}

fn list(ids: &[Identity]) -> String {
    match ids {
        [one] => one.to_string(),
        many => {
            let names: Vec<String> = many.iter().map(Identity::to_string).collect();
            format!("one of [{}]", names.join(", "))
        }
    }
}

/// The SPIFFE identity the peer of an established connection presented, for
/// policy and logs. `None` before the handshake completes, or if the peer
/// sent no certificate or one without a single SPIFFE URI SAN (which the
/// verifiers of this module never accept).
pub fn peer_identity(conn: &CommonState) -> Option<Identity> {
    let leaf = conn.peer_certificates()?.first()?;
    Identity::from_certificate(leaf).ok()
}

/// The SPIFFE identity of a peer whose chain verified, once no revocation
/// list of `roots` revokes that chain: how both verifiers end.
fn unrevoked_identity(
    roots: &TrustBundle,
    end_entity: &CertificateDer<'_>,
    intermediates: &[CertificateDer<'_>],
    now: UnixTime,
    role: PeerRole,
    algorithms: &WebPkiSupportedAlgorithms,
) -> Result<Identity, rustls::Error> {
    if let Some(crl) = roots.revocations() {
        crl.check(
            end_entity,
            intermediates,
            &roots.store(),
            now,
            role,
            algorithms.all,
        )?;
    }
    let side = match role {
        PeerRole::Server => "server",
        PeerRole::Client => "client",
    };
    Identity::from_certificate(end_entity)
        .map_err(|source| PeerIdentityError::NoIdentity { side, source }.into())
}

/// Client side: the server's chain must lead to one of the bundle's roots
/// (as they are at the handshake) and its SPIFFE ID must be one of
/// `expected`. The `ServerName` is ignored.
#[derive(Debug)]
pub(super) struct ServerIdentityVerifier {
    roots: Arc<TrustBundle>,
    expected: Vec<Identity>,
    algorithms: WebPkiSupportedAlgorithms,
}

impl ServerIdentityVerifier {
    pub(super) fn new(
        roots: Arc<TrustBundle>,
        expected: Vec<Identity>,
        algorithms: WebPkiSupportedAlgorithms,
    ) -> Self {
        Self {
            roots,
            expected,
            algorithms,
        }
    }
}

impl ServerCertVerifier for ServerIdentityVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let cert = ParsedCertificate::try_from(end_entity)?;
        // Chain, validity period, signatures and the serverAuth EKU: the
        // stock verifier's checks, minus the host name.
        verify_server_cert_signed_by_trust_anchor(
            &cert,
            &self.roots.store(),
            intermediates,
            now,
            self.algorithms.all,
        )?;
        let presented = unrevoked_identity(
            &self.roots,
            end_entity,
            intermediates,
            now,
            PeerRole::Server,
            &self.algorithms,
        )?;
        if self.expected.contains(&presented) {
            Ok(ServerCertVerified::assertion())
        } else {
            Err(PeerIdentityError::UnexpectedServer {
                presented,
                expected: self.expected.clone(),
            }
            .into())
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        // Unreachable with TLS 1.3-only configurations; correct regardless.
        verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}

/// Server side: rustls' webpki client verifier over the bundle's roots as
/// they are at the handshake (chain, validity, clientAuth EKU, certificate
/// required), then the trust-domain check.
#[derive(Debug)]
pub(super) struct TrustDomainClientVerifier {
    roots: Arc<TrustBundle>,
    trust_domain: String,
    algorithms: WebPkiSupportedAlgorithms,
}

impl TrustDomainClientVerifier {
    pub(super) fn new(
        roots: Arc<TrustBundle>,
        trust_domain: &str,
        algorithms: WebPkiSupportedAlgorithms,
    ) -> Self {
        Self {
            roots,
            trust_domain: trust_domain.to_owned(),
            algorithms,
        }
    }
}

impl ClientCertVerifier for TrustDomainClientVerifier {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        true
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        // Hints are optional, and the roots may change under us; mesh
        // clients hold one certificate and present it regardless.
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        self.roots
            .client_verifier()
            .verify_client_cert(end_entity, intermediates, now)?;
        let presented = unrevoked_identity(
            &self.roots,
            end_entity,
            intermediates,
            now,
            PeerRole::Client,
            &self.algorithms,
        )?;
        if presented.trust_domain == self.trust_domain {
            Ok(ClientCertVerified::assertion())
        } else {
            Err(PeerIdentityError::ForeignTrustDomain {
                presented,
                trust_domain: self.trust_domain.clone(),
            }
            .into())
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}
