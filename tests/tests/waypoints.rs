//! Waypoints (ambient's L7 proxies), end to end with a stand-in: a workload
//! behind a waypoint is reached through it (the client's node tunnels to
//! the waypoint with the original destination as `:authority`, the
//! waypoint tunnels on with its own identity), and the workload's node
//! refuses whatever bypasses it: plaintext from outside the mesh, and a
//! tunnel from a client whose node does not know of the waypoint.
//!
//! What went through the waypoint is counted by the stand-in itself;
//! refusals are what the clients see (a reset) and the destination's
//! `/metrics`.

use dataplane_tests::{
    mesh::{NAMESPACE, TwoNodes, addr, hbone_workload, write_config},
    observe::{family, scrape, value},
    traffic::{echo, echo_server, try_stream, wait_until},
    waypoint::WaypointStandIn,
};
use dataplane_user::{
    config::{LocalConfig, Waypoint},
    identity::Identity,
};

/// The world's mesh with `waypoint` (the `plain` pod, not enrolled: the
/// stand-in runs there) as a workload, and `remote` behind it when
/// `guarded`.
fn mesh(w: &TwoNodes, guarded: bool) -> LocalConfig {
    let mut config = w.mesh_config();
    let mut waypoint = hbone_workload(&w.plain, "waypoint", "node2");
    waypoint.netns = None;
    if guarded {
        for workload in &mut config.workloads {
            if workload.name == "remote" {
                workload.waypoint = Some(Waypoint {
                    address: Some(w.plain.ip4.into()),
                    hostname: None,
                    hbone_port: 15008,
                });
            }
        }
    }
    config.workloads.push(waypoint);
    config
}

fn reloads_applied(agent: &dataplane_tests::Agent) -> anyhow::Result<f64> {
    let samples = scrape(agent)?;
    Ok(value(
        &samples,
        "dataplane_config_reloads_total",
        &[("result", "applied")],
    )
    .unwrap_or(0.0))
}

fn resets(pod: &dataplane_tests::topology::Pod, dst: std::net::SocketAddr) -> anyhow::Result<bool> {
    Ok(try_stream(pod, &["expect-reset", &dst.to_string()])?.stdout == "reset")
}

#[test]
fn a_workload_behind_a_waypoint_is_reached_through_it_and_never_around_it() -> anyhow::Result<()> {
    let w = TwoNodes::new("wpt")?;
    // node1 and node2 read their own files, so node1 can be made to
    // forget the waypoint while node2 still guards the workload.
    let file1 = write_config(w.dir.path(), "node1.yaml", &mesh(&w, true))?;
    let file2 = write_config(w.dir.path(), "node2.yaml", &mesh(&w, true))?;
    let a1 = w.agent("wp", 1, &file1, &[])?;
    let a2 = w.agent("wp", 2, &file2, &[])?;
    let remote_identity = Identity::new("cluster.local", NAMESPACE, "remote")?;
    let standin = WaypointStandIn::start(
        &w.plain,
        &w.shared_ca(),
        NAMESPACE,
        "waypoint",
        &[
            (w.remote.ip4.into(), remote_identity.clone()),
            (w.remote.ip6.into(), remote_identity),
        ],
    )?;
    let server = echo_server(&w.remote, 9000)?;
    let dst = addr(&w.remote, 9000);

    // Through the waypoint, bytes intact.
    echo(&w.client, dst, 50_000, 1)?;
    echo(&w.client, dst, 10, 2)?;
    assert_eq!(
        standin.forwarded(),
        2,
        "both connections went through the waypoint"
    );
    assert_eq!(server.drain().len(), 2);

    // Plaintext from outside the mesh bypasses it: refused.
    assert!(
        resets(&w.plain, dst)?,
        "plaintext around the waypoint was let through"
    );

    // node1 forgets the waypoint and tunnels straight to the workload:
    // node2 refuses the tunnel.
    write_config(w.dir.path(), "node1.yaml", &mesh(&w, false))?;
    wait_until("node1 to apply the file without the waypoint", || {
        Ok(reloads_applied(&a1)? == 1.0)
    })?;
    assert!(
        resets(&w.client, dst)?,
        "a tunnel around the waypoint was let through"
    );
    assert_eq!(
        standin.forwarded(),
        2,
        "nothing more went through the waypoint"
    );
    assert!(
        server.drain().is_empty(),
        "a bypassing connection reached the app"
    );
    let samples = scrape(&a2)?;
    let denied: f64 = family(&samples, "istio_tcp_connections_failed_total")
        .iter()
        .filter(|s| {
            s.labels
                .iter()
                .any(|(k, v)| k == "response_flags" && v == "DENY")
        })
        .map(|s| s.value)
        .sum();
    assert!(denied >= 2.0, "node2 counts the refusals: {samples:#?}");

    // Without the waypoint on node2 either, the same tunnel goes through:
    // the refusal was the waypoint's doing.
    write_config(w.dir.path(), "node2.yaml", &mesh(&w, false))?;
    wait_until("node2 to apply the file without the waypoint", || {
        Ok(reloads_applied(&a2)? == 1.0)
    })?;
    echo(&w.client, dst, 100, 3)?;
    assert_eq!(standin.forwarded(), 2);
    Ok(())
}
