//! Istio's telemetry, label for label: a connection to a service VIP is
//! attributed to the service on both sides (the client's agent names it in
//! `forwarded: host=`, the destination's reads it back and only believes
//! it for a service that selects the workload), a direct connection is
//! attributed by the port it reached, and the mesh's workload facts (owner
//! workload, canonical service and revision, cluster, locality) fill
//! Istio's labels.
//!
//! State is read from `/metrics` only.

use std::net::SocketAddr;

use dataplane_tests::{
    mesh::{ECHO_VIP, TwoNodes, addr, write_config},
    observe::{family, scrape, sum_matching as matching},
    traffic::{echo, echo_server, wait_until},
};
use dataplane_user::config::Locality;

#[test]
fn service_attribution_and_workload_facts_reach_istios_labels() -> anyhow::Result<()> {
    let w = TwoNodes::new("tlabel")?;
    let mut config = w.echo_config();
    for workload in &mut config.workloads {
        let workload = std::sync::Arc::make_mut(workload);
        if workload.name == "remote" {
            workload.workload_name = "remote-deploy".into();
            workload.canonical_name = "remote-app".into();
            workload.canonical_revision = "v7".into();
            workload.cluster_id = "east".into();
            workload.locality = Some(std::sync::Arc::new(Locality {
                region: "eu".into(),
                zone: "eu-1".into(),
                subzone: "".into(),
            }));
        }
    }
    let (a1, a2) = w.agents("tl", &config)?;
    let _local = echo_server(&w.local, 9000)?;
    let remote = echo_server(&w.remote, 9000)?;
    // Through the VIP until the remote endpoint had two (round robin
    // alternates), then once directly.
    let vip = SocketAddr::new(ECHO_VIP, 80);
    let mut to_remote = 0;
    for seed in 0..20 {
        echo(&w.client, vip, 100, seed)?;
        to_remote += remote.drain().len();
        if to_remote >= 2 {
            break;
        }
    }
    anyhow::ensure!(
        to_remote == 2,
        "the VIP never reached the remote endpoint twice"
    );
    echo(&w.client, addr(&w.remote, 9000), 100, 99)?;
    wait_until("node2 to count three closed connections", || {
        Ok(matching(&scrape(&a2)?, "istio_tcp_connections_closed_total", &[]) >= 3.0)
    })?;

    let service = [
        ("destination_service", "echo.test.svc.cluster.local"),
        ("destination_service_name", "echo"),
        ("destination_service_namespace", "test"),
    ];
    let remote_facts = [
        ("destination_workload", "remote-deploy"),
        ("destination_canonical_service", "remote-app"),
        ("destination_app", "remote-app"),
        ("destination_canonical_revision", "v7"),
        ("destination_version", "v7"),
        ("destination_cluster", "east"),
        ("destination_region", "eu"),
        ("destination_zone", "eu-1"),
    ];
    let opened = "istio_tcp_connections_opened_total";
    let (s1, s2) = (scrape(&a1)?, scrape(&a2)?);
    // The destination side: all three attributed to the service (two by
    // the host the client named, one by the target port), with the
    // server's facts.
    let mut both: Vec<(&str, &str)> = service.to_vec();
    both.extend(remote_facts);
    both.push(("reporter", "destination"));
    both.push(("source_workload", "client"));
    assert_eq!(
        matching(&s2, opened, &both),
        3.0,
        "{:#?}",
        family(&s2, opened)
    );
    // The client's side: the two through the VIP name the service, the
    // direct one does not.
    let mut source_side: Vec<(&str, &str)> = service.to_vec();
    source_side.extend(remote_facts);
    source_side.push(("reporter", "source"));
    assert_eq!(
        matching(&s1, opened, &source_side),
        2.0,
        "{:#?}",
        family(&s1, opened)
    );
    let direct = [
        ("reporter", "source"),
        ("destination_workload", "remote-deploy"),
        ("destination_service", "unknown"),
    ];
    assert_eq!(
        matching(&s1, opened, &direct),
        1.0,
        "{:#?}",
        family(&s1, opened)
    );
    Ok(())
}

/// A client the destination's mesh state does not know (as one in another
/// cluster) is named in Istio's labels by the `baggage` its node sent, as
/// ztunnel derives a source from baggage (`src/proxy/inbound.rs`); the
/// principal stays the verified one.
#[test]
fn an_unknown_clients_baggage_names_it() -> anyhow::Result<()> {
    let w = TwoNodes::new("tlbag")?;
    let mut config = w.echo_config();
    for workload in &mut config.workloads {
        let workload = std::sync::Arc::make_mut(workload);
        if workload.name == "client" {
            workload.canonical_name = "client-app".into();
            workload.canonical_revision = "v3".into();
            workload.cluster_id = "west".into();
        }
    }
    let mut unaware = config.clone();
    unaware.workloads.retain(|w| w.name != "client");
    let a1 = w.agent("tb", 1, &w.write(&config)?, &[])?;
    let a2 = w.agent(
        "tb",
        2,
        &write_config(w.dir.path(), "unaware.yaml", &unaware)?,
        &[],
    )?;
    let _remote = echo_server(&w.remote, 9000)?;
    echo(&w.client, addr(&w.remote, 9000), 100, 1)?;
    wait_until("node2 to count the connection", || {
        Ok(matching(&scrape(&a2)?, "istio_tcp_connections_closed_total", &[]) >= 1.0)
    })?;
    let opened = "istio_tcp_connections_opened_total";
    let s2 = scrape(&a2)?;
    let from_baggage = [
        ("reporter", "destination"),
        ("source_workload_namespace", "test"),
        ("source_canonical_service", "client-app"),
        ("source_app", "client-app"),
        ("source_canonical_revision", "v3"),
        ("source_version", "v3"),
        ("source_cluster", "west"),
        (
            "source_principal",
            "spiffe://cluster.local/ns/test/sa/client",
        ),
    ];
    assert_eq!(
        matching(&s2, opened, &from_baggage),
        1.0,
        "{:#?}",
        family(&s2, opened)
    );
    let unknown_workload = [("reporter", "destination"), ("source_workload", "unknown")];
    assert_eq!(
        matching(&s2, opened, &unknown_workload),
        0.0,
        "{:#?}",
        family(&s2, opened)
    );
    drop(a1);
    Ok(())
}
