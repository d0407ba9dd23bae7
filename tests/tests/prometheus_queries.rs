//! A real Prometheus scrapes two agents that carried known traffic, and
//! the queries Istio's and Kiali's dashboards send it return exactly the
//! series and values that traffic makes; every panel of our own Grafana
//! dashboard (`deploy/grafana/dataplane.json`) parses and finds its
//! metrics in the same scrape.
//!
//! The agents take their mesh from a test istiod over xDS, as in a
//! cluster, so the xDS families the dashboard shows have samples; the
//! events some panels count (a failed connection, a shed handshake, a
//! NACK, an ended xDS stream) are provoked once the traffic is checked.
//! State is read from `/metrics` and Prometheus' HTTP API only.

#[path = "prometheus_queries/upstream.rs"]
mod upstream;

use std::net::{SocketAddr, TcpStream};

use anyhow::{Context as _, Result, ensure};
use dataplane_tests::{
    Agent,
    istio_resources::workload_resource,
    istiod::{AgentFiles, TestIstiod, TestPki, xds_flags},
    mesh::{ECHO_VIP, TwoNodes, addr},
    observe::{scrape, sum, sum_matching},
    prometheus::{Prometheus, Series, Target, series_of, sorted},
    topology::Pod,
    traffic::{http, try_stream, wait_until},
    transfer::{Ended, Plan, TransferServer, transfer},
};
use dataplane_user::{config::LocalConfig, istio_api::ADDRESS_TYPE};
use upstream::{Carried, Query, totals};

/// Connections per round from `client` (node1) to the `echo` service's
/// VIP, whose one endpoint is `remote` (node2).
const VIA_SERVICE: u64 = 3;
/// Bytes the client sends on each of them, and the server answers.
const REQUEST: u64 = 1_000;
const RESPONSE: u64 = 3_000;
/// One more connection per round, straight to `remote` on a port no
/// service names, with its own sizes.
const DIRECT_PORT: u16 = 9100;
const DIRECT_REQUEST: u64 = 500;
const DIRECT_RESPONSE: u64 = 700;
/// Rounds of that traffic: the second one raises counters Prometheus
/// has already scraped, so `rate` sees an increase inside its window.
const ROUNDS: u64 = 2;

/// The dashboard shipped for what only this agent exports.
const DASHBOARD: &str = include_str!("../../deploy/grafana/dataplane.json");

/// Each agent's bound on pending HBONE handshakes from one source, low so
/// that the test can shed one.
const PER_SOURCE: usize = 2;

/// The two nodes, the test istiod serving their mesh, and the agents.
struct Mesh {
    // Declared first, so dropped first: the agents stop before istiod.
    a1: Agent,
    a2: Agent,
    w: TwoNodes,
    mesh: LocalConfig,
    istiod: Option<TestIstiod>,
    _pki: TestPki,
    rt: tokio::runtime::Runtime,
}

impl Mesh {
    /// Both agents on the mesh istiod serves: `client` on node1,
    /// `remote` on node2, the service `echo` with `remote` its only
    /// endpoint.
    fn new(tag: &str) -> Result<Self> {
        let w = TwoNodes::new(tag)?;
        let mut mesh = dataplane_tests::mesh::as_istiod_serves(w.echo_config());
        for workload in &mut mesh.workloads {
            let workload = std::sync::Arc::make_mut(workload);
            if workload.name == "local" {
                workload.services = Default::default();
            }
        }
        let (rt, pki, istiod) = dataplane_tests::istiod::loopback_istiod()?;
        let AgentFiles { root, token, empty } =
            AgentFiles::write(w.dir.path(), &pki, "prometheus-queries-token")?;
        rt.block_on(istiod.publish_mesh(&mesh, "v1"))?;
        let agent = |n: u8| -> Result<Agent> {
            let pod = format!("dataplane-node{n}");
            let mut flags = xds_flags(istiod.addr, &root, &token, &pod);
            flags.extend([
                "--max-pending-handshakes-per-source".to_owned(),
                PER_SOURCE.to_string(),
            ]);
            let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
            let agent = w.agent(tag, n, &empty, &flags)?;
            wait_until("the agent to be ready on istiod's state", || {
                Ok(http(agent.readiness_addr()?, "GET", "/healthz/ready")?.0 == 200)
            })?;
            Ok(agent)
        };
        let (a1, a2) = (agent(1)?, agent(2)?);
        enroll(&a1, &w.client, "client")?;
        enroll(&a2, &w.remote, "remote")?;
        Ok(Self {
            a1,
            a2,
            w,
            mesh,
            istiod: Some(istiod),
            _pki: pki,
            rt,
        })
    }

