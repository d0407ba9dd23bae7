//! What strangers to the mesh can take from a node: a pod outside the mesh
//! floods the HBONE ports of a node's pods with idle connections, or
//! clients with valid mesh certificates finish TLS and then never speak
//! HTTP/2. The node's own pods must not notice, and the agent must give
//! every such connection up in bounded time.
//!
//! Topology: [`TwoNodes`]; the stranger is `plain` (node2, not enrolled),
//! with extra addresses of its own. Node1's agent starts with a file
//! descriptor limit below the flood (soft 256, hard 1,024), as a container
//! runtime would start it, so the flood alone would exhaust it.
//!
//! Figures come from `/metrics` (shed and failure counters, the fd limit),
//! `/proc/<agent>/fd` and what the stranger saw; the agent's "accept
//! failed" line is matched as log text because it is the only report of a
//! listener out of descriptors.

use std::{
    net::{IpAddr, Ipv4Addr},
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::Duration,
};

use dataplane_tests::{
    mesh::{TwoNodes, addr},
    observe::{family, scrape, sum, value},
    process::raise_nofile,
    stranger::{Flood, PREFACE, SETTINGS_AND_ACK, StrangerTls, open_fds, wait_for_end},
    traffic::{echo, echo_server, holding_server, stream, wait_until},
};

/// The agent's descriptor limit: soft at start, and the hard limit the
/// agent may raise it to.
const SOFT: u64 = 256;
const HARD: u64 = 1024;
/// Idle connections the stranger holds: more than the agent may ever have.
const FLOOD: usize = 1100;
/// Extra addresses the stranger floods from, besides its own.
const SOURCES: u8 = 15;
/// Rounds of legitimate traffic during the flood (four connections each).
const ROUNDS: u64 = 10;
/// Guard against hangs (not a timing assertion).
const LIMIT: Duration = Duration::from_secs(30);

