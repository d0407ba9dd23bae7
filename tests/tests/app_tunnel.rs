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
//! workloads, and for a waypoint without a tunnel that the authority's
//! workload names as its waypoint). A workload without one gets the
//! client's bytes alone. With `--localhost-app-tunnel false` the tunnel
//! goes to the pod's address; a waypoint service without the HBONE port
//! offers only its instances with a tunnel (ztunnel `src/state.rs`
//! `load_balance`).
//!
//! What the workload got is what its listener read: the header is parsed
//! strictly by the test library (`proxy_protocol`), and the client checks
//! that the bytes after it came back exactly.

use dataplane_user::config::LocalConfig;

use dataplane_tests::{
    Agent,
    app_tunnel::{
        deliveries_are_ztunnels, mesh, mesh_with_waypoint_service, mesh_without_tunnel,
        only_tunnel_instances_serve_a_portless_waypoint, pod_address_deliveries,
        waypoint_without_tunnel_gets_what_it_fronts,
    },
    istiod::{AgentFiles, TestIstiod, loopback_istiod, xds_flags},
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

/// `--localhost-app-tunnel false` on the waypoint's node (ztunnel's
/// `LOCALHOST_APP_TUNNEL=false`): the tunnels go to the waypoint's pod
/// address, where alone its tunnel listener is.
#[test]
fn without_localhost_app_tunnels_a_sandwiched_waypoint_gets_them_on_its_pod_address()
-> anyhow::Result<()> {
    let mut w = TwoNodes::new("apl")?;
    let wp = w.n2.add_pod("apl")?;
    let path = w.write(&mesh(&w, &wp))?;
    let _a1 = w.agent("apl", 1, &path, &[])?;
    let _a2 = w.agent("apl", 2, &path, &["--localhost-app-tunnel", "false"])?;
    pod_address_deliveries(&w, &wp)
}

/// A waypoint without an application tunnel (ztunnel's sandwich case
/// without one): a tunnel whose authority is the workload behind it is
/// accepted, as that workload names it as its waypoint, and delivered to
/// the waypoint at the port asked for.
#[test]
fn a_waypoint_without_a_tunnel_gets_the_tunnels_to_what_it_fronts() -> anyhow::Result<()> {
    let mut w = TwoNodes::new("apw")?;
    let wp = w.n2.add_pod("apw")?;
    let (_a1, _a2) = w.agents("apw", &mesh_without_tunnel(&w, &wp))?;
    waypoint_without_tunnel_gets_what_it_fronts(&w, &wp)
}

/// A waypoint service without the HBONE port among its ports: of its two
/// instances only the one with an application tunnel is chosen, as
/// ztunnel's `load_balance` chooses for a waypoint.
#[test]
fn a_waypoint_service_without_the_hbone_port_sends_only_to_its_tunnel_instances()
-> anyhow::Result<()> {
    let mut w = TwoNodes::new("aps")?;
    let wp = w.n2.add_pod("aps")?;
    let wp2 = w.n2.add_pod("aps")?;
    let (_a1, _a2) = w.agents("aps", &mesh_with_waypoint_service(&w, &wp, &wp2))?;
    only_tunnel_instances_serve_a_portless_waypoint(&w, &wp, &wp2)
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
    let world = ZtunnelOnNode2::start(&w, "apz", &mesh(&w, &wp), &binary)?;
    deliveries_are_ztunnels(&w, &wp)
        .map_err(|e| anyhow::anyhow!("{e:#}\nztunnel log:\n{}", world.node2.ztunnel.log_tail()))
}

/// Node1 served by our engine (its mesh and certificates from the test
/// istiod), node2 by a stock ztunnel; fields in the order they stop.
struct ZtunnelOnNode2 {
    node2: ZtunnelServedNode,
    _a1: Agent,
    _istiod: TestIstiod,
    _rt: tokio::runtime::Runtime,
}

impl ZtunnelOnNode2 {
    fn start(
        w: &TwoNodes,
        tag: &str,
        config: &LocalConfig,
        binary: &std::path::Path,
    ) -> anyhow::Result<Self> {
        Self::start_with_env(w, tag, config, binary, &[])
    }

    /// [`Self::start`] with `extra` in ztunnel's environment.
    fn start_with_env(
        w: &TwoNodes,
        tag: &str,
        config: &LocalConfig,
        binary: &std::path::Path,
        extra: &[(&str, &str)],
    ) -> anyhow::Result<Self> {
        let served = as_istiod_serves(config.clone());
        let (rt, pki, mut istiod) = loopback_istiod()?;
        rt.block_on(istiod.publish_mesh(&served, "1"))?;
        // Node1: our engine, its mesh and certificates from istiod.
        let AgentFiles { root, token, empty } =
            AgentFiles::write(w.dir.path(), &pki, "engine-node1-token")?;
        let mut flags = xds_flags(istiod.addr, &root, &token, "dataplane-node1");
        flags.extend(["--cert-source", "istio"].map(str::to_owned));
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        let a1 = w.agent(tag, 1, &empty, &flags)?;
        for (pod, name) in [(&w.client, "client"), (&w.local, "local")] {
            let mut spec = Agent::spec_for(pod, name);
            spec.service_account = name.to_owned();
            let response = a1.enroll(spec)?;
            anyhow::ensure!(response.ok, "enrolling {name}: {:?}", response.error);
        }
        // Node2: ztunnel serves the waypoint and `remote`.
        let file = w.write(config)?;
        let istiod2 = rt.block_on(istiod.listen_in(w.n2.netns()))?;
        let node2 = ZtunnelServedNode::start_with_env(
            w,
            tag,
            2,
            &file,
            binary,
            istiod2,
            &pki.root_pem,
            extra,
        )?;
        Ok(Self {
            node2,
            _a1: a1,
            _istiod: istiod,
            _rt: rt,
        })
    }
}

/// A stock ztunnel serving a waypoint without an application tunnel
/// accepts what the test above expects of our engine.
#[test]
#[ignore = "needs a ztunnel binary in DATAPLANE_ZTUNNEL"]
fn a_stock_ztunnel_delivers_the_same_to_a_waypoint_without_a_tunnel() -> anyhow::Result<()> {
    let binary = ztunnel_binary()?;
    let mut w = TwoNodes::new("apv")?;
    let wp = w.n2.add_pod("apv")?;
    let world = ZtunnelOnNode2::start(&w, "apv", &mesh_without_tunnel(&w, &wp), &binary)?;
    waypoint_without_tunnel_gets_what_it_fronts(&w, &wp)
        .map_err(|e| anyhow::anyhow!("{e:#}\nztunnel log:\n{}", world.node2.ztunnel.log_tail()))
}

/// A stock ztunnel with `LOCALHOST_APP_TUNNEL=false` delivers to the
/// waypoint's pod address what the test of `--localhost-app-tunnel false`
/// expects of our engine.
#[test]
#[ignore = "needs a ztunnel binary in DATAPLANE_ZTUNNEL"]
fn a_stock_ztunnel_without_localhost_app_tunnels_delivers_the_same() -> anyhow::Result<()> {
    let binary = ztunnel_binary()?;
    let mut w = TwoNodes::new("apk")?;
    let wp = w.n2.add_pod("apk")?;
    let world = ZtunnelOnNode2::start_with_env(
        &w,
        "apk",
        &mesh(&w, &wp),
        &binary,
        &[("LOCALHOST_APP_TUNNEL", "false")],
    )?;
    pod_address_deliveries(&w, &wp)
        .map_err(|e| anyhow::anyhow!("{e:#}\nztunnel log:\n{}", world.node2.ztunnel.log_tail()))
}
