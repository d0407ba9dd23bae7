//! `cargo xtask bench`'s side-by-side with a stock ztunnel: `dp-bench`
//! runs ztunnel in dedicated mode behind iptables REDIRECT in each HBONE
//! pod of a cluster of its own (`dataplane_tests::bench::dedicated`), in
//! the same rounds and with the same load as our modes.
//!
//! Istio's ztunnel is not published to any registry these machines reach,
//! so the run is ignored unless asked for, as the interop tests are:
//! `DATAPLANE_ZTUNNEL=/path/to/ztunnel cargo test -p dataplane-tests --test bench_ztunnel -- --ignored`
//! (after `cargo xtask build`: `dp-bench` runs the `dataplane` beside it).
//! Without a binary, CI's `cargo xtask bench --quick` skips the ztunnel
//! cluster; what is checked here on every run is that the mode is refused
//! without one, before anything is built.

use std::process::Command;

use anyhow::{Context as _, Result};
use dataplane_tests::{TempDir, ztunnel::ztunnel_binary};
use serde_json::Value;

/// `dp-bench` with `args`, writing its samples to `<dir>/samples.json`;
/// returns whether it succeeded and the samples, if it wrote any.
fn dp_bench(dir: &TempDir, args: &[&str], ztunnel: Option<&str>) -> Result<(bool, Option<Value>)> {
    let out = dir.path().join("samples.json");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_dp-bench"));
    cmd.arg("--out")
        .arg(&out)
        .args(args)
        .env_remove("DATAPLANE_ZTUNNEL");
    if let Some(ztunnel) = ztunnel {
        cmd.args(["--ztunnel", ztunnel]);
    }
    let status = cmd.status().context("starting dp-bench")?;
    let samples = match std::fs::read_to_string(&out) {
        Ok(text) => Some(serde_json::from_str(&text).context("dp-bench's samples")?),
        Err(_) => None,
    };
    Ok((status.success(), samples))
}

/// The errors of the failed samples and idle measures, for a message.
fn failures(samples: &Value) -> Vec<String> {
    ["samples", "idle"]
        .iter()
        .flat_map(|key| samples[key].as_array().cloned().unwrap_or_default())
        .filter(|s| !s["ok"].as_bool().unwrap_or(false))
        .map(|s| s["error"].as_str().unwrap_or("?").to_owned())
        .collect()
}

#[test]
#[ignore = "needs a ztunnel binary in DATAPLANE_ZTUNNEL"]
fn a_quick_side_by_side_run_measures_ztunnel_on_both_placements() -> Result<()> {
    let binary = ztunnel_binary()?;
    let dir = TempDir::new("benchzt")?;
    let (ok, samples) = dp_bench(
        &dir,
        &[
            "--quick",
            "--modes",
            "ebpf,ztunnel",
            "--workloads",
            "conn-rate,rr,bulk-1,bulk-4",
        ],
        Some(&binary.display().to_string()),
    )?;
    let samples = samples.context("dp-bench wrote no samples; its messages are above")?;
    assert!(ok, "dp-bench failed: {:#?}", failures(&samples));

    // The build it measured is named, with its commit.
    let build = &samples["meta"]["ztunnel"];
    assert!(
        build["commit"].as_str().is_some_and(|c| c.len() >= 7),
        "no ztunnel commit in {build}"
    );

    // Each path went through ztunnel: the client pod's connection was
    // redirected to its 15001 and tunnelled to the server's 15008.
    let checks = ztunnel_rows(&samples["meta"]["path_checks"], "path checks")?;
    assert_eq!(checks.len(), 2, "{checks:?}");
    for check in &checks {
        assert_eq!(check["protocol"], "hbone");
        assert_eq!(check["captured"], true, "{check}");
        assert_eq!(check["tunnelled"], true, "{check}");
    }

    // Every workload ran through ztunnel on both placements, its CPU read
    // from the ztunnels' cgroups.
    let runs = ztunnel_rows(&samples["samples"], "samples")?;
    assert_eq!(runs.len(), 4 * 2, "{runs:?}");
    for run in &runs {
        assert_eq!(run["ok"], true, "{run}");
        assert!(
            run["agent_cpu_s"].as_f64().is_some_and(|s| s > 0.0),
            "{run}"
        );
    }

    // Memory of both ztunnels of each path, at rest and holding idle
    // connections.
    let idle = ztunnel_rows(&samples["idle"], "idle measures")?;
    assert_eq!(idle.len(), 2, "{idle:?}");
    for row in &idle {
        assert_eq!(row["ok"], true, "{row}");
        let base = row["base_rss_bytes"].as_array().context("no base")?;
        assert_eq!(base.len(), 2, "{row}");
        assert!(
            base.iter().all(|b| b.as_u64().is_some_and(|b| b > 0)),
            "{row}"
        );
    }
    Ok(())
}

#[test]
fn the_ztunnel_mode_is_refused_without_a_binary_before_anything_is_built() -> Result<()> {
    let dir = TempDir::new("benchzt")?;
    let (ok, samples) = dp_bench(&dir, &["--quick", "--modes", "ztunnel"], None)?;
    assert!(!ok && samples.is_none(), "ran without a ztunnel binary");
    let missing = dir.path().join("no-such-ztunnel");
    let (ok, samples) = dp_bench(
        &dir,
        &["--quick", "--modes", "ztunnel"],
        Some(&missing.display().to_string()),
    )?;
    assert!(
        !ok && samples.is_none(),
        "ran with a missing ztunnel binary"
    );
    Ok(())
}

/// The rows of the array `rows` (named `what` in the error) measured
/// through ztunnel.
fn ztunnel_rows<'a>(rows: &'a Value, what: &str) -> anyhow::Result<Vec<&'a Value>> {
    Ok(rows
        .as_array()
        .with_context(|| format!("no {what}"))?
        .iter()
        .filter(|row| row["mode"] == "ztunnel")
        .collect())
}
