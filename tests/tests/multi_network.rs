//! Multi-network (ztunnel `NETWORK`, `src/state.rs` `load_balance`): a
//! service's endpoint on another network is not chosen when it has no
//! network gateway, so every connection goes to the one on the client's
//! network; the node's network shows in the config dump.

use std::{net::SocketAddr, sync::Arc};

use dataplane_tests::{
    mesh::{ECHO_VIP, TwoNodes},
    traffic::{echo, echo_server, http},
};

#[test]
fn an_endpoint_on_another_network_without_a_gateway_is_never_chosen() -> anyhow::Result<()> {
    let w = TwoNodes::new("mnet")?;
    // node1 (client, local) is network `east`; `remote` on node2 is on
    // `west` and has an address but no gateway: ztunnel's
    // `build_request_wrong_network` case.
    let mut config = w.echo_config();
    for workload in &mut config.workloads {
        let workload = Arc::make_mut(workload);
        workload.network = if workload.name == "remote" {
            "west".into()
        } else {
            "east".into()
        };
    }
    let path = w.write(&config)?;
    let a1 = w.agent("mnet", 1, &path, &["--network", "east"])?;
    let _a2 = w.agent("mnet", 2, &path, &["--network", "west"])?;
    let local = echo_server(&w.local, 9000)?;
    let remote = echo_server(&w.remote, 9000)?;
    // With the network ignored, each connection would reach `remote` with
    // chance 1/2 (round robin in the proxy, a uniform draw in the kernel's
    // fast path): 32 connections all at `local` is then 1 in 4 * 10^9.
    const CONNECTIONS: u64 = 32;
    let vip = SocketAddr::new(ECHO_VIP, 80);
    for seed in 0..CONNECTIONS {
        echo(&w.client, vip, 100, seed)?;
    }
    assert_eq!(
        (local.drain().len() as u64, remote.drain().len()),
        (CONNECTIONS, 0),
        "(local, remote) connections"
    );

    // The node's network where ztunnel's dump has it (its `config`; ours
    // is the agent's).
    let (status, text) = http(a1.admin_addr()?, "GET", "/config_dump")?;
    anyhow::ensure!(status == 200, "{text}");
    let dump: serde_json::Value = serde_json::from_str(&text)?;
    assert_eq!(
        dump["agentConfig"]["network"], "east",
        "{}",
        dump["agentConfig"]
    );
    Ok(())
}
