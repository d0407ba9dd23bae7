//! HBONE TLS over real loopback TCP sockets (tokio + tokio-rustls): who is
//! let in, who is refused and why, and certificate rotation under live
//! connections.

#![expect(clippy::unwrap_used, reason = "tests fail loudly on unexpected errors")]

use std::io;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustls::pki_types::ServerName;
use rustls::{ClientConfig, ServerConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tokio_rustls::{TlsAcceptor, TlsConnector};

use super::verify::ServerIdentityVerifier;
use super::*;
use crate::identity::{Identity, TrustBundle};

const TD: &str = "cluster.local";

/// One CA and the certificates it issues (the shared test CA).
type Mesh = crate::test_util::TestCa;

fn mesh(validity: Duration) -> Mesh {
    Mesh::with_validity(validity)
}

fn id(td: &str, sa: &str) -> Identity {
    Identity::new(td, "ns1", sa).unwrap()
}

fn server_cfg(mesh: &Mesh, server: &Identity) -> Arc<ServerConfig> {
    server_config(mesh.store.resolver(server.clone()), mesh.roots.clone(), TD).unwrap()
}

fn client_cfg(mesh: &Mesh, client: &Identity, expected: &Identity) -> Arc<ClientConfig> {
    client_config(
        mesh.store.resolver(client.clone()),
        mesh.roots.clone(),
        vec![expected.clone()],
    )
    .unwrap()
}

/// What the server saw of one accepted connection.
#[derive(Debug)]
struct Accepted {
    peer: Option<Identity>,
    alpn: Option<Vec<u8>>,
}

/// Accepts `count` connections; on each, answers every "ping" with "pong"
/// until the client closes. Returns each handshake's outcome in order.
async fn serve(
    config: Arc<ServerConfig>,
    count: usize,
) -> (SocketAddr, JoinHandle<Vec<io::Result<Accepted>>>) {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let acceptor = TlsAcceptor::from(config);
    let task = tokio::spawn(async move {
        let mut outcomes = Vec::new();
        for _ in 0..count {
            let (tcp, _) = listener.accept().await.unwrap();
            match acceptor.accept(tcp).await {
                Ok(mut tls) => {
                    let (_, conn) = tls.get_ref();
                    outcomes.push(Ok(Accepted {
                        peer: peer_identity(conn),
                        alpn: conn.alpn_protocol().map(<[u8]>::to_vec),
                    }));
                    tokio::spawn(async move {
                        let mut buf = [0_u8; 4];
                        while tls.read_exact(&mut buf).await.is_ok() {
                            if tls.write_all(b"pong").await.is_err() {
                                break;
                            }
                        }
                    });
                }
                Err(e) => outcomes.push(Err(e)),
            }
        }
        outcomes
    });
    (addr, task)
}

type ClientStream = tokio_rustls::client::TlsStream<TcpStream>;

async fn connect(config: Arc<ClientConfig>, addr: SocketAddr) -> io::Result<ClientStream> {
    let tcp = TcpStream::connect(addr).await?;
    TlsConnector::from(config)
        .connect(ServerName::IpAddress(addr.ip().into()), tcp)
        .await
}

async fn ping(tls: &mut ClientStream) -> io::Result<()> {
    tls.write_all(b"ping").await?;
    let mut buf = [0_u8; 4];
    tls.read_exact(&mut buf).await?;
    assert_eq!(&buf, b"pong");
    Ok(())
}

/// The client's view when the *server* refuses it: TLS 1.3 clients finish
/// their side of the handshake before the server checks their certificate,
/// so the refusal shows up as the first read failing.
async fn connect_and_ping(config: Arc<ClientConfig>, addr: SocketAddr) -> io::Result<()> {
    let mut tls = connect(config, addr).await?;
    ping(&mut tls).await
}

fn server_error(outcome: Vec<io::Result<Accepted>>) -> String {
    match outcome.into_iter().next().unwrap() {
        Ok(accepted) => panic!("server accepted {accepted:?}"),
        Err(e) => e.to_string(),
    }
}

fn serial_of(tls: &ClientStream) -> Vec<u8> {
    let leaf = tls.get_ref().1.peer_certificates().unwrap()[0].clone();
    let (_, cert) = <x509_parser::certificate::X509Certificate as x509_parser::prelude::FromDer<
        _,
    >>::from_der(&leaf)
    .unwrap();
    cert.raw_serial().to_vec()
}

#[tokio::test]
async fn mutual_handshake_negotiates_h2_and_shows_both_identities() {
    let mesh = mesh(Duration::from_secs(3600));
    let (server, client) = (id(TD, "server"), id(TD, "client"));
    let (addr, accepted) = serve(server_cfg(&mesh, &server), 1).await;

    let mut tls = connect(client_cfg(&mesh, &client, &server), addr)
        .await
        .unwrap();
    ping(&mut tls).await.unwrap();

    let (_, conn) = tls.get_ref();
    assert_eq!(peer_identity(conn), Some(server));
    assert_eq!(conn.alpn_protocol(), Some(ALPN_H2));
    assert_eq!(
        conn.protocol_version(),
        Some(rustls::ProtocolVersion::TLSv1_3)
    );
    assert_eq!(
        conn.negotiated_cipher_suite().map(|cs| cs.suite()),
        Some(rustls::CipherSuite::TLS13_AES_128_GCM_SHA256)
    );
    let seen = accepted.await.unwrap().into_iter().next().unwrap().unwrap();
    assert_eq!(seen.peer, Some(client));
    assert_eq!(seen.alpn.as_deref(), Some(ALPN_H2));
}

#[tokio::test]
async fn client_rejects_server_with_the_wrong_identity() {
    let mesh = mesh(Duration::from_secs(3600));
    let (server, client) = (id(TD, "impostor"), id(TD, "client"));
    let expected = id(TD, "server");
    let (addr, accepted) = serve(server_cfg(&mesh, &server), 1).await;

    let err = connect(client_cfg(&mesh, &client, &expected), addr)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("server certificate names spiffe://cluster.local/ns/ns1/sa/impostor")
            && err.contains("expects spiffe://cluster.local/ns/ns1/sa/server"),
        "{err}"
    );
    assert!(accepted.await.unwrap()[0].is_err());
}

