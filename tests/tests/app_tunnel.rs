//! Application tunnels, end to end: a workload whose `applicationTunnel`
//! is PROXY (a "sandwiched" waypoint, as istiod marks a waypoint's pods
//! when its Gateway says `ambient.istio.io/waypoint-inbound-binding:
//! PROXY/15088`) gets every HBONE tunnel on its tunnel port over loopback,
//! behind a PROXY protocol v2 header naming the client, the destination the
//! client asked for and the client's SPIFFE identity, as ztunnel sends it
//! (`src/proxy/inbound.rs` `serve_connect`, `find_inbound_upstream`;
//! `src/proxy.rs` `write_proxy_protocol`). Also when the tunnel's authority
//! names the workload behind the waypoint rather than the waypoint (the
//! sandwich: ztunnel's `validate_destination` lets it through for such
//! workloads). A workload without one gets the client's bytes alone.
//!
//! What the workload got is what its listener read: the header is parsed
//! strictly by the test library (`proxy_protocol`), and the client checks
//! that the bytes after it came back exactly.

use dataplane_tests::{
    Agent,
    app_tunnel::{deliveries_are_ztunnels, mesh},
    istiod::{AgentFiles, loopback_istiod, xds_flags},
    mesh::{TwoNodes, as_istiod_serves},
    traffic::{http, wait_until},
    ztunnel::{ZtunnelServedNode, ztunnel_binary},
};

/// The mesh from the local file (`applicationTunnel` on the workload).
#[test]
fn a_sandwiched_waypoint_gets_each_tunnel_on_its_port_behind_a_proxy_header() -> anyhow::Result<()>
{
    let mut w = TwoNodes::new("apt")?;
    let wp = w.n2.add_pod("apt")?;
    let (_a1, _a2) = w.agents("apt", &mesh(&w, &wp))?;
    deliveries_are_ztunnels(&w, &wp)
}

/// The mesh from the test istiod: the waypoint's `istio.workload.Workload`
/// carries `application_tunnel` as istiod sends it; the pods are enrolled
/// over the agents' control sockets.
#[test]
fn a_sandwiched_waypoint_istiod_describes_gets_the_same() -> anyhow::Result<()> {
    let mut w = TwoNodes::new("apx")?;
    let wp = w.n2.add_pod("apx")?;
    let served = as_istiod_serves(mesh(&w, &wp));
    let (rt, pki, istiod) = loopback_istiod()?;
    let AgentFiles { root, token, empty } =
        AgentFiles::write(w.dir.path(), &pki, "app-tunnel-token")?;
    rt.block_on(istiod.publish_mesh(&served, "1"))?;
    let agent = |n: u8| {
        let flags = xds_flags(istiod.addr, &root, &token, &format!("dataplane-node{n}"));
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        w.agent("apx", n, &empty, &flags)
    };
    let (a1, a2) = (agent(1)?, agent(2)?);
    for (agent, pod, name) in [
        (&a1, &w.client, "client"),
        (&a1, &w.local, "local"),
        (&a2, &w.remote, "remote"),
        (&a2, &wp, "waypoint"),
    ] {
        let mut spec = Agent::spec_for(pod, name);
        spec.service_account = name.to_owned();
        let response = agent.enroll(spec)?;
        anyhow::ensure!(response.ok, "enrolling {name}: {:?}", response.error);
    }
    for agent in [&a1, &a2] {
        wait_until("the agent to be ready on istiod's state", || {
            Ok(http(agent.readiness_addr()?, "GET", "/healthz/ready")?.0 == 200)
        })?;
    }
    deliveries_are_ztunnels(&w, &wp)
}

/// A stock ztunnel (`DATAPLANE_ZTUNNEL`, ignored without one) serving the
/// waypoint's node, our engine the client's: the waypoint gets from
/// ztunnel what the tests above expect from our engine, so those
/// expectations are ztunnel's.
#[test]
#[ignore = "needs a ztunnel binary in DATAPLANE_ZTUNNEL"]
fn a_stock_ztunnel_delivers_the_same_to_a_sandwiched_waypoint() -> anyhow::Result<()> {
    let binary = ztunnel_binary()?;
    let mut w = TwoNodes::new("apz")?;
    let wp = w.n2.add_pod("apz")?;
    let config = mesh(&w, &wp);
    let served = as_istiod_serves(config.clone());
    let (rt, pki, mut istiod) = loopback_istiod()?;
    rt.block_on(istiod.publish_mesh(&served, "1"))?;
    // Node1: our engine, its mesh and certificates from istiod.
    let AgentFiles { root, token, empty } =
        AgentFiles::write(w.dir.path(), &pki, "engine-node1-token")?;
    let mut flags = xds_flags(istiod.addr, &root, &token, "dataplane-node1");
    flags.extend(["--cert-source", "istio"].map(str::to_owned));
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let a1 = w.agent("apz", 1, &empty, &flags)?;
    for (pod, name) in [(&w.client, "client"), (&w.local, "local")] {
        let mut spec = Agent::spec_for(pod, name);
        spec.service_account = name.to_owned();
        let response = a1.enroll(spec)?;
        anyhow::ensure!(response.ok, "enrolling {name}: {:?}", response.error);
    }
    // Node2: ztunnel serves the waypoint and `remote`.
    let file = w.write(&config)?;
    let istiod2 = rt.block_on(istiod.listen_in(w.n2.netns()))?;
    let node2 = ZtunnelServedNode::start(&w, "apz", 2, &file, &binary, istiod2, &pki.root_pem)?;
    deliveries_are_ztunnels(&w, &wp)
        .map_err(|e| anyhow::anyhow!("{e:#}\nztunnel log:\n{}", node2.ztunnel.log_tail()))
}
