//! A stock ztunnel as the client's node proxy, asked to carry one
//! connection: which HBONE `:authority` it asks of the peer it chooses.
//! Tests hold our engine's choice against it.

use std::{net::SocketAddr, sync::Arc};

use anyhow::Result;
use dataplane_user::config::LocalConfig;

use crate::{
    gateway::GatewayStandIn,
    istiod::loopback_istiod,
    mesh::{NAMESPACE, TwoNodes, as_istiod_serves},
    traffic::try_stream,
    ztunnel::{ZtunnelServedNode, ztunnel_binary},
};

/// The `:authority`s a stock ztunnel (`DATAPLANE_ZTUNNEL`), the client's
/// node proxy under `config` (its mesh and certificates from the test
/// istiod), asks of the `plain` pod, a workload of service account
/// `service_account` there, on `port`, for one connection from `client`
/// to `dst`. A stand-in on `plain` records each CONNECT and carries it no
/// further (nothing serves the destination).
pub fn ztunnel_asks(
    w: &TwoNodes,
    tag: &str,
    config: LocalConfig,
    (service_account, port): (&str, u16),
    dst: SocketAddr,
) -> Result<Vec<String>> {
    let binary = ztunnel_binary()?;
    let path = w.write(&config)?;
    let (rt, pki, mut istiod) = loopback_istiod()?;
    rt.block_on(istiod.publish_mesh(&as_istiod_serves(config), "1"))?;
    let istiod1 = rt.block_on(istiod.listen_in(w.n1.netns()))?;
    let node1 = ZtunnelServedNode::start(w, tag, 1, &path, &binary, istiod1, &pki.root_pem)?;

    dataplane_user::tls::install_provider();
    let identity = format!("spiffe://cluster.local/ns/{NAMESPACE}/sa/{service_account}");
    let (chain, key) = pki.issue(&identity)?;
    let mut server = rustls::ServerConfig::builder_with_provider(dataplane_user::tls::provider())
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(chain, key)?;
    server.alpn_protocols = vec![b"h2".to_vec()];
    let standin =
        GatewayStandIn::start_with(&w.plain, port, Arc::new(server), identity.parse()?, &[])?;
    // The stand-in answers 503 (no route on): the client sees its
    // connection end, after the CONNECT was recorded (20 s: a hang guard).
    let ended = try_stream(&w.client, &["hold", &dst.to_string(), "20"])?;
    let asked: Vec<String> = standin
        .requests()
        .into_iter()
        .map(|r| r.authority)
        .collect();
    if asked.is_empty() {
        anyhow::bail!(
            "ztunnel asked the plain pod nothing on port {port} (client: {})\nztunnel log:\n{}",
            ended.stdout,
            node1.ztunnel.log_tail()
        );
    }
    drop(rt);
    Ok(asked)
}
