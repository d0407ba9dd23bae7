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

#[path = "cert_sources/istio_ca.rs"]
mod istio_ca;

#[path = "cert_sources/rotation.rs"]
mod rotation;

#[path = "cert_sources/mounted_files.rs"]
mod mounted_files;

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
