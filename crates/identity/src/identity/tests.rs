//! The built-in CA on disk and the certificates it issues.

#![expect(clippy::unwrap_used, reason = "tests fail loudly on unexpected errors")]

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, SystemTime};

use x509_parser::extensions::{GeneralName, ParsedExtension};
use x509_parser::prelude::{FromDer, X509Certificate};

use super::*;

/// A directory under the system temp dir, removed on drop.
pub(super) struct TempDir(pub(super) PathBuf);

impl TempDir {
    pub(super) fn new(test: &str) -> Self {
        static N: AtomicUsize = AtomicUsize::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!("dpt-{test}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        Self(path)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn mode(path: &Path) -> u32 {
    std::fs::metadata(path).unwrap().permissions().mode() & 0o777
}

fn web() -> Identity {
    Identity::new("cluster.local", "default", "web").unwrap()
}

#[test]
fn agents_starting_at_once_on_a_fresh_directory_share_one_root() {
    let tmp = TempDir::new("ca-race");
    let dir = Arc::new(tmp.0.join("ca"));
    let start = Arc::new(std::sync::Barrier::new(8));
    let threads: Vec<_> = (0..8)
        .map(|_| {
            let (dir, start) = (Arc::clone(&dir), Arc::clone(&start));
            std::thread::spawn(move || {
                start.wait();
                Ca::load_or_generate(&dir).map(|ca| ca.root_pem().to_owned())
            })
        })
        .collect();
    let roots: Vec<String> = threads
        .into_iter()
        .map(|t| t.join().unwrap().unwrap())
        .collect();
    assert!(roots.iter().all(|r| r == &roots[0]), "one root for all");
    // And the files on disk are that root and its key.
    let reloaded = Ca::load_or_generate(&dir).unwrap();
    assert_eq!(reloaded.root_pem(), roots[0]);
}

#[test]
fn generated_root_is_persisted_and_reloaded() {
    let tmp = TempDir::new("ca-persist");
    let dir = tmp.0.join("ca");
    let first = Ca::load_or_generate(&dir).unwrap();
    let second = Ca::load_or_generate(&dir).unwrap();
    assert_eq!(first.root_der(), second.root_der());
    assert_eq!(first.root_pem(), second.root_pem());
    assert_eq!(
        std::fs::read_to_string(dir.join(ROOT_CERT_FILE)).unwrap(),
        first.root_pem()
    );
    // The reloaded CA signs certificates that chain to the original root.
    let issued = second.issue(&web(), Duration::from_secs(60)).unwrap();
    assert_eq!(&issued.chain[1], first.root_der());
    let (_, root) = X509Certificate::from_der(first.root_der()).unwrap();
    let (_, leaf) = X509Certificate::from_der(&issued.chain[0]).unwrap();
    assert!(leaf.verify_signature(Some(root.public_key())).is_ok());
    assert!(root.is_ca());
    assert!(root.subject().to_string().contains(GENERATED_ROOT_NAME));
}

#[test]
fn key_file_is_0600_and_directory_0700() {
    let tmp = TempDir::new("ca-modes");
    let dir = tmp.0.join("nested").join("ca");
    Ca::load_or_generate(&dir).unwrap();
    assert_eq!(mode(&dir.join(ROOT_KEY_FILE)), 0o600);
    assert_eq!(mode(&dir.join(ROOT_CERT_FILE)), 0o644);
    assert_eq!(mode(&dir), 0o700);
    assert!(!dir.join(format!("{ROOT_KEY_FILE}.tmp")).exists());
}

#[test]
fn one_root_file_without_the_other_is_an_error_not_overwritten() {
    let tmp = TempDir::new("ca-incomplete");
    let dir = tmp.0.join("ca");
    Ca::load_or_generate(&dir).unwrap();
    let cert = std::fs::read(dir.join(ROOT_CERT_FILE)).unwrap();
    std::fs::remove_file(dir.join(ROOT_KEY_FILE)).unwrap();
    let err = Ca::load_or_generate(&dir).unwrap_err();
    assert!(matches!(err, CaError::Incomplete { .. }), "{err}");
    assert!(err.to_string().contains(ROOT_KEY_FILE), "{err}");
    assert_eq!(std::fs::read(dir.join(ROOT_CERT_FILE)).unwrap(), cert);
}

#[test]
fn from_files_refuses_a_key_of_another_root() {
    let tmp = TempDir::new("ca-mismatch");
    let (a, b) = (tmp.0.join("a"), tmp.0.join("b"));
    Ca::load_or_generate(&a).unwrap();
    Ca::load_or_generate(&b).unwrap();
    let err = Ca::from_files(&a.join(ROOT_CERT_FILE), &b.join(ROOT_KEY_FILE)).unwrap_err();
    assert!(
        err.to_string()
            .contains("does not belong to the certificate"),
        "{err}"
    );
}

#[test]
fn from_files_refuses_a_leaf_as_root() {
    let tmp = TempDir::new("ca-leaf");
    std::fs::create_dir_all(&tmp.0).unwrap();
    let ca = Ca::generate().unwrap();
    let issued = ca.issue(&web(), Duration::from_secs(60)).unwrap();
    let cert = tmp.0.join("leaf.pem");
    let key = tmp.0.join("leaf-key.pem");
    let pem = |tag: &str, der: &[u8]| pem::encode(&pem::Pem::new(tag, der));
    std::fs::write(&cert, pem("CERTIFICATE", issued.chain[0].as_ref())).unwrap();
    std::fs::write(&key, pem("PRIVATE KEY", issued.key.secret_der())).unwrap();
    let err = Ca::from_files(&cert, &key).unwrap_err();
    assert!(err.to_string().contains("not a CA certificate"), "{err}");
}

#[test]
fn issued_certificate_has_the_mesh_shape() {
    let ca = Ca::generate().unwrap();
    let before = SystemTime::now();
    let issued = ca.issue(&web(), Duration::from_secs(3600)).unwrap();
    assert_eq!(issued.identity, web());
    assert_eq!(issued.chain.len(), 2);
    for der in &issued.chain {
        crate::fuzz_seeds::seed("certificate", der);
    }
    assert_eq!(Identity::from_certificate(&issued.chain[0]).unwrap(), web());

    let (_, leaf) = X509Certificate::from_der(&issued.chain[0]).unwrap();
    assert!(
        leaf.subject().iter().next().is_none(),
        "subject should be empty"
    );
    let mut saw_san = false;
    for ext in leaf.extensions() {
        match ext.parsed_extension() {
            ParsedExtension::SubjectAlternativeName(san) => {
                saw_san = true;
                assert!(ext.critical, "SAN must be critical with an empty subject");
                assert!(matches!(
                    san.general_names.as_slice(),
                    [GeneralName::URI("spiffe://cluster.local/ns/default/sa/web")]
                ));
            }
            ParsedExtension::BasicConstraints(bc) => assert!(!bc.ca),
            ParsedExtension::KeyUsage(ku) => {
                assert!(ku.digital_signature() && !ku.key_cert_sign());
            }
            ParsedExtension::ExtendedKeyUsage(eku) => {
                assert!(eku.server_auth && eku.client_auth);
            }
            _ => {}
        }
    }
    assert!(saw_san);
    // id-ecPublicKey with the P-256 curve.
    let spki = &leaf.public_key().algorithm;
    assert_eq!(spki.algorithm.to_id_string(), "1.2.840.10045.2.1");
    let curve = spki.parameters.as_ref().unwrap().as_oid().unwrap();
    assert_eq!(curve.to_id_string(), "1.2.840.10045.3.1.7");

    let lifetime = issued.not_after.duration_since(issued.not_before).unwrap();
    assert!(lifetime >= Duration::from_secs(3600), "{lifetime:?}");
    assert!(issued.not_before <= before && issued.not_after > before);
    assert_eq!(
        issued
            .not_after
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap()
            .as_secs(),
        u64::try_from(leaf.validity().not_after.timestamp()).unwrap()
    );
}

#[test]
fn issue_refuses_invalid_identity_and_validity() {
    let ca = Ca::generate().unwrap();
    let bad = Identity::unchecked("Bad Domain", "ns", "sa");
    assert!(matches!(
        ca.issue(&bad, Duration::from_secs(60)),
        Err(CaError::InvalidIdentity { .. })
    ));
    assert!(matches!(
        ca.issue(&web(), Duration::ZERO),
        Err(CaError::InvalidValidity { .. })
    ));
}

#[test]
fn store_issues_once_and_rotates_at_half_life() {
    let store = crate::test_util::TestCa::with_validity(Duration::from_secs(3600)).store;
    let first = store.get_or_issue(&web()).unwrap();
    assert!(Arc::ptr_eq(&first, &store.get_or_issue(&web()).unwrap()));

    assert_eq!(store.rotate_due(SystemTime::now()), 0);
    let half_life = first.refresh_at();
    assert!(half_life > SystemTime::now());
    assert_eq!(store.rotate_due(half_life), 1);
    let second = store.get(&web()).unwrap();
    assert!(!Arc::ptr_eq(&first, &second));
    assert_ne!(first.serial(), second.serial());

    assert!(store.forget(&web()));
    assert!(store.get(&web()).is_none());
}

/// A re-enrolled pod's previous engine finishes its handshakes with the
/// identity it had, which the store has already forgotten: the resolver
/// presents its last certificate and does not make the store want (or,
/// with the built-in CA, issue) the identity again.
#[test]
fn a_resolver_of_a_forgotten_identity_presents_its_last_certificate() {
    let store = crate::test_util::TestCa::with_validity(Duration::from_secs(3600)).store;
    let resolver = store.resolver(web());
    let presented = resolver.current().unwrap();
    assert_eq!(store.counts(), (1, 1));

    assert!(store.forget(&web()));
    let again = resolver.current().unwrap();
    assert!(Arc::ptr_eq(&presented, &again));
    assert_eq!(store.counts(), (0, 0), "the identity was wanted again");

    // A resolver that never presented anything still gets one issued: the
    // built-in CA issues on the first handshake.
    let fresh = store.resolver(web());
    assert!(fresh.current().is_some());
    assert_eq!(store.counts(), (1, 1));
}
