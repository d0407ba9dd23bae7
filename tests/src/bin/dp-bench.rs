//! `dp-bench`: runs the kernel-level benchmarks (see
//! `dataplane_tests::bench`) and writes every sample as JSON. `cargo xtask
//! bench` builds it, runs it and renders the report; run it directly only to
//! debug the harness.
//!
//! `dp-bench --out FILE [--quick] [--rounds N] [--workloads a,b] [--no-idle]
//! [--modes direct,iptables,ebpf,ztunnel] [--ztunnel PATH]` (a subset of
//! modes is for profiling one of them: the report's ratios need all of
//! them).
//!
//! With a stock ztunnel binary (`--ztunnel PATH`, or `DATAPLANE_ZTUNNEL` as
//! the interop tests take it) a fourth cluster runs it in dedicated mode
//! behind iptables REDIRECT (`dataplane_tests::bench::dedicated`), measured
//! in the same rounds as our modes; without one that cluster is skipped,
//! and said so.
//!
//! Needs root (namespaces, cgroups, bpffs). Everything it creates is named
//! `dpt-bench...` and removed on exit, on Ctrl-C or SIGTERM; leftovers of a
//! run that was killed outright are removed by the next one.

use std::{
    path::PathBuf,
    process::ExitCode,
    time::{Instant, SystemTime, UNIX_EPOCH},
};

use dataplane_tests::bench::{
    dedicated::ZtunnelBuild,
    mesh::{Binaries, Mode},
    plan::{self, Clusters, Counts, Plan, Workload},
    probe, signal, sweep,
};
use serde_json::{Value, json};

/// Nice value of the harness and everything it starts (inherited): every
/// mode's processes alike get ahead of unrelated work on the machine.
const NICE: i32 = -10;

fn main() -> ExitCode {
    signal::install();
    // SAFETY: setpriority has no memory effects; failure keeps nice 0.
    unsafe {
        libc::setpriority(libc::PRIO_PROCESS, 0, NICE);
    }
    match run() {
        Ok(code) => code,
        Err(e) => {
            eprintln!("dp-bench: {e:#}");
            ExitCode::FAILURE
        }
    }
}

struct Args {
    out: PathBuf,
    quick: bool,
    rounds: Option<usize>,
    workloads: Option<Vec<String>>,
    idle: bool,
    modes: Vec<Mode>,
    ztunnel: Option<PathBuf>,
}

fn parse_args() -> anyhow::Result<Args> {
    let mut args = Args {
        out: PathBuf::from("samples.json"),
        quick: false,
        rounds: None,
        workloads: None,
        idle: true,
        modes: Vec::new(),
        ztunnel: std::env::var_os("DATAPLANE_ZTUNNEL")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from),
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = || {
            it.next()
                .ok_or_else(|| anyhow::anyhow!("{arg} needs a value"))
        };
        match arg.as_str() {
            "--out" => args.out = PathBuf::from(value()?),
            "--quick" => args.quick = true,
            "--rounds" => args.rounds = Some(value()?.parse()?),
            "--workloads" => {
                args.workloads = Some(value()?.split(',').map(str::to_owned).collect())
            }
            "--no-idle" => args.idle = false,
            "--ztunnel" => args.ztunnel = Some(PathBuf::from(value()?)),
            "--modes" => {
                for name in value()?.split(',') {
                    let mode = Mode::ALL
                        .into_iter()
                        .find(|m| m.name() == name)
                        .ok_or_else(|| anyhow::anyhow!("unknown mode {name}"))?;
                    args.modes.push(mode);
                }
            }
            other => anyhow::bail!(
                "unknown argument {other}; usage: dp-bench --out FILE [--quick] [--rounds N] [--workloads a,b] [--no-idle] [--modes a,b] [--ztunnel PATH]"
            ),
        }
    }
    Ok(args)
}

