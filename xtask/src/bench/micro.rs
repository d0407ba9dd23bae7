//! The criterion micro-benchmarks of the engine's hot user-space paths
//! (`dataplane-user/benches/`: [`BENCHES`]): run briefly in a full run,
//! once each (criterion's test mode) in a quick one, and read back from
//! criterion's files for the report.

use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::SystemTime;

use anyhow::{Context as _, Result};
use serde_json::Value;

use crate::{build, cmd};

/// The bench targets of `dataplane-user` that measure per-connection hot
/// paths, the cost of building a mesh state (`mesh_state`, paid per
/// configuration change and xDS push) and of one xDS update stage by stage
/// (`xds_update`); `tls_provider` is a one-off
/// provider comparison, not run here.
pub const BENCHES: &[&str] = &["hot_paths", "policy", "mesh_state", "xds_update"];

/// Nice value of the micro-benchmarks (the harness runs at the same).
const NICE: libc::c_int = -10;

/// One benchmark's estimate.
#[derive(Debug, Clone, PartialEq)]
pub struct MicroResult {
    /// Criterion's id, e.g. `hot_paths/connect_request`.
    pub id: String,
    /// Mean time per iteration, ns.
    pub mean_ns: f64,
    /// Lower bound of its 95% confidence interval, ns.
    pub low_ns: f64,
    /// Upper bound, ns.
    pub high_ns: f64,
}

/// Builds the micro-benchmarks without running them (so the kernel-level
/// runs do not share the machine with a compiler), with the same profile
/// as the binaries (`cargo bench` would build a separate `bench` profile
/// from scratch), and returns their executables.
pub fn build(release: bool) -> Result<Vec<PathBuf>> {
    let mut cargo = cmd::cargo();
    cargo
        .arg("build")
        .args(build::profile(release).0)
        .args(["-p", "dataplane-user"]);
    for bench in BENCHES {
        cargo.args(["--bench", bench]);
    }
    cargo.arg("--message-format=json-render-diagnostics");
    // Progress and errors on the terminal; the artifact list on stdout.
    println!("+ {}", cmd::display(&cargo));
    let out = cargo
        .stderr(Stdio::inherit())
        .output()
        .context("cannot start cargo")?;
    anyhow::ensure!(
        out.status.success(),
        "building the micro-benchmarks failed with {}",
        cmd::describe(out.status)
    );
    let executables: Vec<PathBuf> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .filter(|msg| {
            msg["reason"] == "compiler-artifact"
                && BENCHES.iter().any(|b| msg["target"]["name"] == *b)
        })
        .filter_map(|msg| msg["executable"].as_str().map(PathBuf::from))
        .collect();
    anyhow::ensure!(
        executables.len() == BENCHES.len(),
        "cargo built {} of the {} micro-benchmark executables",
        executables.len(),
        BENCHES.len()
    );
    Ok(executables)
}

/// Runs them (`extra` goes to criterion), writing criterion's files under
/// `<target>/criterion`. Quick runs each once, untimed (criterion's test
/// mode).
pub fn run(
    executables: &[PathBuf],
    quick: bool,
    extra: &[String],
    target_dir: &Path,
) -> Result<()> {
    for executable in executables {
        let mut bench = Command::new(executable);
        bench
            .env("CRITERION_HOME", target_dir.join("criterion"))
            .current_dir(cmd::workspace_root());
        if !quick {
            // Without `--bench` criterion only tests that each benchmark runs.
            bench.arg("--bench");
            if extra.is_empty() {
                bench.args(["--warm-up-time", "1", "--measurement-time", "2"]);
            }
        }
        bench.args(extra);
        // Like the kernel-level harness: ahead of unrelated work.
        // SAFETY: setpriority is async-signal-safe and touches no memory.
        unsafe {
            bench.pre_exec(|| {
                libc::setpriority(libc::PRIO_PROCESS, 0, NICE);
                Ok(())
            });
        }
        cmd::run(&mut bench)?;
    }
    Ok(())
}

/// Reads every benchmark under `<target>/criterion` that was measured
/// since `since` (earlier runs' files stay there).
pub fn read(target_dir: &Path, since: SystemTime) -> Vec<MicroResult> {
    let mut results = Vec::new();
    collect(&target_dir.join("criterion"), since, 0, &mut results);
    results.sort_by(|a, b| a.id.cmp(&b.id));
    results
}

/// Criterion keeps `<group>/<function>/new/` or `<function>/new/`.
fn collect(dir: &Path, since: SystemTime, depth: usize, out: &mut Vec<MicroResult>) {
    let new = dir.join("new");
    if let Some(result) = read_one(&new, since) {
        out.push(result);
        return;
    }
    if depth >= 2 {
        return;
    }
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.filter_map(Result::ok) {
        if entry.file_type().is_ok_and(|t| t.is_dir()) && entry.file_name() != "report" {
            collect(&entry.path(), since, depth + 1, out);
        }
    }
}

fn read_one(new: &Path, since: SystemTime) -> Option<MicroResult> {
    let estimates_path = new.join("estimates.json");
    let modified = std::fs::metadata(&estimates_path).ok()?.modified().ok()?;
    if modified < since {
        return None;
    }
    let benchmark: Value =
        serde_json::from_str(&std::fs::read_to_string(new.join("benchmark.json")).ok()?).ok()?;
    let estimates: Value =
        serde_json::from_str(&std::fs::read_to_string(estimates_path).ok()?).ok()?;
    let mean = &estimates["mean"];
    Some(MicroResult {
        id: benchmark["full_id"].as_str()?.to_owned(),
        mean_ns: mean["point_estimate"].as_f64()?,
        low_ns: mean["confidence_interval"]["lower_bound"].as_f64()?,
        high_ns: mean["confidence_interval"]["upper_bound"].as_f64()?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_grouped_and_ungrouped_benchmarks_of_this_run_only() -> Result<()> {
        let root = std::env::temp_dir().join(format!("xtask-micro-{}", std::process::id()));
        let write = |dir: &Path, id: &str, mean: f64| -> Result<()> {
            let new = dir.join("new");
            std::fs::create_dir_all(&new)?;
            std::fs::write(
                new.join("benchmark.json"),
                format!(r#"{{"full_id":"{id}"}}"#),
            )?;
            std::fs::write(
                new.join("estimates.json"),
                format!(
                    r#"{{"mean":{{"point_estimate":{mean},"confidence_interval":{{"lower_bound":1.0,"upper_bound":3.0}}}}}}"#
                ),
            )?;
            Ok(())
        };
        let criterion = root.join("criterion");
        write(
            &criterion.join("hot_paths/connect_request"),
            "hot_paths/connect_request",
            2.0,
        )?;
        write(&criterion.join("policy_evaluate"), "policy_evaluate", 5.0)?;
        let results = read(&root, SystemTime::UNIX_EPOCH);
        let future = read(
            &root,
            SystemTime::now() + std::time::Duration::from_secs(3600),
        );
        let _ = std::fs::remove_dir_all(&root);
        let ids: Vec<&str> = results.iter().map(|r| r.id.as_str()).collect();
        assert_eq!(ids, ["hot_paths/connect_request", "policy_evaluate"]);
        assert_eq!(results[1].mean_ns, 5.0);
        assert!(future.is_empty(), "older files are not this run's");
        Ok(())
    }
}
