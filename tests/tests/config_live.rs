//! The local config as a living source of truth, end to end: services
//! spread load across endpoints and skip a dead one, L4 policies are
//! enforced on HBONE and plaintext inbound, edits apply without restart, a
//! tightened policy closes an open connection it now denies, and a bad file
//! never replaces the last good one.

use std::{net::SocketAddr, path::PathBuf};

use dataplane_tests::{
    Agent, Responder,
    mesh::{TwoNodes, WorkloadEntry, addr, write_config_with},
    traffic::{echo, echo_server, stream, try_stream, wait_until},
};
use dataplane_user::control::Request;

const SERVICE: &str = "services:\n- name: echo\n  namespace: test\n  hostname: echo.test.svc.cluster.local\n  vips: ['/10.96.0.10']\n  ports: {80: 9000}\n";

/// The shared two-node world (node1: client, local; node2: remote,
/// plain, not in the mesh) where `local` and `remote` are endpoints of the
/// `echo` service (VIP 10.96.0.10:80 -> 9000).
struct World(TwoNodes);

impl std::ops::Deref for World {
    type Target = TwoNodes;

    fn deref(&self) -> &TwoNodes {
        &self.0
    }
}

impl World {
    fn new(tag: &str) -> anyhow::Result<Self> {
        Ok(Self(TwoNodes::new(tag)?))
    }

    fn workloads(&self) -> Vec<WorkloadEntry> {
        let endpoint = "  services: {'test/echo.test.svc.cluster.local': {80: 9000}}\n".to_owned();
        let mut local = WorkloadEntry::hbone(&self.local, "local", "node1");
        local.extra = endpoint.clone();
        let mut remote = WorkloadEntry::hbone(&self.remote, "remote", "node2");
        remote.extra = endpoint;
        vec![
            WorkloadEntry::hbone(&self.client, "client", "node1"),
            local,
            remote,
        ]
    }

    fn write(&self, workloads: &[WorkloadEntry], rest: &str) -> anyhow::Result<PathBuf> {
        write_config_with(self.dir.path(), "mesh.yaml", workloads, rest)
    }

    fn agent(&self, n: u8, config: &std::path::Path) -> anyhow::Result<Agent> {
        self.0.agent("cl", n, config, &[])
    }
}

#[test]
fn service_vip_spreads_load_and_skips_a_dead_endpoint() -> anyhow::Result<()> {
    let w = World::new("clsvc")?;
    let config = w.write(&w.workloads(), &format!("{SERVICE}policies: []\n"))?;
    let a1 = w.agent(1, &config)?;
    let mut a2 = w.agent(2, &config)?;
    let local = echo_server(&w.local, 9000)?;
    let remote = echo_server(&w.remote, 9000)?;
    let vip: SocketAddr = "10.96.0.10:80".parse()?;
    for seed in 0..10 {
        echo(&w.client, vip, 1000, seed)?;
    }
    let (l, r) = (local.drain().len(), remote.drain().len());
    assert_eq!(l + r, 10);
    assert!(
        l >= 3 && r >= 3,
        "round-robin spreads: local {l}, remote {r}"
    );

    // node2's agent goes away: its endpoint stops answering on 15008.
    a2.stop()?;
    for seed in 0..6 {
        echo(&w.client, vip, 1000, 100 + seed)?;
    }
    assert_eq!(
        local.drain().len(),
        6,
        "every connection reached the live endpoint"
    );
    assert!(
        a1.log_text()
            .contains("endpoint unreachable; trying the next one")
    );
    Ok(())
}

#[test]
fn policies_are_enforced_on_hbone_and_plaintext() -> anyhow::Result<()> {
    let w = World::new("clpol")?;
    let policies = concat!(
        "policies:\n",
        "- {name: only-client, namespace: test, scope: Namespace, action: Allow,\n",
        "   rules: [[[{principals: ['cluster.local/ns/test/sa/client']}]]]}\n",
        "- {name: no-9001, namespace: test, scope: Global, action: Deny, rules: [[[{destinationPorts: [9001]}]]]}\n",
    );
    let config = w.write(&w.workloads(), &format!("{SERVICE}{policies}"))?;
    let _a1 = w.agent(1, &config)?;
    let a2 = w.agent(2, &config)?;
    let _s9000 = echo_server(&w.remote, 9000)?;
    let _s9001 = echo_server(&w.remote, 9001)?;
    // Allowed: the client's identity, port 9000.
    echo(&w.client, addr(&w.remote, 9000), 4096, 1)?;
    // Denied by the DENY policy, though the ALLOW matches.
    let out = try_stream(
        &w.client,
        &["expect-reset", &addr(&w.remote, 9001).to_string()],
    )?;
    assert_eq!(out.stdout, "reset", "{out:?}");
    // Plaintext from outside the mesh has no principal: no ALLOW matches.
    let out = try_stream(
        &w.plain,
        &["expect-reset", &addr(&w.remote, 9000).to_string()],
    )?;
    assert_eq!(out.stdout, "reset", "{out:?}");
    let log = a2.log_text();
    assert!(log.contains("denied by policy test/no-9001"), "{log}");
    assert!(log.contains("no ALLOW policy matched"), "{log}");
    Ok(())
}

