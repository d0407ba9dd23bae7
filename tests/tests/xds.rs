//! The agent's xDS client against a test control plane serving Istio's
//! real protobuf types over gRPC and TLS on loopback: subscription with the
//! node proxy's node id and token, ACK by nonce, an invalid resource
//! NACKed while the rest applies, removals, and an istiod restart resumed
//! with the versions held.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, Result, bail, ensure};
use dataplane_tests::TempDir;
use dataplane_tests::istiod::{SERVER_NAME, SeenRequest, TestIstiod, TestPki};
use dataplane_user::istio_api::{
    ADDRESS_TYPE, AUTHORIZATION_TYPE,
    discovery::{DeltaDiscoveryResponse, Resource},
    workload::{Address, Workload, address},
};
use dataplane_user::istiod::IstiodEndpoint;
use dataplane_user::xds::{NodeIdentity, XdsClient, XdsConfig, XdsSnapshot};
use prost::Message;
use tokio::sync::watch;

const WAIT: Duration = Duration::from_secs(20);

fn workload(uid: &str, ip: [u8; 4]) -> Resource {
    let body = Address {
        r#type: Some(address::Type::Workload(Workload {
            uid: uid.into(),
            name: format!("pod-{uid}"),
            namespace: "shop".into(),
            addresses: vec![ip.to_vec()],
            service_account: "web".into(),
            node: "node-a".into(),
            ..Default::default()
        })),
    };
    Resource {
        name: uid.into(),
        version: format!("{uid}-v1"),
        resource: Some(prost_types::Any {
            type_url: ADDRESS_TYPE.into(),
            value: body.encode_to_vec(),
        }),
        ..Default::default()
    }
}

fn response(
    type_url: &str,
    nonce: &str,
    resources: Vec<Resource>,
    removed: &[&str],
) -> DeltaDiscoveryResponse {
    DeltaDiscoveryResponse {
        type_url: type_url.into(),
        nonce: nonce.into(),
        resources,
        removed_resources: removed.iter().map(|s| (*s).to_owned()).collect(),
        ..Default::default()
    }
}

struct Fixture {
    _dir: TempDir,
    config: XdsConfig,
}

fn fixture(pki: &TestPki, addr: SocketAddr) -> Result<Fixture> {
    let dir = TempDir::new("xds")?;
    let token = dir.path().join("istio-token");
    std::fs::write(&token, "test-token-abc\n")?;
    let config = XdsConfig {
        istiod: IstiodEndpoint {
            address: format!("{}:{}", addr.ip(), addr.port()),
            server_name: SERVER_NAME.into(),
            roots: Arc::new(pki.root_store()?),
            token_file: Some(token),
            headers: vec![("x-tenant".parse()?, "blue".parse()?)],
        },
        node: NodeIdentity {
            ip: IpAddr::from([10, 0, 0, 7]),
            pod: "dataplane-abc".into(),
            namespace: "istio-system".into(),
            node_name: "node-a".into(),
            cluster_id: Some("Kubernetes".into()),
            extra: BTreeMap::new(),
        },
    };
    Ok(Fixture { _dir: dir, config })
}

/// Reads requests until the initial subscription of both types arrived.
async fn initial_requests(istiod: &mut TestIstiod) -> Result<Vec<SeenRequest>> {
    let mut seen = Vec::new();
    while seen.len() < 2 {
        let request = istiod.next_request(WAIT).await?;
        ensure!(
            request.request.response_nonce.is_empty(),
            "expected subscriptions first: {request:?}"
        );
        seen.push(request);
    }
    Ok(seen)
}

/// The next request that answers `nonce`.
async fn answer_to(istiod: &mut TestIstiod, nonce: &str) -> Result<SeenRequest> {
    loop {
        let request = istiod.next_request(WAIT).await?;
        if request.request.response_nonce == nonce {
            return Ok(request);
        }
    }
}

