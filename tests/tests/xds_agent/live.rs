//! The agents follow istiod live: resources added, removed and NACKed, and
//! an istiod restart that keeps the last state serving while the stream
//! resumes.

use super::*;

#[test]
fn two_agents_serve_the_mesh_istiod_describes_and_follow_it_live() -> Result<()> {
    let world = World::new("xdsa")?;
    let w = &world.w;
    // Before istiod has any state, the agent is up but not ready, and says
    // what it waits for.
    let a1 = world.agent("xa", 1)?;
    let (code, body) = http(a1.readiness_addr()?, "GET", "/healthz/ready")?;
    ensure!(code == 503 && body.contains("istiod"), "{code} {body}");
    world.publish_mesh("v1")?;
    wait_until("node1's agent to be ready on istiod's state", || {
        Ok(http(a1.readiness_addr()?, "GET", "/healthz/ready")?.0 == 200)
    })?;
    let a2 = world.agent("xa", 2)?;
    world.enroll(&a1, &w.client, "client")?;
    world.enroll(&a1, &w.local, "local")?;
    world.enroll(&a2, &w.remote, "remote")?;
    let _local = echo_server(&w.local, 9000)?;
    let remote = echo_server(&w.remote, 9000)?;

    // The remote pod, directly and behind the service VIP, through HBONE.
    echo(&w.client, addr(&w.remote, 9000), 10_000, 1)?;
    ensure!(remote.drain().len() == 1);
    for seed in 0..4 {
        echo(&w.client, SocketAddr::new(ECHO_VIP, 80), 1000, seed)?;
    }
    ensure!(
        mutual_tls_opened(&a2)? >= 1.0,
        "node2 saw no mutual-TLS connection"
    );
    let status = a1.status()?;
    let xds = status.xds.context("status without the xDS section")?;
    ensure!(xds.connected_since.is_some(), "{xds:?}");
    ensure!(
        xds.types.iter().all(|t| t.last_ack.is_some()),
        "every type ACKed: {xds:?}"
    );
    let dump = config_dump(&a1)?;
    ensure!(
        dump["config"]["workloads"][0]["source"] == "xds",
        "entries marked as istiod's: {}",
        dump["config"]
    );

    // A policy istiod adds is enforced at once; removing it opens again.
    let deny = policy(
        "deny-9000",
        NAMESPACE,
        Scope::Global,
        Action::Deny,
        to_ports(&[9000]),
    );
    world.publish(AUTHORIZATION_TYPE, vec![policy_resource(&deny, "v2")], &[])?;
    wait_until("the deny policy to apply", || {
        Ok(!reaches(&w.client, addr(&w.remote, 9000))?)
    })?;
    world.publish(AUTHORIZATION_TYPE, Vec::new(), &["test/deny-9000"])?;
    wait_until("the deny policy to go", || {
        reaches(&w.client, addr(&w.remote, 9000))
    })?;

    // A workload istiod marks unhealthy leaves the service's endpoints
    // (the direct address still works); healthy again, it is back.
    let remote_index = world
        .mesh
        .workloads
        .iter()
        .position(|w| w.name == "remote")
        .context("remote in the mesh")?;
    let mut sick = (*world.mesh.workloads[remote_index]).clone();
    sick.status = dataplane_user::config::WorkloadStatus::Unhealthy;
    world.publish(ADDRESS_TYPE, vec![workload_resource(&sick, "v3")], &[])?;
    wait_until("the unhealthy endpoint to leave the service", || {
        let dump = config_dump(&a1)?;
        Ok(dump["config"]["workloads"]
            .as_array()
            .is_some_and(|l| l.iter().any(|w| w["status"] == "Unhealthy")))
    })?;
    remote.drain();
    for seed in 0..6 {
        echo(&w.client, SocketAddr::new(ECHO_VIP, 80), 100, seed)?;
    }
    ensure!(
        remote.drain().is_empty(),
        "an unhealthy endpoint was chosen"
    );
    echo(&w.client, addr(&w.remote, 9000), 100, 7)?;
    let healthy = &world.mesh.workloads[remote_index];
    world.publish(ADDRESS_TYPE, vec![workload_resource(healthy, "v4")], &[])?;
    wait_until("the endpoint to come back", || {
        echo(&w.client, SocketAddr::new(ECHO_VIP, 80), 100, 8)?;
        Ok(!remote.drain().is_empty())
    })?;

    // A resource that does not decode is NACKed by name and the good
    // version held under that name stays; the valid removal beside it
    // applies (the local workload leaves the mesh).
    let mut bad = workload_resource(healthy, "v5");
    if let Some(any) = bad.resource.as_mut() {
        any.value = vec![0xff, 0xff, 0xff];
    }
    world.publish(ADDRESS_TYPE, vec![bad], &["uid-local"])?;
    wait_until("the NACK and the removal", || {
        let status = a1.status()?;
        let nacked = status.xds.as_ref().is_some_and(|x| {
            x.types.iter().any(|t| {
                t.last_nack_reason
                    .as_deref()
                    .is_some_and(|r| r.contains("uid-remote"))
            })
        });
        Ok(nacked && !workload_names(&config_dump(&a1)?).contains(&"local".to_owned()))
    })?;
    let names = workload_names(&config_dump(&a1)?);
    ensure!(names.contains(&"remote".to_owned()), "{names:?}");
    // Traffic still flows on what is held.
    echo(&w.client, addr(&w.remote, 9000), 1000, 9)?;
    // The local pod, still enrolled, is unknown to istiod now: never served
    // in plaintext, either way (ztunnel's `get_workload` refusal), and
    // status says so.
    ensure!(
        !reaches(&w.client, addr(&w.local, 9000))?,
        "a connection to a pod unknown to istiod was served"
    );
    ensure!(
        !reaches(&w.local, addr(&w.remote, 9000))?,
        "a connection from a pod unknown to istiod was served"
    );
    let local = a1
        .status()?
        .pods
        .into_iter()
        .find(|p| p.name == "local")
        .context("local in status")?;
    ensure!(local.unknown_to_control_plane, "{local:?}");
    let samples = scrape(&a1)?;
    ensure!(
        value(
            &samples,
            "dataplane_tcp_connections_failed_total",
            &[("direction", "outbound"), ("reason", "unknown_workload")]
        ) == Some(1.0),
        "{samples:?}"
    );
    let samples = scrape(&a1)?;
    ensure!(
        value(
            &samples,
            "dataplane_xds_nacks_total",
            &[("url", ADDRESS_TYPE)]
        ) == Some(1.0),
        "{samples:?}"
    );
    ensure!(
        sum(&samples, "istio_xds_message_total") >= 4.0,
        "{samples:?}"
    );
    ensure!(
        sum(&samples, "istio_xds_message_bytes_total") > 0.0,
        "{samples:?}"
    );
    Ok(())
}

