//! Snapshots, Adds and Dels as ztunnel receives them, their acks, NACKs
//! and timeouts, and a reconnecting ztunnel.

use super::*;

#[test]
fn zds_hello_gets_a_snapshot_of_registered_pods_with_their_namespaces() -> anyhow::Result<()> {
    let (ns_a, pod_a) = pod("a")?;
    let (ns_b, pod_b) = pod("b")?;
    let (ns_c, pod_c) = pod("c")?;
    let server = Server::start(|_| {}, vec![pod_a])?;
    assert_eq!(server.handle.add_blocking(pod_b)?, AddOutcome::NoZtunnel);
    // A blocking call from async code is refused, not deadlocked.
    let (_ns_d, pod_d) = pod("d")?;
    let refused = server
        .runtime
        .block_on(async { server.handle.add_blocking(pod_d) });
    assert!(
        matches!(refused, Err(ZdsError::Runtime { .. })),
        "{refused:?}"
    );

    let mut ztunnel = server.connect()?;
    let snapshot = ztunnel.ack_snapshot()?;
    assert_eq!(snapshot.len(), 2, "{snapshot:?}");
    check_add(&snapshot[0], "a", &ns_a)?;
    check_add(&snapshot[1], "b", &ns_b)?;
    let me = i32::try_from(std::process::id())?;
    for uid in ["a", "b"] {
        match server.event()? {
            Event::Acked(got, peer) if got == uid && peer.pid == me => {}
            other => anyhow::bail!("expected {uid} acked by pid {me}, got {other:?}"),
        }
    }
    let status = server.handle.status();
    assert_eq!(status.connections.len(), 1);
    assert!(status.connections[0].hello);
    assert_eq!(status.connections[0].peer.pid, me);
    assert!(
        status
            .pods
            .iter()
            .all(|p| matches!(p.state, PodZdsState::Acked { peer, .. } if peer.pid == me)),
        "{status:?}"
    );

    // Later pods come one at a time, after the one SnapshotSent (the
    // client fails on a second).
    let caller = server.add_in_background(pod_c);
    let request = ztunnel.expect()?;
    check_add(&request, "c", &ns_c)?;
    ztunnel.ack()?;
    match join(caller)?? {
        AddOutcome::Acked { peer } => assert_eq!(peer.pid, me),
        other => anyhow::bail!("expected an ack, got {other:?}"),
    }
    Ok(())
}

#[test]
fn zds_later_adds_go_to_the_newest_connection_and_dels_to_all() -> anyhow::Result<()> {
    let server = Server::start(|_| {}, vec![])?;
    let mut old = server.connect()?;
    assert!(old.ack_snapshot()?.is_empty());
    let mut new = server.connect()?;
    assert!(new.ack_snapshot()?.is_empty());
    let status = server.handle.status();
    let (old_id, new_id) = (
        status.connections[0].peer.connection,
        status.connections[1].peer.connection,
    );

    let (ns_p, pod_p) = pod("p")?;
    let caller = server.add_in_background(pod_p);
    check_add(&new.expect()?, "p", &ns_p)?;
    new.ack()?;
    match join(caller)?? {
        AddOutcome::Acked { peer } => assert_eq!(peer.connection, new_id),
        other => anyhow::bail!("expected an ack from the newest connection, got {other:?}"),
    }
    assert!(
        matches!(server.event()?, Event::Acked(uid, peer) if uid == "p" && peer.connection == new_id)
    );

    let handle = server.handle.clone();
    let deleter = thread::spawn(move || handle.del_blocking("p"));
    // The old connection's first request after its snapshot is the Del:
    // it never saw the Add.
    for ztunnel in [&mut old, &mut new] {
        match ztunnel.expect()? {
            ZdsRequest::Del { uid } if uid == "p" => ztunnel.ack()?,
            other => anyhow::bail!("expected Del of p, got {other:?}"),
        }
    }
    let outcome = join(deleter)??;
    assert_eq!((outcome.connections, outcome.acked), (2, 2), "{outcome:?}");
    assert!(server.handle.status().pods.is_empty());

    // The newest goes away: Adds go to the one left.
    drop(new);
    match server.event()? {
        Event::Disconnected(peer) => assert_eq!(peer.connection, new_id),
        other => anyhow::bail!("expected the newest to disconnect, got {other:?}"),
    }
    let (ns_q, pod_q) = pod("q")?;
    let caller = server.add_in_background(pod_q);
    check_add(&old.expect()?, "q", &ns_q)?;
    old.ack()?;
    match join(caller)?? {
        AddOutcome::Acked { peer } => assert_eq!(peer.connection, old_id),
        other => anyhow::bail!("expected an ack from the remaining connection, got {other:?}"),
    }
    Ok(())
}

