//! A stock Istio ztunnel against this server (run by hand).

use super::*;

/// A stock Istio ztunnel (in-pod mode) against this server: it connects,
/// gets the pod's namespace in the snapshot, binds its listeners there and
/// acks; restarted, it gets the snapshot again; a Del takes the listeners
/// away. Needs a ztunnel binary, so it runs only by hand:
/// `DATAPLANE_ZTUNNEL=/path/to/ztunnel cargo test -p dataplane-tests --test
/// zds_server -- --ignored stock_ztunnel --nocapture`.
#[test]
#[ignore = "needs a ztunnel binary in DATAPLANE_ZTUNNEL"]
fn zds_stock_ztunnel_binds_its_listeners_in_the_pod() -> anyhow::Result<()> {
    let binary = std::env::var_os("DATAPLANE_ZTUNNEL")
        .ok_or_else(|| anyhow!("set DATAPLANE_ZTUNNEL to a ztunnel binary"))?;
    let (pod_ns, pod_p) = pod("p")?;
    pod_ns.ip(&["addr", "add", "10.99.0.2/32", "dev", "lo"])?;
    let node = Netns::new("zds-node")?;
    let server = Server::start(|_| {}, vec![pod_p])?;
    let dir = server._dir.path().to_owned();
    let config = dir.join("ztunnel.yaml");
    std::fs::write(
        &config,
        "workloads:\n- uid: cluster1//v1/Pod/shop/p-name\n  name: p-name\n  namespace: shop\n  \
         serviceAccount: p-sa\n  workloadIps: [\"10.99.0.2\"]\n  protocol: HBONE\n  node: node1\n  \
         network: \"\"\n  services: {}\n",
    )?;
    // As Istio's chart starts it, minus istiod: local config, a fake CA.
    let start = |run: u32| -> anyhow::Result<(dataplane_tests::ChildGuard, Option<i32>)> {
        let log = std::fs::File::create(dir.join(format!("ztunnel-{run}.log")))?;
        let mut command = std::process::Command::new("ip");
        command
            .args(["netns", "exec", node.name()])
            .arg(&binary)
            .env("INPOD_UDS", &server.socket)
            .env("LOCAL_XDS_PATH", &config)
            .env("XDS_ADDRESS", "")
            .env("FAKE_CA", "true")
            .env("NODE_NAME", "node1")
            .stdout(log.try_clone()?)
            .stderr(log);
        let child = dataplane_tests::ChildGuard::new(command.spawn()?);
        let pid = child.id().and_then(|p| i32::try_from(p).ok());
        Ok((child, pid))
    };
    let listening = |port: &str| -> anyhow::Result<bool> {
        let ss = dataplane_tests::run(
            "ip",
            &[
                "netns",
                "exec",
                pod_ns.name(),
                "ss",
                "-Hltn",
                "sport",
                "=",
                port,
            ],
        )?;
        Ok(!ss.trim().is_empty())
    };
    let acked_with_listeners = |pid: Option<i32>| -> anyhow::Result<()> {
        match server.event()? {
            Event::Acked(uid, peer) => {
                ensure!(uid == "p");
                ensure!(
                    Some(peer.pid) == pid,
                    "acked by {peer:?}, ztunnel is {pid:?}"
                );
            }
            other => anyhow::bail!("expected ztunnel to ack p, got {other:?}"),
        }
        for port in [":15001", ":15006", ":15008"] {
            ensure!(
                listening(port)?,
                "ztunnel acked but nothing listens on {port} in the pod"
            );
        }
        Ok(())
    };
    let outcome = (|| -> anyhow::Result<()> {
        let (first, first_pid) = start(1)?;
        acked_with_listeners(first_pid)?;
        drop(first);
        match server.event()? {
            Event::Disconnected(peer) => ensure!(Some(peer.pid) == first_pid),
            other => anyhow::bail!("expected ztunnel's disconnection, got {other:?}"),
        }
        let (second, second_pid) = start(2)?;
        acked_with_listeners(second_pid)?;
        let outcome = server.handle.del_blocking("p")?;
        ensure!(outcome.acked == 1, "{outcome:?}");
        let deadline = std::time::Instant::now() + WAIT;
        while listening(":15008")? {
            ensure!(
                std::time::Instant::now() < deadline,
                "ztunnel kept its listeners after Del"
            );
            thread::sleep(Duration::from_millis(50));
        }
        drop(second);
        Ok(())
    })();
    for run in [1, 2] {
        if let Ok(log) = std::fs::read_to_string(dir.join(format!("ztunnel-{run}.log"))) {
            let zds_lines: Vec<&str> = log
                .lines()
                .filter(|l| l.contains("inpod") || l.contains("pod ") || l.contains("snapshot"))
                .collect();
            eprintln!("ztunnel run {run}, ZDS lines:\n{}", zds_lines.join("\n"));
        }
    }
    outcome
}
