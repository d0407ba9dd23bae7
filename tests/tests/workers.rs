//! Connection workers (`--threading`): under `pinned` each pod is served
//! by one single-threaded worker and pods spread over the workers; under
//! `shared` every pod runs on one work-stealing pool. Two simulated nodes,
//! one agent each, one way each: tunnels and plaintext work across them,
//! same-node tunnels between two workers of one agent work, and `status`
//! says which worker serves each pod.

use dataplane_tests::{
    mesh::{TwoNodes, addr},
    traffic::{echo, echo_server},
};

const APP_PORT: u16 = 9000;

#[test]
fn pods_spread_over_pinned_workers_and_traffic_crosses_both_ways_of_threading() -> anyhow::Result<()>
{
    let mesh = TwoNodes::new("wkspread")?;
    let mut config = mesh.mesh_config();
    // Same-node pairs stay on the proxy (two workers of one agent talk
    // HBONE to each other), not the kernel fast path.
    for workload in &mut config.workloads {
        let workload = std::sync::Arc::make_mut(workload);
        workload.fast_path = Some(false);
    }
    let config = mesh.write(&config)?;
    let pinned = mesh.agent(
        "wk",
        1,
        &config,
        &["--threading", "pinned", "--worker-threads", "2"],
    )?;
    let shared = mesh.agent("wk", 2, &config, &["--threading", "shared"])?;
    let _local = echo_server(&mesh.local, APP_PORT)?;
    let _remote = echo_server(&mesh.remote, APP_PORT)?;
    let _plain = echo_server(&mesh.plain, APP_PORT)?;

    // node1's two pods went to the two workers, one each, in order.
    let worker_of = |agent: &dataplane_tests::Agent, name| agent.pod_status(name).map(|p| p.worker);
    let mut on_node1 = [worker_of(&pinned, "client")?, worker_of(&pinned, "local")?];
    on_node1.sort();
    assert_eq!(on_node1, [Some(0), Some(1)], "one pod per worker");
    assert_eq!(
        worker_of(&shared, "remote")?,
        None,
        "a shared pool names no worker"
    );

    for seed in 0..4 {
        // From a pinned worker to the other worker of the same agent.
        echo(&mesh.client, addr(&mesh.local, APP_PORT), 64 << 10, seed)?;
        // From a pinned worker over the wire to a shared pool.
        echo(&mesh.client, addr(&mesh.remote, APP_PORT), 64 << 10, seed)?;
        // Passthrough to a pod outside the mesh.
        echo(&mesh.client, addr(&mesh.plain, APP_PORT), 64 << 10, seed)?;
    }
    Ok(())
}
