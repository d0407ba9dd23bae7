//! Operating the agent, end to end: the Prometheus counters and the access
//! log agree exactly with the connections and bytes the test made, refused
//! connections are counted with their reason, the admin endpoint answers on
//! the node's loopback only, the log level changes at runtime, and
//! `dataplane status|certs|config-dump` tell an operator what is captured
//! and why not. (Readiness during a drain, and the drain itself: drain.rs.)
//!
//! Topology (where a mesh is needed): two linked simulated nodes with one
//! agent each and a shared CA; node1 has `client` and `local`, node2 has
//! `remote` (all HBONE) and `plain` (not in the mesh). Servers answer with
//! the request twice, so that the two byte directions cannot be confused.
//!
//! Access records (log target `access`) and the log level switch are
//! asserted on log text: those lines are what operators consume.

#[path = "operations/metrics.rs"]
mod metrics;

#[path = "operations/access_log.rs"]
mod access_log;

#[path = "operations/admin.rs"]
mod admin;

use std::{
    net::{IpAddr, SocketAddr, TcpListener, TcpStream},
    process::{Command, Output, Stdio},
    time::Duration,
};

use dataplane_tests::{
    Agent, BpffsDir, ChildGuard, Responder, TempDir, agent_binary,
    mesh::{NAMESPACE, TwoNodes, addr, policy, to_ports},
    observe::{Sample, access_records, family, field, parse_exposition, scrape, sum, value},
    topology::{Node, Pod},
    traffic::{holding_server, http, stream, try_stream, wait_until},
};
use dataplane_user::config::{Action, Scope};
use serde_json::Value;

const CLIENT_ID: &str = "spiffe://cluster.local/ns/test/sa/client";
/// The identity `Agent::spec_for` pods get.
const DEFAULT_ID: &str = "spiffe://cluster.local/ns/test/sa/default";
/// The Istio labels, in the order the exposition must list them.
const TCP_LABELS: [&str; 27] = [
    "reporter",
    "source_workload",
    "source_canonical_service",
    "source_canonical_revision",
    "source_workload_namespace",
    "source_principal",
    "source_app",
    "source_version",
    "source_cluster",
    "destination_service",
    "destination_service_namespace",
    "destination_service_name",
    "destination_workload",
    "destination_canonical_service",
    "destination_canonical_revision",
    "destination_workload_namespace",
    "destination_principal",
    "destination_app",
    "destination_version",
    "destination_cluster",
    "request_protocol",
    "response_flags",
    "connection_security_policy",
    "source_region",
    "source_zone",
    "destination_region",
    "destination_zone",
];

/// A server in `pod` answering each request with the request twice.
fn doubling_server(pod: &Pod, port: u16) -> anyhow::Result<Responder> {
    let listener = pod
        .netns
        .run(move || TcpListener::bind(SocketAddr::from(([0u16; 8], port))))??;
    Responder::start(listener, |req| req.body.repeat(2))
}

/// Sends `len` bytes from `from` to `dst`, half-closes, and checks that
/// exactly twice as many came back.
fn exchange(from: &Pod, dst: SocketAddr, len: usize) -> anyhow::Result<()> {
    let reply = stream(from, &["echo-text", &dst.to_string(), &"x".repeat(len)])?;
    anyhow::ensure!(
        reply.len() == 2 * len,
        "{dst}: got {} bytes back",
        reply.len()
    );
    Ok(())
}

/// Istio's label set for a connection from `src` to `dst` (workload names,
/// namespace `test`, service account = name; `None` = unknown).
fn tcp_labels(reporter: &str, src: &str, dst: Option<&str>, mtls: bool) -> Vec<(String, String)> {
    let principal = |name: &str| format!("spiffe://cluster.local/ns/test/sa/{name}");
    let unknown = || "unknown".to_owned();
    let of_dst = |f: &dyn Fn(&str) -> String| dst.map_or_else(unknown, f);
    // The config names no owner workload, canonical service or revision:
    // the pod's name and `latest` stand in, as Istio defaults them.
    let values = [
        reporter.to_owned(),
        src.to_owned(),
        src.to_owned(),
        "latest".to_owned(),
        "test".to_owned(),
        principal(src),
        src.to_owned(),
        "latest".to_owned(),
        unknown(),
        unknown(),
        unknown(),
        unknown(),
        of_dst(&str::to_owned),
        of_dst(&str::to_owned),
        of_dst(&|_| "latest".to_owned()),
        of_dst(&|_| "test".to_owned()),
        of_dst(&principal),
        of_dst(&str::to_owned),
        of_dst(&|_| "latest".to_owned()),
        unknown(),
        "tcp".to_owned(),
        "-".to_owned(),
        if mtls { "mutual_tls" } else { "none" }.to_owned(),
        unknown(),
        unknown(),
        unknown(),
        unknown(),
    ];
    TCP_LABELS
        .iter()
        .map(|k| (*k).to_owned())
        .zip(values)
        .collect()
}

/// Checks opened, closed, received and sent for one label set.
fn assert_tcp(samples: &[Sample], labels: &[(String, String)], conns: f64, up: f64, down: f64) {
    let labels: Vec<(&str, &str)> = labels
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    for (name, want) in [
        ("istio_tcp_connections_opened_total", conns),
        ("istio_tcp_connections_closed_total", conns),
        ("istio_tcp_received_bytes_total", up),
        ("istio_tcp_sent_bytes_total", down),
    ] {
        assert_eq!(
            value(samples, name, &labels),
            Some(want),
            "{name}{labels:?} in {:#?}",
            family(samples, name)
        );
    }
}

/// The element of the JSON array at `array` whose `key` (a pointer) is
/// `want`.
fn entry<'a>(json: &'a Value, array: &str, key: &str, want: &str) -> anyhow::Result<&'a Value> {
    let list = json.pointer(array).and_then(Value::as_array);
    list.and_then(|l| {
        l.iter()
            .find(|e| e.pointer(key).and_then(Value::as_str) == Some(want))
    })
    .ok_or_else(|| anyhow::anyhow!("no {array} entry with {key} = {want} in {json:#}"))
}

/// Runs `dataplane ARGS --instance I --state-dir D` against `agent`.
fn cli(agent: &Agent, args: &[&str]) -> anyhow::Result<Output> {
    Ok(Command::new(agent_binary()?)
        .args(args)
        .arg("--instance")
        .arg(agent.instance())
        .arg("--state-dir")
        .arg(agent.state_dir())
        .env_remove("NO_COLOR")
        .output()?)
}
