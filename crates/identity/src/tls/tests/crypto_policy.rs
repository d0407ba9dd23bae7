//! The TLS policy knobs: post-quantum-only key exchange and the TLS 1.2
//! opt-in, alone and together.

use super::*;

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
