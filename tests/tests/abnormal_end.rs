//! An abnormal end reaches the application as a reset, on both sides and
//! through tunnels; only a clean end-to-end half-close becomes a FIN.
//!
//! A paced transfer (so the cut lands mid-transfer) runs between a client
//! pod (`dp-stream transfer`) and a server thread whose socket lives in a
//! server pod; then an agent is killed with SIGKILL, its drain deadline
//! passes, or a policy change closes the connection. The end that was
//! reading must see ECONNRESET (a clean EOF short of the full length is
//! what an application could not tell from a complete transfer), the end
//! that was writing an error. Transfers that end cleanly must still carry
//! every byte and end with a FIN, both ways.
//!
//! Topology: [`TwoNodes`]: `client` and `local` on node1, `remote` and the
//! out-of-mesh `plain` on node2, one agent per node.
//!
//! The one log-text match, `drain deadline passed`, is one of the drain's
//! documented progress lines (see `drain.rs`): it proves the deadline, not
//! the transfer's end, cut the connection, and no typed source says so.

use std::{net::SocketAddr, time::Duration};

use dataplane_tests::{
    mesh::{NAMESPACE, TwoNodes, addr, policy, to_ports},
    topology::Pod,
    traffic::wait_until,
    transfer::{Ended, Outcome, Plan, TransferServer, transfer},
};
use dataplane_user::config::{Action, Scope};

const MIB: u64 = 1024 * 1024;

/// More than any test lets through: a transfer of this length never
/// completes, so a clean end of it is always short.
const ENDLESS: u64 = 1024 * MIB;

/// Pause after each 64 KiB sent: slow enough that the cut lands while
/// bytes flow, fast enough to reach [`UNDER_WAY`] in well under a second.
const PACE: Duration = Duration::from_millis(1);

/// Bytes the server must have moved before the cut.
const UNDER_WAY: u64 = 8 * MIB;

/// Which way the bulk of the bytes go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Way {
    /// Client to server: the server reads.
    Upload,
    /// Server to client: the client reads.
    Download,
}

/// Both ends' outcomes of one cut transfer.
#[derive(Debug)]
struct Ends {
    client: Outcome,
    server: Outcome,
}

/// Starts an endless paced transfer `way` between `client` and `server`'s
/// `port` (reached at `dst`), calls `cut` once it is under way, and
/// returns how both ends ended.
fn cut_mid_transfer(
    client: &Pod,
    server: &Pod,
    dst: SocketAddr,
    way: Way,
    cut: impl FnOnce() -> anyhow::Result<()>,
) -> anyhow::Result<Ends> {
    let endless = Plan::paced(ENDLESS, PACE);
    let (client_plan, server_plan) = match way {
        Way::Upload => (endless, Plan::NOTHING),
        Way::Download => (Plan::NOTHING, endless),
    };
    let srv = TransferServer::start(server, dst.port(), server_plan)?;
    let client = std::thread::scope(|scope| -> anyhow::Result<Outcome> {
        let run = scope.spawn(|| transfer(client, dst, client_plan));
        wait_until("the transfer to be under way", || {
            anyhow::ensure!(!run.is_finished(), "the transfer ended before the cut");
            Ok(srv.read().max(srv.written()) >= UNDER_WAY)
        })?;
        cut()?;
        run.join().map_err(|_| anyhow::anyhow!("client panicked"))?
    })?;
    Ok(Ends {
        client,
        server: srv.finish()?,
    })
}

/// Whether the ends that were moving bytes both saw a reset: the reader
/// ECONNRESET, the writer ECONNRESET or EPIPE.
fn both_reset(way: Way, ends: &Ends) -> bool {
    match way {
        Way::Upload => ends.client.write.is_reset() && ends.server.read.is_reset(),
        Way::Download => ends.server.write.is_reset() && ends.client.read.is_reset(),
    }
}

/// Results of several cases, reported together so one run shows every
/// case's ends (and how many of several runs ended how).
#[derive(Default)]
struct Report {
    lines: Vec<String>,
    failed: usize,
}

