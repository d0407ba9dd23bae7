//! `--engine ztunnel`: agents hand their pods to a node proxy over ZDS and
//! capture into the listeners it opens in each pod. The node proxy is
//! `dp-inpod-proxy --zds`, which behaves toward the agent as Istio's
//! ztunnel does (hello, one ack per request, listeners on
//! `[::]:15001/15006/15008` with mark 0x539 in each namespace it receives,
//! `SO_ORIGINAL_DST`, transparent connections to the app, reconnection when
//! the agent's socket goes away) and writes one line per hop to the client,
//! so each case shows the path: the client node's proxy (`outbound`), the
//! server node's proxy (`inbound`), then the app with the client it saw.
//! `ztunnel_interop` runs the same mode against a stock ztunnel where one
//! is available.

use anyhow::Context as _;
use std::{
    net::IpAddr,
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use dataplane_tests::{
    Agent, Cgroup, ChildGuard,
    external_proxy::{APP_PORT, peer_aware_server},
    mesh::TwoNodes,
    observe::{scrape, value},
    process::target_binary,
    redirector_node::{at, dial, mapped},
    responder::Responder,
    spawn_in,
    topology::{Node, Pod},
    traffic::wait_until,
};
use dataplane_user::control::Request;

/// Guard against hangs only.
const LIMIT: Duration = Duration::from_secs(30);

/// One node's stand-in ztunnel, in the node's namespace and a cgroup of
/// its own under the node's.
struct NodeProxy {
    child: ChildGuard,
    // After the child: the cgroup goes once the process is gone.
    _cgroup: Cgroup,
}

impl NodeProxy {
    fn start(node: &Node, zds: &Path, refuse: &[&str]) -> anyhow::Result<Self> {
        let cgroup = Cgroup::child(node.cgroup(), "zt")?;
        let mut cmd = Command::new(target_binary(
            "dp-inpod-proxy",
            "build it with `cargo build -p dataplane-tests --bins`",
        )?);
        cmd.arg("--zds").arg(zds);
        for name in refuse {
            cmd.args(["--refuse", name]);
        }
        let mut child = spawn_in(cmd, Some(node.netns().path()), Some(cgroup.path()))?;
        let line = child.first_line(LIMIT)?;
        anyhow::ensure!(line == "connected", "dp-inpod-proxy said {line:?}");
        Ok(Self {
            child,
            _cgroup: cgroup,
        })
    }

    fn kill(self) -> anyhow::Result<()> {
        self.child.signal(nix::sys::signal::Signal::SIGKILL)?;
        self.child.wait(LIMIT)?;
        Ok(())
    }
}

/// The world: two nodes, their agents in ztunnel mode, apps that name the
/// client they saw.
struct World {
    w: TwoNodes,
    zds: [PathBuf; 2],
    agents: [Agent; 2],
    _apps: Vec<Responder>,
}

impl World {
    fn new(tag: &str) -> anyhow::Result<Self> {
        let w = TwoNodes::new(tag)?;
        let config = w.config()?;
        let zds = [1, 2].map(|n| w.dir.path().join(format!("zds{n}.sock")));
        let args = |zds: &Path| {
            vec![
                "--engine".to_owned(),
                "ztunnel".to_owned(),
                "--zds-socket".to_owned(),
                zds.display().to_string(),
            ]
        };
        let start = |n: u8| -> anyhow::Result<Agent> {
            let args = args(&zds[usize::from(n - 1)]);
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            w.agent(tag, n, &config, &args)
        };
        let agents = [start(1)?, start(2)?];
        let apps = vec![peer_aware_server(&w.local)?, peer_aware_server(&w.remote)?];
        Ok(Self {
            w,
            zds,
            agents,
            _apps: apps,
        })
    }

    fn proxy(&self, n: usize, refuse: &[&str]) -> anyhow::Result<NodeProxy> {
        let node = if n == 1 { &self.w.n1 } else { &self.w.n2 };
        NodeProxy::start(node, &self.zds[n - 1], refuse)
    }
}

/// What the status of `agent` says of pod `name`: (captured, reason).
fn pod_state(agent: &Agent, name: &str) -> anyhow::Result<(bool, String)> {
    let pod = agent.pod_status(name)?;
    Ok((pod.captured, pod.reason))
}

/// Waits until `check` holds for the state of pod `name` on `agent`;
/// returns the reason `status` gave then.
fn wait_state(
    agent: &Agent,
    name: &str,
    what: &str,
    check: impl Fn(bool, &str) -> bool,
) -> anyhow::Result<String> {
    let mut last = (false, String::new());
    wait_until(&format!("{name} {what}"), || {
        last = pod_state(agent, name)?;
        Ok(check(last.0, &last.1))
    })
    .with_context(|| format!("last: captured={}, {}", last.0, last.1))?;
    Ok(last.1)
}

fn wait_served(agent: &Agent, names: &[&str]) -> anyhow::Result<()> {
    for name in names {
        wait_state(agent, name, "served", |captured, _| captured)?;
    }
    Ok(())
}

/// The lines a client in `from` sees when it dials `to` (`ip` of that
/// family) through both nodes' proxies.
fn through_both(from: &Pod, to: &Pod, name: &str, v6: bool) -> (IpAddr, String) {
    let (dst, client): (IpAddr, IpAddr) = if v6 {
        (to.ip6.into(), from.ip6.into())
    } else {
        (to.ip4.into(), from.ip4.into())
    };
    let orig = at(dst, APP_PORT);
    let via = if v6 { "SOL_IPV6" } else { "SOL_IP" };
    (
        dst,
        format!(
            "outbound orig={orig} via={via} client={client}\ninbound pod={name} local={orig}\napp peer={client}"
        ),
    )
}

fn dial_ok(from: &Pod, dst: IpAddr) -> anyhow::Result<String> {
    dial(from, &at(dst, APP_PORT), &[])?.map_err(|e| anyhow::anyhow!("dial {dst}: {e}"))
}

#[test]
fn pods_reach_each_other_through_the_node_proxies_both_ways() -> anyhow::Result<()> {
    let world = World::new("ztm")?;
    let _p1 = world.proxy(1, &[])?;
    let _p2 = world.proxy(2, &[])?;
    wait_served(&world.agents[0], &["client", "local"])?;
    wait_served(&world.agents[1], &["remote"])?;
    let w = &world.w;
    for (to, name, case) in [
        (&w.local, "local", "same node"),
        (&w.remote, "remote", "across nodes"),
    ] {
        for v6 in [false, true] {
            let (dst, expected) = through_both(&w.client, to, name, v6);
            assert_eq!(dial_ok(&w.client, dst)?, expected, "{case}, v6={v6}");
        }
    }
    // Back the other way: remote -> client's node.
    let (dst, expected) = through_both(&w.remote, &w.local, "local", false);
    assert_eq!(dial_ok(&w.remote, dst)?, expected, "node2 -> node1");
    Ok(())
}

/// Issue 29, item 10: the node proxy (ztunnel) must see the pod's own
/// address as the client's, as under istio-cni's `REDIRECT`, not the
/// loopback address the capture steers to: ztunnel writes it in its access
/// records (`src.addr`) and sends it upstream in HBONE's `forwarded: for=`.
/// Its outbound listener is the wildcard `[::]:15001` our stand-in opens
/// too, so the peer the stand-in accepts is the peer ztunnel would. IPv4,
/// IPv6, and an IPv6 socket dialling an IPv4-mapped address; a socket the
/// application bound itself falls back to loopback, counted.
#[test]
fn the_node_proxy_sees_the_pods_own_address_as_the_client() -> anyhow::Result<()> {
    let world = World::new("ztsrc")?;
    let _p1 = world.proxy(1, &[])?;
    let _p2 = world.proxy(2, &[])?;
    wait_served(&world.agents[0], &["client", "local"])?;
    wait_served(&world.agents[1], &["remote"])?;
    let w = &world.w;
    let cases: [(String, IpAddr, &str); 3] = [
        (at(w.remote.ip4, APP_PORT), w.client.ip4.into(), "IPv4"),
        (at(w.remote.ip6, APP_PORT), w.client.ip6.into(), "IPv6"),
        (
            mapped(w.remote.ip4, APP_PORT),
            w.client.ip4.into(),
            "IPv4-mapped",
        ),
    ];
    for (dst, client, case) in cases {
        let out = dial(&w.client, &dst, &[])?.map_err(|e| anyhow::anyhow!("{case}: {e}"))?;
        let first = out.lines().next().unwrap_or_default();
        assert!(
            first.starts_with("outbound ") && first.ends_with(&format!(" client={client}")),
            "{case}: the node proxy saw {first:?}, not the pod {client}"
        );
        // And the app behind the peer's node proxy sees the same address.
        assert!(
            out.ends_with(&format!("app peer={client}")),
            "{case}: {out:?}"
        );
    }
    assert_eq!(world.agents[0].counter("source_bind_failed")?, 0);
    // A socket the application bound itself keeps its own choice (the
    // kernel refuses a second bind): the connection still goes through,
    // from loopback as before, and is counted.
    let dst = at(w.remote.ip4, APP_PORT);
    let out = dial(&w.client, &dst, &["--bind-port", "40123"])?
        .map_err(|e| anyhow::anyhow!("bound socket: {e}"))?;
    let first = out.lines().next().unwrap_or_default();
    assert!(
        first.starts_with("outbound ") && first.ends_with(" client=127.0.0.1"),
        "bound socket: the node proxy saw {first:?}"
    );
    assert_eq!(world.agents[0].counter("source_bind_failed")?, 1);
    Ok(())
}

#[test]
fn a_restarted_node_proxy_gets_the_snapshot_and_serves_again() -> anyhow::Result<()> {
    let world = World::new("ztr")?;
    let p1 = world.proxy(1, &[])?;
    let _p2 = world.proxy(2, &[])?;
    wait_served(&world.agents[0], &["client", "local"])?;
    wait_served(&world.agents[1], &["remote"])?;
    let w = &world.w;
    let (dst, expected) = through_both(&w.remote, &w.local, "local", false);
    assert_eq!(dial_ok(&w.remote, dst)?, expected, "before");
    // The node agent's gauges (ztunnel's workload-manager names): both
    // pods served, none pending, one ztunnel connected.
    let gauges = |agent: &Agent| -> anyhow::Result<[Option<f64>; 3]> {
        let samples = scrape(agent)?;
        Ok([
            "workload_manager_active_proxy_count",
            "workload_manager_pending_proxy_count",
            "dataplane_zds_connections",
        ]
        .map(|name| value(&samples, name, &[])))
    };
    let served = [Some(2.0), Some(0.0), Some(1.0)];
    assert_eq!(gauges(&world.agents[0])?, served);

    // The node proxy dies: its listeners close with it, the agent says so
    // and the pod is refused (fail-closed), not silently passed.
    p1.kill()?;
    let reason = wait_state(&world.agents[0], "local", "unserved", |c, _| !c)?;
    assert!(reason.contains("disconnected"), "{reason}");
    wait_until(
        "the gauges to show no ztunnel and both pods pending",
        || Ok(gauges(&world.agents[0])? == [Some(0.0), Some(2.0), Some(0.0)]),
    )?;
    assert!(
        dial(&w.remote, &at(dst, APP_PORT), &[])?.is_err(),
        "a pod whose node proxy is gone must not be reached around it"
    );

    // A new one connects: it gets every pod in the snapshot and serves.
    let _p1 = world.proxy(1, &[])?;
    wait_served(&world.agents[0], &["client", "local"])?;
    assert_eq!(dial_ok(&w.remote, dst)?, expected, "after the restart");
    assert_eq!(gauges(&world.agents[0])?, served);
    Ok(())
}

#[test]
fn a_refused_pod_is_shown_unserved_and_a_removed_pod_is_released() -> anyhow::Result<()> {
    let world = World::new("ztd")?;
    let _p1 = world.proxy(1, &["local"])?;
    let _p2 = world.proxy(2, &[])?;
    wait_served(&world.agents[0], &["client"])?;
    let reason = wait_state(&world.agents[0], "local", "refused", |c, r| {
        !c && r.contains("refused")
    })?;
    assert!(reason.contains("local is refused by the test"), "{reason}");

    // Removing `remote` from its agent: the node proxy is told (Del), the
    // capture goes, and the client's connection reaches the app directly
    // after the client's own node proxy.
    let w = &world.w;
    let response = world.agents[1].call(&Request::Remove {
        uid: Some("uid-remote".into()),
        netns: None,
    })?;
    assert_eq!(response.removed, Some(true), "remove: {response:?}");
    let dst = IpAddr::from(w.remote.ip4);
    assert_eq!(
        dial_ok(&w.client, dst)?,
        format!(
            "outbound orig={} via=SOL_IP client={}\napp peer={}",
            at(dst, APP_PORT),
            w.client.ip4,
            w.client.ip4
        ),
        "a removed pod is no longer captured"
    );
    Ok(())
}

#[test]
fn while_the_agent_is_down_traffic_keeps_flowing_through_the_node_proxy() -> anyhow::Result<()> {
    let mut world = World::new("zta")?;
    let _p1 = world.proxy(1, &[])?;
    let _p2 = world.proxy(2, &[])?;
    wait_served(&world.agents[0], &["client", "local"])?;
    wait_served(&world.agents[1], &["remote"])?;
    let (dst, expected) = through_both(&world.w.client, &world.w.remote, "remote", false);

    // The agent of node2 crashes: the kernel keeps pointing at the node
    // proxy's sockets, which are the proxy's, not the agent's.
    world.agents[1].kill_hard()?;
    assert_eq!(dial_ok(&world.w.client, dst)?, expected, "agent down");

    // It comes back, re-adopts its pods and the node proxy reconnects.
    world.agents[1].restart()?;
    wait_served(&world.agents[1], &["remote"])?;
    assert_eq!(dial_ok(&world.w.client, dst)?, expected, "agent back");
    Ok(())
}
