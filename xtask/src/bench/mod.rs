//! `cargo xtask bench`: kernel-level benchmarks of the data plane (no mesh
//! vs Istio-style iptables capture vs our eBPF capture, same engine, plain
//! and HBONE, same-node and cross-node; and, given a stock ztunnel binary,
//! ztunnel in dedicated mode behind the same iptables rules, set beside
//! ours in [`vs_ztunnel`]), then criterion micro-benchmarks of the hot
//! user-space paths, then the report (with a model of the figures on more
//! cores, [`scaling`]):
//!
//! - a table on stdout, `target/bench/report.md`;
//! - `target/bench/report.json`: machine, kernel, commit, every sample,
//!   the medians and the targets;
//! - one SVG chart per workload, `target/bench/<workload>.svg`.
//!
//! The measuring is done by `dp-bench` (tests crate, `src/bench/`), which
//! owns namespaces, cgroups, agents and processes and removes them on any
//! exit; this module builds it, runs it, and turns its samples
//! (`target/bench/samples.json`) into the report. `--quick` runs every mode
//! briefly so CI proves the harness works; CI never asserts a timing.

mod idle;
mod micro;
mod report;
mod samples;
mod scaling;
mod svg;
mod targets;
mod vs_ztunnel;

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::Instant;

use anyhow::{Context as _, Result};
use serde_json::{Value, json};

use crate::{build, cmd, setup};

/// `cargo xtask bench` options.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct BenchArgs {
    /// Run every mode and workload briefly (debug build, one round, small
    /// counts, micro-benchmarks once each): proves the harness works; the
    /// numbers mean nothing.
    #[arg(long)]
    pub quick: bool,
    /// Rounds of every workload in every mode [default: 6, quick 1].
    #[arg(long)]
    pub rounds: Option<usize>,
    /// Only these workloads (comma-separated: conn-rate, rr, rr-pinned,
    /// conn-rr, bulk-1, bulk-4, bulk-8).
    #[arg(long, value_delimiter = ',')]
    pub workloads: Vec<String>,
    /// Only these modes (comma-separated: direct, iptables, ebpf, ztunnel)
    /// [default: all; ztunnel only with a binary]: a shorter run, at the
    /// cost of the ratios to the modes left out.
    #[arg(long, value_delimiter = ',')]
    pub modes: Vec<String>,
    /// Skip agent memory under idle connections.
    #[arg(long)]
    pub no_idle: bool,
    /// Skip the enrollment churn benchmark.
    #[arg(long)]
    pub no_churn: bool,
    /// Mesh sizes of the scale benchmark, in workloads (comma-separated)
    /// [default: 1000,10000; quick 1000]; `0` skips it.
    #[arg(long, value_delimiter = ',')]
    pub scale: Vec<usize>,
    /// A stock ztunnel binary: the kernel-level benchmarks run it in
    /// dedicated mode behind iptables REDIRECT beside our modes and report
    /// ours/ztunnel, and the scale benchmark runs every size against it
    /// too [default: `DATAPLANE_ZTUNNEL`, if set; without one both skip
    /// ztunnel].
    #[arg(long, value_name = "PATH")]
    pub ztunnel: Option<PathBuf>,
    /// Skip the criterion micro-benchmarks.
    #[arg(long)]
    pub no_micro: bool,
    /// Render the report from an earlier run's samples file, measuring
    /// nothing.
    #[arg(long, value_name = "SAMPLES_JSON")]
    pub render: Option<PathBuf>,
    /// Arguments for criterion, after `--`.
    #[arg(last = true, value_name = "EXTRA")]
    pub extra: Vec<String>,
}

