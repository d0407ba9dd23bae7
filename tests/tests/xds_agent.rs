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

#[path = "xds_agent/live.rs"]
mod live;

#[path = "xds_agent/pushes.rs"]
mod pushes;

#[path = "xds_agent/root_cert.rs"]
mod root_cert;

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