impl Report {
    fn add(&mut self, case: &str, way: Way, ends: &Ends) {
        let ok = both_reset(way, ends);
        if !ok {
            self.failed += 1;
        }
        let verdict = if ok { "reset" } else { "NOT RESET" };
        let flat = |o: &Outcome| o.to_string().replace('\n', ", ");
        self.lines.push(format!(
            "{verdict}: {case} {way:?}: client [{}] server [{}]",
            flat(&ends.client),
            flat(&ends.server)
        ));
    }

    /// Fails listing every case if one did not end in resets; otherwise
    /// prints the cases (seen with `--nocapture`).
    fn check(self) -> anyhow::Result<()> {
        let text = self.lines.join("\n");
        anyhow::ensure!(
            self.failed == 0,
            "{} case(s) did not end in a reset on both sides:\n{text}",
            self.failed
        );
        eprintln!("{text}");
        Ok(())
    }
}

#[test]
fn kill_9_of_the_agent_resets_both_ends_of_a_same_node_tunnel() -> anyhow::Result<()> {
    let w = TwoNodes::new("abkill1")?;
    let config = w.config()?;
    let mut a1 = w.agent("abk", 1, &config, &[])?;
    let mut report = Report::default();
    for (port, way) in [(9100, Way::Upload), (9101, Way::Download)] {
        let ends = cut_mid_transfer(&w.client, &w.local, addr(&w.local, port), way, || {
            a1.kill_hard()
        })?;
        report.add("same node, agent killed", way, &ends);
        a1.restart()?;
    }
    report.check()
}

#[test]
fn kill_9_of_either_agent_resets_both_ends_of_a_cross_node_tunnel() -> anyhow::Result<()> {
    let w = TwoNodes::new("abkill2")?;
    let config = w.config()?;
    let mut agents = [
        w.agent("abx", 1, &config, &[])?,
        w.agent("abx", 2, &config, &[])?,
    ];
    let mut report = Report::default();
    let cases = [
        (9200, Way::Upload, 0),
        (9201, Way::Download, 0),
        (9202, Way::Upload, 1),
        (9203, Way::Download, 1),
    ];
    for (port, way, killed) in cases {
        let victim = &mut agents[killed];
        let ends = cut_mid_transfer(&w.client, &w.remote, addr(&w.remote, port), way, || {
            victim.kill_hard()
        })?;
        report.add(
            &format!("cross node, node{} agent killed", killed + 1),
            way,
            &ends,
        );
        victim.restart()?;
    }
    report.check()
}

#[test]
fn kill_9_of_the_agent_resets_both_ends_of_a_plaintext_relay() -> anyhow::Result<()> {
    let w = TwoNodes::new("abkill3")?;
    let config = w.config()?;
    let mut a1 = w.agent("abp", 1, &config, &[])?;
    let mut a2 = w.agent("abp", 2, &config, &[])?;
    let mut report = Report::default();
    // Inbound plaintext (15006): from `plain`, outside the mesh, to
    // `remote`; node2's agent relays.
    for (port, way) in [(9300, Way::Upload), (9301, Way::Download)] {
        let ends = cut_mid_transfer(&w.plain, &w.remote, addr(&w.remote, port), way, || {
            a2.kill_hard()
        })?;
        report.add("inbound plaintext, agent killed", way, &ends);
        a2.restart()?;
    }
    // Outbound direct (15001): from `client` to `plain`, outside the
    // mesh; node1's agent relays.
    for (port, way) in [(9302, Way::Upload), (9303, Way::Download)] {
        let ends = cut_mid_transfer(&w.client, &w.plain, addr(&w.plain, port), way, || {
            a1.kill_hard()
        })?;
        report.add("outbound direct, agent killed", way, &ends);
        a1.restart()?;
    }
    report.check()
}