/// `cargo xtask bench [...]`.
pub fn bench(args: &BenchArgs) -> Result<ExitCode> {
    let started = Instant::now();
    let out_dir = cmd::target_dir().join("bench");
    std::fs::create_dir_all(&out_dir)
        .with_context(|| format!("cannot create {}", out_dir.display()))?;
    let samples_file = out_dir.join("samples.json");
    let micro_since = std::time::SystemTime::now();
    // Quick runs reuse the debug build `cargo xtask test` made; full runs
    // measure the release build.
    let release = !args.quick;
    let (samples_file, harness_ok, micro_note) = match &args.render {
        Some(file) => (
            file.clone(),
            true,
            "not run (report rendered from earlier samples)".to_owned(),
        ),
        None => {
            setup::setup(None)?;
            build::build_bins(release)?;
            let micro_exe = if args.no_micro {
                None
            } else {
                Some(micro::build(release)?)
            };
            let harness_ok = run_harness(args, release, &samples_file)?;
            let churn_ok = args.no_churn || run_churn(args.quick, release, &out_dir)?;
            let scale_ok = args.scale == [0] || run_scale(args, release, &out_dir)?;
            let note = if let Some(exe) = micro_exe {
                micro::run(&exe, args.quick, &args.extra, &cmd::target_dir())?;
                if args.quick {
                    "ran once each in criterion's test mode (`--quick`): no timings".to_owned()
                } else {
                    "1 s warm-up, 2 s measurement each, at nice -10".to_owned()
                }
            } else {
                "skipped (`--no-micro`)".to_owned()
            };
            (samples_file, harness_ok && churn_ok && scale_ok, note)
        }
    };
    let micro = if args.quick || args.no_micro {
        Vec::new()
    } else {
        micro::read(&cmd::target_dir(), micro_since)
    };
    let complete = render(&samples_file, &out_dir, &micro, &micro_note)?;
    append_side(&CHURN, &out_dir)?;
    append_side(&SCALE, &out_dir)?;
    println!(
        "bench: report in {} ({:.0} s in all)",
        out_dir.join("report.md").display(),
        started.elapsed().as_secs_f64()
    );
    Ok(if harness_ok && complete {
        ExitCode::SUCCESS
    } else {
        eprintln!("bench: some runs failed; see the report's last section");
        ExitCode::FAILURE
    })
}

/// Runs `dp-bench`, outliving a Ctrl-C so that it can clean up and the
/// partial failure is reported. Returns whether every run succeeded.
fn run_harness(args: &BenchArgs, release: bool, samples: &Path) -> Result<bool> {
    let harness = cmd::target_dir()
        .join(build::profile(release).1)
        .join("dp-bench");
    let mut command = Command::new(&harness);
    command.arg("--out").arg(samples);
    if args.quick {
        command.arg("--quick");
    }
    if let Some(rounds) = args.rounds {
        command.args(["--rounds", &rounds.to_string()]);
    }
    if !args.workloads.is_empty() {
        command.args(["--workloads", &args.workloads.join(",")]);
    }
    if args.no_idle {
        command.arg("--no-idle");
    }
    if !args.modes.is_empty() {
        command.args(["--modes", &args.modes.join(",")]);
    }
    // Without it dp-bench takes `DATAPLANE_ZTUNNEL`, or skips ztunnel.
    if let Some(ztunnel) = &args.ztunnel {
        command.arg("--ztunnel").arg(ztunnel);
    }
    let _ = std::fs::remove_file(samples);
    println!("+ {}", cmd::display(&command));
    // The terminal's Ctrl-C reaches dp-bench too; it stops between runs
    // and removes what it created. xtask only has to outlive it.
    // SAFETY: the handler does nothing (async-signal-safe); a handler,
    // unlike SIG_IGN, is reset to the default in the child on exec.
    unsafe {
        libc::signal(libc::SIGINT, on_sigint as *const () as libc::sighandler_t);
    }
    let status = command
        .status()
        .with_context(|| format!("cannot start {}", harness.display()))?;
    anyhow::ensure!(
        samples.exists(),
        "dp-bench wrote no samples ({}); its messages are above",
        cmd::describe(status)
    );
    Ok(status.success())
}

/// A benchmark beside the main harness: its own binary (tests crate),
/// started with the agent binary, `--out <name>.json` and its own
/// arguments, printing the report's table on stdout (kept in `<name>.md`).
struct SideBench {
    /// The binary, e.g. `dp-churn`.
    binary: &'static str,
    /// The files' stem, e.g. `churn`.
    name: &'static str,
    /// The report section's title.
    title: &'static str,
    /// What the section's table measures.
    intro: &'static str,
}

const CHURN: SideBench = SideBench {
    binary: "dp-churn",
    name: "churn",
    title: "Enrollment churn",
    intro: "Persistent 1 KiB request/response between two enrolled pods of one node, alone (`quiet`) and \
            while other pods are enrolled and removed in a loop over the control socket (`churn`); medians \
            over rounds.",
};

