//! Workload certificates mounted as files, for clusters whose CA is outside
//! Istio (cert-manager's istio-csr, Vault, an operator's own tooling).
//!
//! Layout of the directory (`--cert-dir`):
//!
//! ```text
//! <dir>/root-cert.pem                         the trust bundle: one or more PEM roots
//! <dir>/<namespace>/<service-account>/cert-chain.pem   leaf first, then intermediates
//! <dir>/<namespace>/<service-account>/key.pem          the leaf's private key (PKCS#8, SEC1 or PKCS#1)
//! ```
//!
//! A chain is used only if its leaf names exactly the identity of its
//! directory (`spiffe://<trust domain>/ns/<namespace>/sa/<service-account>`),
//! carries the public half of `key.pem`, and chains to a root of
//! `root-cert.pem`. The files are read again on every poll, because a
//! mounted Secret is updated by swapping a symlink, which no inotify watch
//! on the old target sees; a replacement that does not pass these checks is
//! refused with the reason and the certificate in use stays.

use std::hash::{Hash as _, Hasher as _};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;

use rustls::RootCertStore;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, UnixTime};
use rustls::server::WebPkiClientVerifier;
use x509_parser::prelude::{FromDer, X509Certificate};

use super::ca::IssuedCert;
use super::spiffe::Identity;

/// The trust bundle's file name in the directory.
pub const ROOT_BUNDLE_FILE: &str = "root-cert.pem";
/// A workload's chain file name in its identity's directory.
pub const CHAIN_FILE: &str = "cert-chain.pem";
/// A workload's key file name in its identity's directory.
pub const KEY_FILE: &str = "key.pem";

/// Largest file read from the directory.
const MAX_FILE: usize = 256 * 1024;
/// Most certificates in a chain or bundle file.
const MAX_CERTS: usize = 16;

/// Why mounted certificate files cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum CertDirError {
    /// A file could not be read.
    #[error(
        "cannot read {path}: {source}; mount the certificate there (see the certificate directory layout)"
    )]
    Read {
        /// The file.
        path: PathBuf,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// A file is larger than anything sensible.
    #[error("{path} is larger than {MAX_FILE} bytes")]
    TooLarge {
        /// The file.
        path: PathBuf,
    },
    /// A file's content is not usable.
    #[error("{path}: {reason}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
}

/// What is on disk for one identity, read but not yet checked.
#[derive(Debug)]
pub struct RawFiles {
    chain_path: PathBuf,
    key_path: PathBuf,
    roots_path: PathBuf,
    chain: Vec<u8>,
    key: Vec<u8>,
    roots: Vec<u8>,
}

impl RawFiles {
    /// A digest of the three files' contents, to tell a replacement apart
    /// from what was read before.
    pub fn fingerprint(&self) -> u64 {
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        self.chain.hash(&mut hasher);
        self.key.hash(&mut hasher);
        self.roots.hash(&mut hasher);
        hasher.finish()
    }
}

/// A checked certificate from the directory and the bundle it chains to.
#[derive(Debug)]
pub struct FileCert {
    /// The certificate, key and times.
    pub cert: IssuedCert,
    /// Every root of `root-cert.pem`.
    pub roots: Vec<CertificateDer<'static>>,
}

/// A directory of mounted certificates (see the module documentation).
#[derive(Debug, Clone)]
pub struct CertDir {
    dir: PathBuf,
}

impl CertDir {
    /// The directory at `dir`.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into() }
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// Where `identity`'s chain and key are.
    pub fn identity_dir(&self, identity: &Identity) -> PathBuf {
        self.dir
            .join(&identity.namespace)
            .join(&identity.service_account)
    }

    /// The roots of `root-cert.pem`.
    pub fn read_roots(&self) -> Result<Vec<CertificateDer<'static>>, CertDirError> {
        let path = self.dir.join(ROOT_BUNDLE_FILE);
        let bytes = read(&path)?;
        parse_certs(&bytes).map_err(|reason| CertDirError::Invalid { path, reason })
    }

    /// Reads `identity`'s files and the bundle, unchecked.
    pub fn read_raw(&self, identity: &Identity) -> Result<RawFiles, CertDirError> {
        let dir = self.identity_dir(identity);
        let (chain_path, key_path) = (dir.join(CHAIN_FILE), dir.join(KEY_FILE));
        let roots_path = self.dir.join(ROOT_BUNDLE_FILE);
        Ok(RawFiles {
            chain: read(&chain_path)?,
            key: read(&key_path)?,
            roots: read(&roots_path)?,
            chain_path,
            key_path,
            roots_path,
        })
    }
}

