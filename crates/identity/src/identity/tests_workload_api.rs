//! The SPIFFE Workload API source against a real server on a real unix
//! socket ([`crate::workload_api_server`], refusing what SPIRE refuses),
//! with SVIDs from a real CA: the store's certificates, rotation pushed by
//! the server, a mutual-TLS handshake on the SVIDs, and the errors.

#![expect(clippy::unwrap_used, reason = "tests fail loudly on unexpected errors")]

use std::sync::Arc;
use std::time::{Duration, Instant};

use dataplane_istio_api::spiffe_workload::X509svidRequest;
use dataplane_istio_api::spiffe_workload::spiffe_workload_api_client::SpiffeWorkloadApiClient;
use rustls::pki_types::ServerName;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio_rustls::{TlsAcceptor, TlsConnector};

use super::*;
use crate::test_util::{TRUST_DOMAIN, TestCa};
use crate::workload_api_server::{WorkloadApiServer, message};

/// Generous bound on waiting for the stream (debug builds, a busy host).
const WAIT: Duration = Duration::from_secs(30);

fn id(sa: &str) -> Identity {
    TestCa::identity("shop", sa)
}

/// A store taking certificates from the Workload API at `server`, its
/// trust bundle started from the server's first message.
async fn spiffe_store(server: &WorkloadApiServer) -> Arc<CertStore> {
    let api = WorkloadApi::new(&server.endpoint()).unwrap();
    let roots = api.first_roots(TRUST_DOMAIN, WAIT).await.unwrap();
    let store = Arc::new(CertStore::new(
        CertSource::Spiffe(api),
        Arc::new(TrustBundle::new(roots).unwrap()),
        crate::crypto::provider(),
        DEFAULT_VALIDITY,
    ));
    drop(Arc::clone(&store).spawn_rotation());
    store
}

