//! DNS capture end to end: queries from inside an enrolled pod, to a
//! server address nobody listens on, are steered by the kernel programs
//! (`connect`, `sendmsg`, `recvmsg`, `getpeername`) to the agent's resolver
//! in the pod, which answers mesh names from the config and forwards the
//! rest to an upstream server the test runs on loopback.
//!
//! Topology: one simulated node, an agent in standalone mode with
//! `--dns-capture` and `--dns-upstream` pointing at a stand-in server, a
//! pod `client` (DNS captured) and a pod `plain` (`dnsCapture: false`).

#[path = "dns/mesh_names.rs"]
mod mesh_names;

#[path = "dns/capture.rs"]
mod capture;

#[path = "dns/upstream.rs"]
mod upstream;

#[path = "dns/bounds.rs"]
mod bounds;

#[path = "dns/logging.rs"]
mod logging;

use std::{
    collections::HashMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
};

use dataplane_tests::{
    Agent, TempDir,
    dns::{BIG_RECORDS, DnsReply, FakeDns, getent, query},
    mesh::{NAMESPACE, config_of, endpoint_of, hbone_workload, service, write_config},
    observe::{field, parse_fields, scrape, sum, value},
    topology::{Node, Pod},
    traffic::{http, wait_until},
};

/// A server address the pods ask: no DNS server is there, so only a
/// captured query gets an answer.
const ASKED_V4: &str = "10.1.0.53:53";
const ASKED_V6: &str = "[fd00:1::53]:53";
const ECHO_VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const DUAL_VIP4: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 20);
const DUAL_VIP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x20);
/// What the upstream stand-in answers for names under `up.test`.
const UPSTREAM_TAG: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 1);

struct World {
    client: Pod,
    plain: Pod,
    agent: Agent,
    _dir: TempDir,
    // Last: the node's namespace goes after its pods'.
    node: Node,
}

/// A node with `client` (DNS captured by the agent's default) and `plain`
/// (opted out in its workload), services `echo` (IPv4) and `dual`
/// (dual-stack), and an agent forwarding to `upstream`.
fn world(tag: &str, upstream: SocketAddr) -> anyhow::Result<World> {
    world_with(tag, upstream, Vec::new())
}

/// [`world`] with `extra` services besides `echo` and `dual`.
fn world_with(
    tag: &str,
    upstream: SocketAddr,
    extra: Vec<dataplane_user::config::Service>,
) -> anyhow::Result<World> {
    let mut node = Node::new(tag, 1)?;
    let client = node.add_pod(tag)?;
    let plain = node.add_pod(tag)?;
    let dir = TempDir::new(tag)?;
    let mut plain_workload = hbone_workload(&plain, "plain", "node1");
    plain_workload.dns_capture = Some(false);
    // `plain` is an endpoint of every extra service (a headless one
    // answers with it).
    for extra in &extra {
        endpoint_of(&mut plain_workload, extra);
    }
    let mut config = config_of(vec![
        hbone_workload(&client, "client", "node1"),
        plain_workload,
    ]);
    let mut dual = service("dual", NAMESPACE, DUAL_VIP4.into(), &[(80, 9000)]);
    dual.vips.push(IpAddr::V6(DUAL_VIP6).into());
    config.services = vec![
        service("echo", NAMESPACE, ECHO_VIP.into(), &[(80, 9000)]),
        dual,
    ];
    config.services.extend(extra);
    let path = write_config(dir.path(), "mesh.yaml", &config)?;
    let upstream = upstream.to_string();
    let agent = Agent::standalone(
        tag,
        &node,
        "node1",
        &path,
        &dir.path().join("ca"),
        // DNS capture is the agent's default (Istio's since 1.29).
        &["--dns-upstream", &upstream],
    )?;
    Ok(World {
        client,
        plain,
        agent,
        _dir: dir,
        node,
    })
}

fn asked(addr: &str) -> SocketAddr {
    addr.parse().expect("a fixed address")
}

fn a(reply: &DnsReply) -> Vec<IpAddr> {
    reply.addrs()
}