fn run() -> anyhow::Result<ExitCode> {
    let args = parse_args()?;
    let started = Instant::now();
    let swept = sweep::sweep();
    if swept > 0 {
        eprintln!("dp-bench: removed {swept} leftovers of killed runs");
    }
    dataplane_tests::process::raise_nofile();
    let bins = binaries(args.ztunnel.as_deref())?;
    let ztunnel = bins.ztunnel.as_deref().map(ZtunnelBuild::of);
    let modes = if args.modes.is_empty() {
        Clusters::modes(&bins)
    } else {
        args.modes.clone()
    };
    match &ztunnel {
        None if modes.contains(&Mode::Ztunnel) => anyhow::bail!(
            "--modes ztunnel needs a ztunnel binary: pass --ztunnel PATH or set DATAPLANE_ZTUNNEL"
        ),
        None => eprintln!(
            "dp-bench: no ztunnel binary (--ztunnel PATH or DATAPLANE_ZTUNNEL): the side-by-side with ztunnel is skipped"
        ),
        Some(build) => eprintln!(
            "dp-bench: ztunnel {} at commit {}, dedicated mode behind iptables REDIRECT",
            build.binary.display(),
            build.commit.as_deref().unwrap_or("unknown")
        ),
    }
    let workloads: Vec<Workload> = match &args.workloads {
        None => Workload::ALL.to_vec(),
        Some(names) => {
            let mut chosen = Vec::new();
            for name in names {
                let found = Workload::ALL
                    .into_iter()
                    .find(|w| w.name() == *name)
                    .ok_or_else(|| anyhow::anyhow!("unknown workload {name}"))?;
                chosen.push(found);
            }
            chosen
        }
    };
    let plan = Plan {
        rounds: args.rounds.unwrap_or(if args.quick { 1 } else { 6 }),
        counts: if args.quick {
            Counts::QUICK
        } else {
            Counts::FULL
        },
        workloads,
        idle: args.idle,
        modes: modes.clone(),
    };
    let load_before = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let names: Vec<&str> = modes.iter().map(|m| m.name()).collect();
    eprintln!(
        "dp-bench: building {} clusters ({})",
        modes.len(),
        names.join(", ")
    );
    let mut clusters = Clusters::build(bins, &modes)?;
    let setup_s = started.elapsed().as_secs_f64();
    let checks = plan::verify_paths(&clusters)?;
    eprintln!(
        "dp-bench: every path verified ({} checks, {setup_s:.1}s set-up); {} rounds of {} workloads",
        checks.len(),
        plan.rounds,
        plan.workloads.len()
    );
    let total = plan.rounds * plan.workloads.len() * plan::variants_per_workload(&plan);
    let mut done = 0;
    let samples = plan::run_rounds(&mut clusters, &plan, |sample| {
        done += 1;
        let ok = sample["ok"].as_bool().unwrap_or(false);
        eprintln!(
            "[{done:>3}/{total}] {:<10} {:<10} {:<8} {:<5} {}",
            sample["workload"].as_str().unwrap_or("?"),
            sample["placement"].as_str().unwrap_or("?"),
            sample["mode"].as_str().unwrap_or("?"),
            sample["protocol"].as_str().unwrap_or("?"),
            if ok {
                headline(sample)
            } else {
                format!("FAILED: {}", sample["error"].as_str().unwrap_or("?"))
            }
        );
    })?;
    let idle = if plan.idle {
        eprintln!("dp-bench: agent memory under idle connections");
        plan::measure_idle(&mut clusters, &plan)?
    } else {
        Vec::new()
    };
    let backend = clusters
        .meshes
        .iter()
        .find_map(|m| m.iptables_backend)
        .unwrap_or("none");
    drop(clusters);
    let failures = samples
        .iter()
        .chain(&idle)
        .filter(|s| !s["ok"].as_bool().unwrap_or(false))
        .count();
    let report = json!({
        "meta": {
            "quick": args.quick,
            "rounds": plan.rounds,
            "counts": {
                "conns": plan.counts.conns,
                "conn_concurrency": plan.counts.conn_concurrency,
                "rr": plan.counts.rr,
                "conn_rr": plan.counts.conn_rr,
                "bulk_bytes": plan.counts.bulk_bytes,
                "idle_steps": plan.counts.idle_steps,
            },
            "machine": machine(),
            "kernel": kernel(),
            "iptables_backend": backend,
            "modes": names,
            "ztunnel": ztunnel.as_ref().map(|z| json!({
                "binary": z.binary.display().to_string(),
                "commit": z.commit,
                "version": z.version,
                "proxy_mode": "dedicated",
                "capture": "iptables REDIRECT (the iptables mode's rules), PACKET_MARK=1337 exempt",
                "log_level": "warn",
            })),
            "load_average_before": load_before.trim(),
            "started_unix": SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0) as f64 - started.elapsed().as_secs_f64(),
            "setup_s": setup_s,
            "elapsed_s": started.elapsed().as_secs_f64(),
            "agent_log_level": "warn",
            "nofile_limit": probe::nofile_limit(),
            // SAFETY: getpriority has no memory effects.
            "nice": unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) },
            "path_checks": checks,
        },
        "samples": samples,
        "idle": idle,
    });
    if let Some(dir) = args.out.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&args.out, serde_json::to_string_pretty(&report)?)?;
    eprintln!(
        "dp-bench: {} samples ({failures} failed) in {:.0}s -> {}",
        report["samples"].as_array().map_or(0, Vec::len),
        started.elapsed().as_secs_f64(),
        args.out.display()
    );
    Ok(if failures == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// The one number a progress line shows.
fn headline(sample: &Value) -> String {
    let r = &sample["result"];
    if let Some(gbps) = r["gbps"].as_f64() {
        format!("{gbps:.2} Gbit/s")
    } else if sample["workload"] == "conn-rate" {
        format!("{:.0} conn/s", r["rate"].as_f64().unwrap_or(0.0))
    } else {
        format!(
            "p50 {:.1} us, p99 {:.1} us",
            r["latency"]["p50_us"].as_f64().unwrap_or(0.0),
            r["latency"]["p99_us"].as_f64().unwrap_or(0.0)
        )
    }
}

/// `dataplane` and `dp-load` beside this binary (one cargo target
/// directory and profile); `$DATAPLANE_BIN` overrides the agent. A
/// `ztunnel` given must exist.
fn binaries(ztunnel: Option<&std::path::Path>) -> anyhow::Result<Binaries> {
    let exe = std::env::current_exe()?;
    let dir = exe
        .parent()
        .ok_or_else(|| anyhow::anyhow!("cannot locate the directory of {}", exe.display()))?;
    let agent = std::env::var_os("DATAPLANE_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| dir.join("dataplane"));
    let load = dir.join("dp-load");
    for path in [&agent, &load] {
        anyhow::ensure!(
            path.exists(),
            "{} does not exist: build the workspace's binaries first (`cargo xtask bench` does)",
            path.display()
        );
    }
    if let Some(path) = ztunnel {
        anyhow::ensure!(
            path.is_file(),
            "the ztunnel binary {} does not exist: build ztunnel from Istio's sources or drop --ztunnel / DATAPLANE_ZTUNNEL",
            path.display()
        );
    }
    Ok(Binaries {
        agent,
        load,
        ztunnel: ztunnel.map(std::path::Path::to_path_buf),
    })
}

fn machine() -> Value {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .map(|l| l.trim_start_matches([' ', '\t', ':']).to_owned())
        .unwrap_or_else(|| "unknown".into());
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let mem_kib: u64 = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    json!({
        "cpu_model": model,
        "cpus": probe::online_cpus(),
        "memory_mib": mem_kib / 1024,
    })
}

fn kernel() -> String {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    release.trim().to_owned()
}
