//! The built-in certificate authority: one root (generated, or loaded from
//! PEM files) that signs one short-lived certificate per workload identity.
//!
//! Used when no Istio control plane issues certificates. Every agent that
//! must trust another's workloads needs the same root, so a multi-node mesh
//! shares `root-cert.pem` and `root-key.pem` (e.g. from a Kubernetes Secret)
//! and each agent loads them with [`Ca::from_files`] or
//! [`Ca::load_or_generate`].
//!
//! Issued certificates have the shape Istio's CA gives workloads: ECDSA
//! P-256 key, empty subject, one critical URI SAN (the SPIFFE ID), key usage
//! digitalSignature + keyEncipherment, extended key usage serverAuth +
//! clientAuth, `CA:FALSE`.
//!
//! ```no_run
//! use std::time::Duration;
//! use dataplane_identity::identity::{Ca, Identity};
//!
//! let ca = Ca::load_or_generate("/var/lib/dataplane/ca".as_ref())?;
//! let id = Identity::new("cluster.local", "default", "web")?;
//! let cert = ca.issue(&id, Duration::from_secs(24 * 3600))?;
//! assert_eq!(cert.chain.len(), 2); // leaf, then the root
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, PKCS_ECDSA_P256_SHA256, SanType,
};
use rustls::RootCertStore;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use time::OffsetDateTime;
use x509_parser::prelude::{FromDer, X509Certificate};

use super::ca_files;
use super::spiffe::{Identity, IdentityError};

/// File name of the root certificate in a CA directory.
pub const ROOT_CERT_FILE: &str = "root-cert.pem";
/// File name of the root private key in a CA directory (mode 0600).
pub const ROOT_KEY_FILE: &str = "root-key.pem";
/// Common name of a generated root.
pub const GENERATED_ROOT_NAME: &str = "dataplane built-in root";

/// How long a generated root is valid.
const ROOT_VALIDITY: Duration = Duration::from_secs(10 * 365 * 24 * 3600);
/// How far a certificate's notBefore is set in the past, at most, so that a
/// peer whose clock runs a little behind ours does not refuse it as "not yet
/// valid". Capped at a tenth of the validity so short-lived test certificates
/// stay mostly in the future.
const CLOCK_SKEW_ALLOWANCE: Duration = Duration::from_secs(60);

/// Why the CA could not be loaded, generated or issue a certificate.
#[derive(Debug, thiserror::Error)]
pub enum CaError {
    /// A file or directory of the CA could not be read or written.
    #[error("cannot {action} {path}: {source}; check the path and its permissions")]
    Io {
        /// What was being done ("read", "create", ...).
        action: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// Only one of the two root files exists.
    #[error(
        "CA directory {dir} has {present} but not {missing}; restore {missing}, or remove {present} to generate a new root (every workload certificate signed by the old root stops being trusted)"
    )]
    Incomplete {
        /// The CA directory.
        dir: PathBuf,
        /// The file that exists.
        present: &'static str,
        /// The file that is missing.
        missing: &'static str,
    },
    /// The root certificate or key file does not hold what it should.
    #[error("invalid CA {what} in {path}: {reason}")]
    InvalidRoot {
        /// "certificate" or "private key".
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// What is wrong and how to fix it.
        reason: String,
    },
    /// rcgen refused to generate a key or sign a certificate.
    #[error("cannot {action}: {source}")]
    Generate {
        /// What was being generated or signed.
        action: String,
        /// rcgen's error.
        #[source]
        source: rcgen::Error,
    },
    /// The identity to certify is not a valid SPIFFE identity.
    #[error("cannot issue a certificate for an invalid identity: {source}")]
    InvalidIdentity {
        /// Why the identity is invalid.
        #[source]
        source: IdentityError,
    },
    /// The requested validity is zero or too long to represent.
    #[error(
        "cannot issue a certificate for {identity} valid for {validity:?}: the validity must be between 1s and 100 years"
    )]
    InvalidValidity {
        /// The identity asked for.
        identity: Identity,
        /// The validity asked for.
        validity: Duration,
    },
    /// The root has expired, so nothing it signs is trusted.
    #[error(
        "the CA root expired at {not_after:?}; replace {ROOT_CERT_FILE} and {ROOT_KEY_FILE} with a valid root"
    )]
    RootExpired {
        /// The root's notAfter.
        not_after: SystemTime,
    },
    /// The root certificate could not be put in a rustls root store.
    #[error("cannot use the CA root as a trust anchor: {source}")]
    TrustAnchor {
        /// rustls' error.
        #[source]
        source: rustls::Error,
    },
}

