//! An agent started as Istio's ztunnel chart starts ztunnel: istiod's
//! address (`XDS_ADDRESS`, with its `https://`), the pod, its node and
//! cluster (`POD_NAME`, `POD_NAMESPACE`, `INSTANCE_IP`, `NODE_NAME`,
//! `ISTIO_META_CLUSTER_ID`) and the DNS proxy setting
//! (`ISTIO_META_DNS_CAPTURE`) come from ztunnel's variable names alone, and
//! what the agent sends the test istiod is what ztunnel would: its node id
//! and the metadata keys ztunnel's node carries (ztunnel
//! `src/xds/client.rs` `AdsClient::node`: `NAME`, `NAMESPACE`,
//! `INSTANCE_IPS`, `NODE_NAME`, then the proxy metadata, where `CLUSTER_ID`,
//! `DNS_CAPTURE` and `DNS_PROXY_ADDR` are, `src/config.rs`), with the
//! agent's own values.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context as _, Result};
use dataplane_tests::{
    Agent, TempDir,
    istiod::{AgentFiles, SERVER_NAME, loopback_istiod},
    topology::Node,
};
use prost_types::value::Kind;

#[test]
fn an_agent_set_up_by_ztunnels_variables_tells_istiod_what_ztunnel_would() -> Result<()> {
    let node = Node::new("zenv", 1)?;
    let dir = TempDir::new("zenv")?;
    let (rt, pki, mut istiod) = loopback_istiod()?;
    let AgentFiles { root, token, empty } = AgentFiles::write(dir.path(), &pki, "zenv-token")?;
    let xds_address = format!("https://{}", istiod.addr);
    let (root, token, empty) = (
        root.display().to_string(),
        token.display().to_string(),
        empty.display().to_string(),
    );
    // No istiod address, pod, node or cluster flag: the variables alone.
    let _agent = Agent::start_with_env(
        "zenv",
        &node,
        &["--xds", "--config", &empty],
        &[
            ("XDS_ADDRESS", &xds_address),
            ("ALT_XDS_HOSTNAME", SERVER_NAME),
            ("XDS_ROOT_CA", &root),
            ("AUTH_TOKEN", &token),
            ("POD_NAME", "ztunnel-zenv1"),
            ("POD_NAMESPACE", "istio-system"),
            ("INSTANCE_IP", "127.0.0.1"),
            ("NODE_NAME", "zenv-node-a"),
            ("ISTIO_META_CLUSTER_ID", "zenv-cluster"),
            ("ISTIO_META_DNS_CAPTURE", "false"),
        ],
    )?;
    let seen = rt.block_on(istiod.next_request(Duration::from_secs(60)))?;
    let node = seen.request.node.context("no node in the first request")?;
    assert_eq!(
        node.id,
        "ztunnel~127.0.0.1~ztunnel-zenv1.istio-system~istio-system.svc.cluster.local"
    );
    assert_eq!(seen.authorization.as_deref(), Some("Bearer zenv-token"));
    let metadata: BTreeMap<String, String> = node
        .metadata
        .context("no node metadata")?
        .fields
        .into_iter()
        .filter_map(|(key, value)| match value.kind {
            Some(Kind::StringValue(s)) => Some((key, s)),
            _ => None,
        })
        .collect();
    for (key, want) in [
        ("NAME", "ztunnel-zenv1"),
        ("NAMESPACE", "istio-system"),
        ("INSTANCE_IPS", "127.0.0.1"),
        ("NODE_NAME", "zenv-node-a"),
        ("CLUSTER_ID", "zenv-cluster"),
        // Capture off, as the variable asked (ztunnel: `true` in any case
        // is on); the resolver where the agent serves it, in ztunnel's
        // form (`localhost:<port>`: loopback, IPv6 too when enabled).
        ("DNS_CAPTURE", "false"),
        ("DNS_PROXY_ADDR", "localhost:15053"),
    ] {
        assert_eq!(
            metadata.get(key).map(String::as_str),
            Some(want),
            "node metadata {key}: {metadata:?}"
        );
    }
    rt.block_on(istiod.stop());
    Ok(())
}

/// ztunnel's inline forms (`src/config.rs` `construct_config`): an
/// `XDS_ROOT_CA` naming no file is the PEM itself (`RootCert::Static`), an
/// `AUTH_TOKEN` naming no file the token itself (`AuthSource::StaticToken`,
/// sent as `Bearer <value>`). The agent verifies istiod with that root and
/// sends that token.
#[test]
fn an_agent_takes_ztunnels_inline_root_and_token() -> Result<()> {
    let node = Node::new("zinl", 1)?;
    let dir = TempDir::new("zinl")?;
    let (rt, pki, mut istiod) = loopback_istiod()?;
    let AgentFiles { root, empty, .. } = AgentFiles::write(dir.path(), &pki, "unused")?;
    let root_pem = std::fs::read_to_string(&root).context("reading the test root")?;
    let xds_address = format!("https://{}", istiod.addr);
    let empty = empty.display().to_string();
    let _agent = Agent::start_with_env(
        "zinl",
        &node,
        &[
            "--xds",
            "--config",
            &empty,
            "--pod-name",
            "ztunnel-zinl1",
            "--instance-ip",
            "127.0.0.1",
            "--node",
            "zinl-node",
        ],
        &[
            ("XDS_ADDRESS", &xds_address),
            ("ALT_XDS_HOSTNAME", SERVER_NAME),
            ("XDS_ROOT_CA", &root_pem),
            ("AUTH_TOKEN", "zinl-literal-token"),
            // A compound duration, as ztunnel's `duration_str` reads it.
            ("POOL_UNUSED_RELEASE_TIMEOUT", "1m30s"),
        ],
    )?;
    let seen = rt.block_on(istiod.next_request(Duration::from_secs(60)))?;
    assert_eq!(
        seen.authorization.as_deref(),
        Some("Bearer zinl-literal-token")
    );
    rt.block_on(istiod.stop());
    Ok(())
}