#[tokio::test]
async fn server_rejects_client_from_another_trust_domain() {
    let mesh = mesh(Duration::from_secs(3600));
    let (server, client) = (id(TD, "server"), id("other.domain", "client"));
    let (addr, accepted) = serve(server_cfg(&mesh, &server), 1).await;

    assert!(
        connect_and_ping(client_cfg(&mesh, &client, &server), addr)
            .await
            .is_err()
    );
    let err = server_error(accepted.await.unwrap());
    assert!(
        err.contains("client certificate names spiffe://other.domain/ns/ns1/sa/client")
            && err.contains("outside this server's trust domain \"cluster.local\""),
        "{err}"
    );
}

#[tokio::test]
async fn server_rejects_client_signed_by_another_ca() {
    let (mesh, rogue) = (
        mesh(Duration::from_secs(3600)),
        mesh(Duration::from_secs(3600)),
    );
    let (server, client) = (id(TD, "server"), id(TD, "client"));
    let (addr, accepted) = serve(server_cfg(&mesh, &server), 1).await;

    // Trusts the real CA for the server, presents a rogue CA's certificate.
    let config = client_config(
        rogue.store.resolver(client),
        mesh.roots.clone(),
        vec![server],
    )
    .unwrap();
    assert!(connect_and_ping(config, addr).await.is_err());
    let err = server_error(accepted.await.unwrap());
    assert!(err.contains("UnknownIssuer"), "{err}");
}

#[tokio::test]
async fn client_rejects_server_signed_by_another_ca() {
    let (mesh, rogue) = (
        mesh(Duration::from_secs(3600)),
        mesh(Duration::from_secs(3600)),
    );
    let (server, client) = (id(TD, "server"), id(TD, "client"));
    // Same name, rogue CA.
    let (addr, accepted) = serve(server_cfg(&rogue, &server), 1).await;

    let err = connect(client_cfg(&mesh, &client, &server), addr)
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("UnknownIssuer"), "{err}");
    assert!(accepted.await.unwrap()[0].is_err());
}

