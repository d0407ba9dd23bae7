//! Workload certificates from Istio's CA and from mounted files, end to
//! end: two simulated nodes, one agent per node, pods enrolled from a shared
//! local config, HBONE between them with certificates the agents did not
//! make themselves.
//!
//! The CA is the test control plane ([`TestIstiod`]) on loopback, over real
//! gRPC and TLS; its requests are inspected as it saw them (identity
//! impersonated, bearer token). What the agents hold comes from their
//! certificate lists and status; readiness and metrics from their HTTP
//! endpoints; what a peer is presented from a TLS client of our own
//! ([`StrangerTls`]) that reads the server's certificate.
//!
//! Topology: [`TwoNodes`]: `client` and `local` on node1, `remote` and the
//! out-of-mesh `plain` on node2.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::PoisonError;
use std::time::Duration;

use anyhow::{Context as _, Result, ensure};
use dataplane_tests::{
    Agent,
    istiod::{CaMode, SERVER_NAME, TestIstiod, TestPki, istiod_flags},
    mesh::{NAMESPACE, TwoNodes, addr},
    observe::{scrape, value},
    stranger::StrangerTls,
    traffic::{echo, echo_server, holding_server, http, try_stream, wait_until},
};

const TOKEN: &str = "node-agent-token-42";

fn spiffe(sa: &str) -> String {
    format!("spiffe://cluster.local/ns/{NAMESPACE}/sa/{sa}")
}

/// The test control plane and the files an agent needs to use its CA.
struct IstioCaWorld {
    istiod: TestIstiod,
    /// The mesh root and istiod's serving certificate.
    pki: TestPki,
    root_file: PathBuf,
    token_file: PathBuf,
    /// Owns the control plane's tasks; dropped last.
    runtime: tokio::runtime::Runtime,
}

impl IstioCaWorld {
    fn start(dir: &Path) -> Result<Self> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        let pki = TestPki::generate()?;
        let istiod = runtime.block_on(TestIstiod::start(&pki, "127.0.0.1:0".parse()?))?;
        let root_file = dir.join("istio-root-cert.pem");
        std::fs::write(&root_file, &pki.root_pem)?;
        let token_file = dir.join("istio-token");
        std::fs::write(&token_file, format!("{TOKEN}\n"))?;
        Ok(Self {
            istiod,
            pki,
            root_file,
            token_file,
            runtime,
        })
    }

    fn set_mode(&self, mode: CaMode) {
        *self
            .istiod
            .ca_mode
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = mode;
    }

    /// Flags that make an agent take certificates from this CA.
    fn flags(&self, lifetime: &str) -> Vec<String> {
        let mut flags = ["--cert-source", "istio"].map(str::to_owned).to_vec();
        flags.extend(istiod_flags(
            self.istiod.addr,
            &self.root_file,
            &self.token_file,
        ));
        flags.extend(["--cert-lifetime", lifetime].map(str::to_owned));
        flags
    }

    /// Starts both nodes' agents on `mesh`'s config with this CA.
    fn agents(&self, mesh: &TwoNodes, tag: &str, lifetime: &str) -> Result<(Agent, Agent)> {
        let config = mesh.config()?;
        let flags = self.flags(lifetime);
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        Ok((
            mesh.agent(tag, 1, &config, &flags)?,
            mesh.agent(tag, 2, &config, &flags)?,
        ))
    }
}

/// `identity`'s certificate serial in `agent`'s list, if it holds one.
fn serial(agent: &Agent, sa: &str) -> Result<Option<String>> {
    Ok(agent
        .certs()?
        .into_iter()
        .find(|c| c.identity == spiffe(sa))
        .map(|c| c.serial))
}

/// `agent`'s readiness: status code and body.
fn readiness(agent: &Agent) -> Result<(u16, String)> {
    http(agent.readiness_addr()?, "GET", "/healthz/ready")
}

fn ca_requests(agent: &Agent, result: &str) -> Result<f64> {
    Ok(value(
        &scrape(agent)?,
        "dataplane_ca_requests_total",
        &[("source", "istio"), ("result", result)],
    )
    .unwrap_or(0.0))
}

fn wait_ready(agent: &Agent) -> Result<()> {
    wait_until("the agent to be ready", || Ok(readiness(agent)?.0 == 200))
        .with_context(|| format!("readiness: {:?}", readiness(agent)))
}

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