#[test]
fn zds_a_nacked_add_shows_its_error_and_is_retried_until_acked() -> anyhow::Result<()> {
    let server = Server::start(|c| c.retry_first = Duration::from_millis(100), vec![])?;
    let mut ztunnel = server.connect()?;
    ztunnel.ack_snapshot()?;
    let (ns_p, pod_p) = pod("p")?;
    let error = "failed to bind 15008: address in use";
    let caller = server.add_in_background(pod_p);
    check_add(&ztunnel.expect()?, "p", &ns_p)?;
    ztunnel.nack(error)?;
    assert_eq!(
        join(caller)??,
        AddOutcome::Nacked {
            error: error.into()
        }
    );
    for attempts in 1..=2 {
        // The retry arrives after the status recorded the failure.
        check_add(&ztunnel.expect()?, "p", &ns_p)?;
        let status = server.handle.status();
        match &status.pods[0].state {
            PodZdsState::Failed {
                error: shown,
                attempts: n,
                ..
            } => {
                assert_eq!(shown, error);
                assert_eq!(*n, attempts);
            }
            other => anyhow::bail!("expected the pod failed, got {other:?}"),
        }
        if attempts == 1 {
            ztunnel.nack(error)?;
        } else {
            ztunnel.ack()?;
        }
    }
    match server.event()? {
        Event::Acked(uid, _) => assert_eq!(uid, "p"),
        other => anyhow::bail!("expected p acked, got {other:?}"),
    }
    assert!(matches!(
        server.handle.status().pods[0].state,
        PodZdsState::Acked { .. }
    ));
    Ok(())
}

#[test]
fn zds_an_add_never_acked_times_out_and_the_pod_waits_for_the_next_snapshot() -> anyhow::Result<()>
{
    let server = Server::start(|c| c.io_timeout = Duration::from_secs(1), vec![])?;
    let mut silent = server.connect()?;
    silent.ack_snapshot()?;
    let (ns_p, pod_p) = pod("p")?;
    let caller = server.add_in_background(pod_p);
    check_add(&silent.expect()?, "p", &ns_p)?;
    // No answer: the server gives up and drops the connection.
    assert_eq!(join(caller)??, AddOutcome::TimedOut);
    silent.expect_closed()?;
    assert!(matches!(server.event()?, Event::Disconnected(_)));
    let status = server.handle.status();
    assert!(status.connections.is_empty());
    match &status.pods[0].state {
        PodZdsState::Failed { error, .. } => assert!(error.contains("did not finish"), "{error}"),
        other => anyhow::bail!("expected the pod failed, got {other:?}"),
    }

    let mut ztunnel = server.connect()?;
    let snapshot = ztunnel.ack_snapshot()?;
    assert_eq!(snapshot.len(), 1);
    check_add(&snapshot[0], "p", &ns_p)?;
    Ok(())
}

#[test]
fn zds_a_reconnecting_ztunnel_gets_the_snapshot_again_and_the_observer_hears() -> anyhow::Result<()>
{
    let (ns_p, pod_p) = pod("p")?;
    let server = Server::start(|_| {}, vec![pod_p])?;
    let mut first = server.connect()?;
    check_add(&first.ack_snapshot()?[0], "p", &ns_p)?;
    let Event::Acked(_, first_peer) = server.event()? else {
        anyhow::bail!("expected an ack event");
    };
    // ztunnel restarts.
    drop(first);
    assert_eq!(server.event()?, Event::Disconnected(first_peer));
    assert!(matches!(
        server.handle.status().pods[0].state,
        PodZdsState::Waiting
    ));

    let mut second = server.connect()?;
    check_add(&second.ack_snapshot()?[0], "p", &ns_p)?;
    match server.event()? {
        Event::Acked(uid, peer) => {
            assert_eq!(uid, "p");
            assert_ne!(peer.connection, first_peer.connection);
        }
        other => anyhow::bail!("expected p acked again, got {other:?}"),
    }
    // Forgotten pods are not in the next snapshot.
    let handle = server.handle.clone();
    let deleter = thread::spawn(move || handle.del_blocking("p"));
    assert!(matches!(second.expect()?, ZdsRequest::Del { .. }));
    second.ack()?;
    join(deleter)??;
    drop(second);
    let mut third = server.connect()?;
    assert!(third.ack_snapshot()?.is_empty());
    Ok(())
}