/// A certificate issued for one workload identity, with its private key.
#[derive(Debug)]
pub struct IssuedCert {
    /// The chain to present in a handshake: the leaf, then the root.
    pub chain: Vec<CertificateDer<'static>>,
    /// The leaf's private key (PKCS#8, ECDSA P-256).
    pub key: PrivateKeyDer<'static>,
    /// The leaf's notBefore, as written in the certificate (whole seconds).
    pub not_before: SystemTime,
    /// The leaf's notAfter, as written in the certificate (whole seconds).
    pub not_after: SystemTime,
    /// The identity the leaf's URI SAN names.
    pub identity: Identity,
}

impl IssuedCert {
    /// The leaf certificate.
    pub fn leaf(&self) -> Option<&CertificateDer<'static>> {
        self.chain.first()
    }

    /// The leaf's serial number as its DER bytes (what a CRL lists).
    pub fn raw_serial(&self) -> Vec<u8> {
        self.leaf()
            .and_then(|leaf| X509Certificate::from_der(leaf).ok())
            .map(|(_, cert)| cert.raw_serial().to_vec())
            .unwrap_or_default()
    }

    /// The leaf's serial number as colon-separated hex, for logs and tests.
    pub fn serial(&self) -> String {
        self.leaf()
            .and_then(|leaf| X509Certificate::from_der(leaf).ok())
            .map(|(_, cert)| cert.raw_serial_as_string())
            .unwrap_or_default()
    }

    /// When this certificate should be replaced: half-way through its life.
    pub fn refresh_at(&self) -> SystemTime {
        let lifetime = self
            .not_after
            .duration_since(self.not_before)
            .unwrap_or_default();
        self.not_before + lifetime / 2
    }
}

/// A certificate authority: a root certificate and the key that signs with it.
pub struct Ca {
    issuer: Issuer<'static, KeyPair>,
    root_der: CertificateDer<'static>,
    root_pem: String,
    root_not_after: SystemTime,
}

impl std::fmt::Debug for Ca {
    // Never print the key.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ca")
            .field("root_not_after", &self.root_not_after)
            .finish_non_exhaustive()
    }
}

impl Ca {
    /// Loads `dir/root-cert.pem` and `dir/root-key.pem` if both exist;
    /// otherwise generates a new ECDSA P-256 root and writes both files
    /// (directory created 0700, key file created 0600 before any byte is
    /// written). One file without the other is an error, never overwritten.
    pub fn load_or_generate(dir: &Path) -> Result<Self, CaError> {
        let cert_path = dir.join(ROOT_CERT_FILE);
        let key_path = dir.join(ROOT_KEY_FILE);
        let both = |cert: &Path, key: &Path| -> Result<(bool, bool), CaError> {
            Ok((ca_files::exists(cert)?, ca_files::exists(key)?))
        };
        let mut found = both(&cert_path, &key_path)?;
        // Generating takes the directory's lock, and looks again under it:
        // agents starting at once on a fresh directory make one root.
        let _lock = if found == (false, false) {
            ca_files::create_dir_private(dir)?;
            let lock = ca_files::lock_dir(dir)?;
            found = both(&cert_path, &key_path)?;
            Some(lock)
        } else {
            None
        };
        match found {
            (true, true) => Self::from_files(&cert_path, &key_path),
            (false, false) => {
                let ca = Self::generate()?;
                let key_pem = ca.issuer.key().serialize_pem();
                // Key first: a crash in between leaves a key without a
                // certificate, which the next start reports instead of
                // silently replacing.
                ca_files::write_new(&key_path, key_pem.as_bytes(), ca_files::KEY_MODE)?;
                ca_files::write_new(&cert_path, ca.root_pem.as_bytes(), ca_files::CERT_MODE)?;
                tracing::info!(dir = %dir.display(), "generated a new built-in CA root");
                Ok(ca)
            }
            (true, false) => Err(CaError::Incomplete {
                dir: dir.to_owned(),
                present: ROOT_CERT_FILE,
                missing: ROOT_KEY_FILE,
            }),
            (false, true) => Err(CaError::Incomplete {
                dir: dir.to_owned(),
                present: ROOT_KEY_FILE,
                missing: ROOT_CERT_FILE,
            }),
        }
    }