/// Waits until `identity`'s certificate in `store` has `serial`.
async fn wait_for_serial(store: &CertStore, identity: &Identity, serial: &str) {
    let deadline = Instant::now() + WAIT;
    while store.get(identity).map(|c| c.serial()).as_deref() != Some(serial) {
        assert!(
            Instant::now() < deadline,
            "{identity} never got certificate {serial}; status: {:?}",
            store.status()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The error the source gives for `identity` once it has one other than
/// "no answer yet".
async fn settled_error(api: &WorkloadApi, identity: &Identity) -> WorkloadApiError {
    let deadline = Instant::now() + WAIT;
    loop {
        match api.fetch(identity, None) {
            Err(WorkloadApiError::NotYet { .. }) => {}
            Err(error) => return error,
            Ok(_) => panic!("{identity}: a certificate where an error was expected"),
        }
        assert!(Instant::now() < deadline, "no error settled");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// One mutual-TLS exchange over loopback between `server` and `client`
/// identities of `store`; the leaf the client saw.
async fn handshake(store: &Arc<CertStore>, server: &Identity, client: &Identity) -> String {
    let server_config = crate::tls::server_config(
        store.resolver(server.clone()),
        Arc::clone(store.bundle()),
        TRUST_DOMAIN,
    )
    .unwrap();
    let client_config = crate::tls::client_config(
        store.resolver(client.clone()),
        Arc::clone(store.bundle()),
        vec![server.clone()],
    )
    .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let accept = tokio::spawn(async move {
        let (tcp, _) = listener.accept().await.unwrap();
        let mut tls = TlsAcceptor::from(server_config).accept(tcp).await.unwrap();
        let mut buf = [0u8; 4];
        tls.read_exact(&mut buf).await.unwrap();
        tls.write_all(&buf).await.unwrap();
        tls.shutdown().await.unwrap();
    });
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut tls = TlsConnector::from(client_config)
        .connect(ServerName::IpAddress(addr.ip().into()), tcp)
        .await
        .unwrap();
    tls.write_all(b"ping").await.unwrap();
    let mut buf = [0u8; 4];
    tls.read_exact(&mut buf).await.unwrap();
    assert_eq!(&buf, b"ping");
    let leaf = tls.get_ref().1.peer_certificates().unwrap()[0].clone();
    accept.await.unwrap();
    let (_, parsed) = x509_parser::parse_x509_certificate(&leaf).unwrap();
    parsed.raw_serial_as_string()
}

#[tokio::test]
async fn svids_from_the_workload_api_are_used_and_a_pushed_rotation_is_picked_up() {
    let ca = TestCa::new();
    let (web, db) = (id("web"), id("db"));
    let validity = Duration::from_secs(3600);
    let web1 = ca.ca.issue(&web, validity).unwrap();
    let db1 = ca.ca.issue(&db, validity).unwrap();
    let server = WorkloadApiServer::serve(Some(message(&ca.ca, &[&web1, &db1])));
    let store = spiffe_store(&server).await;
    store.want(&web).unwrap();
    store.want(&db).unwrap();
    wait_for_serial(&store, &web, &web1.serial()).await;
    wait_for_serial(&store, &db, &db1.serial()).await;
    assert_eq!(handshake(&store, &web, &db).await, web1.serial());

    // The server rotates web's SVID on the open stream.
    let web2 = ca.ca.issue(&web, validity).unwrap();
    server.push(Some(message(&ca.ca, &[&web2, &db1])));
    wait_for_serial(&store, &web, &web2.serial()).await;
    assert_eq!(handshake(&store, &web, &db).await, web2.serial());
    assert_eq!(store.get(&db).unwrap().serial(), db1.serial());
    assert_eq!(store.source().kind(), "spiffe");
    // One stream served it all, and it always carried the header.
    assert_eq!(server.requests(), (1, 0));
}

#[tokio::test]
async fn the_server_stand_in_refuses_a_request_without_the_security_header() {
    let ca = TestCa::new();
    let web1 = ca.ca.issue(&id("web"), Duration::from_secs(3600)).unwrap();
    let server = WorkloadApiServer::serve(Some(message(&ca.ca, &[&web1])));
    let socket = server.socket().to_owned();
    let channel = tonic::transport::Endpoint::from_static("http://localhost")
        .connect_with_connector(tower::service_fn(move |_| {
            let socket = socket.clone();
            async move {
                let stream = tokio::net::UnixStream::connect(socket).await?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(stream))
            }
        }))
        .await
        .unwrap();
    let status = SpiffeWorkloadApiClient::new(channel)
        .fetch_x509svid(X509svidRequest {})
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    assert_eq!(server.requests(), (0, 1));
    // The agent's client sends it and is served.
    let api = WorkloadApi::new(&server.endpoint()).unwrap();
    api.first_roots(TRUST_DOMAIN, WAIT).await.unwrap();
    assert_eq!(server.requests(), (1, 1));
}

#[tokio::test]
async fn each_failure_has_its_own_error() {
    let ca = TestCa::new();
    let web = id("web");
    let web1 = ca.ca.issue(&web, Duration::from_secs(3600)).unwrap();

    // Nothing at the socket path.
    let gone = WorkloadApi::new("unix:///nonexistent/dp-spiffe/agent.sock").unwrap();
    assert!(matches!(
        settled_error(&gone, &web).await,
        WorkloadApiError::SocketMissing { .. }
    ));

    // Attested, but no identity issued (SPIRE's PermissionDenied).
    let none = WorkloadApiServer::serve(None);
    let api = WorkloadApi::new(&none.endpoint()).unwrap();
    assert!(matches!(
        settled_error(&api, &web).await,
        WorkloadApiError::NoIdentity { .. }
    ));

    // SVIDs, none for the identity asked for; the one offered is named.
    let other = WorkloadApiServer::serve(Some(message(&ca.ca, &[&web1])));
    let api = WorkloadApi::new(&other.endpoint()).unwrap();
    api.first_roots(TRUST_DOMAIN, WAIT).await.unwrap();
    match api.fetch(&id("db"), None) {
        Err(WorkloadApiError::NoSvid { offered, .. }) => assert_eq!(offered, vec![web.to_uri()]),
        other => panic!("expected NoSvid, got {other:?}"),
    }
    // An SVID whose chain is not DER is refused; the stream is re-dialled.
    let mut bad = message(&ca.ca, &[&web1]);
    bad.svids[0].x509_svid = b"not a certificate".to_vec();
    let broken = WorkloadApiServer::serve(Some(bad));
    let api = WorkloadApi::new(&broken.endpoint()).unwrap();
    assert!(matches!(
        settled_error(&api, &web).await,
        WorkloadApiError::BadMessage { .. }
    ));
    // An SVID another identity's key does not match is refused.
    let db1 = ca.ca.issue(&id("db"), Duration::from_secs(3600)).unwrap();
    let mut swapped = message(&ca.ca, &[&web1]);
    swapped.svids[0].x509_svid_key = db1.key.secret_der().to_vec();
    let swapped = WorkloadApiServer::serve(Some(swapped));
    let api = WorkloadApi::new(&swapped.endpoint()).unwrap();
    api.first_roots(TRUST_DOMAIN, WAIT).await.unwrap();
    assert!(matches!(
        api.fetch(&web, None),
        Err(WorkloadApiError::BadSvid { .. })
    ));
}

#[test]
fn only_unix_socket_endpoints_are_accepted() {
    for good in [
        "unix:///run/spire/sockets/agent.sock",
        "unix:/run/spire/sockets/agent.sock",
        "/run/spire/sockets/agent.sock",
    ] {
        let api = WorkloadApi::new(good).unwrap();
        assert_eq!(
            api.path(),
            std::path::Path::new("/run/spire/sockets/agent.sock")
        );
    }
    for bad in [
        "tcp://127.0.0.1:8081",
        "unix://host/agent.sock",
        "unix:relative.sock",
        "agent.sock",
        "unix:///a.sock?x=1",
    ] {
        assert!(
            matches!(
                WorkloadApi::new(bad),
                Err(WorkloadApiError::Endpoint { .. })
            ),
            "{bad}"
        );
    }
}
