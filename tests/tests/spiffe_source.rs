//! Workload certificates from the SPIFFE Workload API, end to end: two
//! simulated nodes, one agent per node started with `--cert-source spiffe`,
//! each pointed at its own Workload API server on a real unix socket (one
//! per node, as one SPIRE agent runs per node), HBONE between pods with the
//! X.509-SVIDs those servers sent, and a rotation pushed on the open
//! stream picked up by the agent.
//!
//! The servers are `dataplane_identity::workload_api_server`: they refuse
//! what SPIRE's agent refuses (no `workload.spiffe.io` header, no identity
//! issued) and send SVIDs from a real CA, as SPIRE sends them (leaf and
//! key, the trust domain's bundle). What a peer is presented is read by a
//! TLS client of our own ([`StrangerTls`]).
//!
//! Topology: [`TwoNodes`]: `client` and `local` on node1, `remote` and the
//! out-of-mesh `plain` on node2.

use std::time::Duration;

use anyhow::{Context as _, Result, ensure};
use dataplane_identity::workload_api_server::{WorkloadApiServer, message};
use dataplane_tests::{
    Agent,
    mesh::{NAMESPACE, TwoNodes, addr},
    stranger::StrangerTls,
    traffic::{echo, echo_server, http, wait_until},
};
use dataplane_user::identity::{Ca, Identity, IssuedCert};

fn spiffe(sa: &str) -> String {
    format!("spiffe://cluster.local/ns/{NAMESPACE}/sa/{sa}")
}

fn issue(ca: &Ca, sa: &str) -> Result<IssuedCert> {
    let identity = Identity::new("cluster.local", NAMESPACE, sa)?;
    Ok(ca.issue(&identity, Duration::from_secs(3600))?)
}

/// Where the SPIRE server's CA lives in `mesh`'s directory.
fn spire_ca_dir(mesh: &TwoNodes) -> std::path::PathBuf {
    mesh.dir.path().join("spire-ca")
}

/// The SPIRE server's CA (the trust domain's root) in `mesh`'s directory,
/// and the SVIDs of the three pods the tests use: client, local, remote.
fn spire_ca(mesh: &TwoNodes) -> Result<(Ca, [IssuedCert; 3])> {
    let ca = Ca::load_or_generate(&spire_ca_dir(mesh))?;
    let svids = [
        issue(&ca, "client")?,
        issue(&ca, "local")?,
        issue(&ca, "remote")?,
    ];
    Ok((ca, svids))
}

/// `sa`'s certificate in `agent`'s list: serial and source.
fn held(agent: &Agent, sa: &str) -> Result<Option<(String, String)>> {
    Ok(agent
        .certs()?
        .into_iter()
        .find(|c| c.identity == spiffe(sa))
        .map(|c| (c.serial, c.source)))
}

fn wait_ready(agent: &Agent) -> Result<()> {
    let readiness = || http(agent.readiness_addr()?, "GET", "/healthz/ready");
    wait_until("the agent to be ready", || Ok(readiness()?.0 == 200))
        .with_context(|| format!("readiness: {:?}", readiness()))
}

/// One Workload API server per node, each sending its first message's
/// SVIDs, and an agent per node taking its certificates from its node's
/// server. Dropped in field order: agents, servers, then the servers'
/// runtime.
struct SpiffeNodes {
    a1: Agent,
    a2: Agent,
    node1: WorkloadApiServer,
    node2: WorkloadApiServer,
    _runtime: tokio::runtime::Runtime,
}

impl SpiffeNodes {
    /// Agents `<tag>1` and `<tag>2` on `mesh`'s nodes; node1's server
    /// sends `first1`, node2's `first2`, both signed by `ca`.
    fn start(
        mesh: &TwoNodes,
        tag: &str,
        ca: &Ca,
        first1: &[&IssuedCert],
        first2: &[&IssuedCert],
    ) -> Result<Self> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()?;
        let (node1, node2) = runtime.block_on(async {
            (
                WorkloadApiServer::serve(Some(message(ca, first1))),
                WorkloadApiServer::serve(Some(message(ca, first2))),
            )
        });
        let config = mesh.config()?;
        let agent = |node: u8, server: &WorkloadApiServer| {
            let endpoint = server.endpoint();
            let flags = [
                "--cert-source",
                "spiffe",
                "--spiffe-endpoint-socket",
                endpoint.as_str(),
            ];
            mesh.agent(tag, node, &config, &flags)
        };
        Ok(Self {
            a1: agent(1, &node1)?,
            a2: agent(2, &node2)?,
            node1,
            node2,
            _runtime: runtime,
        })
    }
}

