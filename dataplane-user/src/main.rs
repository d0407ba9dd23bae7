//! `dataplane`: the node agent binary.

use std::process::ExitCode;

use dataplane_user::{
    agent::{self, AgentError, config::WorkersConfig},
    cli::{Cli, Command, PodCommand, RedirectCommand, RunArgs, StateArgs},
    control::{self, ControlError, Request},
    enroll::PodSpec,
    inspect::{CertInfo, StatusReport},
    logging::{self, LogFormat},
    redirect::{self, PinLayout},
    render, version,
    workers::Threading,
};

/// Exit code of `ready` when the agent is not (or not this container's).
const EXIT_NOT_READY: u8 = 1;
/// Exit code when flags do not fit together (clap's for flags it refuses).
const EXIT_USAGE: u8 = 2;
/// Exit code when the host lacks something the agent needs.
const EXIT_ENVIRONMENT: u8 = 3;
/// Exit code when no agent answers on the control socket.
const EXIT_UNREACHABLE: u8 = 4;
/// Exit code of `status` when something needs attention.
const EXIT_UNHEALTHY: u8 = 5;

fn main() -> ExitCode {
    // ztunnel's variable names apply as the flags they map onto
    // (`cli::ztunnel_env`); variables that are not Unicode are none of
    // them.
    let env: Vec<(String, String)> = std::env::vars_os()
        .filter_map(|(name, value)| Some((name.into_string().ok()?, value.into_string().ok()?)))
        .collect();
    let cli = match dataplane_user::cli::ztunnel_env::parse(std::env::args_os(), &env) {
        Ok(cli) => cli,
        Err(err) => err.exit(),
    };
    match dispatch(cli) {
        Ok(code) => code,
        Err(err) => {
            eprintln!("error: {err:#}");
            let unreachable = err
                .downcast_ref::<ControlError>()
                .is_some_and(|e| matches!(e, ControlError::Connect { .. }));
            ExitCode::from(if unreachable { EXIT_UNREACHABLE } else { 1 })
        }
    }
}

/// Sends a report request and returns the report.
fn report(state: &StateArgs, request: &Request) -> anyhow::Result<serde_json::Value> {
    let socket = control::socket_path(&state.state_dir, &state.instance);
    control::call(&socket, request, CONTROL_TIMEOUT)?
        .report
        .ok_or_else(|| anyhow::anyhow!("the agent sent no report (is it an older version?)"))
}

/// `dataplane run`: the flags into the agent's configuration (exit 2 when
/// they do not fit together), then the agent until it stops (exit 3 when
/// the host lacks something it needs, 1 on any other failure).
fn run_agent(args: RunArgs) -> ExitCode {
    logging::init(args.log_format);
    let config = match args.into_config() {
        Ok(config) => config,
        Err(err) => {
            eprintln!("error: {:#}", anyhow::Error::from(err));
            return ExitCode::from(EXIT_USAGE);
        }
    };
    let environment = |err: &AgentError| matches!(err, AgentError::Preflight(_));
    let outcome = match runtime(&config.workers) {
        Ok(runtime) => runtime
            .block_on(agent::run(config))
            .map_err(|err| (environment(&err), anyhow::Error::from(err))),
        Err(err) => Err((false, anyhow::Error::from(err))),
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err((environment, err)) => {
            eprintln!("error: {err:#}");
            ExitCode::from(if environment { EXIT_ENVIRONMENT } else { 1 })
        }
    }
}

/// The agent's main runtime, as its worker settings ask.
fn runtime(workers: &WorkersConfig) -> std::io::Result<tokio::runtime::Runtime> {
    Ok(match (workers.threading, workers.threads) {
        // Connections run on workers of their own (started by the
        // agent); the main runtime only enrolls, watches and
        // answers. One thread: no work stealing, no cross-thread
        // wake-ups.
        (Threading::Pinned, _) | (Threading::Shared, Some(1)) => {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?
        }
        (Threading::Shared, threads) => {
            let mut builder = tokio::runtime::Builder::new_multi_thread();
            if let Some(n) = threads {
                builder.worker_threads(usize::from(n));
            }
            builder.enable_all().build()?
        }
    })
}

