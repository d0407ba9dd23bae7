//! `dp-scale`: the mesh scale benchmark (see
//! `dataplane_tests::bench::scale`): one agent fed a synthetic mesh of N
//! workloads by the test istiod, then one workload changed at a time.
//! `cargo xtask bench` runs it; run it directly for other sizes or to
//! compare two agent builds.
//!
//! `dp-scale --agent PATH --out FILE [--quick] [--sizes 1000,10000]
//! [--rate N] [--seconds N] [--ztunnel PATH] [--load PATH]`
//!
//! With `--load PATH` (`dp-load`), our agent's node has a client and a
//! server pod and the client opens a connection to the server through the
//! agent once a second during the churn.
//!
//! With `--ztunnel PATH` (or `DATAPLANE_ZTUNNEL`, as the interop tests
//! take it), each size also runs against that stock ztunnel and the table
//! sets ours beside it; a ztunnel run that fails is reported in the table
//! and makes the exit status non-zero.
//!
//! Needs root. Everything it creates is named `dpt-bench...` and removed on
//! exit, on Ctrl-C or SIGTERM.

use std::{path::PathBuf, process::ExitCode, time::Duration};

use dataplane_tests::bench::{
    scale::{self, ScaleSettings},
    signal, sweep,
};

fn main() -> ExitCode {
    signal::install();
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("dp-scale: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> anyhow::Result<()> {
    let mut agent = None;
    let mut out = PathBuf::from("scale.json");
    let mut settings = ScaleSettings::full();
    let mut ztunnel = std::env::var_os("DATAPLANE_ZTUNNEL").map(PathBuf::from);
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = || {
            args.next()
                .ok_or_else(|| anyhow::anyhow!("{arg} needs a value"))
        };
        match arg.as_str() {
            "--agent" => agent = Some(PathBuf::from(value()?)),
            "--out" => out = PathBuf::from(value()?),
            "--quick" => {
                let quick = ScaleSettings::quick();
                (settings.sizes, settings.churn) = (quick.sizes, quick.churn);
            }
            "--sizes" => {
                settings.sizes = value()?
                    .split(',')
                    .map(str::parse)
                    .collect::<Result<_, _>>()?;
            }
            "--rate" => settings.rate = value()?.parse()?,
            "--seconds" => settings.churn = Duration::from_secs(value()?.parse()?),
            "--ztunnel" => ztunnel = Some(PathBuf::from(value()?)),
            "--load" => settings.load = Some(PathBuf::from(value()?)),
            other => anyhow::bail!("unknown argument `{other}`"),
        }
    }
    let agent = agent.ok_or_else(|| anyhow::anyhow!("--agent PATH is required"))?;
    anyhow::ensure!(
        settings.rate > 0 && settings.sizes.iter().all(|n| (1..1 << 24).contains(n)),
        "--rate must be positive and --sizes between 1 and 2^24 workloads"
    );
    if let Some(path) = &ztunnel {
        anyhow::ensure!(
            path.is_file(),
            "ztunnel binary {} is not a file",
            path.display()
        );
    }
    settings.ztunnel = ztunnel;
    sweep::sweep();
    let rows = scale::run(&agent, &settings)?;
    std::fs::write(&out, serde_json::to_string_pretty(&rows)?)?;
    print!("{}", scale::table(&rows));
    let failed = rows.iter().filter(|r| r.ztunnel_error.is_some()).count();
    anyhow::ensure!(failed == 0, "ztunnel's run failed at {failed} sizes");
    Ok(())
}
