//! Certificates from Istio's CA: HBONE between two nodes with them, a CA
//! address other than istiod's, one istiod giving two agents their mesh and
//! certificates, a CA down at start, and a CA answering garbage or another
//! identity.

use super::*;

#[test]
fn istio_ca_certificates_carry_hbone_between_two_nodes() -> Result<()> {
    let mesh = TwoNodes::new("csistio")?;
    let world = IstioCaWorld::start(mesh.dir.path())?;
    let (a1, a2) = world.agents(&mesh, "csi", "1h")?;
    wait_ready(&a1)?;
    wait_ready(&a2)?;
    let _local = echo_server(&mesh.local, 9000)?;
    let _remote = echo_server(&mesh.remote, 9000)?;
    echo(&mesh.client, addr(&mesh.remote, 9000), 256 * 1024, 1)?;
    echo(&mesh.client, addr(&mesh.local, 9000), 256 * 1024, 2)?;

    // The tunnels used the CA's certificates: issued by the test root, and
    // each agent says where its certificates come from.
    for (agent, sa) in [(&a1, "client"), (&a1, "local"), (&a2, "remote")] {
        let cert = agent
            .certs()?
            .into_iter()
            .find(|c| c.identity == spiffe(sa))
            .with_context(|| format!("no certificate for {sa}"))?;
        ensure!(cert.source == "istio", "{cert:?}");
        ensure!(cert.issuer.contains("test mesh root"), "{cert:?}");
    }
    let status = a1.status()?.certificates.context("no certificate status")?;
    ensure!(status.source == "istio" && status.held == 2, "{status:?}");
    ensure!(
        status.description.contains(&world.istiod.addr.to_string()),
        "{status:?}"
    );
    ensure!(status.last_issued.is_some() && status.next_refresh.is_some());
    ensure!(ca_requests(&a1, "success")? >= 2.0);

    // The CA was asked as a node proxy asks for its pods.
    let csrs = world
        .istiod
        .csrs
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .clone();
    let asked: HashSet<String> = csrs.iter().filter_map(|c| c.impersonated.clone()).collect();
    for sa in ["client", "local", "remote"] {
        ensure!(asked.contains(&spiffe(sa)), "no CSR for {sa}: {csrs:?}");
    }
    for csr in &csrs {
        ensure!(
            csr.authorization.as_deref() == Some(&format!("Bearer {TOKEN}")),
            "{csr:?}"
        );
        ensure!(csr.validity_seconds == 3600, "{csr:?}");
    }
    Ok(())
}

#[test]
fn certificates_come_from_the_ca_address_when_it_is_not_istiod() -> Result<()> {
    let mesh = TwoNodes::new("csaddr")?;
    let world = IstioCaWorld::start(mesh.dir.path())?;
    // A second server of Istio's CA API (istio-csr's part), its serving
    // certificate from the same mesh root.
    let ca = world
        .runtime
        .block_on(TestIstiod::start(&world.pki, "127.0.0.1:0".parse()?))?;
    let mut flags = world.flags("1h");
    flags.extend(
        [
            "--ca-address",
            &ca.addr.to_string(),
            "--ca-server-name",
            SERVER_NAME,
        ]
        .map(str::to_owned),
    );
    let config = mesh.config()?;
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let (a1, a2) = (
        mesh.agent("csa", 1, &config, &flags)?,
        mesh.agent("csa", 2, &config, &flags)?,
    );
    wait_ready(&a1)?;
    wait_ready(&a2)?;
    let _remote = echo_server(&mesh.remote, 9000)?;
    echo(&mesh.client, addr(&mesh.remote, 9000), 64 * 1024, 1)?;
    let asked = |server: &TestIstiod| {
        server
            .csrs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    };
    ensure!(asked(&ca) >= 3, "the CA signed {} requests", asked(&ca));
    ensure!(
        asked(&world.istiod) == 0,
        "istiod was asked for certificates: {}",
        asked(&world.istiod)
    );
    Ok(())
}