#[tokio::test]
async fn tls12_only_client_is_rejected() {
    let mesh = mesh(Duration::from_secs(3600));
    let (server, client) = (id(TD, "server"), id(TD, "client"));
    let (addr, accepted) = serve(server_cfg(&mesh, &server), 1).await;

    let issued = mesh.store.get_or_issue(&client).unwrap();
    let config = ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::aws_lc_rs::default_provider(),
    ))
    .with_protocol_versions(&[&rustls::version::TLS12])
    .unwrap()
    .with_root_certificates(mesh.roots.store())
    .with_client_auth_cert(issued.chain.clone(), issued.key.clone_key())
    .unwrap();
    let err = connect(Arc::new(config), addr)
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("alert"), "{err}");
    let err = server_error(accepted.await.unwrap());
    assert!(err.contains("incompatible"), "{err}");
}

#[tokio::test]
async fn client_without_certificate_is_rejected() {
    let mesh = mesh(Duration::from_secs(3600));
    let server = id(TD, "server");
    let (addr, accepted) = serve(server_cfg(&mesh, &server), 1).await;

    let verifier = ServerIdentityVerifier::new(
        mesh.roots.clone(),
        vec![server],
        provider().signature_verification_algorithms,
    );
    let mut config = ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(verifier))
        .with_no_client_auth();
    config.alpn_protocols = vec![ALPN_H2.to_vec()];
    assert!(connect_and_ping(Arc::new(config), addr).await.is_err());
    let err = server_error(accepted.await.unwrap());
    assert!(err.contains("peer sent no certificates"), "{err}");
}

#[tokio::test]
async fn client_offering_only_other_alpn_is_rejected() {
    let mesh = mesh(Duration::from_secs(3600));
    let (server, client) = (id(TD, "server"), id(TD, "client"));
    let (addr, accepted) = serve(server_cfg(&mesh, &server), 1).await;

    let mut config = ClientConfig::clone(&client_cfg(&mesh, &client, &server));
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    assert!(connect(Arc::new(config), addr).await.is_err());
    let err = server_error(accepted.await.unwrap());
    assert!(err.contains("protocol"), "{err}");
}

#[tokio::test]
async fn rotation_reaches_new_handshakes_and_spares_established_ones() {
    let mesh = mesh(Duration::from_secs(4));
    let (server, client) = (id(TD, "server"), id(TD, "client"));
    let _rotation = mesh.store.clone().spawn_rotation();
    let (addr, accepted) = serve(server_cfg(&mesh, &server), 2).await;
    let config = client_cfg(&mesh, &client, &server);

    let mut before = connect(config.clone(), addr).await.unwrap();
    ping(&mut before).await.unwrap();
    let old_serial = serial_of(&before);
    let old = mesh.store.get(&server).unwrap();

    // Half of a 4 s life is ~2 s; allow plenty for a loaded machine.
    let deadline = Instant::now() + Duration::from_secs(20);
    while mesh
        .store
        .get(&server)
        .is_some_and(|now| Arc::ptr_eq(&now, &old))
    {
        assert!(Instant::now() < deadline, "certificate was not rotated");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let mut after = connect(config, addr).await.unwrap();
    ping(&mut after).await.unwrap();
    assert_ne!(
        serial_of(&after),
        old_serial,
        "new handshake got the old certificate"
    );
    assert_eq!(peer_identity(after.get_ref().1), Some(server));
    // The connection from before the rotation still carries data.
    ping(&mut before).await.unwrap();
    for outcome in accepted.await.unwrap() {
        assert_eq!(outcome.unwrap().peer, Some(client.clone()));
    }
}

#[test]
fn client_config_cache_reuses_configurations() {
    let mesh = mesh(Duration::from_secs(3600));
    let cache = ClientConfigCache::new(mesh.store.clone(), mesh.roots.clone(), 2);
    let (client, a, b, c) = (id(TD, "client"), id(TD, "a"), id(TD, "b"), id(TD, "c"));

    let first = cache.get(&client, &[a.clone(), b.clone()]).unwrap();
    let again = cache
        .get(&client, &[b.clone(), a.clone(), a.clone()])
        .unwrap();
    assert!(
        Arc::ptr_eq(&first, &again),
        "same key, different order, built twice"
    );
    let other = cache.get(&client, std::slice::from_ref(&c)).unwrap();
    assert!(!Arc::ptr_eq(&first, &other));
    cache.get(&client, &[a.clone(), b.clone()]).unwrap();
    // Over capacity: the least recently used ([c]) goes.
    cache.get(&client, std::slice::from_ref(&a)).unwrap();
    assert_eq!(cache.len(), 2);
    let rebuilt = cache.get(&client, &[c]).unwrap();
    assert!(!Arc::ptr_eq(&rebuilt, &other));
    assert!(matches!(
        cache.get(&client, &[]),
        Err(TlsError::NoExpectedIdentity)
    ));
}

fn policy(post_quantum_only: bool, tls12: bool) -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(crate::crypto::provider_for(crate::crypto::TlsPolicy {
        post_quantum_only,
        tls12,
    }))
}

