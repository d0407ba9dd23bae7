//! The test istiod's CA: Istio's `IstioCertificateService`, signing CSRs
//! with a test root, answering as the test tells it to.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use anyhow::Result;
use dataplane_user::istio_api::ca::{
    IstioCertificateRequest, IstioCertificateResponse,
    istio_certificate_service_server::IstioCertificateService,
};
use tonic::{Request, Response, Status};

/// How the test CA answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CaMode {
    /// Signs the CSR as asked.
    Sign,
    /// Answers text that is not a certificate.
    Garbage,
    /// Signs the CSR's key for this other SPIFFE id.
    WrongIdentity(String),
    /// Refuses with UNAVAILABLE.
    Unavailable,
}

/// One certificate request the agent sent.
#[derive(Debug, Clone)]
pub struct SeenCsr {
    /// The `authorization` metadata, if any.
    pub authorization: Option<String>,
    /// The other metadata the client added ([`super::custom_metadata`]).
    pub metadata: Vec<(String, String)>,
    /// `ImpersonatedIdentity` from the request's metadata, if any.
    pub impersonated: Option<String>,
    /// The validity asked for, in seconds.
    pub validity_seconds: i64,
}

/// What the test CA signs with and the root bundle it sends.
pub(super) struct CaSigner {
    pub(super) issuer: Arc<rcgen::Issuer<'static, rcgen::KeyPair>>,
    /// The last element of `cert_chain`: one or more PEM roots.
    pub(super) bundle_pem: String,
}

/// A root the test CA can sign with or send.
pub(super) struct NamedRoot {
    pub(super) name: String,
    pub(super) pem: String,
    pub(super) issuer: Arc<rcgen::Issuer<'static, rcgen::KeyPair>>,
}

/// A new self-signed root named `name`.
pub(super) fn new_root(
    name: &str,
) -> Result<(rcgen::Issuer<'static, rcgen::KeyPair>, rcgen::Certificate)> {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params
        .distinguished_name
        .push(rcgen::DnType::OrganizationName, name);
    let root = params.self_signed(&key)?;
    Ok((Issuer::new(params, key), root))
}

#[derive(Clone)]
pub(super) struct CaService {
    pub(super) signer: Arc<Mutex<CaSigner>>,
    pub(super) mode: Arc<Mutex<CaMode>>,
    pub(super) seen: Arc<Mutex<Vec<SeenCsr>>>,
    /// Identities (SPIFFE URIs) the CA answers UNAVAILABLE for.
    pub(super) refused: Arc<Mutex<Vec<String>>>,
}

#[tonic::async_trait]
impl IstioCertificateService for CaService {
    async fn create_certificate(
        &self,
        request: Request<IstioCertificateRequest>,
    ) -> Result<Response<IstioCertificateResponse>, Status> {
        let authorization = request
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let metadata = super::custom_metadata(request.metadata());
        let request = request.into_inner();
        let impersonated = impersonated_of(&request);
        self.seen
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(SeenCsr {
                authorization,
                metadata,
                impersonated,
                validity_seconds: request.validity_duration,
            });
        let mut mode = self
            .mode
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let refused = self.refused.lock().unwrap_or_else(PoisonError::into_inner);
        if impersonated_of(&request).is_some_and(|who| refused.contains(&who)) {
            mode = CaMode::Unavailable;
        }
        drop(refused);
        let (issuer, bundle_pem) = {
            let signer = self.signer.lock().unwrap_or_else(PoisonError::into_inner);
            (Arc::clone(&signer.issuer), signer.bundle_pem.clone())
        };
        let mut csr = match mode {
            CaMode::Unavailable => return Err(Status::unavailable("the test CA is down")),
            CaMode::Garbage => {
                return Ok(Response::new(IstioCertificateResponse {
                    cert_chain: vec!["not a certificate".into(), bundle_pem],
                }));
            }
            CaMode::Sign | CaMode::WrongIdentity(_) => {
                rcgen::CertificateSigningRequestParams::from_pem(&request.csr)
                    .map_err(|err| Status::invalid_argument(format!("bad CSR: {err}")))?
            }
        };
        if let CaMode::WrongIdentity(other) = mode {
            let san = other
                .try_into()
                .map_err(|err| Status::internal(format!("bad test identity: {err}")))?;
            csr.params.subject_alt_names = vec![rcgen::SanType::URI(san)];
        }
        let validity =
            Duration::from_secs(u64::try_from(request.validity_duration).unwrap_or(3600));
        let now = time::OffsetDateTime::now_utc();
        csr.params.not_before = now - time::Duration::seconds(1);
        csr.params.not_after = now + validity;
        csr.params.extended_key_usages = vec![
            rcgen::ExtendedKeyUsagePurpose::ServerAuth,
            rcgen::ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let leaf = csr
            .signed_by(&issuer)
            .map_err(|err| Status::internal(format!("signing: {err}")))?;
        Ok(Response::new(IstioCertificateResponse {
            cert_chain: vec![leaf.pem(), bundle_pem],
        }))
    }
}

/// `ImpersonatedIdentity` of a request, if any.
fn impersonated_of(request: &IstioCertificateRequest) -> Option<String> {
    use prost_types::value::Kind;
    request
        .metadata
        .as_ref()
        .and_then(|m| m.fields.get("ImpersonatedIdentity"))
        .and_then(|v| match &v.kind {
            Some(Kind::StringValue(s)) => Some(s.clone()),
            _ => None,
        })
}