#[test]
fn svids_from_the_workload_api_carry_hbone_and_a_pushed_rotation_is_used() -> Result<()> {
    let mesh = TwoNodes::new("csspiffe")?;
    let (ca, [client, local, remote]) = spire_ca(&mesh)?;
    let nodes = SpiffeNodes::start(&mesh, "csp", &ca, &[&client, &local], &[&remote])?;
    let (a1, a2, node1, node2) = (&nodes.a1, &nodes.a2, &nodes.node1, &nodes.node2);
    wait_ready(a1)?;
    wait_ready(a2)?;
    let _remote = echo_server(&mesh.remote, 9000)?;
    let _local = echo_server(&mesh.local, 9000)?;
    echo(&mesh.client, addr(&mesh.remote, 9000), 256 * 1024, 1)?;
    echo(&mesh.client, addr(&mesh.local, 9000), 64 * 1024, 2)?;

    // The tunnels used the servers' SVIDs, and nothing else.
    for (agent, cert, sa) in [
        (a1, &client, "client"),
        (a1, &local, "local"),
        (a2, &remote, "remote"),
    ] {
        let (serial, source) =
            held(agent, sa)?.with_context(|| format!("no certificate for {sa}"))?;
        ensure!(
            serial == cert.serial() && source == "spiffe",
            "{sa}: {serial} from {source}"
        );
    }
    ensure!(
        held(a2, "client")?.is_none(),
        "node2 holds only its pods' SVIDs"
    );
    let status = a2.status()?.certificates.context("no certificate status")?;
    ensure!(status.source == "spiffe" && status.held == 1, "{status:?}");
    // Each agent opened one stream, always with the security header.
    ensure!(node1.requests() == (1, 0) && node2.requests() == (1, 0));

    // What `remote` presents to a peer, read by a TLS client of our own.
    let peer = StrangerTls::new(&spire_ca_dir(&mesh), "plain", &spiffe("remote"))?;
    let presented = || peer.presented_serial(&mesh.plain, addr(&mesh.remote, 15008));
    ensure!(presented()? == remote.serial());

    // node2's server rotates `remote` on the open stream.
    let rotated = issue(&ca, "remote")?;
    node2.push(Some(message(&ca, &[&rotated])));
    wait_until("the rotated SVID in use", || {
        Ok(presented()? == rotated.serial())
    })?;
    echo(&mesh.client, addr(&mesh.remote, 9000), 64 * 1024, 3)?;
    ensure!(
        node2.requests() == (1, 0),
        "the rotation came on the same stream"
    );
    Ok(())
}

#[test]
fn a_pod_whose_svid_is_not_issued_yet_holds_readiness_until_the_server_sends_it() -> Result<()> {
    let mesh = TwoNodes::new("csspiffe2")?;
    let (ca, [client, local, remote]) = spire_ca(&mesh)?;
    // node2's server knows the agent (it issues it an SVID of another
    // identity) but has no entry for `remote` yet.
    let other = issue(&ca, "not-a-pod")?;
    let nodes = SpiffeNodes::start(&mesh, "csq", &ca, &[&client, &local], &[&other])?;
    let (a1, a2, node2) = (&nodes.a1, &nodes.a2, &nodes.node2);
    wait_ready(a1)?;
    wait_until("node2's missing SVID recorded", || {
        let status = a2.status()?.certificates.context("no certificate status")?;
        Ok(status.failures > 0)
    })?;
    let (code, _) = http(a2.readiness_addr()?, "GET", "/healthz/ready")?;
    ensure!(code == 503, "node2 is ready without remote's SVID");
    ensure!(held(a2, "remote")?.is_none());

    // The entry is registered: the server sends the SVID on the open stream.
    node2.push(Some(message(&ca, &[&other, &remote])));
    wait_ready(a2)?;
    let (serial, _) = held(a2, "remote")?.context("no certificate for remote")?;
    ensure!(serial == remote.serial());
    let _remote = echo_server(&mesh.remote, 9000)?;
    echo(&mesh.client, addr(&mesh.remote, 9000), 64 * 1024, 1)?;
    ensure!(
        node2.requests() == (1, 0),
        "the SVID came on the same stream"
    );
    Ok(())
}