/// The default HBONE provider offering only the key exchange group `group`.
fn offering_only(group: rustls::NamedGroup) -> Arc<rustls::crypto::CryptoProvider> {
    let mut p = crate::crypto::provider_for(crate::crypto::TlsPolicy::default());
    p.kx_groups.retain(|g| g.name() == group);
    assert_eq!(p.kx_groups.len(), 1);
    Arc::new(p)
}

fn server_cfg_with(
    provider: Arc<rustls::crypto::CryptoProvider>,
    mesh: &Mesh,
    server: &Identity,
) -> Arc<ServerConfig> {
    server_config_with(
        provider,
        mesh.store.resolver(server.clone()),
        mesh.roots.clone(),
        TD,
    )
    .unwrap()
}

fn client_cfg_with(
    provider: Arc<rustls::crypto::CryptoProvider>,
    mesh: &Mesh,
    client: &Identity,
    expected: &Identity,
) -> Arc<ClientConfig> {
    client_config_with(
        provider,
        mesh.store.resolver(client.clone()),
        mesh.roots.clone(),
        vec![expected.clone()],
    )
    .unwrap()
}

#[tokio::test]
async fn post_quantum_only_server_refuses_x25519_and_accepts_x25519mlkem768() {
    let mesh = mesh(Duration::from_secs(3600));
    let (server, client) = (id(TD, "server"), id(TD, "client"));
    let (addr, accepted) = serve(server_cfg_with(policy(true, false), &mesh, &server), 3).await;

    // A client offering only classical X25519 is refused at the hello.
    let classical = client_cfg_with(
        offering_only(rustls::NamedGroup::X25519),
        &mesh,
        &client,
        &server,
    );
    let err = connect(classical, addr).await.unwrap_err().to_string();
    assert!(err.contains("alert"), "{err}");

    // One offering only X25519MLKEM768 gets in, and so does a default
    // client (it offers X25519 first; the server asks for the hybrid).
    for provider in [
        offering_only(rustls::NamedGroup::X25519MLKEM768),
        policy(false, false),
    ] {
        let mut tls = connect(client_cfg_with(provider, &mesh, &client, &server), addr)
            .await
            .unwrap();
        ping(&mut tls).await.unwrap();
        assert_eq!(
            tls.get_ref()
                .1
                .negotiated_key_exchange_group()
                .map(|g| g.name()),
            Some(rustls::NamedGroup::X25519MLKEM768)
        );
    }
    let outcomes = accepted.await.unwrap();
    let err = outcomes[0].as_ref().unwrap_err().to_string();
    assert!(err.contains("NoKxGroupsInCommon"), "{err}");
    assert_eq!(outcomes[1].as_ref().unwrap().peer, Some(client.clone()));
    assert_eq!(outcomes[2].as_ref().unwrap().peer, Some(client));
}

