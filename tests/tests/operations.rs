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

#[test]
fn scraped_counters_equal_the_connections_and_bytes_made() -> anyhow::Result<()> {
    let mesh = TwoNodes::new("opmetrics")?;
    let (a1, a2) = mesh.agents("op", &mesh.mesh_config())?;
    let _remote = doubling_server(&mesh.remote, 9000)?;
    let _plain = doubling_server(&mesh.plain, 9100)?;
    let (hbone, plain) = ([1000, 2000, 4000], [300, 500]);
    for len in hbone {
        exchange(&mesh.client, addr(&mesh.remote, 9000), len)?;
    }
    for len in plain {
        exchange(&mesh.client, addr(&mesh.plain, 9100), len)?;
    }
    // Bytes are counted as connections close, which can be after the
    // client is done: the access records say when.
    wait_until("every connection to be logged as closed", || {
        Ok(
            access_records(&a1.log_text(), "connection closed").len() >= 5
                && access_records(&a2.log_text(), "connection closed").len() >= 3,
        )
    })?;
    let (s1, s2) = (scrape(&a1)?, scrape(&a2)?);
    let (h, p): (usize, usize) = (hbone.iter().sum(), plain.iter().sum());
    let (h, p) = (h as f64, p as f64);
    let out_mtls = tcp_labels("source", "client", Some("remote"), true);
    let out_plain = tcp_labels("source", "client", None, false);
    let in_mtls = tcp_labels("destination", "client", Some("remote"), true);
    assert_tcp(&s1, &out_mtls, 3.0, h, 2.0 * h);
    assert_tcp(&s1, &out_plain, 2.0, p, 2.0 * p);
    assert_tcp(&s2, &in_mtls, 3.0, h, 2.0 * h);
    // Nothing else was counted, and labels come in Istio's order.
    let opened = "istio_tcp_connections_opened_total";
    assert_eq!(family(&s1, opened).len(), 2, "{s1:#?}");
    assert_eq!(family(&s2, opened).len(), 1, "{s2:#?}");
    let both = || s1.iter().chain(&s2);
    for s in both().filter(|s| s.name.starts_with("istio_tcp_")) {
        let keys: Vec<&str> = s.labels.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(keys, TCP_LABELS, "{s:?}");
    }
    // Nothing is open any more, and nothing failed.
    let open = "dataplane_tcp_connections_open";
    assert_eq!(value(&s1, open, &[("direction", "outbound")]), Some(0.0));
    assert_eq!(value(&s2, open, &[("direction", "inbound")]), Some(0.0));
    let gauges: Vec<_> = both().filter(|s| s.name == open).collect();
    assert!(gauges.iter().all(|s| s.value == 0.0), "{gauges:?}");
    let failed: Vec<_> = both().filter(|s| s.name.contains("failed")).collect();
    assert!(failed.iter().all(|s| s.value == 0.0), "{failed:?}");
    assert_eq!(value(&s1, "dataplane_enrolled_pods", &[]), Some(2.0));
    // Kernel counters are exported as read from the pinned map: every
    // connection of the client was redirected.
    let redirected = [("event", "redirected_outbound")];
    let kernel = value(&s1, "dataplane_kernel_events_total", &redirected);
    assert_eq!(kernel, Some(5.0), "{s1:#?}");
    assert_eq!(a1.counter("redirected_outbound")?, 5);
    let expiry = "dataplane_certificate_expiry_timestamp_seconds";
    let expires = value(&s1, expiry, &[("identity", CLIENT_ID)]).unwrap_or_default();
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?;
    assert!(expires > now.as_secs_f64(), "{expires} {s1:#?}");
    let build = [
        ("component", "dataplane"),
        ("tag", env!("CARGO_PKG_VERSION")),
    ];
    assert_eq!(value(&s1, "istio_build", &build), Some(1.0), "{s1:#?}");
    // Istio's other path to the same page (ztunnel `src/metrics/server.rs`
    // serves `/metrics` and `/stats/prometheus`), as some scrape configs
    // ask for it; anything else is not found.
    let (status, body) = http(a1.metrics_addr()?, "GET", "/stats/prometheus")?;
    assert_eq!(status, 200, "{body}");
    let tcp = |samples: Vec<Sample>| -> Vec<Sample> {
        samples
            .into_iter()
            .filter(|s| s.name.starts_with("istio_tcp_"))
            .collect()
    };
    assert_eq!(tcp(parse_exposition(&body)?), tcp(s1.clone()));
    assert_eq!(http(a1.metrics_addr()?, "GET", "/stats")?.0, 404);
    Ok(())
}

