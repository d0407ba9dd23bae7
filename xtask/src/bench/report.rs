//! The report: a header saying what ran where, the targets, ours beside a
//! stock ztunnel (when one ran), the scaling model to 4, 16 and 64 cores,
//! one table (and chart) per workload with every figure as a median and as
//! ratios to direct and ebpf/iptables, agent memory under idle connections, the
//! micro-benchmarks, and any failure.

use std::fmt::Write as _;

use serde_json::Value;

use super::{
    idle::{IdleRow, mib},
    micro::MicroResult,
    samples::{Figures, Variant, describe, metrics},
    svg::{self, Bar},
    targets::Checked,
};

/// Everything the report is made of.
#[derive(Debug)]
pub struct Inputs<'a> {
    /// The harness's `meta` plus the commit.
    pub meta: &'a Value,
    /// Grouped samples.
    pub figures: &'a Figures,
    /// Idle-connection memory.
    pub idle: &'a [IdleRow],
    /// Targets as checked.
    pub targets: &'a [Checked],
    /// Micro-benchmarks (empty when skipped).
    pub micro: &'a [MicroResult],
    /// How the micro-benchmarks ran (or why not).
    pub micro_note: &'a str,
    /// Ours beside ztunnel (empty rows when it did not run).
    pub vs_ztunnel: &'a [super::vs_ztunnel::Row],
    /// The scaling model of this run's costs.
    pub scaling: &'a super::scaling::Model,
}

/// Three significant digits, with thousands separators above 1000.
pub fn sig3(v: f64) -> String {
    if !v.is_finite() {
        return "-".into();
    }
    let a = v.abs();
    if a >= 1000.0 {
        thousands(v.round() as i64)
    } else if a >= 100.0 {
        format!("{v:.0}")
    } else if a >= 10.0 {
        format!("{v:.1}")
    } else if a >= 1.0 {
        format!("{v:.2}")
    } else if a == 0.0 {
        "0".into()
    } else {
        let digits = (2 - a.log10().floor() as i32).clamp(2, 8) as usize;
        format!("{v:.digits$}")
    }
}

fn thousands(n: i64) -> String {
    let digits = n.unsigned_abs().to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    if n < 0 { format!("-{out}") } else { out }
}

fn ratio(r: f64) -> String {
    format!("{r:.2}x")
}

/// One table cell: the median, then its ratios.
fn cell(figures: &Figures, workload: &str, variant: &Variant, metric: &str) -> String {
    let Some(median) = figures.median(workload, variant, metric) else {
        return "-".into();
    };
    let mut ratios = Vec::new();
    if let Some(r) = figures.vs_direct(workload, variant, metric) {
        ratios.push(format!("{}d", ratio(r)));
    }
    if let Some(r) = figures.vs_iptables(workload, variant, metric) {
        ratios.push(format!("**{}i**", ratio(r)));
    }
    if ratios.is_empty() {
        sig3(median)
    } else {
        format!("{} ({})", sig3(median), ratios.join(" "))
    }
}

/// The report as Markdown; `charts` says whether to link the SVGs.
pub fn markdown(inputs: &Inputs<'_>, charts: bool) -> String {
    let mut md = String::new();
    header(&mut md, inputs.meta);
    targets(&mut md, inputs.targets);
    md.push_str(&super::vs_ztunnel::markdown(inputs.meta, inputs.vs_ztunnel));
    md.push_str(&inputs.scaling.markdown());
    let counts = &inputs.meta["counts"];
    for workload in &inputs.figures.workloads {
        let metrics = metrics(workload);
        let _ = writeln!(md, "## {workload}: {}\n", describe(workload, counts));
        let _ = write!(md, "| placement | mode | protocol |");
        for m in metrics {
            let _ = write!(md, " {} |", m.name);
        }
        let _ = write!(md, "\n|---|---|---|");
        for _ in metrics {
            let _ = write!(md, "---:|");
        }
        md.push('\n');
        for variant in inputs.figures.variants(workload) {
            let protocol = if variant.mode == "direct" {
                "-"
            } else {
                variant.protocol.as_str()
            };
            let _ = write!(
                md,
                "| {} | {} | {} |",
                variant.placement, variant.mode, protocol
            );
            for m in metrics {
                let _ = write!(
                    md,
                    " {} |",
                    cell(inputs.figures, workload, &variant, m.name)
                );
            }
            md.push('\n');
        }
        if charts {
            let _ = writeln!(md, "\n![{workload}]({workload}.svg)");
        }
        md.push('\n');
    }
    idle_table(
        &mut md,
        inputs.idle,
        charts,
        inputs.meta["nofile_limit"].as_u64(),
    );
    micro_table(&mut md, inputs.micro, inputs.micro_note);
    if !inputs.figures.failures.is_empty() {
        let _ = writeln!(md, "## Failed runs\n");
        for f in &inputs.figures.failures {
            let _ = writeln!(md, "- {f}");
        }
        md.push('\n');
    }
    md
}

