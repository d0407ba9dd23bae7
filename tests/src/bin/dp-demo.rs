//! `dp-demo` (run it as `cargo xtask demo`): the whole mesh on one machine.
//!
//! Two simulated nodes (network namespaces joined by a link), a client and a
//! server pod on each plus a server outside the mesh, one agent per node on
//! a generated config with a service and a policy. It drives five flows,
//! checks each behaved as the mesh promises, prints what happened, and tears
//! everything down (or, with `--keep`, leaves it running to explore).
//! Exit code 0 only if every flow behaved as reported.

use std::{
    io::Write as _,
    net::SocketAddr,
    process::ExitCode,
    time::{Duration, Instant},
};

use dataplane_tests::{
    Agent, TempDir,
    mesh::{ECHO_VIP, endpoint_of, hbone_workload, policy, service, to_ports, write_config},
    topology::{Node, Pod, link_nodes},
    traffic::{echo_server, try_stream},
};
use dataplane_user::config::{Action, LocalConfig, Scope};

const SERVICE_VIP: &str = "10.96.0.10:80";

/// Set by SIGINT/SIGTERM: stop and tear down.
static STOP: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, std::sync::atomic::Ordering::SeqCst);
}

/// Catches SIGINT and SIGTERM without SA_RESTART, so a blocking read
/// returns and the guards get to tear everything down.
fn catch_signals() {
    for signal in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: zeroed sigaction is a valid empty value; the handler only
        // stores to an atomic (async-signal-safe).
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(signal, &action, std::ptr::null_mut());
        }
    }
}

fn stopping() -> anyhow::Result<()> {
    anyhow::ensure!(
        !STOP.load(std::sync::atomic::Ordering::SeqCst),
        "interrupted; tearing down"
    );
    Ok(())
}

fn main() -> ExitCode {
    catch_signals();
    let keep = std::env::args().any(|a| a == "--keep");
    match run(keep) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(err) => {
            eprintln!("demo failed to run: {err:#}");
            ExitCode::from(2)
        }
    }
}

