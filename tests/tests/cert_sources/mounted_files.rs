//! Certificates from mounted files: a replacement on disk is picked up, a
//! bad one refused.

use super::*;

/// Writes a new certificate for `sa` from `ca` in the files layout under
/// `dir` (with the bundle `roots`), with its own key or, if `key_from` is
/// given, the key of another certificate from that CA; replaces what is
/// there the way a Secret update does: new files, then one rename of the
/// directory link. Returns the new certificate's serial.
fn mount(
    dir: &Path,
    ca: &dataplane_user::identity::Ca,
    key_from: Option<&dataplane_user::identity::Ca>,
    sa: &str,
    roots: &str,
) -> Result<String> {
    use dataplane_user::identity::{CHAIN_FILE, Identity, KEY_FILE, ROOT_BUNDLE_FILE};
    let identity = Identity::new("cluster.local", NAMESPACE, sa)?;
    let cert = ca.issue(&identity, Duration::from_secs(3600))?;
    let other_key = match key_from {
        Some(key_ca) => Some(key_ca.issue(&identity, Duration::from_secs(3600))?.key),
        None => None,
    };
    let key = other_key.as_ref().unwrap_or(&cert.key);
    let versions = dir
        .join(NAMESPACE)
        .join(format!("..{sa}-{}", cert.serial().replace(':', "")));
    std::fs::create_dir_all(&versions)?;
    std::fs::write(
        versions.join(CHAIN_FILE),
        pem::encode(&pem::Pem::new("CERTIFICATE", cert.chain[0].as_ref())),
    )?;
    std::fs::write(
        versions.join(KEY_FILE),
        pem::encode(&pem::Pem::new("PRIVATE KEY", key.secret_der())),
    )?;
    let link = dir.join(NAMESPACE).join(sa);
    let tmp = dir.join(NAMESPACE).join(format!(".{sa}.tmp"));
    let _ = std::fs::remove_file(&tmp);
    std::os::unix::fs::symlink(&versions, &tmp)?;
    std::fs::rename(&tmp, &link)?;
    std::fs::write(dir.join(ROOT_BUNDLE_FILE), roots)?;
    Ok(cert.serial())
}

#[test]
fn mounted_certificates_replaced_on_disk_are_picked_up_and_a_bad_replacement_refused() -> Result<()>
{
    use dataplane_user::identity::Ca;
    let mesh = TwoNodes::new("csfiles")?;
    let ca_dir = mesh.dir.path().join("external-ca");
    let ca = Ca::load_or_generate(&ca_dir)?;
    let other = Ca::generate()?;
    let certs = mesh.dir.path().join("mounted");
    let root = ca.root_pem().to_owned();
    for sa in ["client", "local", "remote"] {
        mount(&certs, &ca, None, sa, &root)?;
    }
    let config = mesh.config()?;
    let flags = [
        "--cert-source",
        "files",
        "--cert-dir",
        certs.to_str().context("path")?,
    ];
    let a1 = mesh.agent("csf", 1, &config, &flags)?;
    let a2 = mesh.agent("csf", 2, &config, &flags)?;
    wait_ready(&a1)?;
    wait_ready(&a2)?;
    let _remote = echo_server(&mesh.remote, 9000)?;
    echo(&mesh.client, addr(&mesh.remote, 9000), 64 * 1024, 1)?;

    // What `remote` presents to a peer, read by a TLS client of our own.
    let peer = StrangerTls::new(&ca_dir, "plain", &spiffe("remote"))?;
    let presented = || peer.presented_serial(&mesh.plain, addr(&mesh.remote, 15008));
    let first = serial(&a2, "remote")?.context("no remote certificate")?;
    ensure!(presented()? == first);

    let second = mount(&certs, &ca, None, "remote", &root)?;
    wait_until("the replaced certificate in use", || {
        Ok(presented()? == second)
    })?;
    ensure!(serial(&a2, "remote")?.as_deref() == Some(second.as_str()));

    // A chain from a root not in the bundle, then a key of another
    // certificate: refused, and the good certificate stays.
    for (chain_ca, key_ca, reason) in [
        (&other, None, "does not verify"),
        (&ca, Some(&ca), "do not belong together"),
    ] {
        let failures = a2.status()?.certificates.context("no status")?.failures;
        mount(&certs, chain_ca, key_ca, "remote", &root)?;
        wait_until("the replacement refused", || {
            Ok(a2.status()?.certificates.context("no status")?.failures > failures)
        })?;
        let status = a2.status()?.certificates.context("no status")?;
        ensure!(
            status
                .last_failure
                .as_deref()
                .unwrap_or_default()
                .contains(reason),
            "{status:?}"
        );
        ensure!(presented()? == second, "the good certificate stays in use");
        echo(&mesh.client, addr(&mesh.remote, 9000), 4096, 2)?;
    }
    let status = a2.status()?.certificates.context("no status")?;
    ensure!(status.source == "files", "{status:?}");
    Ok(())
}