/// Writes a new certificate for `sa` from `ca` in the files layout under
/// `dir` (with the bundle `roots`), with its own key or, if `key_from` is
/// given, the key of another certificate from that CA; replaces what is
/// there the way a Secret update does: new files, then one rename of the
/// directory link. Returns the new certificate's serial.
fn mount(
    dir: &Path,
    ca: &dataplane_user::identity::Ca,
    key_from: Option<&dataplane_user::identity::Ca>,
    sa: &str,
    roots: &str,
) -> Result<String> {
    use dataplane_user::identity::{CHAIN_FILE, Identity, KEY_FILE, ROOT_BUNDLE_FILE};
    let identity = Identity::new("cluster.local", NAMESPACE, sa)?;
    let cert = ca.issue(&identity, Duration::from_secs(3600))?;
    let other_key = match key_from {
        Some(key_ca) => Some(key_ca.issue(&identity, Duration::from_secs(3600))?.key),
        None => None,
    };
    let key = other_key.as_ref().unwrap_or(&cert.key);
    let versions = dir
        .join(NAMESPACE)
        .join(format!("..{sa}-{}", cert.serial().replace(':', "")));
    std::fs::create_dir_all(&versions)?;
    std::fs::write(
        versions.join(CHAIN_FILE),
        pem::encode(&pem::Pem::new("CERTIFICATE", cert.chain[0].as_ref())),
    )?;
    std::fs::write(
        versions.join(KEY_FILE),
        pem::encode(&pem::Pem::new("PRIVATE KEY", key.secret_der())),
    )?;
    let link = dir.join(NAMESPACE).join(sa);
    let tmp = dir.join(NAMESPACE).join(format!(".{sa}.tmp"));
    let _ = std::fs::remove_file(&tmp);
    std::os::unix::fs::symlink(&versions, &tmp)?;
    std::fs::rename(&tmp, &link)?;
    std::fs::write(dir.join(ROOT_BUNDLE_FILE), roots)?;
    Ok(cert.serial())
}

#[test]
fn mounted_certificates_replaced_on_disk_are_picked_up_and_a_bad_replacement_refused() -> Result<()>
{
    use dataplane_user::identity::Ca;
    let mesh = TwoNodes::new("csfiles")?;
    let ca_dir = mesh.dir.path().join("external-ca");
    let ca = Ca::load_or_generate(&ca_dir)?;
    let other = Ca::generate()?;
    let certs = mesh.dir.path().join("mounted");
    let root = ca.root_pem().to_owned();
    for sa in ["client", "local", "remote"] {
        mount(&certs, &ca, None, sa, &root)?;
    }
    let config = mesh.config()?;
    let flags = [
        "--cert-source",
        "files",
        "--cert-dir",
        certs.to_str().context("path")?,
    ];
    let a1 = mesh.agent("csf", 1, &config, &flags)?;
    let a2 = mesh.agent("csf", 2, &config, &flags)?;
    wait_ready(&a1)?;
    wait_ready(&a2)?;
    let _remote = echo_server(&mesh.remote, 9000)?;
    echo(&mesh.client, addr(&mesh.remote, 9000), 64 * 1024, 1)?;

    // What `remote` presents to a peer, read by a TLS client of our own.
    let peer = StrangerTls::new(&ca_dir, "plain", &spiffe("remote"))?;
    let presented = || peer.presented_serial(&mesh.plain, addr(&mesh.remote, 15008));
    let first = serial(&a2, "remote")?.context("no remote certificate")?;
    ensure!(presented()? == first);

    let second = mount(&certs, &ca, None, "remote", &root)?;
    wait_until("the replaced certificate in use", || {
        Ok(presented()? == second)
    })?;
    ensure!(serial(&a2, "remote")?.as_deref() == Some(second.as_str()));

    // A chain from a root not in the bundle, then a key of another
    // certificate: refused, and the good certificate stays.
    for (chain_ca, key_ca, reason) in [
        (&other, None, "does not verify"),
        (&ca, Some(&ca), "do not belong together"),
    ] {
        let failures = a2.status()?.certificates.context("no status")?.failures;
        mount(&certs, chain_ca, key_ca, "remote", &root)?;
        wait_until("the replacement refused", || {
            Ok(a2.status()?.certificates.context("no status")?.failures > failures)
        })?;
        let status = a2.status()?.certificates.context("no status")?;
        ensure!(
            status
                .last_failure
                .as_deref()
                .unwrap_or_default()
                .contains(reason),
            "{status:?}"
        );
        ensure!(presented()? == second, "the good certificate stays in use");
        echo(&mesh.client, addr(&mesh.remote, 9000), 4096, 2)?;
    }
    let status = a2.status()?.certificates.context("no status")?;
    ensure!(status.source == "files", "{status:?}");
    Ok(())
}