#[tokio::test]
async fn post_quantum_only_client_refuses_a_classical_server() {
    let mesh = mesh(Duration::from_secs(3600));
    let (server, client) = (id(TD, "server"), id(TD, "client"));
    let (addr, accepted) = serve(
        server_cfg_with(offering_only(rustls::NamedGroup::X25519), &mesh, &server),
        1,
    )
    .await;
    let pqc = client_cfg_with(policy(true, false), &mesh, &client, &server);
    assert!(connect(pqc, addr).await.is_err());
    assert!(accepted.await.unwrap()[0].is_err());
}

/// A client that speaks TLS 1.2 only, with the HBONE identity checks and
/// the TLS 1.2 suites the opt-in allows.
fn tls12_only_client(mesh: &Mesh, client: &Identity, expected: &Identity) -> Arc<ClientConfig> {
    let provider = policy(false, true);
    let verifier = Arc::new(ServerIdentityVerifier::new(
        mesh.roots.clone(),
        vec![expected.clone()],
        provider.signature_verification_algorithms,
    ));
    let mut config = ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS12])
        .unwrap()
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_client_cert_resolver(mesh.store.resolver(client.clone()));
    config.alpn_protocols = vec![ALPN_H2.to_vec()];
    Arc::new(config)
}

#[tokio::test]
async fn tls12_client_is_refused_by_default_and_accepted_with_the_opt_in() {
    let mesh = mesh(Duration::from_secs(3600));
    let (server, client) = (id(TD, "server"), id(TD, "client"));

    let (addr, accepted) = serve(server_cfg(&mesh, &server), 1).await;
    assert!(
        connect(tls12_only_client(&mesh, &client, &server), addr)
            .await
            .is_err()
    );
    let err = server_error(accepted.await.unwrap());
    assert!(err.contains("incompatible"), "{err}");

    let (addr, accepted) = serve(server_cfg_with(policy(false, true), &mesh, &server), 2).await;
    let mut tls = connect(tls12_only_client(&mesh, &client, &server), addr)
        .await
        .unwrap();
    ping(&mut tls).await.unwrap();
    let (_, conn) = tls.get_ref();
    assert_eq!(
        conn.protocol_version(),
        Some(rustls::ProtocolVersion::TLSv1_2)
    );
    assert_eq!(peer_identity(conn), Some(server.clone()));
    assert_eq!(conn.alpn_protocol(), Some(ALPN_H2));
    // A TLS 1.3 client still gets TLS 1.3 from the opted-in server.
    let mut tls = connect(client_cfg(&mesh, &client, &server), addr)
        .await
        .unwrap();
    ping(&mut tls).await.unwrap();
    assert_eq!(
        tls.get_ref().1.protocol_version(),
        Some(rustls::ProtocolVersion::TLSv1_3)
    );
    let outcomes = accepted.await.unwrap();
    assert_eq!(outcomes[0].as_ref().unwrap().peer, Some(client.clone()));
    assert_eq!(outcomes[1].as_ref().unwrap().peer, Some(client));
}

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

#[tokio::test]
async fn post_quantum_only_with_tls12_still_refuses_a_tls12_client() {
    let mesh = mesh(Duration::from_secs(3600));
    let (server, client) = (id(TD, "server"), id(TD, "client"));
    let (addr, accepted) = serve(server_cfg_with(policy(true, true), &mesh, &server), 2).await;
    // TLS 1.2 has no post-quantum group: nothing to agree on.
    assert!(
        connect(tls12_only_client(&mesh, &client, &server), addr)
            .await
            .is_err()
    );
    let mut tls = connect(client_cfg(&mesh, &client, &server), addr)
        .await
        .unwrap();
    ping(&mut tls).await.unwrap();
    let outcomes = accepted.await.unwrap();
    assert!(outcomes[0].is_err());
    assert_eq!(outcomes[1].as_ref().unwrap().peer, Some(client));
}
