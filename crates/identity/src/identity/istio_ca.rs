//! Certificates from Istio's CA: `istio.v1.auth.IstioCertificateService/
//! CreateCertificate` on istiod (or any CA serving that API, such as
//! cert-manager's istio-csr), the way Istio's node proxy asks for its pods.
//!
//! The agent generates the key (ECDSA P-256) and sends a CSR whose only name
//! is the URI SAN of the SPIFFE identity (empty subject, as Istio's own
//! agents do), the validity it wants, and, because it asks on behalf of a
//! pod on its node, `ImpersonatedIdentity` in the request's metadata
//! (istiod lets a node proxy's service account impersonate identities of
//! pods on its node). The answer is `cert_chain`: the leaf, intermediates,
//! and last the root bundle (one PEM element that may hold several roots).
//!
//! Nothing from the CA is used before it is checked: every element must be
//! PEM certificates, the leaf must name exactly the identity asked for and
//! carry the key the agent generated, and it must chain to one of the roots
//! sent. A CA answering garbage, or a chain for someone else, is refused
//! with the reason and never replaces a good certificate.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use dataplane_istio_api::ca::{
    IstioCertificateRequest, istio_certificate_service_client::IstioCertificateServiceClient,
};
use prost_types::{Struct, Value, value::Kind};
use rcgen::{
    CertificateParams, DistinguishedName, KeyPair, PKCS_ECDSA_P256_SHA256, PublicKeyData as _,
    SanType,
};
use rustls::RootCertStore;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, UnixTime};
use rustls::server::WebPkiClientVerifier;
use x509_parser::prelude::{FromDer, X509Certificate};

use super::ca::IssuedCert;
use super::spiffe::Identity;
use crate::istiod::{IstiodEndpoint, IstiodError};

/// Most certificates accepted in one chain (leaf, intermediates, roots).
const MAX_CHAIN: usize = 16;
/// Largest answer accepted from the CA.
const MAX_RESPONSE: usize = 1024 * 1024;

/// Why Istio's CA gave no usable certificate.
#[derive(Debug, thiserror::Error)]
pub enum IstioCaError {
    /// istiod could not be reached or authenticated to.
    #[error(transparent)]
    Istiod(#[from] IstiodError),
    /// The key or CSR could not be made.
    #[error("cannot make the certificate request for {identity}: {source}")]
    Request {
        /// The identity asked for.
        identity: String,
        /// rcgen's error.
        #[source]
        source: rcgen::Error,
    },
    /// The CA refused or failed the request.
    #[error("the CA at {address} refused the certificate for {identity}: {status}")]
    Rpc {
        /// The address dialled.
        address: String,
        /// The identity asked for.
        identity: String,
        /// The gRPC status (boxed: it is large).
        status: Box<tonic::Status>,
    },
    /// The answer is not a usable chain for the identity asked for.
    #[error("the CA at {address} answered a chain that cannot be used for {identity}: {reason}")]
    BadChain {
        /// The address dialled.
        address: String,
        /// The identity asked for.
        identity: String,
        /// What is wrong with it.
        reason: String,
    },
}

/// A certificate from Istio's CA and the roots it came with.
#[derive(Debug)]
pub struct IstioIssued {
    /// The certificate, key and times.
    pub cert: IssuedCert,
    /// The roots the CA sent (the trust bundle peers are verified against).
    pub roots: Vec<CertificateDer<'static>>,
}

/// A client of Istio's certificate service.
#[derive(Debug, Clone)]
pub struct IstioCa {
    /// Where the CA is (normally istiod's 15012).
    pub istiod: IstiodEndpoint,
    /// Ask on behalf of the pod (`ImpersonatedIdentity`), as a node proxy
    /// does; off when the agent asks for its own identity.
    pub impersonate: bool,
}

impl IstioCa {
    /// Asks for a certificate for `identity` valid for `validity`.
    pub async fn issue(
        &self,
        identity: &Identity,
        validity: Duration,
    ) -> Result<IstioIssued, IstioCaError> {
        let uri = identity.to_uri();
        let request_error = |source| IstioCaError::Request {
            identity: uri.clone(),
            source,
        };
        let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).map_err(request_error)?;
        let mut params = CertificateParams::default();
        params.distinguished_name = DistinguishedName::new();
        params.subject_alt_names =
            vec![SanType::URI(uri.clone().try_into().map_err(request_error)?)];
        let csr = params
            .serialize_request(&key)
            .and_then(|csr| csr.pem())
            .map_err(request_error)?;
        let metadata = self.impersonate.then(|| Struct {
            fields: BTreeMap::from([(
                "ImpersonatedIdentity".to_owned(),
                Value {
                    kind: Some(Kind::StringValue(uri.clone())),
                },
            )]),
        });
        let mut request = tonic::Request::new(IstioCertificateRequest {
            csr,
            validity_duration: i64::try_from(validity.as_secs()).unwrap_or(i64::MAX),
            metadata,
        });
        self.istiod.add_metadata(request.metadata_mut())?;
        let channel = self.istiod.connect().await?;
        let response = IstioCertificateServiceClient::new(channel)
            .max_decoding_message_size(MAX_RESPONSE)
            .create_certificate(request)
            .await
            .map_err(|status| IstioCaError::Rpc {
                address: self.istiod.address.clone(),
                identity: uri.clone(),
                status: Box::new(status),
            })?
            .into_inner();
        let key_der = PrivatePkcs8KeyDer::from(key.serialize_der());
        checked_chain(
            &response.cert_chain,
            identity,
            &key.subject_public_key_info(),
            key_der,
        )
        .map_err(|reason| IstioCaError::BadChain {
            address: self.istiod.address.clone(),
            identity: uri,
            reason,
        })
    }
}