impl RawFiles {
    /// Checks the files for `identity` (see the module documentation).
    pub fn check(&self, identity: &Identity) -> Result<FileCert, CertDirError> {
        let invalid = |path: &Path| {
            let path = path.to_owned();
            move |reason| CertDirError::Invalid { path, reason }
        };
        let roots = parse_certs(&self.roots).map_err(invalid(&self.roots_path))?;
        let chain = parse_certs(&self.chain).map_err(invalid(&self.chain_path))?;
        let key = PrivateKeyDer::from_pem_slice(&self.key)
            .map_err(|e| format!("no PEM private key in it ({e})"))
            .map_err(invalid(&self.key_path))?;
        let cert = check_files(identity, chain, key, &roots).map_err(invalid(&self.chain_path))?;
        Ok(FileCert { cert, roots })
    }
}

/// Checks that `chain` is usable for `identity` with `key`, chaining to
/// `roots`; the result presents `chain` as given.
pub fn check_files(
    identity: &Identity,
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    roots: &[CertificateDer<'static>],
) -> Result<IssuedCert, String> {
    let leaf = chain.first().ok_or("no certificate in the chain")?;
    let named = Identity::from_certificate(leaf).map_err(|e| format!("the leaf: {e}"))?;
    if &named != identity {
        return Err(format!(
            "the leaf names {named}, not {identity} (the identity of its directory)"
        ));
    }
    let (_, parsed) = X509Certificate::from_der(leaf).map_err(|e| format!("the leaf: {e}"))?;
    let signing = crate::crypto::provider()
        .key_provider
        .load_private_key(key.clone_key())
        .map_err(|e| format!("the key cannot sign: {e}"))?;
    let public = signing
        .public_key()
        .ok_or("the key's public half cannot be read")?;
    if public.as_ref() != parsed.public_key().raw {
        return Err(format!(
            "the leaf does not carry the public half of {KEY_FILE}: the chain and key do not belong together"
        ));
    }
    let not_before = SystemTime::from(parsed.validity().not_before.to_datetime());
    let not_after = SystemTime::from(parsed.validity().not_after.to_datetime());
    let mut store = RootCertStore::empty();
    for root in roots {
        store
            .add(root.clone())
            .map_err(|e| format!("a root of {ROOT_BUNDLE_FILE} is unusable: {e}"))?;
    }
    let verifier =
        WebPkiClientVerifier::builder_with_provider(Arc::new(store), crate::crypto::provider())
            .build()
            .map_err(|e| format!("cannot verify against {ROOT_BUNDLE_FILE}: {e}"))?;
    verifier
        .verify_client_cert(leaf, &chain[1..], UnixTime::now())
        .map_err(|e| format!("the chain does not verify against {ROOT_BUNDLE_FILE}: {e}"))?;
    drop(parsed);
    Ok(IssuedCert {
        chain,
        key,
        not_before,
        not_after,
        identity: identity.clone(),
    })
}

fn read(path: &Path) -> Result<Vec<u8>, CertDirError> {
    let (bytes, more) =
        dataplane_core::fs::read_at_most(path, MAX_FILE).map_err(|source| CertDirError::Read {
            path: path.to_owned(),
            source,
        })?;
    if more {
        return Err(CertDirError::TooLarge {
            path: path.to_owned(),
        });
    }
    Ok(bytes)
}

/// Every PEM certificate of `bytes`; none, or more than [`MAX_CERTS`], is
/// an error.
pub fn parse_certs(bytes: &[u8]) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs = CertificateDer::pem_slice_iter(bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("not PEM certificates: {e}"))?;
    if certs.is_empty() {
        return Err("no PEM certificate in it".into());
    }
    if certs.len() > MAX_CERTS {
        return Err(format!("more than {MAX_CERTS} certificates"));
    }
    Ok(certs)
}
