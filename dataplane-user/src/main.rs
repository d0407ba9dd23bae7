//! `dataplane`: the node agent binary.

use std::process::ExitCode;

use clap::Parser;
use dataplane_user::{
    agent::{self, AgentError},
    cli::{Cli, Command, RedirectCommand},
    logging,
    redirect::{self, PinLayout},
    version,
};

/// Exit code when the host lacks something the agent needs.
const EXIT_ENVIRONMENT: u8 = 3;

fn main() -> ExitCode {
    let cli = Cli::parse();
    match dispatch(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            let environment = err
                .downcast_ref::<AgentError>()
                .is_some_and(|e| matches!(e, AgentError::Preflight(_)));
            ExitCode::from(if environment { EXIT_ENVIRONMENT } else { 1 })
        }
    }
}

fn dispatch(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Run(args) => {
            logging::init(args.log_format);
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()?;
            runtime.block_on(agent::run(args))?;
        }
        Command::Version { json } => {
            let report = version::report()?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{report}");
            }
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
    Ok(())
}