fn header(md: &mut String, meta: &Value) {
    let _ = writeln!(md, "# Kernel-level benchmarks\n");
    if meta["quick"].as_bool().unwrap_or(false) {
        let _ = writeln!(
            md,
            "**Quick run (`--quick`): every path exercised briefly to prove the harness works; the numbers mean nothing.**\n"
        );
    }
    let machine = &meta["machine"];
    let _ = writeln!(
        md,
        "- commit `{}`, kernel {}, {} x {} ({} MiB), iptables front end `{}`",
        meta["commit"].as_str().unwrap_or("unknown"),
        meta["kernel"].as_str().unwrap_or("?"),
        machine["cpus"],
        machine["cpu_model"].as_str().unwrap_or("?"),
        machine["memory_mib"],
        meta["iptables_backend"].as_str().unwrap_or("?")
    );
    let _ = writeln!(
        md,
        "- {} rounds, modes alternated run by run (order rotated each round); {:.0} s in all ({:.0} s set-up); load average before: {}",
        meta["rounds"],
        meta["elapsed_s"].as_f64().unwrap_or(0.0),
        meta["setup_s"].as_f64().unwrap_or(0.0),
        meta["load_average_before"].as_str().unwrap_or("?")
    );
    let _ = writeln!(
        md,
        "- every figure is the median over rounds; `0.41xd` = ratio to **direct** (same placement), **`1.27xi`** = **ebpf / iptables** (same placement and protocol), all from this run"
    );
    let _ = writeln!(
        md,
        "- `plain`: destination not in the mesh, the client's engine passes it through as TCP; `hbone`: mTLS HTTP/2 CONNECT tunnel between the two engines (same engine in both capture modes; the ebpf agents run with `--fast-path off`, so same-node HBONE is the proxied path); `fast-path`: a same-node HBONE pair whose workloads opt into the kernel fast path (socket to socket after the pair's first connection); `fast-path-vip`: the same server dialled at a service VIP whose only endpoint it is (the kernel chooses the endpoint and rewrites the destination per connection)"
    );
    let _ = writeln!(
        md,
        "- CPU: agent = both agents' cgroups (`cpu.stat`; in `ztunnel` rows every ztunnel's), kernel = system+irq+softirq of the whole machine, machine = every busy CPU second (`/proc/stat`, 10 ms ticks; client and server included); agents log at `warn`; the harness and all it starts run at nice {} to stay ahead of unrelated work on the machine\n",
        meta["nice"]
    );
}

fn targets(md: &mut String, checked: &[Checked]) {
    let _ = writeln!(md, "## Targets (issue 8)\n");
    let _ = writeln!(md, "| target | measured | goal | met | reference |");
    let _ = writeln!(md, "|---|---:|---|---|---|");
    for c in checked {
        let measured = match c.measured {
            Some(m) if c.is_ratio => ratio(m),
            Some(m) => format!("{m:.1} MiB"),
            None => "-".into(),
        };
        let met = match c.met {
            Some(true) => "yes",
            Some(false) => "**no**",
            None => "-",
        };
        let _ = writeln!(
            md,
            "| {} | {measured} | {} | {met} | {} |",
            c.label, c.goal, c.reference
        );
    }
    md.push('\n');
}

fn idle_table(md: &mut String, idle: &[IdleRow], charts: bool, nofile: Option<u64>) {
    if idle.is_empty() {
        return;
    }
    let _ = writeln!(
        md,
        "## Agent memory with idle connections\n\nRSS (`VmRSS`) of node 1's / node 2's agent (in `ztunnel` rows: the client pod's / the server pod's ztunnel), freshly started, then with idle connections held open through the engine; per connection = growth of both agents / connections. Counts below 10k: the busiest agent holds two sockets per connection and the descriptor limit it inherits (a hard limit root cannot raise here) is {}.\n",
        nofile.map_or("unknown".into(), |n| thousands(n as i64))
    );
    let _ = writeln!(
        md,
        "| mode | placement | protocol | before MiB | first step MiB | last step MiB | KiB/conn |"
    );
    let _ = writeln!(md, "|---|---|---|---:|---:|---:|---:|");
    let both = |rss: &[u64]| {
        rss.iter()
            .map(|b| format!("{:.1}", mib(*b)))
            .collect::<Vec<_>>()
            .join(" / ")
    };
    let mut rows: Vec<&IdleRow> = idle.iter().collect();
    rows.sort_by_key(|r| {
        (
            r.variant.protocol.clone(),
            r.variant.placement.clone(),
            r.variant.mode.clone(),
        )
    });
    for row in rows {
        let v = &row.variant;
        if let Some(err) = &row.error {
            let first = err.lines().next().unwrap_or(err);
            let _ = writeln!(
                md,
                "| {} | {} | {} | failed: {first} | | | |",
                v.mode, v.placement, v.protocol
            );
            continue;
        }
        let step = |i: usize| {
            row.steps.get(i).map_or("-".into(), |(conns, rss)| {
                format!("{}: {}", thousands(*conns as i64), both(rss))
            })
        };
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {} | {} | {} |",
            v.mode,
            v.placement,
            v.protocol,
            both(&row.base),
            step(0),
            step(row.steps.len().saturating_sub(1)),
            row.kib_per_connection().map_or("-".into(), sig3)
        );
    }
    if charts {
        let _ = writeln!(md, "\n![idle](idle-rss.svg)");
    }
    md.push('\n');
}