fn dispatch(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Run(args) => return Ok(run_agent(*args)),
        Command::Version { json } => {
            let report = version::report()?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{report}");
            }
        }
        Command::Pod(command) => pod_command(command)?,
        Command::Status { state, json } => {
            let value = report(&state, &Request::Status)?;
            let status: StatusReport = serde_json::from_value(value.clone())?;
            if json {
                println!("{}", serde_json::to_string_pretty(&value)?);
            } else {
                print!("{}", render::status(&status, render::colour_wanted()));
            }
            if !status.healthy() {
                return Ok(ExitCode::from(EXIT_UNHEALTHY));
            }
        }
        Command::Ready { state, same_cgroup } => {
            let value = report(&state, &Request::Status)?;
            let status: StatusReport = serde_json::from_value(value)?;
            if !status.ready {
                eprintln!(
                    "not ready: agent pid {} waits for {}",
                    status.pid,
                    status.pending.join(", ")
                );
                return Ok(ExitCode::from(EXIT_NOT_READY));
            }
            if same_cgroup && !in_my_cgroup(status.pid)? {
                eprintln!(
                    "not ready: the control socket is answered by agent pid {}, which runs in another cgroup (another pod's agent, not yet taken over from)",
                    status.pid
                );
                return Ok(ExitCode::from(EXIT_NOT_READY));
            }
            println!("ready (agent pid {})", status.pid);
        }
        Command::ConfigDump { state, json: _ } => {
            let value = report(&state, &Request::ConfigDump)?;
            println!("{}", serde_json::to_string_pretty(&value)?);
        }
        Command::Certs { state, json } => {
            let value = report(&state, &Request::Certs)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&value)?);
            } else {
                let certs: Vec<CertInfo> = serde_json::from_value(value)?;
                print!("{}", render::certs(&certs, render::colour_wanted()));
            }
        }
        Command::InstallCni(args) => {
            logging::init(LogFormat::Text);
            dataplane_user::cni::install::run((*args).into())?;
        }
        Command::Redirect(RedirectCommand::Stats { state, json }) => {
            let pins = PinLayout::new(&state.bpffs, &state.instance);
            let counters = redirect::read_counters(&pins).map_err(|e| {
                anyhow::anyhow!(
                    "{e}; is an agent instance `{}` running (pins under {})?",
                    state.instance,
                    pins.dir().display()
                )
            })?;
            if json {
                println!("{}", serde_json::to_string_pretty(&counters)?);
            } else {
                for c in counters {
                    println!("{:24} {}", c.name, c.value);
                }
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// How long the CLI waits for the agent.
const CONTROL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

fn pod_command(command: PodCommand) -> anyhow::Result<()> {
    match command {
        PodCommand::Add(args) => {
            let args = *args;
            let socket = control::socket_path(&args.state.state_dir, &args.state.instance);
            let pod = PodSpec {
                uid: args.uid,
                name: args.name,
                namespace: args.namespace,
                service_account: args.service_account,
                trust_domain: args.trust_domain,
                netns: args.netns,
                ips: args.ips,
                node_addr: args.node_addr,
                exclusions: dataplane_user::redirect::Exclusions {
                    outbound_ports: args.exclude_outbound_ports,
                    outbound_cidrs: args.exclude_outbound_cidrs,
                    inbound_ports: args.exclude_inbound_ports,
                    bypass_inbound: args.bypass_inbound_capture,
                },
                dns_capture: args.dns_capture,
                fast_path: args.fast_path,
            };
            let response = control::call(
                &socket,
                &Request::Add { pod: Box::new(pod) },
                CONTROL_TIMEOUT,
            )?;
            for status in response.pods {
                println!(
                    "enrolled {}/{} (uid {}, netns cookie {})",
                    status.spec.namespace, status.spec.name, status.spec.uid, status.netns_cookie
                );
            }
        }
        PodCommand::Remove { state, uid, netns } => {
            let socket = control::socket_path(&state.state_dir, &state.instance);
            let response =
                control::call(&socket, &Request::Remove { uid, netns }, CONTROL_TIMEOUT)?;
            match response.removed {
                Some(true) => println!("removed"),
                _ => println!("not enrolled (nothing to do)"),
            }
        }
        PodCommand::List { state, json } => {
            let socket = control::socket_path(&state.state_dir, &state.instance);
            let response = control::call(&socket, &Request::List, CONTROL_TIMEOUT)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&response.pods)?);
            } else if response.pods.is_empty() {
                println!("no pods enrolled");
            } else {
                println!(
                    "{:40} {:30} {:20} {:40} NOT CAPTURED",
                    "UID", "NAMESPACE/NAME", "NETNS COOKIE", "IPS"
                );
                for p in response.pods {
                    let ips: Vec<String> = p.spec.ips.iter().map(ToString::to_string).collect();
                    println!(
                        "{:40} {:30} {:<20} {:40} {}",
                        p.spec.uid,
                        format!("{}/{}", p.spec.namespace, p.spec.name),
                        p.netns_cookie,
                        ips.join(","),
                        dataplane_user::enroll::exclusions_summary(&p.spec.exclusions)
                    );
                }
            }
        }
    }
    Ok(())
}

/// Whether process `pid` runs in the calling process's cgroup: for
/// `dataplane ready --same-cgroup`, which a kubelet `exec` probe runs in
/// its container's cgroup (both sides read through the caller's cgroup
/// namespace, so the paths compare whatever the container's view). On a
/// hybrid host only the cgroup v2 line counts, the one every container
/// has its own of.
fn in_my_cgroup(pid: u32) -> std::io::Result<bool> {
    let unified = |text: String| {
        text.lines()
            .find(|l| l.starts_with("0::"))
            .map_or(text.clone(), str::to_owned)
    };
    let mine = unified(std::fs::read_to_string("/proc/self/cgroup")?);
    let theirs = unified(std::fs::read_to_string(format!("/proc/{pid}/cgroup"))?);
    Ok(mine == theirs)
}

#[cfg(test)]
mod tests {
    #[test]
    fn this_process_is_in_its_own_cgroup() -> std::io::Result<()> {
        assert!(super::in_my_cgroup(std::process::id())?);
        Ok(())
    }
}
