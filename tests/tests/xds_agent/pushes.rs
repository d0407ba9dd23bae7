//! Pushes: ACKed once served, as large as ztunnel takes, and voiding only
//! the same-node fast-path verdicts they concern.

use super::*;

/// As ztunnel, a push is ACKed once the agent's state holds it: the moment
/// istiod sees the ACK of a push of thousands of workloads, the agent
/// serves every one of them (ACKed on arrival, the ACK came long before:
/// the state takes far longer to build than the push to read).
#[test]
fn a_push_is_acked_once_the_agent_serves_it() -> Result<()> {
    pushed_workloads_are_served_at_the_ack(("xdsack", "xa"), "bulk", 250, 4000, 0)
}

/// `resource` with `bytes` more of a field no Workload has (number 1000,
/// skipped when decoded, as protobuf skips unknown fields): a push as
/// large as a mesh of hundreds of thousands of workloads, made of few.
fn padded(mut resource: Resource, bytes: usize) -> Resource {
    use prost::encoding::{WireType, encode_key, encode_varint};
    if let Some(any) = resource.resource.as_mut().filter(|_| bytes > 0) {
        encode_key(1000, WireType::LengthDelimited, &mut any.value);
        encode_varint(bytes as u64, &mut any.value);
        any.value.resize(any.value.len() + bytes, b' ');
    }
    resource
}

/// istiod sends a proxy's whole state in one response, and ztunnel takes
/// one of up to 200 MiB (`src/xds/client.rs`; this agent 512 MiB, held
/// once as received): a push of 70 MiB (a mesh
/// of about 300k workloads) is taken and served, not refused at the
/// 64 MiB this agent once stopped at (its stream then failed and every
/// reconnect got the same push again).
#[test]
fn a_push_as_large_as_ztunnel_takes_is_taken() -> Result<()> {
    pushed_workloads_are_served_at_the_ack(("xdsbig", "xb"), "large", 251, 70, 1024 * 1024)
}

/// Once node1's agent (tags: the world's, the agent's) holds the mesh, one push of `n` workloads named
/// `<prefix><i>` (at 10.`octet`.x.y, each padded with `pad` bytes) is
/// ACKed, and at the ACK the agent serves every one of them.
fn pushed_workloads_are_served_at_the_ack(
    (world_tag, agent_tag): (&str, &str),
    prefix: &str,
    octet: u8,
    n: usize,
    pad: usize,
) -> Result<()> {
    let mut world = World::new(world_tag)?;
    world.publish_mesh("v1")?;
    let a1 = world.agent(agent_tag, 1)?;
    wait_until("node1's agent to hold istiod's state", || {
        Ok(workload_names(&config_dump(&a1)?).contains(&"remote".to_owned()))
    })?;
    let pushed: Vec<Resource> = (0..n)
        .map(|i| {
            let workload = dataplane_user::config::Workload {
                uid: format!("uid-{prefix}{i}").into(),
                name: format!("{prefix}{i}"),
                namespace: NAMESPACE.into(),
                service_account: prefix.into(),
                trust_domain: "cluster.local".into(),
                workload_ips: [std::net::Ipv4Addr::new(10, octet, (i >> 8) as u8, i as u8).into()]
                    .into(),
                ..dataplane_user::config::Workload::default()
            };
            padded(workload_resource(&workload, "v1"), pad)
        })
        .collect();
    let nonce = world.publish(ADDRESS_TYPE, pushed, &[])?;
    world.acked(&nonce)?;
    let held = workload_names(&config_dump(&a1)?)
        .iter()
        .filter(|name| name.starts_with(prefix))
        .count();
    ensure!(
        held == n,
        "ACKed while the agent served {held} of the {n} workloads pushed"
    );
    Ok(())
}

/// `(redirected_outbound, fast_path_outbound)` of `agent`'s kernel counters.
fn ways(agent: &Agent) -> Result<(u64, u64)> {
    Ok((
        agent.counter("redirected_outbound")?,
        agent.counter("fast_path_outbound")?,
    ))
}

/// A push changes only the fast-path verdicts it concerns: one about a pod
/// elsewhere leaves a same-node pair socket to socket; a namespace policy
/// that now denies the pair resets its open fast-path connection and sends
/// the next one back to the proxy, which refuses it. The push is ACKed
/// only once both are done, so every check follows the ACK.
#[test]
fn a_push_revokes_the_fast_path_verdicts_it_concerns_and_no_other() -> Result<()> {
    let mut world = World::new("xdsfp")?;
    world.publish_mesh("v1")?;
    let a1 = world.agent("xf", 1)?;
    wait_until("node1's agent to be ready on istiod's state", || {
        Ok(http(a1.readiness_addr()?, "GET", "/healthz/ready")?.0 == 200)
    })?;
    let w = &world.w;
    world.enroll(&a1, &w.client, "client")?;
    world.enroll(&a1, &w.local, "local")?;
    let _held = echo_server(&w.local, 9001)?;
    // The first connection is decided by the proxy, the next goes socket to
    // socket.
    echo(&w.client, addr(&w.local, 9001), 10, 1)?;
    echo(&w.client, addr(&w.local, 9001), 10, 2)?;
    let decided = ways(&a1)?;
    ensure!(
        decided.0 == 1 && decided.1 == 1,
        "(proxied, socket to socket) = {decided:?}"
    );

    // The remote pod turns unhealthy: its own entry and the service it
    // serves change, the pair's verdict stays.
    let remote = world
        .mesh
        .workloads
        .iter()
        .find(|w| w.name == "remote")
        .context("remote in the mesh")?;
    let mut sick = (**remote).clone();
    sick.status = dataplane_user::config::WorkloadStatus::Unhealthy;
    let nonce = world.publish(ADDRESS_TYPE, vec![workload_resource(&sick, "v2")], &[])?;
    world.acked(&nonce)?;
    let w = &world.w;
    echo(&w.client, addr(&w.local, 9001), 10, 3)?;
    let after = ways(&a1)?;
    ensure!(
        after == (decided.0, decided.1 + 1),
        "a push about another node's pod revoked the pair's verdict: {decided:?} -> {after:?}"
    );

    // A namespace policy denying the port resets the open connection.
    let target = addr(&w.local, 9001).to_string();
    let (outcome, nonce) = std::thread::scope(|scope| -> Result<(String, String)> {
        let holder = scope.spawn(|| stream(&w.client, &["hold-end", &target, "30"]));
        wait_until("the held connection to take the fast path", || {
            Ok(ways(&a1)?.1 > after.1)
        })?;
        let deny = policy(
            "deny-9001",
            NAMESPACE,
            Scope::Namespace,
            Action::Deny,
            to_ports(&[9001]),
        );
        let nonce = world.publish(AUTHORIZATION_TYPE, vec![policy_resource(&deny, "v3")], &[])?;
        let outcome = holder
            .join()
            .map_err(|_| anyhow::anyhow!("the holding client panicked"))??;
        Ok((outcome, nonce))
    })?;
    ensure!(
        outcome == "reset",
        "the denied fast-path connection: {outcome}"
    );
    world.acked(&nonce)?;
    let w = &world.w;
    // The next connection goes to the proxy again, which refuses it.
    let proxied = ways(&a1)?.0;
    let denied = stream(
        &w.client,
        &["expect-reset", &addr(&w.local, 9001).to_string()],
    )?;
    ensure!(denied == "reset", "a denied connection: {denied}");
    ensure!(
        ways(&a1)?.0 == proxied + 1,
        "the denied connection did not go through the proxy"
    );
    Ok(())
}