fn micro_table(md: &mut String, micro: &[MicroResult], note: &str) {
    let _ = writeln!(
        md,
        "## Micro-benchmarks (criterion, `dataplane-user/benches/`: {})\n",
        super::micro::BENCHES.join(", ")
    );
    if micro.is_empty() {
        let _ = writeln!(md, "{note}\n");
        return;
    }
    let _ = writeln!(md, "{note}\n");
    let _ = writeln!(md, "| benchmark | mean | 95% interval |");
    let _ = writeln!(md, "|---|---:|---|");
    for m in micro {
        let _ = writeln!(
            md,
            "| {} | {} | {} .. {} |",
            m.id,
            duration(m.mean_ns),
            duration(m.low_ns),
            duration(m.high_ns)
        );
    }
    md.push('\n');
}

fn duration(ns: f64) -> String {
    if ns >= 1e6 {
        format!("{} ms", sig3(ns / 1e6))
    } else if ns >= 1e3 {
        format!("{} us", sig3(ns / 1e3))
    } else {
        format!("{} ns", sig3(ns))
    }
}

/// The chart of a workload's headline metric.
pub fn chart(figures: &Figures, workload: &str) -> Option<String> {
    let metric = metrics(workload).first()?;
    let mut groups: Vec<(String, Vec<Bar>)> = Vec::new();
    for variant in figures.variants(workload) {
        let figure = figures
            .by_workload
            .get(workload)?
            .get(&variant)?
            .get(metric.name)?;
        let bar = Bar {
            label: if variant.mode == "direct" {
                "direct".into()
            } else {
                format!("{} {}", variant.mode, variant.protocol)
            },
            color: svg::color(&variant.mode, &variant.protocol),
            value: figure.median()?,
            min: figure.min()?,
            max: figure.max()?,
        };
        match groups.iter_mut().find(|(p, _)| *p == variant.placement) {
            Some((_, bars)) => bars.push(bar),
            None => groups.push((variant.placement.clone(), vec![bar])),
        }
    }
    let better = if metric.higher_is_better {
        "higher is better"
    } else {
        "lower is better"
    };
    Some(svg::bar_chart(
        &format!("{workload}: {} ({better})", metric.name),
        metric.name,
        &groups,
    ))
}

/// The chart of the largest agent's RSS at the most idle connections.
pub fn idle_chart(idle: &[IdleRow]) -> Option<String> {
    let mut groups: Vec<(String, Vec<Bar>)> = Vec::new();
    let mut rows: Vec<&IdleRow> = idle.iter().filter(|r| r.error.is_none()).collect();
    rows.sort_by_key(|r| r.variant.order_key());
    let conns = rows.first()?.steps.last()?.0;
    for row in rows {
        let value = row.largest_agent_mib()?;
        let bar = Bar {
            label: format!("{} {}", row.variant.mode, row.variant.protocol),
            color: svg::color(&row.variant.mode, &row.variant.protocol),
            value,
            min: value,
            max: value,
        };
        match groups.iter_mut().find(|(p, _)| *p == row.variant.placement) {
            Some((_, bars)) => bars.push(bar),
            None => groups.push((row.variant.placement.clone(), vec![bar])),
        }
    }
    Some(svg::bar_chart(
        &format!("largest agent RSS with {conns} idle connections (lower is better)"),
        "MiB",
        &groups,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_keep_three_significant_digits() {
        assert_eq!(sig3(12_345.6), "12,346");
        assert_eq!(sig3(123.4), "123");
        assert_eq!(sig3(12.34), "12.3");
        assert_eq!(sig3(1.234), "1.23");
        assert_eq!(sig3(0.01234), "0.0123");
        assert_eq!(sig3(0.0), "0");
        assert_eq!(thousands(-1_234_567), "-1,234,567");
    }
}