    /// One round of the test's traffic, every connection checked to have
    /// moved exactly its bytes both ways.
    fn carry_round(&self) -> Result<()> {
        for _ in 0..VIA_SERVICE {
            self.connection(SocketAddr::new(ECHO_VIP, 80), 9000, REQUEST, RESPONSE)?;
        }
        self.connection(
            addr(&self.w.remote, DIRECT_PORT),
            DIRECT_PORT,
            DIRECT_REQUEST,
            DIRECT_RESPONSE,
        )
    }

    fn connection(&self, dst: SocketAddr, port: u16, request: u64, response: u64) -> Result<()> {
        let server = TransferServer::start(&self.w.remote, port, Plan::bytes(response))?;
        let client = transfer(&self.w.client, dst, Plan::bytes(request))?;
        let served = server.finish()?;
        ensure!(
            client.write == Ended::Clean(request)
                && client.read == Ended::Clean(response)
                && served.read == Ended::Clean(request),
            "to {dst}: client {client}, server {served}"
        );
        Ok(())
    }

    /// Waits until both agents count `connections` closed (the last
    /// counter an ended connection moves).
    fn wait_closed(&self, connections: u64) -> Result<()> {
        for (agent, reporter) in [(&self.a1, "source"), (&self.a2, "destination")] {
            wait_until("the agents to count every connection closed", || {
                let closed = sum_matching(
                    &scrape(agent)?,
                    "istio_tcp_connections_closed_total",
                    &[("reporter", reporter)],
                );
                Ok(closed == connections as f64)
            })?;
        }
        Ok(())
    }

    /// Prometheus targets for both agents, labelled as Kubernetes service
    /// discovery labels a node agent's pod (`pod`, `namespace`).
    fn targets(&self) -> Result<Vec<Target>> {
        [(&self.a1, "node1"), (&self.a2, "node2")]
            .into_iter()
            .map(|(agent, node)| {
                Ok(Target {
                    addr: agent.metrics_addr()?,
                    labels: vec![
                        ("pod".into(), format!("dataplane-{node}")),
                        ("namespace".into(), "istio-system".into()),
                    ],
                })
            })
            .collect()
    }

    /// Waits until Prometheus holds each agent's current value of every
    /// `istio_tcp_*` family, as its own `/metrics` shows it.
    fn wait_scraped(&self, prometheus: &Prometheus) -> Result<()> {
        for family in [
            "istio_tcp_connections_opened_total",
            "istio_tcp_connections_closed_total",
            "istio_tcp_received_bytes_total",
            "istio_tcp_sent_bytes_total",
        ] {
            let mut want = Vec::new();
            for agent in [&self.a1, &self.a2] {
                let instance = agent.metrics_addr()?.to_string();
                want.push(series_of(
                    &[("instance", &instance)],
                    sum(&scrape(agent)?, family),
                ));
            }
            let query = format!("sum by (instance) ({family})");
            let have = prometheus.wait_for(&query, &want)?;
            ensure!(
                have == sorted(want.clone()),
                "prometheus never showed the agents' {family}: {have:?}, the agents {want:?}"
            );
        }
        Ok(())
    }

    /// Makes the agents count what the traffic did not: a connection that
    /// fails, a handshake shed, an xDS response NACKed and the xDS stream
    /// ended (istiod stopped), each waited on in the agents' `/metrics`.
    fn provoke_events(&mut self) -> Result<()> {
        // To a port nothing listens on. The client's connection is
        // accepted in its own pod before the far end is tried, so how the
        // client ends says little: the agents' counter says it failed.
        let failing = addr(&self.w.remote, 9200).to_string();
        try_stream(
            &self.w.client,
            &["transfer", &failing, "10", "0", "at-once"],
        )?;
        self.wait_both(
            "a failed connection",
            |s| sum(s, "dataplane_tcp_connections_failed_total"),
            false,
        )?;

        // Idle TCP connections from a pod outside the mesh to the remote
        // pod's HBONE port: one more than the bound sheds the oldest.
        let hbone = addr(&self.w.remote, 15008);
        let mut idle = Vec::new();
        for _ in 0..=PER_SOURCE {
            idle.push(
                self.w
                    .plain
                    .netns
                    .run(move || TcpStream::connect(hbone))??,
            );
        }
        wait_until("a handshake shed", || {
            Ok(sum(&scrape(&self.a2)?, "dataplane_hbone_handshakes_shed_total") > 0.0)
        })?;
        drop(idle);

        // A workload resource that does not decode.
        let client = self
            .mesh
            .workloads
            .iter()
            .find(|w| w.name == "client")
            .context("client in the mesh")?;
        let mut bad = workload_resource(client, "v2");
        if let Some(any) = bad.resource.as_mut() {
            any.value = vec![0xff, 0xff, 0xff];
        }
        let istiod = self.istiod.take().context("istiod already stopped")?;
        self.rt
            .block_on(istiod.publish(ADDRESS_TYPE, vec![bad], &[]))?;
        self.wait_both("an xDS NACK", |s| sum(s, "dataplane_xds_nacks_total"), true)?;
        self.rt.block_on(istiod.stop());
        self.wait_both(
            "the xDS stream to end",
            |s| sum(s, "istio_xds_connection_terminations_total"),
            true,
        )
    }