#[test]
fn byte_counters_grow_while_a_connection_is_open() -> anyhow::Result<()> {
    let mesh = TwoNodes::new("oplive")?;
    let (a1, a2) = mesh.agents("op", &mesh.mesh_config())?;
    // Accepts and never answers: the connection stays open with one byte
    // from the client, until the client gives up.
    let _held = holding_server(&mesh.remote, 9000)?;
    let target = addr(&mesh.remote, 9000).to_string();
    std::thread::scope(|scope| -> anyhow::Result<()> {
        let holder = scope.spawn(|| try_stream(&mesh.client, &["hold", &target, "5"]));
        for (agent, reporter, direction) in
            [(&a1, "source", "outbound"), (&a2, "destination", "inbound")]
        {
            let labels = tcp_labels(reporter, "client", Some("remote"), true);
            let labels: Vec<(&str, &str)> = labels
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect();
            let received = "istio_tcp_received_bytes_total";
            wait_until("the open connection's byte to be counted", || {
                Ok(value(&scrape(agent)?, received, &labels) == Some(1.0))
            })?;
            let samples = scrape(agent)?;
            let closed = "istio_tcp_connections_closed_total";
            assert_eq!(value(&samples, closed, &labels), Some(0.0), "{samples:#?}");
            let open = [("direction", direction)];
            let gauge = value(&samples, "dataplane_tcp_connections_open", &open);
            assert_eq!(gauge, Some(1.0), "{samples:#?}");
        }
        let held = holder
            .join()
            .map_err(|_| anyhow::anyhow!("the holding client panicked"))??;
        assert_eq!(held.stdout.trim(), "open", "{held:?}");
        Ok(())
    })
}

#[test]
fn access_log_has_one_record_per_connection_with_the_byte_counts() -> anyhow::Result<()> {
    let mesh = TwoNodes::new("opaccess")?;
    let (a1, a2) = mesh.agents("op", &mesh.mesh_config())?;
    let _servers = [
        doubling_server(&mesh.remote, 9000)?,
        doubling_server(&mesh.local, 9000)?,
        doubling_server(&mesh.plain, 9100)?,
    ];
    // (size, destination, destination workload, its node)
    let conns = [
        (10_001, addr(&mesh.remote, 9000), Some("remote"), 2),
        (20_002, addr(&mesh.remote, 9000), Some("remote"), 2),
        (30_003, addr(&mesh.local, 9000), Some("local"), 1),
        (5_005, addr(&mesh.plain, 9100), None, 2),
    ];
    for (len, dst, _, _) in conns {
        exchange(&mesh.client, dst, len)?;
    }
    wait_until("both agents to log every leg", || {
        Ok(
            access_records(&a1.log_text(), "connection closed").len() >= 5
                && access_records(&a2.log_text(), "connection closed").len() >= 2,
        )
    })?;
    let (log1, log2) = (a1.log_text(), a2.log_text());
    let (r1, r2) = (
        access_records(&log1, "connection closed"),
        access_records(&log2, "connection closed"),
    );
    assert_eq!(
        r1.len(),
        5,
        "node1: 4 outbound + 1 same-node inbound:\n{log1}"
    );
    assert_eq!(r2.len(), 2, "node2: the 2 cross-node inbound:\n{log2}");
    for (len, dst, workload, node) in conns {
        let principal = |w| format!("spiffe://cluster.local/ns/test/sa/{w}");
        let (dst, n, n2) = (dst.to_string(), len.to_string(), (2 * len).to_string());
        let (dst_ns, dst_id) = workload.map_or(("-", "-".into()), |w| ("test", principal(w)));
        let protocol = if workload.is_some() { "HBONE" } else { "TCP" };
        let mut want = vec![
            ("protocol", protocol),
            ("dst", &dst),
            ("src_workload", "client"),
            ("src_namespace", "test"),
            ("src_identity", CLIENT_ID),
            ("dst_workload", workload.unwrap_or("-")),
            ("dst_namespace", dst_ns),
            ("dst_identity", &dst_id),
            ("bytes_sent", &n),
            ("bytes_received", &n2),
            ("error", "-"),
        ];
        // Outbound on node1; inbound where the server's agent runs (none for
        // the pod outside the mesh).
        let mut sides = vec![("outbound", &r1)];
        if workload.is_some() {
            sides.push(("inbound", if node == 1 { &r1 } else { &r2 }));
        }
        for (direction, records) in sides {
            want.push(("direction", direction));
            let found: Vec<_> = records
                .iter()
                .filter(|r| want.iter().all(|(k, v)| field(r, k) == *v))
                .collect();
            assert_eq!(found.len(), 1, "{want:?}:\n{log1}\n{log2}");
            assert!(field(found[0], "duration_ms").parse::<u64>().is_ok());
            // Both sides name the client pod's address (outbound, not the
            // loopback the capture listener saw).
            let src: SocketAddr = field(found[0], "src").parse()?;
            assert_eq!(src.ip(), IpAddr::V4(mesh.client.ip4), "{:?}", found[0]);
            want.pop();
        }
    }
    Ok(())
}