    /// Loads a root from PEM files: the first certificate of `cert` and the
    /// PKCS#8 (or SEC1) private key in `key`, which must belong together.
    pub fn from_files(cert: &Path, key: &Path) -> Result<Self, CaError> {
        let invalid = |what, path: &Path, reason: String| CaError::InvalidRoot {
            what,
            path: path.to_owned(),
            reason,
        };
        let cert_pem = ca_files::read_to_string(cert)?;
        let key_pem = ca_files::read_to_string(key)?;
        ca_files::warn_if_readable_by_others(key);

        let root_der = CertificateDer::from_pem_slice(cert_pem.as_bytes()).map_err(|e| {
            invalid(
                "certificate",
                cert,
                format!("no PEM CERTIFICATE block ({e})"),
            )
        })?;
        let key_der = PrivateKeyDer::from_pem_slice(key_pem.as_bytes()).map_err(|e| {
            invalid(
                "private key",
                key,
                format!("no PEM private key block ({e})"),
            )
        })?;
        let key_pair = KeyPair::try_from(&key_der).map_err(|e| {
            invalid(
                "private key",
                key,
                format!("unsupported key ({e}); use ECDSA P-256"),
            )
        })?;

        let (_, parsed) = X509Certificate::from_der(&root_der)
            .map_err(|e| invalid("certificate", cert, format!("not DER X.509 ({e})")))?;
        if !parsed.is_ca() {
            return Err(invalid(
                "certificate",
                cert,
                "it is not a CA certificate (basicConstraints CA:TRUE missing)".to_owned(),
            ));
        }
        if parsed.public_key().subject_public_key.data.as_ref() != key_pair.public_key_raw() {
            return Err(invalid(
                "private key",
                key,
                format!(
                    "it does not belong to the certificate in {}",
                    cert.display()
                ),
            ));
        }
        let root_not_after = to_system_time(parsed.validity().not_after.to_datetime());
        if root_not_after <= SystemTime::now() {
            return Err(CaError::RootExpired {
                not_after: root_not_after,
            });
        }
        let issuer = Issuer::from_ca_cert_der(&root_der, key_pair)
            .map_err(|e| invalid("certificate", cert, format!("cannot sign with it ({e})")))?;
        // `parsed` borrows `root_der`, which moves into the CA below.
        drop(parsed);
        Ok(Self {
            issuer,
            root_pem: pem_of(&root_der),
            root_der,
            root_not_after,
        })
    }

