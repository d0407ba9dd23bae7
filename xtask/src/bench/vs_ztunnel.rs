//! Side by side with a stock ztunnel: when `dp-bench` ran one (dedicated
//! mode behind the iptables rules, the `ztunnel` mode of its samples), our
//! agents' HBONE path (`ebpf hbone`) against ztunnel's on the same
//! placements and load, as ours/ztunnel ratios of the medians of the same
//! run, with the issue 32 goals beside the cross-node ones, and the
//! ztunnel commit.

use std::fmt::Write as _;

use serde_json::{Value, json};

use super::{
    idle::{IdleRow, mib},
    report::sig3,
    samples::{Figures, Variant},
};

/// Where a figure comes from.
#[derive(Debug, Clone, Copy)]
enum Source {
    /// A workload's metric (median over rounds).
    Run {
        workload: &'static str,
        metric: &'static str,
    },
    /// Both proxies' RSS, freshly started, MiB.
    AtRest,
    /// Both proxies' growth per idle connection, KiB.
    PerIdleConnection,
}

/// A goal of issue 32 on the ratio (or on ours alone).
#[derive(Debug, Clone, Copy)]
enum Goal {
    RatioAtLeast(f64),
    RatioAtMost(f64),
    OursAtMost(f64),
}

/// One row of the table.
#[derive(Debug, Clone, Copy)]
struct Figure {
    label: &'static str,
    source: Source,
    /// Issue 32's goal, for the cross-node path.
    goal: Option<Goal>,
}

const fn run(label: &'static str, workload: &'static str, metric: &'static str) -> Figure {
    Figure {
        label,
        source: Source::Run { workload, metric },
        goal: None,
    }
}

const fn with_goal(figure: Figure, goal: Goal) -> Figure {
    Figure {
        goal: Some(goal),
        ..figure
    }
}

const FIGURES: [Figure; 11] = [
    with_goal(
        run("connections/s", "conn-rate", "conn/s"),
        Goal::RatioAtLeast(1.3),
    ),
    with_goal(
        run(
            "proxy CPU s / 10k connections",
            "conn-rate",
            "agent CPU s/10k conn",
        ),
        Goal::RatioAtMost(0.7),
    ),
    with_goal(run("RR p50 us", "rr", "p50 us"), Goal::RatioAtMost(0.85)),
    with_goal(run("RR p99 us", "rr", "p99 us"), Goal::RatioAtMost(0.85)),
    run("RR p99.9 us", "rr", "p99.9 us"),
    with_goal(
        run("bulk 1 stream Gbit/s", "bulk-1", "Gbit/s"),
        Goal::RatioAtLeast(1.3),
    ),
    run("bulk 4 streams Gbit/s", "bulk-4", "Gbit/s"),
    with_goal(
        run("proxy CPU s / GB, 1 stream", "bulk-1", "agent CPU s/GB"),
        Goal::RatioAtMost(0.9),
    ),
    run("proxy CPU s / GB, 4 streams", "bulk-4", "agent CPU s/GB"),
    Figure {
        label: "memory at rest, pair MiB",
        source: Source::AtRest,
        goal: None,
    },
    Figure {
        label: "memory per idle connection, pair KiB",
        source: Source::PerIdleConnection,
        goal: Some(Goal::OursAtMost(4.0)),
    },
];

/// Placements in table order: the cross-node path is the headline.
const PLACEMENTS: [&str; 2] = ["cross-node", "same-node"];

/// One measured row.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    /// `cross-node` or `same-node`.
    pub placement: &'static str,
    /// What it is.
    pub label: &'static str,
    /// Our median.
    pub ours: Option<f64>,
    /// ztunnel's median.
    pub ztunnel: Option<f64>,
    /// `>= 1.3x`, or empty.
    pub goal: String,
    /// Whether the goal is met, if there is one and both were measured.
    pub met: Option<bool>,
}

impl Row {
    /// ours / ztunnel.
    pub fn ratio(&self) -> Option<f64> {
        super::samples::ratio(self.ours?, self.ztunnel?)
    }
}

fn value(figures: &Figures, idle: &[IdleRow], source: Source, variant: &Variant) -> Option<f64> {
    match source {
        Source::Run { workload, metric } => figures.median(workload, variant, metric),
        Source::AtRest => idle
            .iter()
            .find(|r| r.variant == *variant && r.error.is_none())
            .map(|r| mib(r.base.iter().sum())),
        Source::PerIdleConnection => idle
            .iter()
            .find(|r| r.variant == *variant && r.error.is_none())
            .and_then(IdleRow::kib_per_connection),
    }
}

