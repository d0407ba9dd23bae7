//! The trust bundle, the mounted-files layout, and the store taking
//! certificates from files.

#![expect(clippy::unwrap_used, reason = "tests fail loudly on unexpected errors")]

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use rustls::pki_types::{CertificateDer, UnixTime};

use super::tests::TempDir;
use super::*;

fn id(sa: &str) -> Identity {
    Identity::new("cluster.local", "shop", sa).unwrap()
}

fn pem(label: &str, der: &[u8]) -> String {
    pem::encode(&pem::Pem::new(label, der))
}

/// Whether `bundle` accepts `cert` (leaf then root) as a client chain.
fn trusts(bundle: &TrustBundle, cert: &IssuedCert) -> bool {
    bundle
        .client_verifier()
        .verify_client_cert(&cert.chain[0], &[], UnixTime::now())
        .is_ok()
}

#[test]
fn a_root_leaving_the_bundle_stays_trusted_for_the_overlap_then_goes() {
    let (old, new) = (Ca::generate().unwrap(), Ca::generate().unwrap());
    let validity = Duration::from_secs(3600);
    let (old_leaf, new_leaf) = (
        old.issue(&id("a"), validity).unwrap(),
        new.issue(&id("b"), validity).unwrap(),
    );
    let bundle = TrustBundle::new(vec![old.root_der().clone()]).unwrap();
    assert!(trusts(&bundle, &old_leaf) && !trusts(&bundle, &new_leaf));
    let now = SystemTime::now();
    let overlap = Duration::from_secs(600);

    assert!(
        !bundle
            .update(vec![old.root_der().clone()], overlap, now)
            .unwrap(),
        "same set"
    );
    assert_eq!(bundle.generation(), 0);
    assert!(
        bundle
            .update(vec![new.root_der().clone()], overlap, now)
            .unwrap()
    );
    assert_eq!(bundle.generation(), 1);
    assert!(
        trusts(&bundle, &old_leaf) && trusts(&bundle, &new_leaf),
        "both during the overlap"
    );
    assert_eq!(bundle.current_roots(), vec![new.root_der().clone()]);
    let described = bundle.describe();
    assert_eq!(
        described.iter().filter(|r| r.retiring_at.is_some()).count(),
        1
    );

    assert_eq!(bundle.prune(now + overlap - Duration::from_secs(1)), 0);
    assert_eq!(bundle.prune(now + overlap), 1);
    assert!(
        !trusts(&bundle, &old_leaf) && trusts(&bundle, &new_leaf),
        "old root gone"
    );
    assert_eq!(bundle.generation(), 1, "pruning is not a root change");
}

#[test]
fn a_bundle_of_two_roots_trusts_both_and_a_retiring_root_sent_again_is_current() {
    let (a, b) = (Ca::generate().unwrap(), Ca::generate().unwrap());
    let validity = Duration::from_secs(3600);
    let bundle = TrustBundle::new(vec![a.root_der().clone(), b.root_der().clone()]).unwrap();
    assert!(trusts(&bundle, &a.issue(&id("a"), validity).unwrap()));
    assert!(trusts(&bundle, &b.issue(&id("b"), validity).unwrap()));
    let now = SystemTime::now();
    assert!(
        bundle
            .update(vec![b.root_der().clone()], validity, now)
            .unwrap()
    );
    assert!(
        bundle
            .update(
                vec![a.root_der().clone(), b.root_der().clone()],
                validity,
                now
            )
            .unwrap()
    );
    assert!(bundle.describe().iter().all(|r| r.retiring_at.is_none()));
    assert_eq!(bundle.prune(now + validity * 2), 0, "nothing retiring");
}

#[test]
fn unusable_root_sets_are_refused_and_the_bundle_stays() {
    let a = Ca::generate().unwrap();
    assert!(matches!(
        TrustBundle::new(vec![]),
        Err(TrustBundleError::Empty)
    ));
    let bundle = TrustBundle::new(vec![a.root_der().clone()]).unwrap();
    let now = SystemTime::now();
    assert!(bundle.update(vec![], Duration::from_secs(1), now).is_err());
    let junk = CertificateDer::from(vec![0x30, 0x03, 0x02, 0x01, 0x01]);
    assert!(
        bundle
            .update(vec![junk], Duration::from_secs(1), now)
            .is_err()
    );
    assert_eq!(bundle.current_roots(), vec![a.root_der().clone()]);
    assert_eq!(bundle.generation(), 0);
}

/// Writes `cert` (and `root`'s bundle) in the files layout under `dir`,
/// replacing the files as a Secret update would (rename over).
fn mount(dir: &Path, cert: &IssuedCert, key_of: &IssuedCert, roots: &[&Ca]) {
    let leaf_dir = dir
        .join(&cert.identity.namespace)
        .join(&cert.identity.service_account);
    std::fs::create_dir_all(&leaf_dir).unwrap();
    let bundle: String = roots.iter().map(|ca| ca.root_pem().to_owned()).collect();
    let key = pem("PRIVATE KEY", key_of.key.secret_der());
    for (path, text) in [
        (dir.join(ROOT_BUNDLE_FILE), bundle),
        (
            leaf_dir.join(CHAIN_FILE),
            pem("CERTIFICATE", &cert.chain[0]),
        ),
        (leaf_dir.join(KEY_FILE), key),
    ] {
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(&tmp, &path).unwrap();
    }
}

