//! Agents whose mesh comes from istiod: a test control plane serves the
//! two-node world's workloads, service and policies as Istio's own
//! resources over delta xDS (gRPC, TLS, token), the agents (`--xds`) carry
//! HBONE between pods enrolled over their control sockets, and follow
//! istiod live: a policy added and removed, a workload removed, an invalid
//! resource NACKed while the rest applies, istiod restarted (the last state
//! keeps serving, the stream resumes with the versions held), and
//! readiness held until the first complete state; a push voids only the
//! same-node fast-path verdicts it concerns.
//!
//! State is read from the agents' status, config dump, readiness endpoint
//! and `/metrics`, never from their logs.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context as _, Result, ensure};
use dataplane_tests::{
    Agent,
    istio_resources::{
        address_resources, authorization_resources, policy_resource, workload_resource,
    },
    istiod::{AgentFiles, TestIstiod, TestPki, xds_flags},
    mesh::{ECHO_VIP, NAMESPACE, TwoNodes, addr, policy, to_ports},
    observe::{scrape, sum, value},
    traffic::{echo, echo_server, http, stream, try_stream, wait_until},
};
use dataplane_user::config::{Action, LocalConfig, Scope};
use dataplane_user::control::Request;
use dataplane_user::istio_api::{ADDRESS_TYPE, AUTHORIZATION_TYPE, discovery::Resource};
use tokio::runtime::Runtime;

/// The world, its mesh as istiod serves it, and the files the agents read.
struct World {
    w: TwoNodes,
    mesh: LocalConfig,
    rt: Runtime,
    pki: TestPki,
    istiod: Option<TestIstiod>,
    root: PathBuf,
    token: PathBuf,
    empty: PathBuf,
}

impl World {
    fn new(tag: &str) -> Result<Self> {
        let w = TwoNodes::new(tag)?;
        let mesh = dataplane_tests::mesh::as_istiod_serves(w.echo_config());
        let (rt, pki, istiod) = dataplane_tests::istiod::loopback_istiod()?;
        let AgentFiles { root, token, empty } =
            AgentFiles::write(w.dir.path(), &pki, "xds-agent-token")?;
        Ok(Self {
            w,
            mesh,
            rt,
            pki,
            istiod: Some(istiod),
            root,
            token,
            empty,
        })
    }

    fn istiod(&self) -> Result<&TestIstiod> {
        self.istiod.as_ref().context("the test istiod is stopped")
    }

    /// Serves `resources` of `type_url` and removes `removed`; returns the
    /// push's nonce.
    fn publish(
        &self,
        type_url: &str,
        resources: Vec<Resource>,
        removed: &[&str],
    ) -> Result<String> {
        self.rt
            .block_on(self.istiod()?.publish(type_url, resources, removed))
    }

    /// Waits for the agent's answer to the push `nonce` (sent once the
    /// agent's state holds it) and checks it is an ACK. An agent that
    /// never answers it (one whose stream fails on it keeps reconnecting,
    /// each time with requests of its own) fails after 120 s.
    fn acked(&mut self, nonce: &str) -> Result<()> {
        let istiod = self.istiod.as_mut().context("the test istiod is stopped")?;
        let deadline = std::time::Instant::now() + Duration::from_secs(120);
        let seen = self.rt.block_on(async {
            loop {
                let left = deadline.saturating_duration_since(std::time::Instant::now());
                ensure!(!left.is_zero(), "no answer to push {nonce} in 120 s");
                let seen = istiod.next_request(left).await?;
                if seen.request.response_nonce == nonce {
                    return anyhow::Ok(seen);
                }
            }
        })?;
        ensure!(
            seen.request.error_detail.is_none(),
            "push {nonce} NACKed: {:?}",
            seen.request.error_detail
        );
        Ok(())
    }

    /// Serves the whole mesh (version `version`).
    fn publish_mesh(&self, version: &str) -> Result<()> {
        self.publish(ADDRESS_TYPE, address_resources(&self.mesh, version), &[])?;
        self.publish(
            AUTHORIZATION_TYPE,
            authorization_resources(&self.mesh, version),
            &[],
        )?;
        Ok(())
    }

    /// Node `n`'s agent on an empty file, with istiod as its source.
    fn agent(&self, tag: &str, n: u8) -> Result<Agent> {
        let pod = format!("dataplane-node{n}");
        let flags = xds_flags(self.istiod()?.addr, &self.root, &self.token, &pod);
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        self.w.agent(tag, n, &self.empty, &flags)
    }

    /// Enrolls `pod` as the workload `name` of the mesh (its service
    /// account is its name, as the mesh says).
    fn enroll(
        &self,
        agent: &Agent,
        pod: &dataplane_tests::topology::Pod,
        name: &str,
    ) -> Result<()> {
        let mut spec = Agent::spec_for(pod, name);
        spec.service_account = name.to_owned();
        let response = agent.enroll(spec)?;
        ensure!(response.ok, "enrolling {name}: {:?}", response.error);
        Ok(())
    }
}

