//! Waypoints (ambient's L7 proxies), end to end with a stand-in: a workload
//! behind a waypoint is reached through it (the client's node tunnels to
//! the waypoint with the original destination as `:authority`, the
//! waypoint tunnels on with its own identity); what goes around it
//! (plaintext from outside the mesh, a tunnel from a client whose node
//! does not know of the waypoint) is let in or refused by authorization
//! policy alone, as ztunnel does.
//!
//! A waypoint service's instance is dialled at the port the waypoint's
//! HBONE port maps to as a port of that service (ztunnel `src/state.rs`
//! `fetch_waypoint` -> `find_upstream_from_service`), which a stock
//! ztunnel is checked to do as well.
//!
//! What went through the waypoint is counted by the stand-in itself;
//! refusals are what the clients see (a reset) and the destination's
//! `/metrics`.

use dataplane_tests::{
    mesh::{NAMESPACE, TwoNodes, addr, endpoint_of, hbone_workload, policy, service, write_config},
    observe::{family, scrape, value},
    traffic::{echo, echo_server, try_stream, wait_until},
    waypoint::WaypointStandIn,
    ztunnel_client::ztunnel_asks,
};
use dataplane_user::{
    config::{Action, LocalConfig, Match, Scope, Waypoint},
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
            let workload = std::sync::Arc::make_mut(workload);
            if workload.name == "remote" {
                workload.waypoint = Some(Box::new(Waypoint {
                    address: Some(w.plain.ip4.into()),
                    network: None,
                    hostname: None,
                    hbone_port: 15008,
                }));
            }
        }
    }
    config.workloads.push(waypoint.into());
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