#[test]
fn one_istiod_gives_two_agents_their_mesh_over_xds_and_their_certificates() -> Result<()> {
    let mesh = TwoNodes::new("csxds")?;
    let world = IstioCaWorld::start(mesh.dir.path())?;
    // Pods are enrolled over the control socket, each with its name as its
    // service account.
    let config = dataplane_tests::mesh::as_istiod_serves(mesh.mesh_config());
    world
        .runtime
        .block_on(world.istiod.publish_mesh(&config, "v1"))?;
    let empty = mesh.dir.path().join("empty.yaml");
    std::fs::write(&empty, "workloads: []\n")?;
    let mut flags = world.flags("1h");
    flags.extend(["--xds", "--instance-ip", "127.0.0.1"].map(str::to_owned));
    let agent = |n: u8| -> Result<Agent> {
        let pod = format!("dataplane-node{n}");
        let mut flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        flags.extend(["--pod-name", pod.as_str()]);
        mesh.agent("csx", n, &empty, &flags)
    };
    let (a1, a2) = (agent(1)?, agent(2)?);
    for (agent, pod, name) in [
        (&a1, &mesh.client, "client"),
        (&a1, &mesh.local, "local"),
        (&a2, &mesh.remote, "remote"),
    ] {
        let mut spec = Agent::spec_for(pod, name);
        spec.service_account = name.to_owned();
        let response = agent.enroll(spec)?;
        ensure!(response.ok, "enrolling {name}: {:?}", response.error);
    }
    wait_ready(&a1)?;
    wait_ready(&a2)?;
    let _remote = echo_server(&mesh.remote, 9000)?;
    echo(&mesh.client, addr(&mesh.remote, 9000), 64 * 1024, 1)?;
    for (agent, sa) in [(&a1, "client"), (&a2, "remote")] {
        let cert = agent
            .certs()?
            .into_iter()
            .find(|c| c.identity == spiffe(sa))
            .with_context(|| format!("no certificate for {sa}"))?;
        ensure!(
            cert.source == "istio" && cert.issuer.contains("test mesh root"),
            "{cert:?}"
        );
    }
    let xds = a1.status()?.xds.context("no xDS status")?;
    ensure!(xds.connected_since.is_some(), "{xds:?}");
    Ok(())
}

#[test]
fn ca_down_at_start_holds_readiness_naming_it_then_traffic_flows() -> Result<()> {
    let mesh = TwoNodes::new("csdown")?;
    let world = IstioCaWorld::start(mesh.dir.path())?;
    world.set_mode(CaMode::Unavailable);
    let (a1, a2) = world.agents(&mesh, "csd", "1h")?;
    let _remote = echo_server(&mesh.remote, 9000)?;
    wait_until("a failed CA request", || {
        Ok(ca_requests(&a1, "error")? >= 1.0)
    })?;

    let (code, body) = readiness(&a1)?;
    ensure!(code == 503, "{code} {body}");
    ensure!(
        body.contains(&format!("Istio's CA at {}", world.istiod.addr))
            && body.contains("the test CA is down")
            && body.contains(&spiffe("client")),
        "{body}"
    );
    ensure!(a1.certs()?.is_empty());
    // Without a certificate the tunnel cannot start: the application's
    // connection ends (at once, not after a hang) and does not echo.
    let out = try_stream(
        &mesh.client,
        &["echo", &addr(&mesh.remote, 9000).to_string(), "100", "1"],
    )?;
    ensure!(out.code != Some(0), "echoed without certificates: {out:?}");

    world.set_mode(CaMode::Sign);
    wait_ready(&a1)?;
    wait_ready(&a2)?;
    echo(&mesh.client, addr(&mesh.remote, 9000), 64 * 1024, 3)?;
    let status = a1.status()?.certificates.context("no certificate status")?;
    ensure!(
        status.failures >= 1 && status.last_failure.is_some(),
        "{status:?}"
    );
    Ok(())
}

#[test]
fn ca_answering_garbage_or_another_identity_is_refused_and_the_good_cert_stays() -> Result<()> {
    let mesh = TwoNodes::new("csbad")?;
    let world = IstioCaWorld::start(mesh.dir.path())?;
    // Refreshes from 10s (half of 20s); the certificate stays valid to 20s.
    let (a1, a2) = world.agents(&mesh, "csb", "20s")?;
    wait_ready(&a1)?;
    wait_ready(&a2)?;
    let _remote = echo_server(&mesh.remote, 9000)?;
    let good = serial(&a1, "client")?.context("no client certificate")?;
    let errors_before = ca_requests(&a1, "error")?;

    for (mode, reason) in [
        (CaMode::Garbage, "element 0"),
        (
            CaMode::WrongIdentity(spiffe("intruder")),
            "the leaf names spiffe://cluster.local/ns/test/sa/intruder",
        ),
    ] {
        world.set_mode(mode);
        // An answer of the previous mode may still be in flight: wait for
        // a refusal of this one, not for any refusal.
        let last_failure = || -> Result<String> {
            let status = a1.status()?.certificates.context("no status")?;
            Ok(status.last_failure.unwrap_or_default())
        };
        wait_until("a refused answer", || Ok(last_failure()?.contains(reason)))?;
        ensure!(serial(&a1, "client")?.as_deref() == Some(good.as_str()));
        echo(&mesh.client, addr(&mesh.remote, 9000), 4096, 1)?;
    }
    ensure!(ca_requests(&a1, "error")? >= errors_before + 2.0);
    world.set_mode(CaMode::Sign);
    wait_until("a good certificate again", || {
        Ok(serial(&a1, "client")?.is_some_and(|s| s != good))
    })?;
    echo(&mesh.client, addr(&mesh.remote, 9000), 4096, 2)?;
    Ok(())
}