#[test]
fn connections_the_agent_cuts_are_reset_at_both_ends() -> anyhow::Result<()> {
    let w = TwoNodes::new("abcut")?;
    let config = w.config()?;
    let mut report = Report::default();

    // The drain deadline of the client's agent cuts a download through a
    // same-node tunnel...
    let mut a1 = w.agent("abd", 1, &config, &["--drain-timeout", "2s"])?;
    let ends = cut_mid_transfer(
        &w.client,
        &w.local,
        addr(&w.local, 9400),
        Way::Download,
        || {
            a1.stop()?;
            Ok(())
        },
    )?;
    report.add("drain deadline, same node", Way::Download, &ends);
    assert!(
        a1.log_text().contains("drain deadline passed"),
        "{}",
        a1.log_text()
    );
    drop(a1);

    // ...the server's agent's deadline an upload across nodes...
    let _a1 = w.agent("abd", 1, &config, &[])?;
    let mut a2 = w.agent("abd", 2, &config, &["--drain-timeout", "2s"])?;
    let ends = cut_mid_transfer(
        &w.client,
        &w.remote,
        addr(&w.remote, 9401),
        Way::Upload,
        || {
            a2.stop()?;
            Ok(())
        },
    )?;
    report.add(
        "drain deadline, cross node, server's agent",
        Way::Upload,
        &ends,
    );
    drop(a2);

    // ...and a policy that now denies the port an upload across nodes.
    let _a2 = w.agent("abd", 2, &config, &[])?;
    let ends = cut_mid_transfer(
        &w.client,
        &w.remote,
        addr(&w.remote, 9402),
        Way::Upload,
        || {
            let mut lockdown = w.mesh_config();
            lockdown.policies = vec![policy(
                "lockdown",
                NAMESPACE,
                Scope::Namespace,
                Action::Deny,
                to_ports(&[9402]),
            )];
            w.write(&lockdown)?;
            Ok(())
        },
    )?;
    report.add("policy change, cross node", Way::Upload, &ends);
    report.check()
}

#[test]
fn clean_half_closes_still_end_with_a_fin_and_every_byte() -> anyhow::Result<()> {
    let w = TwoNodes::new("abclean")?;
    let config = w.config()?;
    let _a1 = w.agent("abc", 1, &config, &[])?;
    let _a2 = w.agent("abc", 2, &config, &[])?;
    let paths: [(&str, &Pod, &Pod); 4] = [
        ("same-node tunnel", &w.client, &w.local),
        ("cross-node tunnel", &w.client, &w.remote),
        ("inbound plaintext", &w.plain, &w.remote),
        ("outbound direct", &w.client, &w.plain),
    ];
    // (client sends, server sends): both at once; a request half-closed
    // before a long response; a response half-closed before a long
    // request.
    let shapes = [
        ("both at once", Plan::bytes(4 * MIB), Plan::bytes(4 * MIB)),
        (
            "request, then a long response",
            Plan::bytes(64 * 1024),
            Plan::bytes(16 * MIB).after_eof(),
        ),
        (
            "response, then a long request",
            Plan::bytes(16 * MIB).after_eof(),
            Plan::bytes(64 * 1024),
        ),
    ];
    let mut port = 9500;
    for (path, client, server) in paths {
        for (shape, client_plan, server_plan) in shapes {
            port += 1;
            let srv = TransferServer::start(server, port, server_plan)?;
            let client_end = transfer(client, addr(server, port), client_plan)?;
            let server_end = srv.finish()?;
            let context = format!("{path}, {shape}: client [{client_end}] server [{server_end}]");
            // Every byte, then the peer's FIN, both ways, at both ends.
            assert_eq!(
                client_end.write,
                Ended::Clean(client_plan.send),
                "{context}"
            );
            assert_eq!(server_end.read, Ended::Clean(client_plan.send), "{context}");
            assert_eq!(
                server_end.write,
                Ended::Clean(server_plan.send),
                "{context}"
            );
            assert_eq!(client_end.read, Ended::Clean(server_plan.send), "{context}");
        }
    }
    Ok(())
}