/// ztunnel's rule (`src/proxy/inbound.rs`: nothing waypoint-related but
/// authorization policy): a client that goes around the waypoint reaches
/// the workload unless a policy says otherwise, and the policy Istio users
/// write for it (ALLOW only the waypoint's principal) keeps it out.
#[test]
fn a_workload_behind_a_waypoint_is_reached_through_it_and_around_it_only_as_policy_allows()
-> anyhow::Result<()> {
    let w = TwoNodes::new("wpt")?;
    // node1 and node2 read their own files, so node1 can be made to
    // forget the waypoint while node2 still knows of it.
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

    // Around it, with no policy in the way: plaintext from outside the
    // mesh, and a tunnel from a node that forgot the waypoint.
    echo(&w.plain, dst, 100, 3)?;
    write_config(w.dir.path(), "node1.yaml", &mesh(&w, false))?;
    wait_until("node1 to apply the file without the waypoint", || {
        Ok(reloads_applied(&a1)? == 1.0)
    })?;
    echo(&w.client, dst, 100, 4)?;
    assert_eq!(standin.forwarded(), 2, "neither went through the waypoint");
    assert_eq!(server.drain().len(), 2, "both reached the app");

    // Only the waypoint's principal allowed in: both are refused now.
    let mut locked = mesh(&w, true);
    locked.policies = vec![policy(
        "waypoint-only",
        NAMESPACE,
        Scope::WorkloadSelector,
        Action::Allow,
        Match {
            principals: vec![format!("cluster.local/ns/{NAMESPACE}/sa/waypoint")],
            ..Match::default()
        },
    )];
    for workload in &mut locked.workloads {
        let workload = std::sync::Arc::make_mut(workload);
        if workload.name == "remote" {
            workload.authorization_policies = [format!("{NAMESPACE}/waypoint-only")].into();
        }
    }
    write_config(w.dir.path(), "node2.yaml", &locked)?;
    wait_until("node2 to apply the policy", || {
        Ok(reloads_applied(&a2)? == 1.0)
    })?;
    assert!(
        resets(&w.client, dst)?,
        "a tunnel around the waypoint was let through"
    );
    assert!(
        resets(&w.plain, dst)?,
        "plaintext around the waypoint was let through"
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

    // Through the waypoint it still goes.
    write_config(w.dir.path(), "node1.yaml", &mesh(&w, true))?;
    wait_until("node1 to apply the file with the waypoint again", || {
        Ok(reloads_applied(&a1)? == 2.0)
    })?;
    echo(&w.client, dst, 100, 5)?;
    assert_eq!(standin.forwarded(), 3);
    assert_eq!(server.drain().len(), 1);
    Ok(())
}

/// The VIP of the waypoint service of [`mapped_port_mesh`].
const WAYPOINT_VIP: std::net::IpAddr = std::net::IpAddr::V4(std::net::Ipv4Addr::new(10, 96, 0, 77));
/// The port that service maps the HBONE port (15008) to.
const MAPPED_HBONE_PORT: u16 = 15019;

/// The world's mesh with `remote` behind the waypoint service at
/// [`WAYPOINT_VIP`] (named by address), whose HBONE port maps to
/// [`MAPPED_HBONE_PORT`] (the service's and its instance's own mapping,
/// as istiod sends a Kubernetes service's); its one instance is
/// `waypoint` (the `plain` pod, not enrolled: the stand-in runs there).
fn mapped_port_mesh(w: &TwoNodes) -> LocalConfig {
    let mut config = mesh(w, false);
    let waypoints = service(
        "waypoint",
        NAMESPACE,
        WAYPOINT_VIP,
        &[(15008, MAPPED_HBONE_PORT)],
    );
    for workload in &mut config.workloads {
        let workload = std::sync::Arc::make_mut(workload);
        match workload.name.as_str() {
            "waypoint" => endpoint_of(workload, &waypoints),
            "remote" => {
                workload.waypoint = Some(Box::new(Waypoint {
                    address: Some(WAYPOINT_VIP),
                    network: None,
                    hostname: None,
                    hbone_port: 15008,
                }));
            }
            _ => {}
        }
    }
    config.services.push(waypoints);
    config
}

/// ztunnel `src/state.rs` `fetch_waypoint`: the waypoint service's
/// instance takes the tunnel on the port 15008 maps to, not on 15008
/// (where nothing listens here), with the original destination as
/// `:authority`.
#[test]
fn a_waypoint_service_is_reached_at_the_port_its_hbone_port_maps_to() -> anyhow::Result<()> {
    let w = TwoNodes::new("wpm")?;
    let (_a1, _a2) = w.agents("wpm", &mapped_port_mesh(&w))?;
    let remote_identity = Identity::new("cluster.local", NAMESPACE, "remote")?;
    let standin = WaypointStandIn::start_on(
        &w.plain,
        MAPPED_HBONE_PORT,
        &w.shared_ca(),
        (NAMESPACE, "waypoint"),
        &[(w.remote.ip4.into(), remote_identity)],
    )?;
    let server = echo_server(&w.remote, 9000)?;
    echo(&w.client, addr(&w.remote, 9000), 10_000, 1)?;
    assert_eq!(standin.forwarded(), 1, "it went through the waypoint");
    assert_eq!(server.drain().len(), 1);
    Ok(())
}

/// The same mesh with a stock ztunnel (`DATAPLANE_ZTUNNEL`, ignored
/// without one) as the client's node proxy: it asks the waypoint's
/// instance on the mapped port for the original destination, as the test
/// above expects of our engine.
#[test]
#[ignore = "needs a ztunnel binary in DATAPLANE_ZTUNNEL"]
fn a_stock_ztunnel_reaches_a_waypoint_service_at_the_mapped_port_too() -> anyhow::Result<()> {
    let w = TwoNodes::new("wpz")?;
    let dst = addr(&w.remote, 9000);
    let asked = ztunnel_asks(
        &w,
        "wpz",
        mapped_port_mesh(&w),
        ("waypoint", MAPPED_HBONE_PORT),
        dst,
    )?;
    assert_eq!(
        asked,
        [dst.to_string()],
        "ztunnel asked the waypoint at the mapped port"
    );
    Ok(())
}

/// The world's mesh with `remote` behind the waypoint named by the
/// hostname `waypoint.example.com`, which no service has: the `waypoint`
/// workload (the `plain` pod) has it.
fn hostname_workload_mesh(w: &TwoNodes) -> LocalConfig {
    let mut config = mesh(w, false);
    for workload in &mut config.workloads {
        let workload = std::sync::Arc::make_mut(workload);
        match workload.name.as_str() {
            "waypoint" => workload.hostname = "waypoint.example.com".into(),
            "remote" => {
                workload.waypoint = Some(Box::new(Waypoint {
                    address: None,
                    network: None,
                    hostname: Some(format!("{NAMESPACE}/waypoint.example.com")),
                    hbone_port: 15008,
                }));
            }
            _ => {}
        }
    }
    config
}

/// ztunnel `src/state.rs` `find_hostname`: a waypoint hostname no service
/// has is the workload of that hostname, reached at the HBONE port.
#[test]
fn a_waypoint_named_by_a_workloads_hostname_is_that_workload() -> anyhow::Result<()> {
    let w = TwoNodes::new("wph")?;
    let (_a1, _a2) = w.agents("wph", &hostname_workload_mesh(&w))?;
    let remote_identity = Identity::new("cluster.local", NAMESPACE, "remote")?;
    let standin = WaypointStandIn::start(
        &w.plain,
        &w.shared_ca(),
        NAMESPACE,
        "waypoint",
        &[(w.remote.ip4.into(), remote_identity)],
    )?;
    let server = echo_server(&w.remote, 9000)?;
    echo(&w.client, addr(&w.remote, 9000), 10_000, 1)?;
    assert_eq!(standin.forwarded(), 1, "it went through the waypoint");
    assert_eq!(server.drain().len(), 1);
    Ok(())
}

/// A stock ztunnel as the client's node proxy does the same.
#[test]
#[ignore = "needs a ztunnel binary in DATAPLANE_ZTUNNEL"]
fn a_stock_ztunnel_reaches_a_waypoint_named_by_a_workloads_hostname_too() -> anyhow::Result<()> {
    let w = TwoNodes::new("wpy")?;
    let dst = addr(&w.remote, 9000);
    let asked = ztunnel_asks(
        &w,
        "wpy",
        hostname_workload_mesh(&w),
        ("waypoint", 15008),
        dst,
    )?;
    assert_eq!(
        asked,
        [dst.to_string()],
        "ztunnel asked the waypoint workload"
    );
    Ok(())
}