fn config_dump(agent: &Agent) -> Result<serde_json::Value> {
    let response = agent.call(&Request::ConfigDump)?;
    ensure!(response.ok, "config dump refused: {:?}", response.error);
    response.report.context("config dump without a report")
}

fn workload_names(dump: &serde_json::Value) -> Vec<String> {
    dump["config"]["workloads"]
        .as_array()
        .map(|list| {
            list.iter()
                .filter_map(|w| w["name"].as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

fn reaches(pod: &dataplane_tests::topology::Pod, dst: SocketAddr) -> Result<bool> {
    let out = try_stream(pod, &["echo", &dst.to_string(), "100", "1"])?;
    Ok(out.code == Some(0) && out.stdout == "ok 100")
}

fn mutual_tls_opened(agent: &Agent) -> Result<f64> {
    let samples = scrape(agent)?;
    Ok(samples
        .iter()
        .filter(|s| s.name == "istio_tcp_connections_opened_total")
        .filter(|s| {
            s.labels
                .iter()
                .any(|(k, v)| k == "connection_security_policy" && v == "mutual_tls")
        })
        .map(|s| s.value)
        .sum())
}

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

/// `--istiod-root-cert SYSTEM` (ztunnel's `XDS_ROOT_CA=SYSTEM`,
/// `src/config.rs`; `src/tls/control.rs` `RootCert::Default`): istiod's
/// certificate is checked against the system's roots, here the file
/// `SSL_CERT_FILE` names. An agent whose system roots hold istiod's root
/// takes its mesh; one whose hold another root is refused by TLS and
/// says so in its dump; an empty store stops the agent at start-up.
#[test]
fn istiods_certificate_may_be_checked_against_the_systems_roots() -> Result<()> {
    let world = World::new("xdssys")?;
    world.publish_mesh("v1")?;
    let stranger = TestPki::generate()?;
    let stranger_root = world.w.dir.path().join("stranger-root.pem");
    std::fs::write(&stranger_root, &stranger.root_pem)?;
    let no_dir = world.w.dir.path().join("no-system-certs");
    std::fs::create_dir(&no_dir)?;
    let no_dir = no_dir.display().to_string();
    let (empty, ca) = (world.empty.display().to_string(), world.w.shared_ca());
    let ca = ca.display().to_string();
    let start = |tag: &str, n: u8, system_roots: &std::path::Path| -> Result<Agent> {
        let node = if n == 1 { &world.w.n1 } else { &world.w.n2 };
        let pod = format!("dataplane-node{n}");
        let system = std::path::Path::new("SYSTEM");
        let mut flags = xds_flags(world.istiod()?.addr, system, &world.token, &pod);
        let node_name = format!("node{n}");
        flags
            .extend(["--config", &empty, "--node", &node_name, "--ca-dir", &ca].map(str::to_owned));
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        let roots = system_roots.display().to_string();
        // The system's store is these files alone: no directory the
        // test's own environment may name (`SSL_CERT_DIR`).
        Agent::start_with_env(
            tag,
            node,
            &flags,
            &[("SSL_CERT_FILE", &roots), ("SSL_CERT_DIR", &no_dir)],
        )
    };

    let trusting = start("xsys1", 1, &world.root)?;
    wait_until("the agent trusting istiod's root to hold its state", || {
        Ok(workload_names(&config_dump(&trusting)?).contains(&"remote".to_owned()))
    })?;
    let distrusting = start("xsys2", 2, &stranger_root)?;
    let mut refused = String::new();
    wait_until("the agent trusting another root to be refused", || {
        let dump = config_dump(&distrusting)?;
        refused = dump["xds"]["lastError"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        Ok(!refused.is_empty())
    })?;
    assert!(refused.contains("certificate"), "{refused}");
    let dump = config_dump(&distrusting)?;
    assert!(dump["xds"]["connectedSince"].is_null(), "{}", dump["xds"]);
    assert!(
        workload_names(&dump).is_empty(),
        "{:?}",
        workload_names(&dump)
    );

    // A system store with no root at all stops the agent at start-up,
    // saying so, rather than running with nothing to trust.
    let no_roots = world.w.dir.path().join("no-roots.pem");
    std::fs::write(&no_roots, "")?;
    let refused = match start("xsys3", 1, &no_roots) {
        Ok(_) => anyhow::bail!("an agent started with an empty system root store"),
        Err(err) => format!("{err:#}"),
    };
    assert!(
        refused.contains("exited during start-up") && refused.contains("holds no usable root"),
        "{refused}"
    );
    Ok(())
}