#[test]
fn json_logs_carry_access_records_as_objects() -> anyhow::Result<()> {
    let mesh = TwoNodes::new("opjson")?;
    let config = mesh.config()?;
    let a1 = mesh.agent("opj", 1, &config, &["--log-format", "json"])?;
    let _a2 = mesh.agent("opj", 2, &config, &[])?;
    let _server = doubling_server(&mesh.remote, 9000)?;
    exchange(&mesh.client, addr(&mesh.remote, 9000), 7_007)?;
    let closed = |log: &str| -> Vec<Value> {
        log.lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|v| v["target"] == "access" && v["message"] == "connection closed")
            .collect()
    };
    wait_until("the JSON access record", || {
        Ok(!closed(&a1.log_text()).is_empty())
    })?;
    let log = a1.log_text();
    // Every line is one JSON object.
    for line in log.lines() {
        serde_json::from_str::<Value>(line).map_err(|e| anyhow::anyhow!("{e}: {line}"))?;
    }
    let records = closed(&log);
    assert_eq!(records.len(), 1, "{log}");
    let r = &records[0];
    assert_eq!(r["direction"], "outbound", "{r}");
    assert_eq!(r["protocol"], "HBONE", "{r}");
    assert_eq!(r["src_workload"], "client", "{r}");
    assert_eq!(
        r["dst_identity"], "spiffe://cluster.local/ns/test/sa/remote",
        "{r}"
    );
    assert_eq!(r["bytes_sent"], 7_007, "{r}");
    assert_eq!(r["bytes_received"], 14_014, "{r}");
    assert_eq!(r["level"], "INFO", "{r}");
    Ok(())
}

