//! Who a handshake lets in and who it refuses, and why: identities, trust
//! domains, CAs, protocol versions, client certificates and ALPN.

use super::*;

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