#[test]
fn an_istiod_restart_keeps_the_last_state_serving_and_resumes() -> Result<()> {
    let mut world = World::new("xdsr")?;
    world.publish_mesh("v1")?;
    let w = &world.w;
    let a1 = world.agent("xr", 1)?;
    let a2 = world.agent("xr", 2)?;
    world.enroll(&a1, &w.client, "client")?;
    world.enroll(&a2, &w.remote, "remote")?;
    let _remote = echo_server(&w.remote, 9000)?;
    wait_until("node1's agent to hold istiod's state", || {
        Ok(workload_names(&config_dump(&a1)?).contains(&"remote".to_owned()))
    })?;
    echo(&w.client, addr(&w.remote, 9000), 1000, 1)?;

    let stopped = world.istiod.take().context("istiod")?;
    let port = stopped.addr;
    world.rt.block_on(stopped.stop());
    wait_until("the agent to see istiod gone", || {
        Ok(a1
            .status()?
            .xds
            .is_some_and(|x| x.connected_since.is_none()))
    })?;
    // Nothing is forgotten while istiod is away.
    echo(&world.w.client, addr(&world.w.remote, 9000), 1000, 2)?;
    let status = a1.status()?;
    ensure!(
        !status.healthy(),
        "status flags the lost stream: {status:?}"
    );

    // istiod comes back on the same address with one workload fewer.
    let mut istiod = world.rt.block_on(TestIstiod::start(&world.pki, port))?;
    world
        .rt
        .block_on(istiod.publish(ADDRESS_TYPE, address_resources(&world.mesh, "v1"), &[]))?;
    world
        .rt
        .block_on(istiod.publish(AUTHORIZATION_TYPE, Vec::new(), &[]))?;
    world
        .rt
        .block_on(istiod.publish(ADDRESS_TYPE, Vec::new(), &["uid-local"]))?;
    let resumed = world.rt.block_on(async {
        loop {
            let seen = istiod.next_request(Duration::from_secs(30)).await?;
            if seen.request.type_url == ADDRESS_TYPE && seen.request.response_nonce.is_empty() {
                return anyhow::Ok(seen);
            }
        }
    })?;
    // The resume names what the agent holds, at the versions it got.
    ensure!(
        resumed
            .request
            .initial_resource_versions
            .get("uid-remote")
            .map(String::as_str)
            == Some("v1"),
        "{:?}",
        resumed.request.initial_resource_versions
    );
    ensure!(
        resumed.authorization.as_deref() == Some("Bearer xds-agent-token"),
        "{:?}",
        resumed.authorization
    );
    world.istiod = Some(istiod);
    wait_until(
        "the agent to reconnect and drop the removed workload",
        || {
            let connected = a1
                .status()?
                .xds
                .is_some_and(|x| x.connected_since.is_some() && x.streams >= 2);
            Ok(connected && !workload_names(&config_dump(&a1)?).contains(&"local".to_owned()))
        },
    )?;
    echo(&world.w.client, addr(&world.w.remote, 9000), 1000, 3)?;
    let samples = scrape(&a1)?;
    ensure!(
        sum(&samples, "istio_xds_connection_terminations_total") >= 1.0,
        "{samples:?}"
    );
    Ok(())
}