#[test]
fn refused_connections_are_counted_with_a_reason() -> anyhow::Result<()> {
    let mesh = TwoNodes::new("opdeny")?;
    let mut config = mesh.mesh_config();
    config.policies = vec![policy(
        "no-9001",
        NAMESPACE,
        Scope::Global,
        Action::Deny,
        to_ports(&[9001]),
    )];
    let (a1, a2) = mesh.agents("op", &config)?;
    // Something listens on 9001: only the policy can refuse.
    let _servers = [
        doubling_server(&mesh.remote, 9000)?,
        doubling_server(&mesh.remote, 9001)?,
    ];
    let denied = addr(&mesh.remote, 9001).to_string();
    // Three through HBONE tunnels, two in plaintext from outside the mesh.
    let (c, p) = (&mesh.client, &mesh.plain);
    for from in [c, c, c, p, p] {
        let out = try_stream(from, &["expect-reset", &denied])?;
        assert_eq!(out.stdout, "reset", "{out:?}");
    }
    exchange(&mesh.client, addr(&mesh.remote, 9000), 100)?;
    wait_until(
        "the refusals and the allowed connection to be logged",
        || {
            let log = a2.log_text();
            Ok(access_records(&log, "connection refused").len() >= 5
                && !access_records(&log, "connection closed").is_empty()
                && access_records(&a1.log_text(), "connection refused").len() >= 3)
        },
    )?;
    let log2 = a2.log_text();
    let refused = access_records(&log2, "connection refused");
    assert_eq!(refused.len(), 5, "{log2}");
    for r in &refused {
        assert_eq!(
            (field(r, "reason"), field(r, "direction")),
            ("denied", "inbound")
        );
        assert!(field(r, "error").contains("no-9001"), "{r:?}");
    }
    let via = |p: &str| refused.iter().filter(|r| field(r, "protocol") == p).count();
    assert_eq!((via("HBONE"), via("TCP")), (3, 2), "{log2}");
    let (s1, s2) = (scrape(&a1)?, scrape(&a2)?);
    let failed = "dataplane_tcp_connections_failed_total";
    let denied = [("direction", "inbound"), ("reason", "denied")];
    assert_eq!(value(&s2, failed, &denied), Some(5.0), "{s2:#?}");
    assert_eq!(sum(&s2, failed), 5.0, "{s2:#?}");
    // The client's side sees its tunnels refused (401).
    let tunnel = [("direction", "outbound"), ("reason", "tunnel_failed")];
    assert_eq!(value(&s1, failed, &tunnel), Some(3.0), "{s1:#?}");
    // Refused connections were never opened; the allowed one was.
    assert_eq!(
        sum(&s2, "istio_tcp_connections_opened_total"),
        1.0,
        "{s2:#?}"
    );
    // Istio's family counts them with its response flags: DENY where the
    // policy refused, CONNECT where the client's tunnel was refused.
    let istio_failed = "istio_tcp_connections_failed_total";
    let flagged = |samples: &[Sample], flags: &str, security: &str| -> f64 {
        family(samples, istio_failed)
            .iter()
            .filter(|s| {
                s.labels.contains(&("response_flags".into(), flags.into()))
                    && s.labels
                        .contains(&("connection_security_policy".into(), security.into()))
            })
            .map(|s| s.value)
            .sum()
    };
    assert_eq!(flagged(&s2, "DENY", "mutual_tls"), 3.0, "{s2:#?}");
    assert_eq!(flagged(&s2, "DENY", "none"), 2.0, "{s2:#?}");
    assert_eq!(sum(&s2, istio_failed), 5.0, "{s2:#?}");
    assert_eq!(flagged(&s1, "CONNECT", "mutual_tls"), 3.0, "{s1:#?}");
    Ok(())
}

#[test]
fn admin_is_reachable_on_loopback_only() -> anyhow::Result<()> {
    let mut node = Node::new("opadmin", 1)?;
    let pod = node.add_pod("opadmin")?;
    let agent = Agent::start("opadmin", &node, &[])?;
    agent.enroll(Agent::spec_for(&pod, "adm"))?;
    let admin = agent.admin_addr()?;
    assert!(admin.ip().is_loopback(), "{admin}");
    // The enrollment actor answers an enrollment before it publishes the
    // pod list that status and the dump read, so the pod can be missing
    // from a dump taken at once: wait for it (bounded).
    let (mut body, mut dump) = (String::new(), Value::Null);
    wait_until("the dump to list the pod", || {
        let (status, text) = http(admin, "GET", "/config_dump")?;
        anyhow::ensure!(status == 200, "{text}");
        dump = serde_json::from_str(&text)?;
        body = text;
        Ok(entry(&dump, "/pods", "/spec/uid", "uid-adm").is_ok())
    })?;
    let cert = entry(&dump, "/heldCertificates", "/identity", DEFAULT_ID)?;
    assert!(
        cert["expiresInSecs"].as_i64().is_some_and(|s| s > 0),
        "{cert}"
    );
    for key in ["origin", "workloads", "services", "policies"] {
        assert!(dump["config"].get(key).is_some(), "config.{key}: {dump:#}");
    }
    assert_eq!(dump["kernel"]["capture"], "ebpf", "{dump:#}");
    // What the agent runs with: its flags, as one checked configuration.
    let config = &dump["agentConfig"];
    assert_eq!(config["state"]["instance"], agent.instance(), "{config:#}");
    assert_eq!(config["capture"], "ebpf", "{config:#}");
    assert_eq!(config["redirect"]["onExit"], "detach", "{config:#}");
    assert_eq!(
        config["endpoints"]["admin"].as_str(),
        Some("127.0.0.1:0"),
        "{config:#}"
    );
    assert!(
        dump["kernel"]["pinnedLinks"]
            .as_array()
            .is_some_and(|l| !l.is_empty()),
        "{dump:#}"
    );
    // No key material: no PEM key, and not a line of the CA's key.
    assert!(!body.contains("PRIVATE KEY"), "{body}");
    let ca_key = std::fs::read_to_string(agent.state_dir().join("ca/root-key.pem"))?;
    let key_line = ca_key
        .lines()
        .filter(|l| !l.starts_with("-----"))
        .max_by_key(|l| l.len());
    assert!(
        key_line.is_some_and(|l| l.len() > 16 && !body.contains(l)),
        "{body}"
    );

    // From inside the pod: the node's addresses, and loopback.
    let mut targets: Vec<IpAddr> = vec!["127.0.0.1".parse()?, "::1".parse()?];
    let addrs = node.netns().ip(&["-o", "addr", "show"])?;
    for word in addrs.split_whitespace() {
        if let Some((ip, _)) = word.split_once('/')
            && let Ok(ip) = ip.parse::<IpAddr>()
            && !matches!(ip, IpAddr::V6(v6) if v6.segments()[0] == 0xfe80)
        {
            targets.push(ip);
        }
    }
    assert!(targets.contains(&IpAddr::V4(node.bridge_ip4())), "{addrs}");
    let port = admin.port();
    for ip in targets {
        let target = SocketAddr::new(ip, port);
        let reached = pod
            .netns
            .run(move || TcpStream::connect_timeout(&target, Duration::from_secs(2)).is_ok())?;
        assert!(!reached, "the pod reached the admin port at {target}");
    }
    let lo = SocketAddr::from(([127, 0, 0, 1], port));
    let reached = node
        .netns()
        .run(move || TcpStream::connect_timeout(&lo, Duration::from_secs(2)).is_ok())?;
    assert!(!reached, "the node namespace reached the admin port");

    let out = Command::new(agent_binary()?)
        .args(["run", "--admin-addr", "10.0.0.1:15000"])
        .output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("loopback"), "{stderr}");
    Ok(())
}

