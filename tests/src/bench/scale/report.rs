//! The scale results as Markdown: our agent alone, or beside ztunnel with
//! the ratio of each figure.

use super::{ScaleResult, ScaleRow};

/// The results as a Markdown table: one line per size for our agent
/// alone; with ztunnel, one line per figure and size, ours, ztunnel's and
/// ours/ztunnel side by side.
pub fn table(rows: &[ScaleRow]) -> String {
    if rows
        .iter()
        .all(|r| r.ztunnel.is_none() && r.ztunnel_error.is_none())
    {
        return ours_table(rows);
    }
    let mut out = String::from(
        "| workloads (services, policies) | figure | ours | ztunnel | ours/ztunnel |\n|---|---|---|---|---|\n",
    );
    let mut failures = Vec::new();
    for row in rows {
        let mut label = format!(
            "{} ({}, {})",
            count(row.workloads),
            count(row.services),
            count(row.policies)
        );
        for figure in FIGURES {
            let ours = (figure.values)(&row.ours, row.workloads);
            if ours.iter().all(|v| v.is_nan()) {
                // Not measured (connections without `dp-load`).
                continue;
            }
            let (theirs, ratios) = match &row.ztunnel {
                Some(zt) => {
                    let theirs = (figure.values)(zt, row.workloads);
                    let ratios: Vec<String> = ours
                        .iter()
                        .zip(&theirs)
                        .map(|(a, b)| ratio(*a, *b))
                        .collect();
                    (cell(&theirs, figure.format), ratios.join(" / "))
                }
                None => ("failed".to_owned(), "-".to_owned()),
            };
            out.push_str(&format!(
                "| {label} | {} | {} | {theirs} | {ratios} |\n",
                figure.name,
                cell(&ours, figure.format),
            ));
            label.clear();
        }
        if let Some(e) = &row.ztunnel_error {
            failures.push(format!(
                "- ztunnel at {}: {}",
                count(row.workloads),
                e.lines().next().unwrap_or_default()
            ));
        }
    }
    if !failures.is_empty() {
        out.push('\n');
        out.push_str(&failures.join("\n"));
        out.push('\n');
    }
    out
}

/// One figure of the comparison table: its values for one proxy (several
/// are shown as `a / b`) at n workloads, and how one is written.
pub(super) struct Figure {
    name: &'static str,
    values: fn(&ScaleResult, usize) -> Vec<f64>,
    format: fn(f64) -> String,
}

pub(super) const FIGURES: &[Figure] = &[
    Figure {
        name: "first complete state: time / CPU",
        values: |r, _| vec![r.first_state_ms, r.first_state_cpu_ms],
        format: ms,
    },
    Figure {
        name: "RSS: peak to the first state / after it / after churn",
        values: |r, _| {
            vec![
                r.rss_peak_first as f64,
                r.rss_first as f64,
                r.rss_after_churn as f64,
            ]
        },
        format: megabytes,
    },
    Figure {
        name: "RSS per workload (first state)",
        values: |r, n| vec![r.rss_first as f64 / n.max(1) as f64],
        format: kilobytes,
    },
    Figure {
        name: "CPU per update",
        values: |r, _| vec![r.cpu_per_update_ms],
        format: ms,
    },
    Figure {
        name: "push-to-ACK p50 / p99",
        values: |r, _| vec![r.ack_p50_ms, r.ack_p99_ms],
        format: ms,
    },
    Figure {
        name: "connection set-up during churn p50 / p99",
        values: |r, _| {
            vec![
                r.conn_p50_ms.unwrap_or(f64::NAN),
                r.conn_p99_ms.unwrap_or(f64::NAN),
            ]
        },
        format: ms,
    },
    Figure {
        name: "agent CPU per probe connection (out of CPU per update)",
        values: |r, _| vec![r.conn_cpu_ms.unwrap_or(f64::NAN)],
        format: ms,
    },
];

/// `values` written with `format`, joined by ` / `.
pub(super) fn cell(values: &[f64], format: fn(f64) -> String) -> String {
    values
        .iter()
        .map(|v| format(*v))
        .collect::<Vec<_>>()
        .join(" / ")
}

/// Milliseconds, with as many digits as they deserve; seconds from 10 s.
pub(super) fn ms(v: f64) -> String {
    if !v.is_finite() {
        "-".to_owned()
    } else if v >= 10_000.0 {
        format!("{:.1} s", v / 1e3)
    } else if v >= 100.0 {
        format!("{v:.0} ms")
    } else if v >= 1.0 {
        format!("{v:.1} ms")
    } else {
        format!("{v:.2} ms")
    }
}

/// Bytes as MB (10^6).
pub(super) fn megabytes(v: f64) -> String {
    format!("{:.1} MB", v / 1e6)
}

/// Bytes as KB (10^3).
pub(super) fn kilobytes(v: f64) -> String {
    format!("{:.1} KB", v / 1e3)
}

/// `a / b` as a factor: two digits below 1, one below 10, none above;
/// `-` when either is missing or `b` is zero.
pub(super) fn ratio(a: f64, b: f64) -> String {
    let r = a / b;
    if !a.is_finite() || !b.is_finite() || b <= 0.0 || !r.is_finite() {
        "-".to_owned()
    } else if r < 1.0 {
        format!("{r:.2}x")
    } else if r < 10.0 {
        format!("{r:.1}x")
    } else {
        format!("{r:.0}x")
    }
}

/// A count as the issue writes sizes: `1k`, `100k`, `1M`; exact below a
/// thousand or when not round.
pub(super) fn count(n: usize) -> String {
    if n >= 1_000_000 && n.is_multiple_of(1_000_000) {
        format!("{}M", n / 1_000_000)
    } else if n >= 1_000 && n.is_multiple_of(1_000) {
        format!("{}k", n / 1_000)
    } else {
        n.to_string()
    }
}

/// Our agent alone: one line per size.
fn ours_table(rows: &[ScaleRow]) -> String {
    let mut out = String::from(
        "| workloads (services, policies) | first state: time / CPU | RSS peak / first / after churn | CPU per update | push-to-ACK p50 / p99 | RSS / workload | connection set-up p50 / p99 | CPU per probe connection |\n|---|---|---|---|---|---|---|---|\n",
    );
    for row in rows {
        let r = &row.ours;
        out.push_str(&format!(
            "| {} ({}, {}) | {} / {} | {} / {} / {} | {} | {} / {} | {} | {} / {} | {} |\n",
            count(row.workloads),
            count(row.services),
            count(row.policies),
            ms(r.first_state_ms),
            ms(r.first_state_cpu_ms),
            megabytes(r.rss_peak_first as f64),
            megabytes(r.rss_first as f64),
            megabytes(r.rss_after_churn as f64),
            ms(r.cpu_per_update_ms),
            ms(r.ack_p50_ms),
            ms(r.ack_p99_ms),
            kilobytes(r.rss_first as f64 / row.workloads.max(1) as f64),
            ms(r.conn_p50_ms.unwrap_or(f64::NAN)),
            ms(r.conn_p99_ms.unwrap_or(f64::NAN)),
            ms(r.conn_cpu_ms.unwrap_or(f64::NAN)),
        ));
    }
    out
}
