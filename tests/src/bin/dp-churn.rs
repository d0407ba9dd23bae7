//! `dp-churn`: the enrollment churn benchmark (see
//! `dataplane_tests::bench::churn`): request/response latency of an
//! enrolled pod while other pods are enrolled and removed in a loop.
//! `cargo xtask bench` runs it; run it directly to compare two agent
//! builds.
//!
//! `dp-churn --agent PATH --load PATH --out FILE [--quick] [--pods N]
//! [--requests N] [--rounds N] [--worker-threads 1,2]`
//!
//! Needs root. Everything it creates is named `dpt-bench...` and removed on
//! exit, on Ctrl-C or SIGTERM.

use std::{path::PathBuf, process::ExitCode};

use dataplane_tests::bench::{
    churn::{self, ChurnSettings},
    signal, sweep,
};

fn main() -> ExitCode {
    signal::install();
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("dp-churn: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> anyhow::Result<()> {
    let mut agent = None;
    let mut load = None;
    let mut out = PathBuf::from("churn.json");
    let mut settings = ChurnSettings::full();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = || {
            args.next()
                .ok_or_else(|| anyhow::anyhow!("{arg} needs a value"))
        };
        match arg.as_str() {
            "--agent" => agent = Some(PathBuf::from(value()?)),
            "--load" => load = Some(PathBuf::from(value()?)),
            "--out" => out = PathBuf::from(value()?),
            "--quick" => settings = ChurnSettings::quick(),
            "--pods" => settings.pods = value()?.parse()?,
            "--requests" => settings.requests = value()?.parse()?,
            "--rounds" => settings.rounds = value()?.parse()?,
            "--worker-threads" => {
                settings.worker_threads = value()?
                    .split(',')
                    .map(str::parse)
                    .collect::<Result<_, _>>()?;
            }
            other => anyhow::bail!("unknown argument `{other}`"),
        }
    }
    let agent = agent.ok_or_else(|| anyhow::anyhow!("--agent PATH is required"))?;
    let load = load.ok_or_else(|| anyhow::anyhow!("--load PATH is required"))?;
    anyhow::ensure!(
        settings.pods <= 200,
        "--pods: at most 200 pods fit one simulated node"
    );
    sweep::sweep();
    let results = churn::run(&agent, &load, &settings)?;
    std::fs::write(&out, serde_json::to_string_pretty(&results)?)?;
    print!("{}", churn::table(&results));
    Ok(())
}