/// Reads and checks `cert_chain` for `identity` and the key whose public
/// half is `public_key` (SubjectPublicKeyInfo DER).
pub fn checked_chain(
    cert_chain: &[String],
    identity: &Identity,
    public_key: &[u8],
    key: PrivatePkcs8KeyDer<'static>,
) -> Result<IstioIssued, String> {
    if cert_chain.is_empty() {
        return Err("the chain is empty".into());
    }
    let mut elements = Vec::with_capacity(cert_chain.len());
    for (index, pem) in cert_chain.iter().enumerate() {
        let certs = CertificateDer::pem_slice_iter(pem.as_bytes())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|err| format!("element {index} is not PEM certificates: {err}"))?;
        if certs.is_empty() {
            return Err(format!("element {index} holds no certificate"));
        }
        elements.push(certs);
    }
    if elements.iter().map(Vec::len).sum::<usize>() > MAX_CHAIN {
        return Err(format!("more than {MAX_CHAIN} certificates"));
    }
    let roots = elements.pop().unwrap_or_default();
    // The leaf is the first certificate; a chain of one element is a leaf
    // that is its own root, which no CA sends.
    let mut rest = elements.into_iter().flatten();
    let leaf = rest.next().ok_or("the chain holds roots only, no leaf")?;
    let intermediates: Vec<_> = rest.collect();

    let named = Identity::from_certificate(&leaf).map_err(|err| format!("leaf: {err}"))?;
    if &named != identity {
        return Err(format!("the leaf names {named}, not {identity}"));
    }
    let (_, parsed) = X509Certificate::from_der(&leaf).map_err(|err| format!("leaf: {err}"))?;
    if parsed.public_key().raw != public_key {
        return Err("the leaf does not carry the key this agent generated".into());
    }
    let not_before = SystemTime::from(parsed.validity().not_before.to_datetime());
    let not_after = SystemTime::from(parsed.validity().not_after.to_datetime());

    let mut store = RootCertStore::empty();
    for root in &roots {
        store
            .add(root.clone())
            .map_err(|err| format!("a root is unusable: {err}"))?;
    }
    let verifier =
        WebPkiClientVerifier::builder_with_provider(Arc::new(store), crate::crypto::provider())
            .build()
            .map_err(|err| format!("cannot verify against the roots sent: {err}"))?;
    verifier
        .verify_client_cert(&leaf, &intermediates, UnixTime::now())
        .map_err(|err| format!("the leaf does not chain to the roots sent: {err}"))?;

    let mut chain = vec![leaf];
    chain.extend(intermediates);
    Ok(IstioIssued {
        cert: IssuedCert {
            chain,
            key: PrivateKeyDer::Pkcs8(key),
            not_before,
            not_after,
            identity: identity.clone(),
        },
        roots,
    })
}
