//! The HBONE pool under concurrent streams, end to end: two simulated
//! nodes, one agent each; the client pod holds long tunnels to one remote
//! destination and the destination pod's namespace is asked (with `ss`)
//! how many HBONE connections it accepted and how many tunnelled
//! connections reached its app. A stream is busy-making by being open:
//! the pool counts open streams, not bytes.

use std::{net::SocketAddr, process::Command};

use dataplane_tests::{
    ChildGuard,
    mesh::{TwoNodes, addr},
    process::target_binary,
    spawn_in,
    topology::Pod,
    traffic::{echo_server, wait_until},
};

const APP_PORT: u16 = 9000;

/// How long a held stream stays open at most (the test ends it sooner by
/// dropping its guard; a bound, not a timing).
const HOLD_SECS: &str = "120";

/// Established TCP connections in `pod`'s namespace whose local port is
/// `port`.
fn established_on(pod: &Pod, port: u16) -> anyhow::Result<usize> {
    let filter = format!("( sport = :{port} )");
    let out = dataplane_tests::run(
        "ip",
        &[
            "netns",
            "exec",
            pod.netns.name(),
            "ss",
            "-Htn",
            "state",
            "established",
            &filter,
        ],
    )?;
    Ok(out.lines().filter(|l| !l.trim().is_empty()).count())
}

/// A connection from `client` to `dst` that stays open (`dp-stream
/// hold`), ended when the guard drops.
fn hold(client: &Pod, dst: SocketAddr) -> anyhow::Result<ChildGuard> {
    let mut cmd = Command::new(target_binary(
        "dp-stream",
        "cargo builds it with this package's tests",
    )?);
    cmd.args(["hold", &dst.to_string(), HOLD_SECS]);
    spawn_in(cmd, Some(client.netns.path()), Some(client.cgroup.path()))
}

/// Opens `n` more held streams from the client to the remote app at once
/// and waits until every held stream reached the app.
fn hold_more(mesh: &TwoNodes, held: &mut Vec<ChildGuard>, n: usize) -> anyhow::Result<()> {
    let dst = addr(&mesh.remote, APP_PORT);
    for _ in 0..n {
        held.push(hold(&mesh.client, dst)?);
    }
    let total = held.len();
    wait_until(&format!("{total} tunnels to reach the app"), || {
        Ok(established_on(&mesh.remote, APP_PORT)? >= total)
    })
}

#[test]
fn four_concurrent_streams_to_one_destination_use_more_than_one_connection() -> anyhow::Result<()> {
    let mesh = TwoNodes::new("hbspread")?;
    let config = mesh.config()?;
    let _a1 = mesh.agent("hb", 1, &config, &[])?;
    let _a2 = mesh.agent("hb", 2, &config, &[])?;
    let _app = echo_server(&mesh.remote, APP_PORT)?;
    let mut held = Vec::new();

    hold_more(&mesh, &mut held, 1)?;
    assert_eq!(
        established_on(&mesh.remote, 15008)?,
        1,
        "one stream travels on one connection"
    );

    hold_more(&mesh, &mut held, 3)?;
    let connections = established_on(&mesh.remote, 15008)?;
    assert!(
        (2..=4).contains(&connections),
        "four concurrent streams spread over 2..=4 (the default bound) connections, not {connections}"
    );
    Ok(())
}

#[test]
fn connections_to_one_destination_stay_within_the_bound() -> anyhow::Result<()> {
    let mesh = TwoNodes::new("hbbound")?;
    let config = mesh.config()?;
    let _a1 = mesh.agent("hb", 1, &config, &["--hbone-pool-max-connections", "3"])?;
    let _a2 = mesh.agent("hb", 2, &config, &[])?;
    let _app = echo_server(&mesh.remote, APP_PORT)?;
    let mut held = Vec::new();

    hold_more(&mesh, &mut held, 10)?;
    assert_eq!(
        established_on(&mesh.remote, 15008)?,
        3,
        "ten busy streams fill the bound of three connections and no more"
    );
    // Closed streams free their slots; the connections stay pooled (idle
    // ones close only after the pool's idle timeout) and carry new ones.
    held.truncate(4);
    wait_until("six tunnels to end at the app", || {
        Ok(established_on(&mesh.remote, APP_PORT)? == 4)
    })?;
    hold_more(&mesh, &mut held, 6)?;
    assert_eq!(established_on(&mesh.remote, 15008)?, 3);
    Ok(())
}

#[test]
fn the_agents_pool_caps_streams_per_connection_and_releases_idle_ones() -> anyhow::Result<()> {
    let mesh = TwoNodes::new("hbknobs")?;
    let config = mesh.config()?;
    // One connection to spread over and no busy threshold below the cap:
    // only `--hbone-pool-max-streams-per-connection` can add connections.
    let _a1 = mesh.agent(
        "hb",
        1,
        &config,
        &[
            "--hbone-pool-max-connections",
            "1",
            "--hbone-pool-busy-streams",
            "100",
            "--hbone-pool-max-streams-per-connection",
            "2",
            "--hbone-pool-idle-timeout",
            "20s",
        ],
    )?;
    let _a2 = mesh.agent("hb", 2, &config, &[])?;
    let _app = echo_server(&mesh.remote, APP_PORT)?;
    let mut held = Vec::new();

    hold_more(&mesh, &mut held, 5)?;
    assert_eq!(
        established_on(&mesh.remote, 15008)?,
        3,
        "five streams, two per connection, take three connections"
    );
    // Every stream ends at the app; the connections outlive them, idle in
    // the pool (the idle time counts from a connection's last new stream,
    // and twenty seconds leave the steps since a margin no stall of a
    // loaded machine eats; eviction runs every ten), until the
    // pool's eviction closes them (the server's own idle timeout is 3 min).
    held.clear();
    wait_until("the tunnels to end at the app", || {
        Ok(established_on(&mesh.remote, APP_PORT)? == 0)
    })?;
    assert_eq!(
        established_on(&mesh.remote, 15008)?,
        3,
        "the pooled connections closed with their streams, not once idle"
    );
    wait_until("the idle pooled connections to close", || {
        Ok(established_on(&mesh.remote, 15008)? == 0)
    })?;
    Ok(())
}
