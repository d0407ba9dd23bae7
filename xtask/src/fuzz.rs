//! `cargo xtask fuzz`: every fuzz target in `dataplane-user/fuzz` (libFuzzer
//! through cargo-fuzz, nightly, address sanitizer), each for a time budget,
//! starting from seeds the unit tests write; prints executions per target.
//!
//! Corpora grow under `target/fuzz/corpus/<target>` and are kept between
//! runs; a crash stops that target, leaves the input under
//! `dataplane-user/fuzz/artifacts/<target>/` and fails the task.

use std::path::Path;
use std::process::{Command, ExitCode, Stdio};
use std::time::Instant;

use anyhow::{Context as _, Result, bail};

use crate::{cmd, setup};

/// The cargo-fuzz release installed when missing (its CLI is what this
/// module drives).
const CARGO_FUZZ: &str = "cargo-fuzz@0.13.2";

/// Arguments of `cargo xtask fuzz`.
#[derive(Debug, clap::Args)]
pub struct FuzzArgs {
    /// Seconds per target.
    #[arg(long = "time", value_name = "SECS", default_value_t = 60)]
    pub seconds: u64,
    /// Only these targets (comma-separated; `cargo fuzz list` in
    /// dataplane-user names them all).
    #[arg(long, value_delimiter = ',')]
    pub targets: Vec<String>,
}

/// One target's run.
struct Outcome {
    target: String,
    executions: Option<u64>,
    seconds: f64,
    corpus: usize,
    crashed: bool,
}

/// Runs the fuzz targets and prints a table of executions.
pub fn fuzz(args: &FuzzArgs) -> Result<ExitCode> {
    setup::setup(None)?;
    ensure_cargo_fuzz()?;
    let crate_dir = cmd::workspace_root().join("dataplane-user");
    let work = cmd::target_dir().join("fuzz");
    let seeds = work.join("seeds");
    write_seeds(&seeds)?;

    let targets = if args.targets.is_empty() {
        list_targets(&crate_dir)?
    } else {
        args.targets.clone()
    };
    let mut outcomes = Vec::new();
    for target in &targets {
        let corpus = work.join("corpus").join(target);
        std::fs::create_dir_all(&corpus)
            .with_context(|| format!("cannot create {}", corpus.display()))?;
        outcomes.push(run_target(
            &crate_dir,
            target,
            &corpus,
            &seeds.join(target),
            args.seconds,
        )?);
    }

    println!("\n| target | executions | seconds | exec/s | corpus | result |");
    println!("|---|---|---|---|---|---|");
    for o in &outcomes {
        let execs = o.executions.map_or("?".to_owned(), |n| n.to_string());
        let rate = o
            .executions
            .map_or("?".to_owned(), |n| format!("{:.0}", n as f64 / o.seconds));
        let result = if o.crashed { "CRASH" } else { "ok" };
        println!(
            "| {} | {execs} | {:.0} | {rate} | {} | {result} |",
            o.target, o.seconds, o.corpus
        );
    }
    if outcomes.iter().any(|o| o.crashed) {
        eprintln!(
            "fuzz: a target crashed; the input is under dataplane-user/fuzz/artifacts/ \
             (reproduce with `cargo +nightly fuzz run <target> <file>` in dataplane-user)"
        );
        return Ok(ExitCode::FAILURE);
    }
    Ok(ExitCode::SUCCESS)
}

/// Installs a C++ compiler (libfuzzer-sys builds libFuzzer from C++) and
/// cargo-fuzz when missing. apt may not remove anything to do it.
fn ensure_cargo_fuzz() -> Result<()> {
    let has_cxx = Command::new("c++")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|status| status.success());
    if !has_cxx {
        println!("installing g++ (libFuzzer is C++)...");
        setup::apt::install_packages(&["g++"])
            .context("cargo fuzz needs a C++ compiler: install g++")?;
    }
    let present = Command::new("cargo")
        .args(["fuzz", "--version"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|status| status.success());
    if present {
        return Ok(());
    }
    println!("installing {CARGO_FUZZ}...");
    cmd::run(Command::new("cargo").args(["install", "--locked", CARGO_FUZZ]))
}