#[test]
fn mounted_files_are_checked_for_identity_key_and_root() {
    let tmp = TempDir::new("cert-dir");
    let (ca, other) = (Ca::generate().unwrap(), Ca::generate().unwrap());
    let validity = Duration::from_secs(3600);
    let dir = CertDir::new(&tmp.0);
    let web = id("web");
    assert!(matches!(dir.read_raw(&web), Err(CertDirError::Read { .. })));

    let good = ca.issue(&web, validity).unwrap();
    mount(&tmp.0, &good, &good, &[&other, &ca]);
    let checked = dir.read_raw(&web).unwrap().check(&web).unwrap();
    assert_eq!(checked.cert.serial(), good.serial());
    assert_eq!(checked.roots.len(), 2, "both roots of the bundle");
    assert_eq!(dir.read_roots().unwrap().len(), 2);

    let refusal = |cert: &IssuedCert, key: &IssuedCert, roots: &[&Ca]| {
        mount(&tmp.0, cert, key, roots);
        dir.read_raw(&web)
            .unwrap()
            .check(&web)
            .unwrap_err()
            .to_string()
    };
    // A chain for someone else in web's directory.
    let mut db = ca.issue(&id("db"), validity).unwrap();
    db.identity = web.clone();
    let error = refusal(&db, &db, &[&ca]);
    assert!(
        error.contains("names spiffe://cluster.local/ns/shop/sa/db"),
        "{error}"
    );
    let error = refusal(&good, &ca.issue(&web, validity).unwrap(), &[&ca]);
    assert!(error.contains("do not belong together"), "{error}");
    let error = refusal(&good, &good, &[&other]);
    assert!(error.contains("does not verify"), "{error}");
    std::fs::write(tmp.0.join(ROOT_BUNDLE_FILE), "no pem here").unwrap();
    let error = dir
        .read_raw(&web)
        .unwrap()
        .check(&web)
        .unwrap_err()
        .to_string();
    assert!(
        error.contains(ROOT_BUNDLE_FILE) && error.contains("no PEM"),
        "{error}"
    );
}

#[tokio::test]
async fn the_store_reloads_replaced_files_and_refuses_a_bad_replacement() {
    crate::crypto::install_provider();
    let tmp = TempDir::new("cert-dir-store");
    let (ca, other) = (Ca::generate().unwrap(), Ca::generate().unwrap());
    let validity = Duration::from_secs(3600);
    let web = id("web");
    let first = ca.issue(&web, validity).unwrap();
    mount(&tmp.0, &first, &first, &[&ca]);
    let dir = CertDir::new(&tmp.0);
    let bundle = Arc::new(TrustBundle::new(dir.read_roots().unwrap()).unwrap());
    let store = CertStore::new(
        CertSource::Files(dir),
        Arc::clone(&bundle),
        crate::crypto::provider(),
        validity,
    );
    store.want(&web).unwrap();
    assert!(
        store.get(&web).is_none(),
        "files are read by the task, not by want"
    );
    assert!(store.missing().unwrap().contains("certificate files in"));
    let later = || SystemTime::now() + FILES_POLL * 2;
    // Polls are `FILES_POLL` apart; wait them out rather than fake time.
    let poll = || tokio::time::sleep(FILES_POLL + Duration::from_millis(50));

    assert_eq!(store.refresh_due(SystemTime::now()).await, 1);
    assert_eq!(store.get(&web).unwrap().serial(), first.serial());
    assert!(store.missing().is_none());

    // A chain from a root not in the bundle file: refused once, kept out.
    let rogue = other.issue(&web, validity).unwrap();
    mount(&tmp.0, &rogue, &rogue, &[&ca]);
    poll().await;
    assert_eq!(store.refresh_due(later()).await, 0);
    poll().await;
    assert_eq!(store.refresh_due(later()).await, 0);
    assert_eq!(
        store.get(&web).unwrap().serial(),
        first.serial(),
        "the good cert stays"
    );
    assert_eq!(
        store.request_counts(),
        (1, 1),
        "the same bad files count once"
    );
    let status = store.status();
    assert!(status.last_failure.unwrap().contains("does not verify"));

    let second = ca.issue(&web, validity).unwrap();
    mount(&tmp.0, &second, &second, &[&ca]);
    poll().await;
    assert_eq!(store.refresh_due(later()).await, 1);
    assert_eq!(store.get(&web).unwrap().serial(), second.serial());
    assert_eq!(store.request_counts(), (2, 1));
}