/// Every row, ours (`ebpf hbone`) beside ztunnel (`ztunnel hbone`).
pub fn rows(figures: &Figures, idle: &[IdleRow]) -> Vec<Row> {
    let mut rows = Vec::new();
    for placement in PLACEMENTS {
        let ours = Variant::new(placement, "ebpf", "hbone");
        let theirs = Variant::new(placement, "ztunnel", "hbone");
        for figure in FIGURES {
            let mut row = Row {
                placement,
                label: figure.label,
                ours: value(figures, idle, figure.source, &ours),
                ztunnel: value(figures, idle, figure.source, &theirs),
                goal: String::new(),
                met: None,
            };
            if let Some(goal) = figure.goal.filter(|_| placement == "cross-node") {
                let (text, met) = match goal {
                    Goal::RatioAtLeast(g) => (format!(">= {g}x"), row.ratio().map(|r| r >= g)),
                    Goal::RatioAtMost(g) => (format!("<= {g}x"), row.ratio().map(|r| r <= g)),
                    Goal::OursAtMost(g) => (format!("ours <= {g}"), row.ours.map(|o| o <= g)),
                };
                row.goal = text;
                row.met = met;
            }
            rows.push(row);
        }
    }
    rows
}

/// The report's section: the table, or why there is none.
pub fn markdown(meta: &Value, rows: &[Row]) -> String {
    let mut md = String::from("## Side by side with ztunnel\n\n");
    let ztunnel = &meta["ztunnel"];
    if ztunnel.is_null() {
        md.push_str(
            "Skipped: no ztunnel binary given (`cargo xtask bench --ztunnel PATH`, or `DATAPLANE_ZTUNNEL`).\n\n",
        );
        return md;
    }
    let _ = writeln!(
        md,
        "Stock ztunnel at commit `{}` (`{}`), one per HBONE pod in dedicated mode (`PROXY_MODE=dedicated`) behind the iptables rules of the `iptables` mode (outbound REDIRECT to 15001, inbound to 15006, its own sockets marked `PACKET_MARK=1337` and exempt), workloads and certificates from the test istiod, logging at `warn`; ours: the `ebpf hbone` rows (both agents). Same topology, load generator, counts and rounds, runs interleaved. Proxy CPU: both ends' cgroups; memory: the two proxies of the path (client's and server's), freshly started.\n",
        ztunnel["commit"].as_str().unwrap_or("unknown"),
        ztunnel["version"].as_str().unwrap_or("no version output")
    );
    let _ = writeln!(
        md,
        "| placement | figure | ztunnel | ours | ours/ztunnel | goal (issue 32) | met |"
    );
    let _ = writeln!(md, "|---|---|---:|---:|---:|---|---|");
    let show = |v: Option<f64>| v.map_or("-".to_owned(), sig3);
    for row in rows {
        let met = match row.met {
            Some(true) => "yes",
            Some(false) => "**no**",
            None => "",
        };
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {} | {} | {met} |",
            row.placement,
            row.label,
            show(row.ztunnel),
            show(row.ours),
            row.ratio().map_or("-".to_owned(), |r| format!("{r:.2}x")),
            row.goal
        );
    }
    md.push('\n');
    md
}

/// The section for report.json: the ztunnel build and every row, or null.
pub fn to_json(meta: &Value, rows: &[Row]) -> Value {
    if meta["ztunnel"].is_null() {
        return Value::Null;
    }
    json!({
        "ztunnel": meta["ztunnel"],
        "ours": "ebpf hbone",
        "rows": rows.iter().map(|r| json!({
            "placement": r.placement,
            "figure": r.label,
            "ours": r.ours,
            "ztunnel": r.ztunnel,
            "ours_over_ztunnel": r.ratio(),
            "goal": r.goal,
            "met": r.met,
        })).collect::<Vec<_>>(),
    })
}

