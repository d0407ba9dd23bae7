//! Certificate revocation lists: loading and refusing bad files, refusing
//! revoked peers at the handshake, and resetting established connections
//! when their peer is revoked.

use super::*;

/// A test's own directory (`dp-crl-<pid>-<name>` under the temporary
/// directory), removed when dropped, so a failing test leaves nothing
/// behind either.
struct ScratchDir(std::path::PathBuf);

impl ScratchDir {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("dp-crl-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }

    fn join(&self, file: &str) -> std::path::PathBuf {
        self.0.join(file)
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A revocation list file in a fresh directory (kept while the returned
/// guard lives), listing nothing yet, checked by every verifier of `mesh`.
fn revocations(
    mesh: &Mesh,
    name: &str,
) -> (
    std::path::PathBuf,
    Arc<crate::identity::RevocationList>,
    ScratchDir,
) {
    let dir = ScratchDir::new(name);
    let path = dir.join("ca-crl.pem");
    std::fs::write(&path, mesh.ca.revocation_list(&[], 1).unwrap()).unwrap();
    let list = Arc::new(crate::identity::RevocationList::load(path.clone()).unwrap());
    mesh.roots.set_revocations(Some(list.clone()));
    (path, list, dir)
}

#[tokio::test]
async fn a_revoked_client_is_refused_once_the_changed_file_is_read() {
    let mesh = mesh(Duration::from_secs(3600));
    let (server, client, other) = (id(TD, "server"), id(TD, "client"), id(TD, "other"));
    let (path, list, _dir) = revocations(&mesh, "client");
    let watch = crate::identity::RevocationList::watch(&list);
    let (addr, accepted) = serve(server_cfg(&mesh, &server), 3).await;

    // Listed nowhere yet: let in.
    connect_and_ping(client_cfg(&mesh, &client, &server), addr)
        .await
        .unwrap();

    let serial = mesh.store.get_or_issue(&client).unwrap().raw_serial();
    let before = list.generation();
    std::fs::write(&path, mesh.ca.revocation_list(&[serial], 2).unwrap()).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while list.generation() == before {
        assert!(Instant::now() < deadline, "the changed file was never read");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    assert!(
        connect_and_ping(client_cfg(&mesh, &client, &server), addr)
            .await
            .is_err()
    );
    // Another workload's certificate is not revoked.
    connect_and_ping(client_cfg(&mesh, &other, &server), addr)
        .await
        .unwrap();
    let outcomes = accepted.await.unwrap();
    assert_eq!(outcomes[0].as_ref().unwrap().peer, Some(client));
    let err = outcomes[1].as_ref().unwrap_err().to_string();
    assert!(err.contains("Revoked"), "{err}");
    assert_eq!(outcomes[2].as_ref().unwrap().peer, Some(other));
    watch.abort();
}

#[tokio::test]
async fn a_client_refuses_a_revoked_server() {
    let mesh = mesh(Duration::from_secs(3600));
    let (server, client) = (id(TD, "server"), id(TD, "client"));
    let (path, list, _dir) = revocations(&mesh, "server");
    let serial = mesh.store.get_or_issue(&server).unwrap().raw_serial();
    std::fs::write(&path, mesh.ca.revocation_list(&[serial], 2).unwrap()).unwrap();
    assert!(list.reload().unwrap());
    assert_eq!(list.len(), 1);
    let (addr, accepted) = serve(server_cfg(&mesh, &server), 1).await;

    let err = connect(client_cfg(&mesh, &client, &server), addr)
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("Revoked"), "{err}");
    assert!(accepted.await.unwrap()[0].is_err());
}

#[test]
fn revocation_list_files_missing_empty_or_malformed() {
    let dir = ScratchDir::new("files");
    let path = dir.join("crl.pem");
    // Missing: nothing revoked until it appears.
    let list = crate::identity::RevocationList::load(path.clone()).unwrap();
    assert!(list.is_empty());
    std::fs::write(&path, "").unwrap();
    assert!(list.reload().unwrap());
    assert!(list.is_empty());
    std::fs::write(
        &path,
        "-----BEGIN X509 CRL-----\nAAAA\n-----END X509 CRL-----\n",
    )
    .unwrap();
    let err = list.reload().unwrap_err().to_string();
    assert!(err.contains("CRL 1"), "{err}");
    let err = crate::identity::RevocationList::load(path.clone())
        .unwrap_err()
        .to_string();
    assert!(err.contains("crl.pem"), "{err}");
}

/// A revocation list file past [`crate::identity::MAX_CRL_FILE`] is
/// refused unread, with an error that names it, and the lists loaded
/// before stay in force; a file of exactly the cap is read.
#[test]
fn an_oversized_revocation_list_file_is_refused_and_the_loaded_lists_stay() {
    use crate::identity::{Ca, CrlError, MAX_CRL_FILE, RevocationList};

    let dir = ScratchDir::new("oversized");
    let path = dir.join("crl.pem");
    let ca = Ca::generate().unwrap();
    std::fs::write(&path, ca.revocation_list(&[vec![1, 2, 3]], 1).unwrap()).unwrap();
    let list = RevocationList::load(path.clone()).unwrap();
    assert_eq!((list.len(), list.generation()), (1, 1));

    // Zeros past the CRL (a sparse file: no disk is written).
    let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    file.set_len(MAX_CRL_FILE as u64 + 1).unwrap();
    let err = list.reload().unwrap_err();
    assert!(matches!(err, CrlError::TooLarge { .. }), "{err:?}");
    let message = err.to_string();
    assert!(
        message.contains(&path.display().to_string())
            && message.contains(&format!("larger than {MAX_CRL_FILE} bytes")),
        "{message}"
    );
    assert_eq!((list.len(), list.generation()), (1, 1));
    assert!(matches!(
        RevocationList::load(path.clone()),
        Err(CrlError::TooLarge { .. })
    ));

    // At the cap it is read (the PEM parser skips the zeros).
    file.set_len(MAX_CRL_FILE as u64).unwrap();
    assert!(list.reload().unwrap());
    assert_eq!((list.len(), list.generation()), (1, 2));
}

/// Accepts `count` connections and answers pings on each until the peer's
/// chain is revoked: then the connection is reset (linger 0, dropped).
async fn serve_until_revoked(
    config: Arc<ServerConfig>,
    list: Arc<crate::identity::RevocationList>,
    roots: Arc<TrustBundle>,
    count: usize,
) -> SocketAddr {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let acceptor = TlsAcceptor::from(config);
    tokio::spawn(async move {
        for _ in 0..count {
            let (tcp, _) = listener.accept().await.unwrap();
            let mut tls = acceptor.accept(tcp).await.unwrap();
            let peer = crate::identity::PeerChain {
                certificates: tls.get_ref().1.peer_certificates().unwrap().to_vec(),
                roots: roots.store(),
                verified_at: rustls::pki_types::UnixTime::now(),
                role: crate::identity::PeerRole::Client,
            };
            let list = list.clone();
            tokio::spawn(async move {
                let algorithms = provider().signature_verification_algorithms.all;
                let revoked = list.revoked(&peer, algorithms);
                tokio::pin!(revoked);
                let mut buf = [0_u8; 4];
                loop {
                    tokio::select! {
                        read = tls.read_exact(&mut buf) => {
                            if read.is_err() || tls.write_all(b"pong").await.is_err() {
                                return;
                            }
                        }
                        () = &mut revoked => {
                            socket2::SockRef::from(tls.get_ref().0).set_linger(Some(Duration::ZERO)).unwrap();
                            return;
                        }
                    }
                }
            });
        }
    });
    addr
}

#[tokio::test]
async fn an_established_connection_is_reset_when_its_peer_is_revoked() {
    let mesh = mesh(Duration::from_secs(3600));
    let (server, client, other) = (id(TD, "server"), id(TD, "client"), id(TD, "other"));
    let (path, list, _dir) = revocations(&mesh, "established");
    let addr = serve_until_revoked(
        server_cfg(&mesh, &server),
        list.clone(),
        mesh.roots.clone(),
        2,
    )
    .await;
    let mut revoked = connect(client_cfg(&mesh, &client, &server), addr)
        .await
        .unwrap();
    ping(&mut revoked).await.unwrap();
    let mut kept = connect(client_cfg(&mesh, &other, &server), addr)
        .await
        .unwrap();
    ping(&mut kept).await.unwrap();

    // A reload that revokes nothing new ends nothing.
    std::fs::write(&path, mesh.ca.revocation_list(&[], 2).unwrap()).unwrap();
    assert!(list.reload().unwrap());
    ping(&mut revoked).await.unwrap();

    let serial = mesh.store.get_or_issue(&client).unwrap().raw_serial();
    std::fs::write(&path, mesh.ca.revocation_list(&[serial], 3).unwrap()).unwrap();
    assert!(list.reload().unwrap());
    // The server acts on the change by itself, not on the next ping.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let err = tokio::time::timeout(Duration::from_secs(5), ping(&mut revoked))
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::ConnectionReset, "{err}");
    ping(&mut kept).await.unwrap();
}