    /// Waits until `count` of both agents' samples (`each`), or of the
    /// two together, is above zero.
    fn wait_both(
        &self,
        what: &str,
        count: impl Fn(&[dataplane_tests::observe::Sample]) -> f64,
        each: bool,
    ) -> Result<()> {
        wait_until(what, || {
            let (one, two) = (count(&scrape(&self.a1)?), count(&scrape(&self.a2)?));
            Ok(if each {
                one > 0.0 && two > 0.0
            } else {
                one + two > 0.0
            })
        })
    }
}

/// Enrolls `pod` as workload `name` (its service account is its name, as
/// the mesh says).
fn enroll(agent: &Agent, pod: &Pod, name: &str) -> Result<()> {
    let mut spec = Agent::spec_for(pod, name);
    spec.service_account = name.to_owned();
    let response = agent.enroll(spec)?;
    ensure!(response.ok, "enrolling {name}: {:?}", response.error);
    Ok(())
}

/// Runs `query` as the dashboard sends it and in its totals form: the
/// totals are exactly `want`; the dashboard's own form has the same
/// series (its values are rates, of which the test knows only the sign).
fn check(prometheus: &Prometheus, query: &Query) -> Result<()> {
    let exact = totals(&query.expr)?;
    let have = sorted(prometheus.query(&exact)?);
    ensure!(
        have == sorted(query.want.clone()),
        "{}:\n{exact}\nreturned {have:#?}\nnot {:#?}",
        query.from,
        query.want
    );
    let labels = |series: &[Series]| -> Vec<_> {
        sorted(series.to_vec())
            .into_iter()
            .map(|s| s.labels)
            .collect()
    };
    let have = prometheus.query(&query.expr)?;
    ensure!(
        labels(&have) == labels(&query.want),
        "{}:\n{}\nreturned {have:#?}",
        query.from,
        query.expr
    );
    Ok(())
}

/// Every target `expr` of the dashboard's panels (rows included).
fn dashboard_queries(dashboard: &serde_json::Value) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut panels: Vec<&serde_json::Value> = dashboard["panels"]
        .as_array()
        .map(|p| p.iter().collect())
        .unwrap_or_default();
    while let Some(panel) = panels.pop() {
        if let Some(inner) = panel["panels"].as_array() {
            panels.extend(inner);
        }
        for target in panel["targets"].as_array().into_iter().flatten() {
            if let Some(expr) = target["expr"].as_str() {
                let title = panel["title"].as_str().unwrap_or_default();
                out.push((title.to_owned(), expr.to_owned()));
            }
        }
    }
    out
}

#[test]
fn dashboards_queries_return_the_traffic_carried() -> Result<()> {
    let mut mesh = Mesh::new("promq")?;
    let prometheus = Prometheus::start("promq", &mesh.targets()?)?;
    for round in 1..=ROUNDS {
        mesh.carry_round()?;
        mesh.wait_closed(round * (VIA_SERVICE + 1))?;
        mesh.wait_scraped(&prometheus)?;
    }
    let carried = Carried {
        service_request: ROUNDS * VIA_SERVICE * REQUEST,
        service_response: ROUNDS * VIA_SERVICE * RESPONSE,
        direct_request: ROUNDS * DIRECT_REQUEST,
        direct_response: ROUNDS * DIRECT_RESPONSE,
    };
    for query in upstream::istio(&carried)
        .iter()
        .chain(&upstream::kiali(&carried))
    {
        check(&prometheus, query)?;
    }

    // Our dashboard: every panel's query parses and finds series, once the
    // events only some panels show have happened and been scraped.
    mesh.provoke_events()?;
    let dashboard: serde_json::Value = serde_json::from_str(DASHBOARD)?;
    let queries = dashboard_queries(&dashboard);
    ensure!(queries.len() >= 20, "only {} panel queries", queries.len());
    for (title, expr) in queries {
        // `$pod` at "All" is its allValue, `.*`; `$__rate_interval` as for
        // Istio's dashboards.
        let expr = expr.replace("$pod", ".*").replace("$__rate_interval", "1m");
        let mut found = Vec::new();
        wait_until(&format!("panel {title:?} to show data"), || {
            found = prometheus.query(&expr)?;
            Ok(!found.is_empty())
        })
        .with_context(|| format!("{expr}: is every metric it names exported?"))?;
    }
    Ok(())
}
