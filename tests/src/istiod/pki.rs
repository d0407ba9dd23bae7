//! The test istiod's PKI: a mesh root and istiod's serving certificate
//! signed by it.

use std::sync::Arc;

use anyhow::Result;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

use super::SERVER_NAME;

/// A mesh root and a serving certificate for [`SERVER_NAME`] signed by it.
pub struct TestPki {
    /// The root, DER (what clients trust).
    pub root: CertificateDer<'static>,
    /// The root, PEM.
    pub root_pem: String,
    chain: Vec<CertificateDer<'static>>,
    key: PrivatePkcs8KeyDer<'static>,
    pub(super) issuer: Arc<rcgen::Issuer<'static, rcgen::KeyPair>>,
}

impl TestPki {
    /// A fresh root and serving certificate.
    pub fn generate() -> Result<Self> {
        use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
        let root_key = KeyPair::generate()?;
        let mut root_params = CertificateParams::new(Vec::<String>::new())?;
        root_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        root_params
            .distinguished_name
            .push(rcgen::DnType::OrganizationName, "test mesh root");
        let root = root_params.self_signed(&root_key)?;
        let issuer = Issuer::new(root_params, root_key);
        let key = KeyPair::generate()?;
        let leaf =
            CertificateParams::new(vec![SERVER_NAME.to_owned()])?.signed_by(&key, &issuer)?;
        Ok(Self {
            root: root.der().clone(),
            root_pem: root.pem(),
            chain: vec![leaf.der().clone(), root.der().clone()],
            key: PrivatePkcs8KeyDer::from(key.serialize_der()),
            issuer: Arc::new(issuer),
        })
    }

    /// A certificate for the SPIFFE URI `identity` signed by the root, its
    /// chain (leaf, root) and key: what a mesh peer that istiod's CA signed
    /// presents, for stand-ins of a node proxy.
    pub fn issue(
        &self,
        identity: &str,
    ) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>)> {
        let key = rcgen::KeyPair::generate()?;
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new())?;
        params.subject_alt_names = vec![rcgen::SanType::URI(identity.try_into()?)];
        params.extended_key_usages = vec![
            rcgen::ExtendedKeyUsagePurpose::ServerAuth,
            rcgen::ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let leaf = params.signed_by(&key, &self.issuer)?;
        Ok((
            vec![leaf.der().clone(), self.root.clone()],
            PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
        ))
    }

    /// The root as a rustls store.
    pub fn root_store(&self) -> Result<rustls::RootCertStore> {
        let mut store = rustls::RootCertStore::empty();
        store.add(self.root.clone())?;
        Ok(store)
    }

    pub(super) fn server_config(&self) -> Result<rustls::ServerConfig> {
        let mut config =
            rustls::ServerConfig::builder_with_provider(dataplane_user::tls::provider())
                .with_safe_default_protocol_versions()?
                .with_no_client_auth()
                .with_single_cert(
                    self.chain.clone(),
                    PrivateKeyDer::Pkcs8(self.key.clone_key()),
                )?;
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(config)
    }
}