/// Runs the unit tests that write seeds (see `dataplane-user/src/fuzz_seeds.rs`
/// and the `fuzz_seeds.rs` of `crates/identity`, `crates/model` and
/// `crates/engine`):
/// each crate's tests seed the targets of the parsers it holds.
fn write_seeds(seeds: &Path) -> Result<()> {
    if seeds.exists() {
        std::fs::remove_dir_all(seeds)
            .with_context(|| format!("cannot clear old seeds in {}", seeds.display()))?;
    }
    cmd::run(cmd::cargo().env("DATAPLANE_FUZZ_SEEDS", seeds).args([
        "test",
        "-p",
        "dataplane-user",
        "-p",
        "dataplane-identity",
        "-p",
        "dataplane-model",
        "-p",
        "dataplane-engine",
        "--lib",
        "-q",
    ]))
    .context("the unit tests that write the fuzz seeds failed")
}

/// The targets cargo-fuzz finds.
fn list_targets(crate_dir: &Path) -> Result<Vec<String>> {
    let listed = cmd::output(
        Command::new("cargo")
            .current_dir(crate_dir)
            .args(["+nightly", "fuzz", "list"]),
    )?;
    let targets: Vec<String> = listed.lines().map(str::trim).map(str::to_owned).collect();
    if targets.is_empty() {
        bail!(
            "cargo fuzz list found no targets in {}",
            crate_dir.display()
        );
    }
    Ok(targets)
}

/// Fuzzes one target for `seconds`, reading its statistics from
/// libFuzzer's final report.
fn run_target(
    crate_dir: &Path,
    target: &str,
    corpus: &Path,
    seeds: &Path,
    seconds: u64,
) -> Result<Outcome> {
    let started = Instant::now();
    let mut fuzz = Command::new("cargo");
    fuzz.current_dir(crate_dir)
        .args(["+nightly", "fuzz", "run", "-O", target])
        .arg(corpus);
    // A target whose tests wrote no seed starts from an empty corpus.
    if seeds.is_dir() {
        fuzz.arg(seeds);
    }
    fuzz.args([
        "--",
        &format!("-max_total_time={seconds}"),
        "-print_final_stats=1",
        // Inputs past 64 KiB say nothing new about these parsers and slow
        // every execution.
        "-max_len=65536",
    ]);
    let shown = cmd::display(&fuzz);
    println!("+ {shown}");
    let output = fuzz
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("cannot start `{shown}`"))?;
    let log = String::from_utf8_lossy(&output.stderr);
    let crashed = !output.status.success();
    if crashed {
        eprintln!("{log}");
    }
    let executions = final_stat(&log, "stat::number_of_executed_units:");
    // libFuzzer's own run time, without cargo's build before it.
    let fuzzing_seconds = fuzz_seconds(&log);
    let corpus_files = std::fs::read_dir(corpus)
        .map(|entries| entries.count())
        .unwrap_or(0);
    let outcome = Outcome {
        target: target.to_owned(),
        executions,
        seconds: fuzzing_seconds.unwrap_or_else(|| started.elapsed().as_secs_f64()),
        corpus: corpus_files,
        crashed,
    };
    println!(
        "fuzz: {target}: {} executions, corpus {corpus_files}{}",
        executions.map_or("?".to_owned(), |n| n.to_string()),
        if crashed { ", CRASHED" } else { "" }
    );
    Ok(outcome)
}

/// A number from libFuzzer's `-print_final_stats` lines.
fn final_stat(log: &str, key: &str) -> Option<u64> {
    log.lines()
        .filter_map(|line| line.trim().strip_prefix(key))
        .find_map(|value| value.trim().parse().ok())
}

/// The run time from libFuzzer's `Done N runs in S second(s)` line.
fn fuzz_seconds(log: &str) -> Option<f64> {
    log.lines()
        .filter_map(|line| line.strip_prefix("Done "))
        .find_map(|rest| {
            rest.split(" in ")
                .nth(1)?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .map(|seconds: u64| seconds.max(1) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_libfuzzer_final_stats() {
        let log = "#1048576\tpulse  cov: 812 ft: 2100\nDone 1234567 runs in 61 second(s)\n\
                   stat::number_of_executed_units: 1234567\nstat::average_exec_per_sec:     20238\n";
        assert_eq!(
            final_stat(log, "stat::number_of_executed_units:"),
            Some(1_234_567)
        );
        assert_eq!(final_stat("", "stat::number_of_executed_units:"), None);
        assert_eq!(fuzz_seconds(log), Some(61.0));
        assert_eq!(fuzz_seconds(""), None);
    }
}