    /// Generates a new root in memory (ECDSA P-256, CA:TRUE, keyCertSign and
    /// cRLSign, valid ten years). Nothing is written to disk.
    pub fn generate() -> Result<Self, CaError> {
        let key =
            KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).map_err(|source| CaError::Generate {
                action: "generate an ECDSA P-256 root key".to_owned(),
                source,
            })?;
        let now = SystemTime::now();
        let mut params = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, GENERATED_ROOT_NAME);
        // Distinct subjects for distinct roots: a peer holding another
        // generated root then fails with "unknown issuer", not with a
        // confusing "bad signature" from a same-named issuer.
        let key_id: String = params
            .key_identifier(&key)
            .iter()
            .take(8)
            .map(|b| format!("{b:02x}"))
            .collect();
        dn.push(DnType::OrganizationalUnitName, format!("root {key_id}"));
        params.distinguished_name = dn;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        params.not_before = whole_seconds(now.checked_sub(CLOCK_SKEW_ALLOWANCE).unwrap_or(now));
        params.not_after = whole_seconds(now.checked_add(ROOT_VALIDITY).unwrap_or(now));
        let root = params
            .self_signed(&key)
            .map_err(|source| CaError::Generate {
                action: "self-sign the root certificate".to_owned(),
                source,
            })?;
        let root_der = root.der().clone();
        Ok(Self {
            root_pem: root.pem(),
            root_not_after: to_system_time(params.not_after),
            issuer: Issuer::new(params, key),
            root_der,
        })
    }

    /// A CRL signed by this root revoking the certificates of `serials`
    /// (DER serial bytes, [`IssuedCert::raw_serial`]), numbered `number`,
    /// valid from now for a day, as PEM: what `CRL_PATH` reads. For tests,
    /// and for operators of the built-in CA.
    pub fn revocation_list(&self, serials: &[Vec<u8>], number: u64) -> Result<String, CaError> {
        let now = time::OffsetDateTime::now_utc();
        let params = rcgen::CertificateRevocationListParams {
            this_update: now,
            next_update: now + time::Duration::days(1),
            crl_number: rcgen::SerialNumber::from(number.to_be_bytes().to_vec()),
            issuing_distribution_point: None,
            revoked_certs: serials
                .iter()
                .map(|serial| rcgen::RevokedCertParams {
                    serial_number: rcgen::SerialNumber::from(serial.clone()),
                    revocation_time: now,
                    reason_code: Some(rcgen::RevocationReason::KeyCompromise),
                    invalidity_date: None,
                })
                .collect(),
            key_identifier_method: rcgen::KeyIdMethod::Sha256,
        };
        let crl = params
            .signed_by(&self.issuer)
            .map_err(|source| CaError::Generate {
                action: "sign a revocation list".to_owned(),
                source,
            })?;
        crl.pem().map_err(|source| CaError::Generate {
            action: "encode a revocation list".to_owned(),
            source,
        })
    }

    /// Issues a certificate for `identity`, valid from now for `validity`
    /// (cut short if the root expires first), with a new ECDSA P-256 key.
    pub fn issue(&self, identity: &Identity, validity: Duration) -> Result<IssuedCert, CaError> {
        identity
            .validate()
            .map_err(|source| CaError::InvalidIdentity { source })?;
        let now = SystemTime::now();
        if self.root_not_after <= now {
            return Err(CaError::RootExpired {
                not_after: self.root_not_after,
            });
        }
        let too_long = Duration::from_secs(100 * 365 * 24 * 3600);
        if validity < Duration::from_secs(1) || validity > too_long {
            return Err(CaError::InvalidValidity {
                identity: identity.clone(),
                validity,
            });
        }
        let uri = identity.to_uri();
        let generate = |action: &str| {
            let action = format!("{action} for {uri}");
            move |source| CaError::Generate { action, source }
        };
        let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256)
            .map_err(generate("generate an ECDSA P-256 key"))?;

        let mut params = CertificateParams::default();
        // Istio leaves the subject empty: the URI SAN is the name (rcgen then
        // marks the SAN extension critical, as RFC 5280 requires).
        params.distinguished_name = DistinguishedName::new();
        let san = uri
            .clone()
            .try_into()
            .map_err(generate("encode the URI SAN"))?;
        params.subject_alt_names = vec![SanType::URI(san)];
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.use_authority_key_identifier_extension = true;
        let skew = CLOCK_SKEW_ALLOWANCE.min(validity / 10);
        // `validity` is at most 100 years, so neither overflows in practice.
        let not_after = now
            .checked_add(validity)
            .unwrap_or(self.root_not_after)
            .min(self.root_not_after);
        params.not_before = whole_seconds(now.checked_sub(skew).unwrap_or(now));
        params.not_after = whole_seconds(not_after);
        let leaf = params
            .signed_by(&key, &self.issuer)
            .map_err(generate("sign the certificate"))?;

        Ok(IssuedCert {
            chain: vec![leaf.der().clone(), self.root_der.clone()],
            key: PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
            not_before: to_system_time(params.not_before),
            not_after: to_system_time(params.not_after),
            identity: identity.clone(),
        })
    }

    /// The root certificate, DER.
    pub fn root_der(&self) -> &CertificateDer<'static> {
        &self.root_der
    }

    /// The root certificate, PEM.
    pub fn root_pem(&self) -> &str {
        &self.root_pem
    }

    /// A rustls root store holding just this CA's root, for verifying peers.
    pub fn root_cert_store(&self) -> Result<RootCertStore, CaError> {
        let mut roots = RootCertStore::empty();
        roots
            .add(self.root_der.clone())
            .map_err(|source| CaError::TrustAnchor { source })?;
        Ok(roots)
    }
}

/// X.509 times have whole seconds; issue with exactly what will be written so
/// that [`IssuedCert`]'s times match the certificate's.
fn whole_seconds(t: SystemTime) -> OffsetDateTime {
    let t = OffsetDateTime::from(t);
    t.replace_nanosecond(0).unwrap_or(t)
}

fn to_system_time(t: OffsetDateTime) -> SystemTime {
    SystemTime::from(t)
}

fn pem_of(der: &CertificateDer<'_>) -> String {
    let config = pem::EncodeConfig::new().set_line_ending(pem::LineEnding::LF);
    pem::encode_config(&pem::Pem::new("CERTIFICATE", der.as_ref()), config)
}