async fn wait_for(
    snapshots: &mut watch::Receiver<XdsSnapshot>,
    what: &str,
    done: impl Fn(&XdsSnapshot) -> bool,
) -> Result<()> {
    let held = tokio::time::timeout(WAIT, snapshots.wait_for(|s| done(s)))
        .await
        .is_ok_and(|waited| waited.is_ok());
    if !held {
        bail!(
            "the client never held {what}: {:?}",
            snapshots.borrow().resources
        );
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscribes_acks_nacks_and_resumes_after_an_istiod_restart() -> Result<()> {
    let pki = TestPki::generate()?;
    let mut istiod = TestIstiod::start(&pki, "127.0.0.1:0".parse()?).await?;
    let addr = istiod.addr;
    let fixture = fixture(&pki, addr)?;
    let (client, mut snapshots, status) = XdsClient::new(fixture.config.clone());
    let client = tokio::spawn(client.run());

    // Subscription: both types, node proxy node id and metadata, token.
    let initial = initial_requests(&mut istiod).await?;
    let types: Vec<&str> = initial
        .iter()
        .map(|r| r.request.type_url.as_str())
        .collect();
    assert_eq!(types, [ADDRESS_TYPE, AUTHORIZATION_TYPE]);
    let node = initial[0]
        .request
        .node
        .clone()
        .context("no node in the first request")?;
    assert_eq!(
        node.id,
        "ztunnel~10.0.0.7~dataplane-abc.istio-system~istio-system.svc.cluster.local"
    );
    assert!(
        node.metadata
            .is_some_and(|m| m.fields.contains_key("NODE_NAME"))
    );
    assert_eq!(
        initial[0].authorization.as_deref(),
        Some("Bearer test-token-abc")
    );
    // The extra headers (ztunnel's XDS_HEADER_*) reach istiod.
    assert_eq!(
        initial[0].metadata,
        [("x-tenant".to_owned(), "blue".to_owned())]
    );
    assert!(initial[0].request.initial_resource_versions.is_empty());

    // A push is applied and ACKed by its nonce; not synced until both
    // types had a response.
    istiod
        .push(response(
            ADDRESS_TYPE,
            "a1",
            vec![
                workload("uid-1", [10, 1, 0, 5]),
                workload("uid-2", [10, 1, 0, 6]),
            ],
            &[],
        ))
        .await?;
    let ack = answer_to(&mut istiod, "a1").await?;
    assert!(ack.request.error_detail.is_none(), "{ack:?}");
    wait_for(&mut snapshots, "two workloads", |s| {
        s.resources.addresses.len() == 2
    })
    .await?;
    assert!(!snapshots.borrow().synced);
    istiod
        .push(response(AUTHORIZATION_TYPE, "p1", vec![], &[]))
        .await?;
    answer_to(&mut istiod, "p1").await?;
    wait_for(&mut snapshots, "a synced state", |s| s.synced).await?;
    // The names the responses carried, which tell the consumer how much
    // at most changed between two snapshots.
    assert_eq!(snapshots.borrow().names, 2);

    // An invalid resource is NACKed with a reason; the rest applies and
    // the invalid one's previous version stays.
    let mut broken = workload("uid-1", [10, 1, 0, 9]);
    broken.version = "uid-1-v2".into();
    if let Some(any) = &mut broken.resource {
        any.value = vec![0xff; 5];
    }
    istiod
        .push(response(
            ADDRESS_TYPE,
            "a2",
            vec![broken, workload("uid-3", [10, 1, 0, 7])],
            &["uid-2"],
        ))
        .await?;
    let nack = answer_to(&mut istiod, "a2").await?;
    let detail = nack
        .request
        .error_detail
        .context("the invalid resource was ACKed")?;
    assert!(detail.message.contains("uid-1"), "{detail:?}");
    wait_for(&mut snapshots, "uid-3 and not uid-2", |s| {
        s.resources.addresses.contains_key("uid-3") && !s.resources.addresses.contains_key("uid-2")
    })
    .await?;
    assert_eq!(
        &*snapshots.borrow().resources.addresses["uid-1"].version,
        "uid-1-v1"
    );
    // Two resources and a removal, the rejected one counted too.
    assert_eq!(snapshots.borrow().names, 5);
    {
        let status = status
            .lock()
            .map_err(|_| anyhow::anyhow!("status poisoned"))?;
        assert!(status.types[0].last_nack.is_some() && status.connected_since.is_some());
    }

    // istiod restarts on the same address: the client reconnects and
    // resumes with what it holds, keeping it meanwhile.
    istiod.stop().await;
    let mut istiod = TestIstiod::start(&pki, addr).await?;
    let resumed = initial_requests(&mut istiod).await?;
    let versions = &resumed[0].request.initial_resource_versions;
    assert_eq!(
        versions.get("uid-1").map(String::as_str),
        Some("uid-1-v1"),
        "{versions:?}"
    );
    assert_eq!(
        versions.get("uid-3").map(String::as_str),
        Some("uid-3-v1"),
        "{versions:?}"
    );
    assert!(!versions.contains_key("uid-2"), "{versions:?}");
    assert_eq!(resumed[0].stream, 1, "a new server counts streams from 1");
    assert_eq!(
        snapshots.borrow().resources.addresses.len(),
        2,
        "state kept while disconnected"
    );
    // The client counts the stream once istiod has answered its headers,
    // which may be after istiod read the requests.
    let deadline = tokio::time::Instant::now() + WAIT;
    while status
        .lock()
        .map_err(|_| anyhow::anyhow!("poisoned"))?
        .streams
        < 2
    {
        ensure!(
            tokio::time::Instant::now() < deadline,
            "the reconnect was not counted"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    drop(snapshots);
    client.abort();
    istiod.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refuses_an_istiod_with_a_certificate_from_another_root() -> Result<()> {
    let pki = TestPki::generate()?;
    let stranger = TestPki::generate()?;
    let istiod = TestIstiod::start(&stranger, "127.0.0.1:0".parse()?).await?;
    let fixture = fixture(&pki, istiod.addr)?;
    let (client, snapshots, status) = XdsClient::new(fixture.config.clone());
    let client = tokio::spawn(client.run());
    let deadline = tokio::time::Instant::now() + WAIT;
    let error = loop {
        let error = status
            .lock()
            .map_err(|_| anyhow::anyhow!("poisoned"))?
            .last_error
            .clone();
        if let Some(error) = error {
            break error;
        }
        ensure!(
            tokio::time::Instant::now() < deadline,
            "no connection error reported"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(
        error.contains("certificate") || error.contains("connect"),
        "{error}"
    );
    assert!(
        status
            .lock()
            .map_err(|_| anyhow::anyhow!("poisoned"))?
            .connected_since
            .is_none()
    );
    drop(snapshots);
    client.abort();
    istiod.stop().await;
    Ok(())
}