const SCALE: SideBench = SideBench {
    binary: "dp-scale",
    name: "scale",
    title: "Mesh scale",
    intro: "One agent fed by the test istiod a mesh of N workloads (one IP each, a service per ten, a \
            namespace policy per hundred), then 20 single-workload updates per second; the agent ACKs a push \
            once its state holds it. CPU from the agent's cgroup; RSS per workload includes the agent's base. \
            With `--ztunnel PATH` (or `DATAPLANE_ZTUNNEL`), a stock ztunnel is then fed the same resources by a \
            fresh test istiod, in a cgroup of its own, and measured the same way (it ACKs a push once applied; \
            its /config_dump is checked to hold every resource and the last update). Connection set-up: a client \
            pod opens a connection (connect, 64 bytes echoed) to a server pod of the agent's node through the \
            agent, HBONE, no fast path, once a second during the churn (our agent only).",
};

/// Runs `dp-churn` (enrollment churn beside request/response traffic).
fn run_churn(quick: bool, release: bool, out_dir: &Path) -> Result<bool> {
    let load = cmd::target_dir()
        .join(build::profile(release).1)
        .join("dp-load");
    let mut extra = vec!["--load".into(), load.into_os_string()];
    if quick {
        extra.push("--quick".into());
    }
    run_side(&CHURN, &extra, release, out_dir)
}

/// Runs `dp-scale` (the mesh state at N workloads fed by the test istiod).
fn run_scale(args: &BenchArgs, release: bool, out_dir: &Path) -> Result<bool> {
    let load = cmd::target_dir()
        .join(build::profile(release).1)
        .join("dp-load");
    let mut extra = vec!["--load".into(), load.into_os_string()];
    if args.quick {
        extra.push("--quick".into());
    }
    if !args.scale.is_empty() {
        let sizes: Vec<String> = args.scale.iter().map(usize::to_string).collect();
        extra.extend(["--sizes".into(), sizes.join(",").into()]);
    }
    if let Some(ztunnel) = &args.ztunnel {
        extra.extend(["--ztunnel".into(), ztunnel.clone().into_os_string()]);
    }
    run_side(&SCALE, &extra, release, out_dir)
}

/// Runs `bench` with `extra`; its table goes to `<name>.md` and its
/// samples to `<name>.json`. Returns whether it succeeded.
fn run_side(
    bench: &SideBench,
    extra: &[std::ffi::OsString],
    release: bool,
    out_dir: &Path,
) -> Result<bool> {
    let bin_dir = cmd::target_dir().join(build::profile(release).1);
    let json = out_dir.join(format!("{}.json", bench.name));
    let table = out_dir.join(format!("{}.md", bench.name));
    let _ = std::fs::remove_file(&json);
    let _ = std::fs::remove_file(&table);
    let mut command = Command::new(bin_dir.join(bench.binary));
    command
        .arg("--agent")
        .arg(bin_dir.join("dataplane"))
        .arg("--out")
        .arg(&json)
        .args(extra);
    println!("+ {}", cmd::display(&command));
    let output = command
        .stderr(std::process::Stdio::inherit())
        .output()
        .with_context(|| format!("cannot start {}", bench.binary))?;
    if !output.status.success() {
        eprintln!(
            "bench: {} failed ({})",
            bench.title.to_lowercase(),
            cmd::describe(output.status)
        );
        return Ok(false);
    }
    write(&table, &String::from_utf8_lossy(&output.stdout))?;
    Ok(true)
}

/// Adds `bench`'s table (when this run made one) to the report.
fn append_side(bench: &SideBench, out_dir: &Path) -> Result<()> {
    let Ok(table) = std::fs::read_to_string(out_dir.join(format!("{}.md", bench.name))) else {
        return Ok(());
    };
    let section = format!("\n## {}\n\n{}\n\n{table}", bench.title, bench.intro);
    let report = out_dir.join("report.md");
    let mut text = std::fs::read_to_string(&report).unwrap_or_default();
    text.push_str(&section);
    write(&report, &text)?;
    println!("{section}");
    Ok(())
}

extern "C" fn on_sigint(_signal: libc::c_int) {}

