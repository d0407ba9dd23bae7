//! The test topology itself carries traffic: same node and across two nodes,
//! IPv4 and IPv6, with no mesh involved.

use std::{
    net::{SocketAddr, TcpListener},
    process::Command,
    time::Duration,
};

use dataplane_tests::{
    Responder, probe_binary, spawn_in,
    topology::{Node, link_nodes},
};

fn probe(pod: &dataplane_tests::topology::Pod, dst: SocketAddr) -> anyhow::Result<String> {
    let mut cmd = Command::new(probe_binary()?);
    cmd.args(["connect", &dst.to_string(), "ping"]);
    let out = spawn_in(cmd, Some(pod.netns.path()), Some(pod.cgroup.path()))?
        .wait(Duration::from_secs(20))?;
    anyhow::ensure!(out.code == Some(0), "probe failed: {}", out.stderr);
    Ok(out.stdout)
}

#[test]
fn pods_reach_each_other_on_one_node_and_across_nodes() -> anyhow::Result<()> {
    let mut n1 = Node::new("topo", 1)?;
    let mut n2 = Node::new("topo", 2)?;
    link_nodes(&n1, &n2)?;
    let client = n1.add_pod("topo")?;
    let local = n1.add_pod("topo")?;
    let remote = n2.add_pod("topo")?;

    for server in [&local, &remote] {
        let any = server.netns.run(|| TcpListener::bind("[::]:8080"))??;
        let responder =
            Responder::start(any, |req| format!("from {}", req.peer.ip()).into_bytes())?;
        let v4 = probe(&client, SocketAddr::new(server.ip4.into(), 8080))?;
        assert_eq!(v4, format!("from ::ffff:{}", client.ip4));
        let v6 = probe(&client, SocketAddr::new(server.ip6.into(), 8080))?;
        assert_eq!(v6, format!("from {}", client.ip6));
        drop(responder);
    }
    Ok(())
}