#[test]
fn config_changes_apply_live_and_bad_files_are_rejected() -> anyhow::Result<()> {
    let w = World::new("clreload")?;
    let mut workloads = w.workloads();
    let without_local: Vec<WorkloadEntry> = workloads
        .iter()
        .filter(|e| e.name != "local")
        .cloned()
        .collect();
    let config = w.write(&without_local, &format!("{SERVICE}policies: []\n"))?;
    let a1 = w.agent(1, &config)?;
    let _a2 = w.agent(2, &config)?;
    assert_eq!(a1.call(&Request::List)?.pods.len(), 1);

    // Add a workload: enrolled without restart.
    w.write(&workloads, &format!("{SERVICE}policies: []\n"))?;
    wait_until("`local` to be enrolled", || {
        Ok(a1.call(&Request::List)?.pods.len() == 2)
    })?;

    // A bad file: rejected with its location; traffic keeps flowing.
    std::fs::write(
        &config,
        "workloads:\n- uid: x\n  name: x\n  namespace: test\n  colour: blue\n",
    )?;
    wait_until("the rejection", || {
        Ok(a1.log_text().contains("configuration rejected"))
    })?;
    let log = a1.log_text();
    assert!(log.contains("colour") && log.contains("line 5"), "{log}");
    let _remote = echo_server(&w.remote, 9000)?;
    echo(&w.client, addr(&w.remote, 9000), 2048, 4)?;
    assert_eq!(
        a1.call(&Request::List)?.pods.len(),
        2,
        "last good state kept"
    );

    // Identity change: the remote now runs as another service account.
    workloads[2].service_account = "renamed".into();
    w.write(&workloads, &format!("{SERVICE}policies: []\n"))?;
    wait_until("the new identity on node1", || {
        Ok(a1.log_text().matches("configuration applied").count() >= 2)
    })?;
    // node2 serves the remote under its new identity once it holds that
    // certificate (and only then: the old one is dropped with it).
    wait_until("the remote's re-enrollment", || {
        let certs = _a2.call(&Request::Certs)?.report.unwrap_or_default();
        Ok(certs.to_string().contains("/sa/renamed"))
    })?;
    echo(&w.client, addr(&w.remote, 9000), 2048, 5)?;
    assert!(
        a1.log_text()
            .contains("dst_identity=spiffe://cluster.local/ns/test/sa/renamed"),
        "{}",
        a1.log_text()
    );

    // Remove a workload: unenrolled.
    let without_local: Vec<WorkloadEntry> = workloads
        .iter()
        .filter(|e| e.name != "local")
        .cloned()
        .collect();
    w.write(&without_local, &format!("{SERVICE}policies: []\n"))?;
    wait_until("`local` to be unenrolled", || {
        Ok(a1.call(&Request::List)?.pods.len() == 1)
    })?;
    Ok(())
}

#[test]
fn tightened_policy_closes_an_open_connection_it_now_denies() -> anyhow::Result<()> {
    let w = World::new("cltight")?;
    let config = w.write(&w.workloads(), &format!("{SERVICE}policies: []\n"))?;
    let a1 = w.agent(1, &config)?;
    let a2 = w.agent(2, &config)?;
    let _held = Responder::start(
        w.remote
            .netns
            .run(|| std::net::TcpListener::bind("[::]:9000"))??,
        |req| req.body.clone(),
    )?;
    let _other = echo_server(&w.remote, 9002)?;
    // A connection that stays open (the server waits for the client's FIN).
    let holder = std::thread::scope(|scope| -> anyhow::Result<String> {
        let held = scope.spawn(|| {
            stream(
                &w.client,
                &["hold", &addr(&w.remote, 9000).to_string(), "30"],
            )
        });
        // The tunnel is up once the client's side has dialled; the server
        // holds the connection until our FIN (or its 10 s read timeout).
        wait_until("the tunnel to be up", || {
            Ok(a1.log_text().contains("HBONE connection established"))
        })?;
        let deny = "policies:\n- {name: lockdown, namespace: test, scope: Namespace, action: Deny, rules: [[[{destinationPorts: [9000]}]]]}\n";
        w.write(&w.workloads(), &format!("{SERVICE}{deny}"))?;
        held.join()
            .map_err(|_| anyhow::anyhow!("holder panicked"))?
    })?;
    assert_eq!(holder, "closed", "the denied connection was closed");
    assert!(
        a2.log_text().contains("policy now denies it"),
        "{}",
        a2.log_text()
    );
    // Connections the new policy allows are untouched and still work.
    echo(&w.client, addr(&w.remote, 9002), 1024, 8)?;
    Ok(())
}

#[test]
fn an_empty_or_half_written_file_never_unenrolls_the_pods() -> anyhow::Result<()> {
    let w = World::new("clempty")?;
    let workloads = w.workloads();
    let rest = format!("{SERVICE}policies: []\n");
    let config = w.write(&workloads, &rest)?;
    let a1 = w.agent(1, &config)?;
    let enrolled = || -> anyhow::Result<usize> { Ok(a1.call(&Request::List)?.pods.len()) };
    assert_eq!(enrolled()?, 2);

    // Truncated to nothing (a config being written, a volume not yet
    // filled): refused, the pods stay.
    std::fs::write(&config, "")?;
    wait_until("the empty file's rejection", || {
        Ok(a1
            .status()?
            .config_error
            .is_some_and(|e| e.contains("is empty")))
    })?;
    assert_eq!(enrolled()?, 2, "an empty file unenrolled pods");

    // A file that never holds still (each read differs from the one
    // before) is never applied, even though every version is valid and
    // drops `local`.
    let without_local: Vec<WorkloadEntry> = workloads
        .iter()
        .filter(|e| e.name != "local")
        .cloned()
        .collect();
    for round in 0..60 {
        write_config_with(
            w.dir.path(),
            "mesh.yaml",
            &without_local,
            &format!("# version {round}\n{rest}"),
        )?;
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert_eq!(enrolled()?, 2, "a version read only once was applied");
    // Once it holds still, it is applied.
    wait_until("the settled file to apply", || Ok(enrolled()? == 1))?;
    assert!(a1.status()?.config_error.is_none());
    Ok(())
}