/// Flags that do not fit together are refused before anything starts:
/// exit 2 and a message naming the flag and what to do. Everything else
/// points at the test's own directories, iptables capture and free ports,
/// so that an agent that wrongly starts touches nothing of the host's and
/// fails (an unusable bpffs) instead of running.
#[test]
fn conflicting_flags_exit_2_naming_the_flag() -> anyhow::Result<()> {
    let dir = TempDir::new("opflags")?;
    let none: &[(&str, &str)] = &[];
    // A mesh config whose outbound traffic mode Istio does not define.
    let bad_mode = dir.path().join("mesh-bad-mode");
    std::fs::write(&bad_mode, "outboundTrafficPolicy:\n  mode: BLOCK\n")?;
    let bad_mode = bad_mode.display().to_string();
    for (flags, env, named) in [
        (
            &["--engine", "ztunnel", "--capture", "iptables"][..],
            none,
            "--engine ztunnel cannot run with --capture iptables",
        ),
        (
            &["--kube"][..],
            none,
            "--kube needs this node's name: pass --node",
        ),
        (
            &["--cert-source", "files"][..],
            none,
            "--cert-source files needs --cert-dir",
        ),
        (
            &["--proxy-mark", "0x700", "--transparent-mark", "0x700"][..],
            none,
            "--transparent-mark 0x700 must be non-zero and differ from --proxy-mark",
        ),
        // Istio's proxy config, under ztunnel's variable name, and a mesh
        // config file named but missing.
        (
            &[][..],
            &[("PROXY_CONFIG", r#"{"proxyAdminPort": 70000}"#)][..],
            "PROXY_CONFIG: proxyAdminPort: invalid value",
        ),
        (
            &["--mesh-config", "/nonexistent/dp-mesh-config"][..],
            none,
            "mesh config /nonexistent/dp-mesh-config",
        ),
        (
            &["--mesh-config", bad_mode.as_str()][..],
            none,
            "outboundTrafficPolicy.mode \"BLOCK\"",
        ),
        // ztunnel's DNS proxy address, which the agent's resolver (where
        // its kernel programs steer DNS) cannot move to.
        (
            &[][..],
            &[("ISTIO_META_DNS_PROXY_ADDR", "localhost:5353")][..],
            "DNS_PROXY_ADDR=\"localhost:5353\"",
        ),
    ] {
        let mut command = Command::new(agent_binary()?);
        command
            .arg("run")
            .args(flags)
            .envs(env.iter().copied())
            .arg("--state-dir")
            .arg(dir.path())
            .arg("--bpffs")
            .arg(dir.path())
            .arg("--zds-socket")
            .arg(dir.path().join("zds.sock"))
            .args(["--instance", "opflags", "--on-exit", "detach"])
            .args(["--readiness-addr", "127.0.0.1:0"])
            .args(["--metrics-addr", "127.0.0.1:0"])
            .args(["--admin-addr", "127.0.0.1:0"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if !flags.contains(&"--capture") {
            command.args(["--capture", "iptables"]);
        }
        let out = ChildGuard::new(command.spawn()?).wait(Duration::from_secs(30))?;
        assert_eq!(out.code, Some(2), "{flags:?} {env:?}: {}", out.stderr);
        assert!(
            out.stderr.contains(named),
            "{flags:?} {env:?}: {}",
            out.stderr
        );
    }
    Ok(())
}

/// An agent started in this process (`agent::start`, no second process)
/// serves its admin endpoint with the configuration its flags made, stops
/// on `Bound::stop` as on `/quitquitquit`, and shuts down leaving no
/// control socket.
#[test]
fn an_agent_starts_in_process_and_stops_cleanly() -> anyhow::Result<()> {
    use dataplane_user::agent::{self, Stop};
    use dataplane_user::cli::{Cli, Command as CliCommand};

    let node = Node::new("opinproc", 1)?;
    let bpffs = BpffsDir::new("opinproc")?;
    let state = TempDir::new("opinproc")?;
    let (bpffs_path, state_path) = (bpffs.path().display(), state.path().display());
    let (bpffs_path, state_path) = (bpffs_path.to_string(), state_path.to_string());
    let cgroup = node.cgroup().path().display().to_string();
    let argv = [
        "dataplane",
        "run",
        "--instance",
        "opinproc-agent",
        "--bpffs",
        &bpffs_path,
        "--state-dir",
        &state_path,
        "--cgroup",
        &cgroup,
        "--on-exit",
        "detach",
        "--threading",
        "shared",
        "--readiness-addr",
        "127.0.0.1:0",
        "--metrics-addr",
        "127.0.0.1:0",
        "--admin-addr",
        "127.0.0.1:0",
    ];
    let CliCommand::Run(args) = <Cli as clap::Parser>::try_parse_from(argv)?.command else {
        anyhow::bail!("`dataplane run` parsed as another command");
    };
    let config = args.into_config_with([])?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let bound = agent::start(config).await?;
        let socket = bound.control_socket().to_path_buf();
        assert!(socket.exists(), "{}", socket.display());
        let admin = bound
            .endpoints()
            .admin
            .ok_or_else(|| anyhow::anyhow!("no admin endpoint: {bound:?}"))?;
        let (status, body) =
            tokio::task::spawn_blocking(move || http(admin, "GET", "/config_dump")).await??;
        assert_eq!(status, 200, "{body}");
        let dump: Value = serde_json::from_str(&body)?;
        let config = &dump["agentConfig"];
        assert_eq!(config["state"]["instance"], "opinproc-agent", "{config:#}");
        assert_eq!(config["workers"]["threading"], "shared", "{config:#}");
        bound.stop();
        let stop = bound.wait(None).await;
        assert_eq!(stop, Stop::Asked);
        bound.shut_down(stop, None).await?;
        assert!(!socket.exists(), "the control socket was left behind");
        anyhow::Ok(())
    })
}

#[test]
fn runtime_log_level_change_takes_effect() -> anyhow::Result<()> {
    let mut node = Node::new("oplog", 1)?;
    let client = node.add_pod("oplog")?;
    let server = node.add_pod("oplog")?;
    let agent = Agent::start("oplog", &node, &[])?;
    agent.enroll(Agent::spec_for(&client, "client"))?;
    let _server = doubling_server(&server, 9000)?;
    let admin = agent.admin_addr()?;
    let debug_lines = || agent.log_text().matches(" DEBUG ").count();
    let closed = || access_records(&agent.log_text(), "connection closed").len();
    let connect = |n: usize| -> anyhow::Result<()> {
        exchange(&client, addr(&server, 9000), 64)?;
        wait_until("the access record", || Ok(closed() >= n))
    };

    connect(1)?;
    assert_eq!(debug_lines(), 0, "{}", agent.log_text());
    assert_eq!(
        http(admin, "GET", "/logging")?,
        (200, "log filter: info\n".into())
    );
    let (status, body) = http(admin, "POST", "/logging?level=debug")?;
    assert_eq!(status, 200, "{body}");
    assert_eq!(http(admin, "GET", "/logging")?.1, "log filter: debug\n");
    connect(2)?;
    wait_until("DEBUG lines", || Ok(debug_lines() > 0))?;
    let log = agent.log_text();
    assert!(
        log.lines()
            .any(|l| l.contains(" DEBUG ") && l.contains("connected")),
        "{log}"
    );

    // A bad filter is refused and the one in force stays.
    let (status, body) = http(admin, "POST", "/logging?level=access=loud")?;
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("invalid log filter"), "{body}");
    assert_eq!(http(admin, "GET", "/logging?level=info")?.0, 405);
    assert_eq!(http(admin, "GET", "/logging")?.1, "log filter: debug\n");

    // And back: no DEBUG line after the change.
    assert_eq!(http(admin, "POST", "/logging?level=info")?.0, 200);
    let before = debug_lines();
    connect(3)?;
    assert_eq!(debug_lines(), before, "{}", agent.log_text());
    Ok(())
}

#[test]
fn status_shows_capture_and_the_reason_after_unenroll() -> anyhow::Result<()> {
    let mut node = Node::new("opstatus", 1)?;
    let pod = node.add_pod("opstatus")?;
    let mut agent = Agent::start("opstatus", &node, &[])?;
    agent.enroll(Agent::spec_for(&pod, "stat"))?;
    let json = |out: &Output| -> anyhow::Result<Value> { Ok(serde_json::from_slice(&out.stdout)?) };

    let out = cli(&agent, &["status", "--json"])?;
    let report = json(&out)?;
    assert_eq!(out.status.code(), Some(0), "{report:#}");
    assert_eq!(report["ready"], true, "{report:#}");
    let programs = report["programs"].as_array().cloned().unwrap_or_default();
    assert!(
        !programs.is_empty() && programs.iter().all(|p| p["attached"] == true),
        "{report:#}"
    );
    assert_eq!(
        entry(&report, "/pods", "/uid", "uid-stat")?["captured"],
        true
    );
    assert_eq!(report["connectionsOpen"], 0, "{report:#}");
    for key in [
        "configOrigin",
        "errorsLastMinute",
        "recentErrors",
        "pending",
        "configError",
    ] {
        assert!(report.get(key).is_some(), "{key} missing: {report:#}");
    }

    let out = cli(&agent, &["certs", "--json"])?;
    assert_eq!(out.status.code(), Some(0));
    let certs = json(&out)?;
    let cert = entry(&certs, "", "/identity", DEFAULT_ID)?;
    assert!(
        cert["expiresInSecs"].as_i64().is_some_and(|s| s > 0),
        "{cert}"
    );
    for key in ["serial", "issuer", "notBefore", "notAfter"] {
        assert!(
            cert[key].as_str().is_some_and(|v| !v.is_empty()),
            "{key}: {cert}"
        );
    }
    // `config-dump` prints what the admin endpoint serves.
    let dump = json(&cli(&agent, &["config-dump"])?)?;
    let (_, body) = http(agent.admin_addr()?, "GET", "/config_dump")?;
    let admin: Value = serde_json::from_str(&body)?;
    for key in [
        "/config",
        "/pods",
        "/kernel/pinnedLinks",
        "/heldCertificates/0/serial",
    ] {
        assert_eq!(dump.pointer(key), admin.pointer(key), "{key}");
        assert!(dump.pointer(key).is_some(), "{key} missing: {dump:#}");
    }

    let out = cli(&agent, &["pod", "remove", "--uid", "uid-stat"])?;
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "removed");
    let out = cli(&agent, &["status", "--json"])?;
    let report = json(&out)?;
    assert_eq!(out.status.code(), Some(5), "{report:#}");
    let pod = entry(&report, "/pods", "/uid", "uid-stat")?;
    let dump = json(&cli(&agent, &["config-dump"])?)?;
    entry(&dump, "/departedPods", "/uid", "uid-stat")?;
    assert_eq!(pod["captured"], false, "{pod}");
    let reason = pod["reason"].as_str().unwrap_or_default();
    assert!(reason.starts_with("unenrolled on request"), "{pod}");
    let out = cli(&agent, &["status"])?;
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(5), "{text}");
    assert!(
        text.contains("test/stat") && text.contains("not captured"),
        "{text}"
    );
    assert!(
        !text.contains('\x1b'),
        "escape codes without a TTY: {text:?}"
    );

    assert_eq!(agent.stop()?, Some(0));
    let out = cli(&agent, &["status"])?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(4), "{stderr}");
    Ok(())
}
