//! The agent's client of Istio's CA (`IstioCertificateService/
//! CreateCertificate`) against the test control plane over gRPC and TLS:
//! the request a node proxy makes for its pods (CSR, validity,
//! `ImpersonatedIdentity`, bearer token), and every bad answer refused.

use std::sync::{Arc, PoisonError};
use std::time::Duration;

use anyhow::{Result, bail, ensure};
use dataplane_tests::TempDir;
use dataplane_tests::istiod::{CaMode, SERVER_NAME, TestIstiod, TestPki};
use dataplane_user::identity::{Identity, IstioCa, IstioCaError};
use dataplane_user::istiod::IstiodEndpoint;

fn client(pki: &TestPki, istiod: &TestIstiod, dir: &TempDir) -> Result<IstioCa> {
    let token = dir.path().join("istio-token");
    std::fs::write(&token, "ca-token-123\n")?;
    Ok(IstioCa {
        istiod: IstiodEndpoint {
            address: istiod.addr.to_string(),
            server_name: SERVER_NAME.into(),
            roots: Arc::new(pki.root_store()?),
            token_file: Some(token),
            headers: vec![("x-tenant".parse()?, "blue".parse()?)],
        },
        impersonate: true,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn asks_for_a_pods_certificate_as_a_node_proxy_does() -> Result<()> {
    let pki = TestPki::generate()?;
    let istiod = TestIstiod::start(&pki, "127.0.0.1:0".parse()?).await?;
    let dir = TempDir::new("istio-ca")?;
    let ca = client(&pki, &istiod, &dir)?;
    let web = Identity::new("cluster.local", "shop", "web")?;

    let issued = ca.issue(&web, Duration::from_secs(3600)).await?;
    assert_eq!(issued.cert.identity, web);
    assert_eq!(
        issued.roots.as_slice(),
        std::slice::from_ref(&pki.root),
        "the roots are the CA's"
    );
    assert_eq!(
        issued.cert.chain.len(),
        1,
        "leaf only: the root travels as a root"
    );
    let lifetime = issued
        .cert
        .not_after
        .duration_since(issued.cert.not_before)?;
    ensure!(
        lifetime > Duration::from_secs(3500) && lifetime < Duration::from_secs(3700),
        "lifetime {lifetime:?}"
    );
    // The key and chain load into rustls as the agent will present them.
    dataplane_user::tls::provider()
        .key_provider
        .load_private_key(issued.cert.key.clone_key())?;

    let seen = istiod
        .csrs
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .clone();
    assert_eq!(seen.len(), 1);
    assert_eq!(
        seen[0].authorization.as_deref(),
        Some("Bearer ca-token-123")
    );
    // The extra headers (ztunnel's CA_HEADER_*) reach the CA.
    assert_eq!(
        seen[0].metadata,
        [("x-tenant".to_owned(), "blue".to_owned())]
    );
    assert_eq!(
        seen[0].impersonated.as_deref(),
        Some("spiffe://cluster.local/ns/shop/sa/web")
    );
    assert_eq!(seen[0].validity_seconds, 3600);
    istiod.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refuses_garbage_a_chain_for_someone_else_and_a_ca_that_is_down() -> Result<()> {
    let pki = TestPki::generate()?;
    let istiod = TestIstiod::start(&pki, "127.0.0.1:0".parse()?).await?;
    let dir = TempDir::new("istio-ca")?;
    let ca = client(&pki, &istiod, &dir)?;
    let web = Identity::new("cluster.local", "shop", "web")?;
    let set_mode = |mode| {
        *istiod
            .ca_mode
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = mode
    };

    set_mode(CaMode::Garbage);
    match ca.issue(&web, Duration::from_secs(3600)).await {
        Err(IstioCaError::BadChain { reason, .. }) => {
            assert!(reason.contains("element 0"), "{reason}");
        }
        other => bail!("garbage accepted: {other:?}"),
    }

    set_mode(CaMode::WrongIdentity(
        "spiffe://cluster.local/ns/kube-system/sa/admin".into(),
    ));
    match ca.issue(&web, Duration::from_secs(3600)).await {
        Err(err @ IstioCaError::BadChain { .. }) => {
            let text = err.to_string();
            assert!(
                text.contains("kube-system/sa/admin") && text.contains("shop/sa/web"),
                "{text}"
            );
        }
        other => bail!("a chain for another identity accepted: {other:?}"),
    }

    set_mode(CaMode::Unavailable);
    match ca.issue(&web, Duration::from_secs(3600)).await {
        Err(err @ IstioCaError::Rpc { .. }) => {
            assert!(err.to_string().contains("the test CA is down"), "{err}");
        }
        other => bail!("a CA that is down gave {other:?}"),
    }

    // A CA whose serving certificate is from another root is not talked to.
    let stranger = TestPki::generate()?;
    let impostor = TestIstiod::start(&stranger, "127.0.0.1:0".parse()?).await?;
    let to_impostor = IstioCa {
        istiod: IstiodEndpoint {
            address: impostor.addr.to_string(),
            ..ca.istiod.clone()
        },
        impersonate: true,
    };
    match to_impostor.issue(&web, Duration::from_secs(3600)).await {
        Err(IstioCaError::Istiod(_)) => {}
        other => bail!("an impostor CA was used: {other:?}"),
    }
    assert!(
        impostor
            .csrs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_empty()
    );
    impostor.stop().await;
    istiod.stop().await;
    Ok(())
}