/// The ratios as one line each, for the terminal.
pub fn summary_lines(rows: &[Row]) -> Vec<String> {
    rows.iter()
        .filter_map(|r| {
            Some(format!(
                "{} {}: ours/ztunnel {:.2}x",
                r.placement,
                r.label,
                r.ratio()?
            ))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(mode: &str, workload: &str, result: Value, cpu: f64) -> Value {
        json!({
            "ok": true, "workload": workload, "placement": "cross-node",
            "mode": mode, "protocol": "hbone", "round": 0,
            "result": result, "agent_cpu_s": cpu, "machine_cpu_s": 1.0, "machine_kernel_s": 0.5,
        })
    }

    #[test]
    fn ours_over_ztunnel_with_the_goals_on_the_cross_node_path() -> anyhow::Result<()> {
        let samples = [
            sample(
                "ebpf",
                "conn-rate",
                json!({"ops": 1000, "rate": 3900.0}),
                0.3,
            ),
            sample(
                "ztunnel",
                "conn-rate",
                json!({"ops": 1000, "rate": 3000.0}),
                0.5,
            ),
            sample(
                "ebpf",
                "rr",
                json!({"ops": 100, "rate": 1.0, "latency": {"p50_us": 90.0, "p99_us": 180.0, "p999_us": 400.0}}),
                0.1,
            ),
            sample(
                "ztunnel",
                "rr",
                json!({"ops": 100, "rate": 1.0, "latency": {"p50_us": 100.0, "p99_us": 200.0, "p999_us": 500.0}}),
                0.1,
            ),
        ];
        let figures = Figures::from_samples(&samples)?;
        let idle = IdleRow::parse_all(&json!([
            {"ok": true, "mode": "ebpf", "placement": "cross-node", "protocol": "hbone",
             "base_rss_bytes": [20 << 20, 20 << 20],
             "steps": [{"connections": 1024, "rss_bytes": [(20 << 20) + (2 << 20), (20 << 20) + (1 << 20)]}]},
            {"ok": true, "mode": "ztunnel", "placement": "cross-node", "protocol": "hbone",
             "base_rss_bytes": [25 << 20, 25 << 20],
             "steps": [{"connections": 1024, "rss_bytes": [(25 << 20) + (4 << 20), (25 << 20) + (4 << 20)]}]},
        ]));
        let rows = rows(&figures, &idle);
        let find = |placement: &str, label: &str| {
            rows.iter()
                .find(|r| r.placement == placement && r.label == label)
                .cloned()
        };
        let rate = find("cross-node", "connections/s").ok_or_else(|| anyhow::anyhow!("no row"))?;
        assert_eq!(rate.ratio(), Some(1.3));
        assert_eq!(rate.met, Some(true));
        let cpu = find("cross-node", "proxy CPU s / 10k connections")
            .ok_or_else(|| anyhow::anyhow!("no row"))?;
        assert!(
            cpu.ratio().is_some_and(|r| (r - 0.6).abs() < 1e-9),
            "{cpu:?}"
        );
        assert_eq!(cpu.met, Some(true));
        let p50 = find("cross-node", "RR p50 us").ok_or_else(|| anyhow::anyhow!("no row"))?;
        assert_eq!((p50.ratio(), p50.met), (Some(0.9), Some(false)));
        let rest = find("cross-node", "memory at rest, pair MiB")
            .ok_or_else(|| anyhow::anyhow!("no row"))?;
        assert_eq!((rest.ours, rest.ztunnel), (Some(40.0), Some(50.0)));
        let per = find("cross-node", "memory per idle connection, pair KiB")
            .ok_or_else(|| anyhow::anyhow!("no row"))?;
        assert_eq!(
            (per.ours, per.ztunnel, per.met),
            (Some(3.0), Some(8.0), Some(true))
        );
        // Same-node rows carry no goal, and nothing was measured there.
        let same = find("same-node", "connections/s").ok_or_else(|| anyhow::anyhow!("no row"))?;
        assert_eq!((same.ratio(), same.goal.as_str()), (None, ""));

        let meta = json!({"ztunnel": {"commit": "62d8265", "version": "v"}});
        let md = markdown(&meta, &rows);
        assert!(md.contains("commit `62d8265`"), "{md}");
        assert!(
            md.contains("| cross-node | connections/s | 3,000 | 3,900 | 1.30x | >= 1.3x | yes |"),
            "{md}"
        );
        let json = to_json(&meta, &rows);
        assert_eq!(json["ztunnel"]["commit"], "62d8265");
        assert_eq!(json["rows"][0]["ours_over_ztunnel"], 1.3);
        Ok(())
    }

    #[test]
    fn without_ztunnel_the_section_says_it_was_skipped() {
        let meta = json!({"ztunnel": null});
        assert!(markdown(&meta, &[]).contains("Skipped: no ztunnel binary given"));
        assert!(to_json(&meta, &[]).is_null());
    }
}
