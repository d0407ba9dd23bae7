//! Simulated nodes and pods: a node is a network namespace with a bridge;
//! a pod is a network namespace wired to its node's bridge by a veth pair,
//! with its own cgroup under the node's. Two nodes can be joined by a veth link so cross-node
//! traffic is real. Everything lives in namespaces the test owns, so fixed
//! addresses cannot collide between parallel tests.
//!
//! Addressing for node `n` (1-based): pods `10.n.0.(10+k)/24` and
//! `fd00:n::(10+k)/64`, the node's bridge `10.n.0.1` / `fd00:n::1` (the
//! node-side address toward its pods); node-to-node link `192.168.255.n/24`
//! and `fd00:ff::n/64`.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use crate::{Cgroup, Netns};

/// A simulated node.
#[derive(Debug)]
pub struct Node {
    index: u8,
    pods: u8,
    // Declared before `netns`: pods' cgroups live under it and go first.
    cgroup: Cgroup,
    netns: Netns,
}

/// A simulated pod: its namespace, cgroup and addresses.
#[derive(Debug)]
pub struct Pod {
    /// The pod's network namespace (`eth0` toward the node).
    pub netns: Netns,
    /// The pod's own cgroup (its processes run here).
    pub cgroup: Cgroup,
    /// IPv4 address.
    pub ip4: Ipv4Addr,
    /// IPv6 address.
    pub ip6: Ipv6Addr,
    /// The node-side address toward the pod (the bridge's IPv4 address).
    pub node_side: IpAddr,
}

impl Node {
    /// Creates node `index` (1..=200) with its bridge up.
    pub fn new(tag: &str, index: u8) -> anyhow::Result<Self> {
        anyhow::ensure!((1..=200).contains(&index), "node index out of range");
        let netns = Netns::new(&format!("{tag}n{index}"))?;
        sysctls(&netns, true)?;
        netns.ip(&["link", "add", "br0", "type", "bridge"])?;
        netns.ip(&["addr", "add", &format!("10.{index}.0.1/24"), "dev", "br0"])?;
        netns.ip(&[
            "addr",
            "add",
            &format!("fd00:{index}::1/64"),
            "dev",
            "br0",
            "nodad",
        ])?;
        netns.ip(&["link", "set", "br0", "up"])?;
        let cgroup = Cgroup::new(&format!("{tag}n{index}"))?;
        Ok(Self {
            index,
            pods: 0,
            cgroup,
            netns,
        })
    }

    /// The node's network namespace.
    pub fn netns(&self) -> &Netns {
        &self.netns
    }

    /// The node's cgroup: every pod's cgroup is a child of it, so an agent
    /// attached here sees all of the node's pods and nothing else.
    pub fn cgroup(&self) -> &Cgroup {
        &self.cgroup
    }

    /// The node-side IPv4 address toward its pods.
    pub fn bridge_ip4(&self) -> Ipv4Addr {
        Ipv4Addr::new(10, self.index, 0, 1)
    }

    /// Adds a pod wired to this node's bridge.
    pub fn add_pod(&mut self, tag: &str) -> anyhow::Result<Pod> {
        self.pods += 1;
        let k = self.pods;
        let host = 10 + k;
        let n = self.index;
        let netns = Netns::new(&format!("{tag}p{n}x{k}"))?;
        let cgroup = Cgroup::child(&self.cgroup, &format!("{tag}p{n}x{k}"))?;
        sysctls(&netns, false)?;
        let veth = format!("vp{k}");
        self.netns.ip(&[
            "link",
            "add",
            &veth,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            netns.name(),
        ])?;
        self.netns
            .ip(&["link", "set", &veth, "master", "br0", "up"])?;
        let ip4 = Ipv4Addr::new(10, n, 0, host);
        let ip6: Ipv6Addr = format!("fd00:{n}::{host:x}").parse()?;
        netns.ip(&["addr", "add", &format!("{ip4}/24"), "dev", "eth0"])?;
        netns.ip(&["addr", "add", &format!("{ip6}/64"), "dev", "eth0", "nodad"])?;
        netns.ip(&["link", "set", "eth0", "up"])?;
        netns.ip(&["route", "add", "default", "via", &format!("10.{n}.0.1")])?;
        netns.ip(&[
            "-6",
            "route",
            "add",
            "default",
            "via",
            &format!("fd00:{n}::1"),
        ])?;
        Ok(Pod {
            netns,
            cgroup,
            ip4,
            ip6,
            node_side: IpAddr::V4(self.bridge_ip4()),
        })
    }
}

/// Joins two nodes with a veth link and routes each node's pod subnet to
/// the other.
pub fn link_nodes(a: &Node, b: &Node) -> anyhow::Result<()> {
    let (na, nb) = (a.index, b.index);
    let a_if = format!("to{nb}");
    let b_if = format!("to{na}");
    a.netns.ip(&[
        "link",
        "add",
        &a_if,
        "type",
        "veth",
        "peer",
        "name",
        &b_if,
        "netns",
        b.netns.name(),
    ])?;
    for (node, ifname, me, other) in [(a, &a_if, na, nb), (b, &b_if, nb, na)] {
        node.netns.ip(&[
            "addr",
            "add",
            &format!("192.168.255.{me}/24"),
            "dev",
            ifname,
        ])?;
        node.netns.ip(&[
            "addr",
            "add",
            &format!("fd00:ff::{me}/64"),
            "dev",
            ifname,
            "nodad",
        ])?;
        node.netns.ip(&["link", "set", ifname, "up"])?;
        node.netns.ip(&[
            "route",
            "add",
            &format!("10.{other}.0.0/24"),
            "via",
            &format!("192.168.255.{other}"),
        ])?;
        node.netns.ip(&[
            "-6",
            "route",
            "add",
            &format!("fd00:{other}::/64"),
            "via",
            &format!("fd00:ff::{other}"),
        ])?;
    }
    Ok(())
}

/// Per-namespace sysctls: no IPv6 duplicate address detection (addresses
/// usable at once), forwarding on nodes.
fn sysctls(netns: &Netns, forwarding: bool) -> anyhow::Result<()> {
    let forwarding = if forwarding { "1" } else { "0" };
    let settings = [
        ("net/ipv6/conf/all/accept_dad", "0"),
        ("net/ipv6/conf/default/accept_dad", "0"),
        ("net/ipv4/ip_forward", forwarding),
        ("net/ipv6/conf/all/forwarding", forwarding),
    ];
    netns.run(move || -> std::io::Result<()> {
        // /proc/sys/net reflects the network namespace of the thread that
        // opens it, so these writes land in `netns`.
        for (key, value) in settings {
            std::fs::write(format!("/proc/sys/{key}"), value)?;
        }
        Ok(())
    })??;
    Ok(())
}