#[test]
fn a_flood_of_idle_strangers_fails_no_connection_of_the_nodes_pods() -> anyhow::Result<()> {
    // The flood's sockets are this process's.
    raise_nofile();
    let mesh = TwoNodes::new("slflood")?;
    let config = mesh.config()?;
    // Per-pod and per-source bounds below their defaults so that this
    // flood reaches each of the three; the node-wide one is the default,
    // derived from the descriptor limit (a quarter: 256).
    let bounds = [
        "--max-pending-handshakes-per-pod",
        "160",
        "--max-pending-handshakes-per-source",
        "24",
    ];
    let a1 = mesh.agent_with_nofile("sl", 1, &config, &bounds, (SOFT, HARD))?;
    let _a2 = mesh.agent("sl", 2, &config, &[])?;
    let pid = a1
        .pid()
        .ok_or_else(|| anyhow::anyhow!("agent not running"))?;
    // The agent raised its soft limit to the hard one, and that is still
    // less than the flood.
    assert_eq!(
        sum(&scrape(&a1)?, "process_max_fds"),
        HARD as f64,
        "the agent runs with the hard limit"
    );
    assert!(FLOOD as u64 > HARD);
    let _servers = [
        echo_server(&mesh.local, 9000)?,
        echo_server(&mesh.remote, 9000)?,
        echo_server(&mesh.plain, 9100)?,
    ];
    // The stranger's own address sends half the flood, other addresses of
    // it the rest (over the per-source bound); three quarters go to
    // `local` (over the per-pod bound), the rest to `client` (together
    // over the node's).
    let heavy = IpAddr::V4(mesh.plain.ip4);
    let mut sources = Vec::new();
    for i in 0..SOURCES {
        let light = IpAddr::V4(Ipv4Addr::new(10, 2, 0, 100 + i));
        mesh.plain
            .netns
            .ip(&["addr", "add", &format!("{light}/24"), "dev", "eth0"])?;
        sources.extend([heavy, light]);
    }
    let targets = vec![
        addr(&mesh.local, 15008),
        addr(&mesh.local, 15008),
        addr(&mesh.local, 15008),
        addr(&mesh.client, 15008),
    ];

    let fds_idle = open_fds(pid)?;
    let flood = Flood::start(&mesh.plain, sources, targets, FLOOD)?;
    wait_until("the stranger to hold its flood", || {
        Ok(flood.held() >= FLOOD * 9 / 10)
    })?;
    let fds_before = open_fds(pid)?;
    // The agent's descriptors, sampled while the node's pods connect.
    let most_fds = Arc::new(AtomicUsize::new(fds_before));
    let sampling = Arc::new(AtomicBool::new(true));
    let sampler = {
        let (most_fds, sampling) = (Arc::clone(&most_fds), Arc::clone(&sampling));
        std::thread::spawn(move || {
            while sampling.load(Ordering::Relaxed) {
                if let Ok(n) = open_fds(pid) {
                    most_fds.fetch_max(n, Ordering::Relaxed);
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        })
    };
    // Captured outbound of both node1 pods' kinds (same node through the
    // flooded pod's 15008, across nodes, out of the mesh) and inbound from
    // the other node into the flooded pod.
    let flows = [
        (&mesh.client, addr(&mesh.local, 9000)),
        (&mesh.client, addr(&mesh.remote, 9000)),
        (&mesh.client, addr(&mesh.plain, 9100)),
        (&mesh.remote, addr(&mesh.local, 9000)),
    ];
    let (mut succeeded, mut failed) = (0u32, Vec::new());
    'rounds: for round in 0..ROUNDS {
        for (i, (pod, dst)) in flows.iter().enumerate() {
            match echo(pod, *dst, 16 * 1024, round * 10 + i as u64) {
                Ok(()) => succeeded += 1,
                Err(e) => {
                    failed.push(format!("{dst}: {e}"));
                    // One is enough to fail; the rest would only wait.
                    break 'rounds;
                }
            }
        }
    }
    let held_during = flood.held();
    let opened_during = flood.opened();
    sampling.store(false, Ordering::Relaxed);
    let _ = sampler.join();
    let report = flood.stop()?;
    let samples = scrape(&a1)?;
    let shed = |reason: &str| {
        value(
            &samples,
            "dataplane_hbone_handshakes_shed_total",
            &[("reason", reason)],
        )
        .unwrap_or(0.0)
    };
    let most_fds = most_fds.load(Ordering::Relaxed);
    let ms = |d: Option<Duration>| d.map_or(0, |d| d.as_millis());
    eprintln!(
        "flood of {FLOOD} idle connections from {} addresses: legitimate connections \
         {succeeded} succeeded, {} failed; agent fds {fds_idle} before the flood, {fds_before} \
         once it was at full strength, at most \
         {most_fds} (limit {HARD}); stranger opened {} connections ({} connects failed), held \
         {held_during} at the end; {} ended by the agent ({} reset), lifetime p50 {} ms, p99 {} \
         ms, max {} ms; shed source_limit {} pod_limit {} node_limit {}",
        SOURCES + 1,
        failed.len(),
        report.opened,
        report.connect_failures,
        report.lifetimes.len(),
        report.resets,
        ms(report.lifetime_quantile(0.5)),
        ms(report.lifetime_quantile(0.99)),
        ms(report.lifetime_quantile(1.0)),
        shed("source_limit"),
        shed("pod_limit"),
        shed("node_limit"),
    );
    assert!(
        failed.is_empty(),
        "a legitimate connection failed during the flood: {failed:?}"
    );
    assert!(opened_during >= FLOOD, "the flood was real");
    let out_of_descriptors: f64 = family(&samples, "dataplane_accept_failures_total")
        .iter()
        .filter(|s| {
            s.labels
                .iter()
                .any(|(k, v)| k == "reason" && v == "descriptors")
        })
        .map(|s| s.value)
        .sum();
    assert_eq!(
        out_of_descriptors, 0.0,
        "the agent ran out of descriptors: {samples:#?}"
    );
    assert!(
        (most_fds as u64) < HARD,
        "the agent used all {HARD} descriptors"
    );
    for reason in ["source_limit", "pod_limit", "node_limit"] {
        assert!(shed(reason) > 0.0, "no handshake shed for {reason}");
    }
    assert!(
        report.resets > 0 && report.resets == report.lifetimes.len() as u64,
        "every connection the agent shed was reset ({} of {})",
        report.resets,
        report.lifetimes.len()
    );
    Ok(())
}

#[test]
fn strangers_with_valid_certificates_that_never_finish_http2_are_closed() -> anyhow::Result<()> {
    let mesh = TwoNodes::new("slpreface")?;
    let config = mesh.config()?;
    let a1 = mesh.agent(
        "sl",
        1,
        &config,
        &[
            "--hbone-handshake-timeout",
            "2s",
            "--hbone-idle-timeout",
            "3s",
        ],
    )?;
    let stranger = StrangerTls::new(
        &mesh.shared_ca(),
        "stranger",
        "spiffe://cluster.local/ns/test/sa/local",
    )?;
    let target = addr(&mesh.local, 15008);
    // TLS done, then nothing; the preface alone; the preface and SETTINGS
    // but never a stream.
    let mut silent = (0..20)
        .map(|_| stranger.connect(&mesh.plain, target, &[]))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let mut preface_only = stranger.connect(&mesh.plain, target, PREFACE)?;
    let mut no_stream =
        stranger.connect(&mesh.plain, target, &[PREFACE, SETTINGS_AND_ACK].concat())?;

    for (i, tls) in silent.iter_mut().enumerate() {
        let ended = wait_for_end(tls, LIMIT)?
            .ok_or_else(|| anyhow::anyhow!("silent connection {i} still open after {LIMIT:?}"))?;
        assert!(ended.reset, "an unfinished handshake ends with a reset");
    }
    let ended = wait_for_end(&mut preface_only, LIMIT)?
        .ok_or_else(|| anyhow::anyhow!("the preface-only connection is still open"))?;
    assert!(ended.reset, "{ended:?}");
    let ended = wait_for_end(&mut no_stream, LIMIT)?
        .ok_or_else(|| anyhow::anyhow!("the idle HTTP/2 connection is still open"))?;
    assert!(
        ended.frame_types.contains(&7) && !ended.reset,
        "an idle connection is told GOAWAY and closed: {ended:?}"
    );
    // Last, one that never starts TLS: its reset is the latest event, and
    // the agent counts the timeout before it resets, so the count is read
    // at once.
    let mut tcp_only = mesh
        .plain
        .netns
        .run(move || std::net::TcpStream::connect(target))??;
    tcp_only.set_read_timeout(Some(LIMIT))?;
    let read = std::io::Read::read(&mut tcp_only, &mut [0u8; 1]).map_err(|e| e.kind());
    assert_eq!(
        read,
        Err(std::io::ErrorKind::ConnectionReset),
        "a handshake never begun ends with a reset"
    );
    let samples = scrape(&a1)?;
    assert_eq!(
        value(
            &samples,
            "dataplane_tcp_connections_failed_total",
            &[("direction", "inbound"), ("reason", "handshake_timeout")]
        ),
        Some(22.0),
        "each handshake that timed out is counted"
    );
    Ok(())
}

#[test]
fn an_open_tunnel_outlives_the_idle_timeout() -> anyhow::Result<()> {
    let mesh = TwoNodes::new("slidle")?;
    let config = mesh.config()?;
    let idle = ["--hbone-idle-timeout", "1s"];
    let _a1 = mesh.agent("sl", 1, &config, &idle)?;
    let _a2 = mesh.agent("sl", 2, &config, &idle)?;
    let _server = holding_server(&mesh.remote, 9000)?;
    // Held three idle timeouts, with no byte moving after the first.
    let out = stream(
        &mesh.client,
        &["hold", &addr(&mesh.remote, 9000).to_string(), "3"],
    )?;
    assert_eq!(
        out, "open",
        "an idle timeout cut a tunnel with an open stream"
    );
    // And the connection after it gets a new one, which works.
    let _echo = echo_server(&mesh.remote, 9001)?;
    echo(&mesh.client, addr(&mesh.remote, 9001), 1024, 1)?;
    Ok(())
}