/// One flow of the demo and what the mesh must do with it.
struct Flow {
    title: &'static str,
    from: &'static str,
    to: String,
    expect: Expect,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Expect {
    Tunnel,
    Passthrough,
    Denied,
}

fn run(keep: bool) -> anyhow::Result<bool> {
    let started = Instant::now();
    println!(
        "Setting up two simulated nodes with pods (network namespaces, veth, bridge, cgroups)..."
    );
    let mut n1 = Node::new("demo", 1)?;
    let mut n2 = Node::new("demo", 2)?;
    link_nodes(&n1, &n2)?;
    let client1 = n1.add_pod("demo")?;
    let server1 = n1.add_pod("demo")?;
    let client2 = n2.add_pod("demo")?;
    let server2 = n2.add_pod("demo")?;
    let outsider = n2.add_pod("demo")?;
    let dir = TempDir::new("demo")?;

    let echo = service("echo", "demo", ECHO_VIP, &[(80, 9000)]);
    let mut workloads = vec![
        hbone_workload(&client1, "client1", "node1"),
        hbone_workload(&server1, "server1", "node1"),
        hbone_workload(&client2, "client2", "node2"),
        hbone_workload(&server2, "server2", "node2"),
    ];
    endpoint_of(&mut workloads[1], &echo);
    endpoint_of(&mut workloads[3], &echo);
    let config = LocalConfig {
        workloads: workloads.into_iter().map(std::sync::Arc::new).collect(),
        services: vec![echo],
        policies: vec![policy(
            "no-admin-port",
            "demo",
            Scope::Global,
            Action::Deny,
            to_ports(&[9001]),
        )],
        ..LocalConfig::default()
    };
    let config = write_config(dir.path(), "mesh.yaml", &config)?;
    let ca = dir.path().join("ca");
    println!(
        "Starting one agent per node (config: {})...",
        config.display()
    );
    let a1 = Agent::standalone("demo1", &n1, "node1", &config, &ca, &[])?;
    let a2 = Agent::standalone("demo2", &n2, "node2", &config, &ca, &[])?;

    let _s1 = echo_server(&server1, 9000)?;
    let _s2 = echo_server(&server2, 9000)?;
    let _s2admin = echo_server(&server2, 9001)?;
    let _outside = echo_server(&outsider, 9100)?;

    let at = |pod: &Pod, port: u16| SocketAddr::new(pod.ip4.into(), port).to_string();
    let flows = [
        Flow {
            title: "same node",
            from: "client1",
            to: at(&server1, 9000),
            expect: Expect::Tunnel,
        },
        Flow {
            title: "across nodes",
            from: "client1",
            to: at(&server2, 9000),
            expect: Expect::Tunnel,
        },
        Flow {
            title: "through the service VIP",
            from: "client2",
            to: SERVICE_VIP.into(),
            expect: Expect::Tunnel,
        },
        Flow {
            title: "denied by policy no-admin-port",
            from: "client1",
            to: at(&server2, 9001),
            expect: Expect::Denied,
        },
        Flow {
            title: "to a server outside the mesh",
            from: "client1",
            to: at(&outsider, 9100),
            expect: Expect::Passthrough,
        },
    ];
    println!();
    println!(
        "{:<34} {:<8} {:<18} {:<12} {:<10} RESULT",
        "FLOW", "FROM", "TO", "CARRIED BY", "BYTES"
    );
    let mut all_ok = true;
    for flow in &flows {
        stopping()?;
        let pod = if flow.from == "client1" {
            &client1
        } else {
            &client2
        };
        let agent = if flow.from == "client1" { &a1 } else { &a2 };
        let before = agent.log_text().len();
        let out = try_stream(pod, &["echo", &flow.to, "65536", "42"])?;
        std::thread::sleep(Duration::from_millis(100)); // let the access record land
        let log = agent.log_text();
        let record = log.get(before..).unwrap_or_default();
        let (carried, ok, detail) = judge(flow.expect, out.code == Some(0), record);
        all_ok &= ok;
        let bytes = if out.code == Some(0) {
            "64 KiB x2"
        } else {
            "-"
        };
        println!(
            "{:<34} {:<8} {:<18} {:<12} {:<10} {}{}",
            flow.title,
            flow.from,
            flow.to,
            carried,
            bytes,
            if ok { "as expected" } else { "UNEXPECTED" },
            detail
        );
    }
    println!();
    identities(&a1, &a2);
    println!(
        "\nKernel decisions: node1 redirected {} outbound connections to its engine; node2 handed {} TCP connection(s) to its HBONE listener (tunnels share pooled connections)",
        a1.counter("redirected_outbound")?,
        a2.counter("inbound_hbone")?
    );
    println!(
        "Done in {:.1}s: {}",
        started.elapsed().as_secs_f64(),
        if all_ok {
            "every flow behaved as reported"
        } else {
            "SOME FLOWS MISBEHAVED"
        }
    );

    if keep {
        println!("\n--keep: the mesh stays up. Explore it, then press Enter to tear it down:");
        println!("  ip netns list | grep dpt-demo                      # nodes and pods");
        println!(
            "  ip netns exec {} bash                    # a shell in client1",
            client1.netns.name()
        );
        println!(
            "  {} pod list --instance {} --state-dir {}",
            bin_hint(),
            a1.instance(),
            a1.state_dir().display()
        );
        println!(
            "  {} redirect stats --instance {} --bpffs {}",
            bin_hint(),
            a1.instance(),
            a1.bpffs().display()
        );
        println!(
            "  less {}                                  # the config (edits apply live)",
            config.display()
        );
        let _ = std::io::stdout().flush();
        let mut line = String::new();
        let _ = std::io::stdin().read_line(&mut line);
    }
    println!("Tearing down (agents, pods, nodes, pins)...");
    Ok(all_ok)
}

/// How the flow was carried, per the agent's access log, and whether that
/// is what the flow expects.
fn judge(expect: Expect, succeeded: bool, record: &str) -> (&'static str, bool, String) {
    let tunnelled = record.contains("protocol=\"HBONE\"") && record.contains("connection closed");
    let refused = record.contains("refused") || record.contains("401");
    match expect {
        Expect::Tunnel => ("HBONE/mTLS", succeeded && tunnelled, String::new()),
        Expect::Passthrough => ("plain TCP", succeeded && !tunnelled, String::new()),
        Expect::Denied => (
            "HBONE/mTLS",
            !succeeded && refused,
            " (server answered 401; client connection reset)".into(),
        ),
    }
}

/// Prints the identities each side saw.
fn identities(a1: &Agent, a2: &Agent) {
    let seen: std::collections::BTreeSet<String> = a2
        .log_text()
        .lines()
        .chain(a1.log_text().lines())
        .filter(|l| l.contains("direction=\"inbound\"") && l.contains("protocol=\"HBONE\""))
        .filter_map(|l| l.split("src_identity=\"").nth(1))
        .filter_map(|rest| rest.split('"').next().map(str::to_owned))
        .collect();
    println!("Client identities verified by the servers (mutual TLS, SPIFFE):");
    for id in seen {
        println!("  {id}");
    }
}

fn bin_hint() -> String {
    std::env::current_exe()
        .ok()
        .and_then(|p| {
            p.parent()
                .map(|d| d.join("dataplane").display().to_string())
        })
        .unwrap_or_else(|| "dataplane".into())
}