/// Writes report.md, report.json and the charts; prints the report.
/// Returns whether every run and measurement succeeded.
fn render(
    samples_file: &Path,
    out_dir: &Path,
    micro: &[micro::MicroResult],
    micro_note: &str,
) -> Result<bool> {
    let text = std::fs::read_to_string(samples_file)
        .with_context(|| format!("cannot read {}", samples_file.display()))?;
    let raw: Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not JSON", samples_file.display()))?;
    let samples = raw["samples"].as_array().cloned().unwrap_or_default();
    let figures = samples::Figures::from_samples(&samples)?;
    let idle_rows = idle::IdleRow::parse_all(&raw["idle"]);
    let checked = targets::check(&figures, &idle_rows);
    let side_by_side = vs_ztunnel::rows(&figures, &idle_rows);
    let scaling = scaling::Model::from_run(&figures, &raw["meta"]);
    let mut meta = raw["meta"].clone();
    if let Some(obj) = meta.as_object_mut() {
        obj.insert("commit".into(), json!(commit()));
    }
    let inputs = report::Inputs {
        meta: &meta,
        figures: &figures,
        idle: &idle_rows,
        targets: &checked,
        micro,
        micro_note,
        vs_ztunnel: &side_by_side,
        scaling: &scaling,
    };
    let md = report::markdown(&inputs, true);
    write(&out_dir.join("report.md"), &md)?;
    for workload in &figures.workloads {
        if let Some(svg) = report::chart(&figures, workload) {
            write(&out_dir.join(format!("{workload}.svg")), &svg)?;
        }
    }
    if let Some(svg) = report::idle_chart(&idle_rows) {
        write(&out_dir.join("idle-rss.svg"), &svg)?;
    }
    let summary = summary(&figures);
    let report_json = json!({
        "meta": meta,
        "targets": targets::to_json(&checked),
        "vs_ztunnel": vs_ztunnel::to_json(&meta, &side_by_side),
        "scaling": scaling.to_json(),
        "summary": summary,
        "samples": raw["samples"],
        "idle": raw["idle"],
        "micro": micro.iter().map(|m| json!({
            "id": m.id, "mean_ns": m.mean_ns, "low_ns": m.low_ns, "high_ns": m.high_ns,
        })).collect::<Vec<_>>(),
    });
    write(
        &out_dir.join("report.json"),
        &serde_json::to_string_pretty(&report_json)?,
    )?;
    println!("\n{}", report::markdown(&inputs, false));
    for line in vs_ztunnel::summary_lines(&side_by_side) {
        println!("vs ztunnel: {line}");
    }
    let idle_failed = idle_rows.iter().any(|r| r.error.is_some());
    Ok(figures.failures.is_empty() && !idle_failed)
}

/// Medians and ratios of every figure, for report.json.
fn summary(figures: &samples::Figures) -> Value {
    let mut rows = Vec::new();
    for workload in &figures.workloads {
        for variant in figures.variants(workload) {
            for metric in samples::metrics(workload) {
                let Some(median) = figures.median(workload, &variant, metric.name) else {
                    continue;
                };
                rows.push(json!({
                    "workload": workload,
                    "placement": variant.placement,
                    "mode": variant.mode,
                    "protocol": variant.protocol,
                    "metric": metric.name,
                    "median": median,
                    "vs_direct": figures.vs_direct(workload, &variant, metric.name),
                    "ebpf_vs_iptables": figures.vs_iptables(workload, &variant, metric.name),
                }));
            }
        }
    }
    Value::Array(rows)
}

fn write(path: &Path, text: &str) -> Result<()> {
    std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))
}

/// `git describe`-like: the commit, `-dirty` when the tree has changes.
fn commit() -> String {
    let root = cmd::workspace_root();
    let head = cmd::probe(
        Command::new("git")
            .arg("-C")
            .arg(&root)
            .args(["rev-parse", "HEAD"]),
    )
    .map(|s| s.trim().to_owned())
    .unwrap_or_else(|| "unknown".into());
    let dirty = cmd::probe(
        Command::new("git")
            .arg("-C")
            .arg(&root)
            .args(["status", "--porcelain"]),
    )
    .is_some_and(|s| !s.trim().is_empty());
    if dirty { format!("{head}-dirty") } else { head }
}
