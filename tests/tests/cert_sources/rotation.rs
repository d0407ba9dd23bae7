//! Rotation through the CA: a long-lived connection stays open, and peers
//! of the old and the new root keep talking during the overlap.

use super::*;

#[test]
fn rotation_through_the_ca_keeps_a_long_lived_connection_open() -> Result<()> {
    let mesh = TwoNodes::new("csrot")?;
    let world = IstioCaWorld::start(mesh.dir.path())?;
    let (a1, a2) = world.agents(&mesh, "csr", "3s")?;
    wait_ready(&a1)?;
    wait_ready(&a2)?;
    let _remote = echo_server(&mesh.remote, 9000)?;
    let _held = holding_server(&mesh.remote, 9100)?;
    std::thread::scope(|scope| -> Result<()> {
        // One connection open across several rotations of both ends.
        let hold = scope.spawn(|| {
            try_stream(
                &mesh.client,
                &["hold", &addr(&mesh.remote, 9100).to_string(), "12"],
            )
        });
        let (mut client_serials, mut remote_serials) = (HashSet::new(), HashSet::new());
        let mut seed = 0;
        wait_until("three certificates on each side", || {
            client_serials.extend(serial(&a1, "client")?);
            remote_serials.extend(serial(&a2, "remote")?);
            seed += 1;
            echo(&mesh.client, addr(&mesh.remote, 9000), 16 * 1024, seed)?;
            Ok(client_serials.len() >= 3 && remote_serials.len() >= 3)
        })?;
        let held = hold
            .join()
            .map_err(|_| anyhow::anyhow!("hold thread panicked"))??;
        ensure!(
            held.stdout == "open",
            "the long-lived connection ended during rotation: {held:?}"
        );
        Ok(())
    })?;
    ensure!(ca_requests(&a1, "success")? >= 4.0);
    Ok(())
}

#[test]
fn root_rotation_keeps_peers_of_the_old_and_new_root_talking_during_the_overlap() -> Result<()> {
    let mut mesh = TwoNodes::new("csroot")?;
    let world = IstioCaWorld::start(mesh.dir.path())?;
    world.istiod.new_root("second root")?;
    let (a1, a2) = world.agents(&mesh, "csro", "20s")?;
    wait_ready(&a1)?;
    wait_ready(&a2)?;
    let _local = echo_server(&mesh.local, 9000)?;
    let _remote = echo_server(&mesh.remote, 9000)?;
    let _held = holding_server(&mesh.remote, 9100)?;
    let current_roots = |agent: &Agent| -> Result<usize> {
        let status = agent.status()?.certificates.context("no status")?;
        Ok(status
            .roots
            .iter()
            .filter(|r| r.retiring_at.is_none())
            .count())
    };
    let issuer = |agent: &Agent, sa: &str| -> Result<String> {
        Ok(agent
            .certs()?
            .into_iter()
            .find(|c| c.identity == spiffe(sa))
            .map(|c| c.issuer)
            .unwrap_or_default())
    };
    std::thread::scope(|scope| -> Result<()> {
        let hold = scope.spawn(|| {
            try_stream(
                &mesh.client,
                &["hold", &addr(&mesh.remote, 9100).to_string(), "25"],
            )
        });
        // A two-root bundle: still signing with the first root, both sent.
        world.istiod.ca_roots("mesh", &["mesh", "second root"])?;
        wait_until("both agents to trust two roots", || {
            Ok(current_roots(&a1)? == 2 && current_roots(&a2)? == 2)
        })?;
        echo(&mesh.client, addr(&mesh.remote, 9000), 16 * 1024, 1)?;

        // The switch: signs with the second root and sends only it. node2's
        // `remote` cannot refresh (its CA requests fail), so it keeps its
        // certificate from the first root while node1's pods move on.
        world
            .istiod
            .ca_refused
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(spiffe("remote"));
        world.istiod.ca_roots("second root", &["second root"])?;
        wait_until("node1's pods on the second root", || {
            Ok(issuer(&a1, "client")?.contains("second root")
                && issuer(&a1, "local")?.contains("second root"))
        })?;
        ensure!(issuer(&a2, "remote")?.contains("test mesh root"));
        // New-root client to old-root server, and old-root client to
        // new-root server.
        echo(&mesh.client, addr(&mesh.remote, 9000), 16 * 1024, 2)?;
        let other_way = try_stream(
            &mesh.remote,
            &["echo", &addr(&mesh.local, 9000).to_string(), "4096", "3"],
        )?;
        ensure!(other_way.code == Some(0), "{other_way:?}");
        let roots = a1.status()?.certificates.context("no status")?.roots;
        ensure!(
            roots.len() == 2 && roots.iter().any(|r| r.retiring_at.is_some()),
            "node1 keeps the first root as retiring: {roots:?}"
        );

        // `remote` refreshes: everyone on the second root.
        world
            .istiod
            .ca_refused
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
        wait_until("remote on the second root", || {
            Ok(issuer(&a2, "remote")?.contains("second root"))
        })?;
        echo(&mesh.client, addr(&mesh.remote, 9000), 16 * 1024, 4)?;
        let held = hold
            .join()
            .map_err(|_| anyhow::anyhow!("hold thread panicked"))??;
        ensure!(
            held.stdout == "open",
            "the long-lived connection ended during the root rotation: {held:?}"
        );
        Ok(())
    })?;
    // A pod enrolled later gets the new root's certificate at once.
    let extra = mesh.n1.add_pod("csroot")?;
    a1.enroll(Agent::spec_for(&extra, "late"))?;
    wait_until("the late pod's certificate", || {
        Ok(issuer(&a1, "default")?.contains("second root"))
    })?;
    Ok(())
}
