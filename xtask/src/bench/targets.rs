//! The targets issues 8 and 18 set, checked against one run's figures (never
//! asserted: the report prints whether each is met), beside what the
//! throwaway prototype and Istio's node proxy gave on this kind of machine.

use serde_json::Value;

use super::idle::IdleRow;
use super::samples::{Figures, Variant};

/// How a target's figure is formed.
#[derive(Debug, Clone, Copy)]
enum Measure {
    /// ebpf median / iptables median, same placement and protocol.
    EbpfOverIptables {
        placement: &'static str,
        protocol: &'static str,
    },
    /// ebpf median / direct median, same placement.
    EbpfOverDirect {
        placement: &'static str,
        protocol: &'static str,
    },
    /// The largest agent's RSS with the most idle connections, MiB.
    IdleRssMib {
        placement: &'static str,
        protocol: &'static str,
    },
}

/// Whether a figure must be at least or at most the goal.
#[derive(Debug, Clone, Copy)]
enum Goal {
    AtLeast(f64),
    AtMost(f64),
}

/// One target.
#[derive(Debug, Clone, Copy)]
struct Target {
    label: &'static str,
    workload: &'static str,
    metric: &'static str,
    measure: Measure,
    goal: Goal,
    reference: &'static str,
}

const fn ei(
    label: &'static str,
    workload: &'static str,
    metric: &'static str,
    placement: &'static str,
    goal: Goal,
    reference: &'static str,
) -> Target {
    Target {
        label,
        workload,
        metric,
        measure: Measure::EbpfOverIptables {
            placement,
            protocol: "plain",
        },
        goal,
        reference,
    }
}

/// ebpf over direct for one placement and protocol.
const fn over_direct(
    label: &'static str,
    workload: &'static str,
    metric: &'static str,
    (placement, protocol): (&'static str, &'static str),
    goal: Goal,
    reference: &'static str,
) -> Target {
    Target {
        label,
        workload,
        metric,
        measure: Measure::EbpfOverDirect {
            placement,
            protocol,
        },
        goal,
        reference,
    }
}

/// Cross-node HBONE.
const HBONE: (&str, &str) = ("cross-node", "hbone");
/// The same-node fast path.
const FAST: (&str, &str) = ("same-node", "fast-path");
/// The same-node fast path through a service VIP.
const FAST_VIP: (&str, &str) = ("same-node", "fast-path-vip");

const TARGETS: &[Target] = &[
    ei(
        "connection rate, ebpf / iptables, plain, same-node",
        "conn-rate",
        "conn/s",
        "same-node",
        Goal::AtLeast(1.25),
        "prototype 1.27x",
    ),
    ei(
        "connection rate, ebpf / iptables, plain, cross-node",
        "conn-rate",
        "conn/s",
        "cross-node",
        Goal::AtLeast(1.25),
        "prototype 1.27x",
    ),
    ei(
        "single-stream throughput, ebpf / iptables, plain, same-node",
        "bulk-1",
        "Gbit/s",
        "same-node",
        Goal::AtLeast(1.2),
        "prototype 1.27x",
    ),
    ei(
        "single-stream throughput, ebpf / iptables, plain, cross-node",
        "bulk-1",
        "Gbit/s",
        "cross-node",
        Goal::AtLeast(1.2),
        "prototype 1.27x",
    ),
    ei(
        "agent CPU per connection, ebpf / iptables, plain, same-node",
        "conn-rate",
        "agent CPU s/10k conn",
        "same-node",
        Goal::AtMost(0.85),
        "prototype 0.84x",
    ),
    ei(
        "agent CPU per connection, ebpf / iptables, plain, cross-node",
        "conn-rate",
        "agent CPU s/10k conn",
        "cross-node",
        Goal::AtMost(0.85),
        "prototype 0.84x",
    ),
    ei(
        "RR p99, ebpf / iptables, plain, same-node",
        "rr",
        "p99 us",
        "same-node",
        Goal::AtMost(1.0),
        "-",
    ),
    ei(
        "RR p99, ebpf / iptables, plain, cross-node",
        "rr",
        "p99 us",
        "cross-node",
        Goal::AtMost(1.0),
        "-",
    ),
    ei(
        "RR p99 pinned, ebpf / iptables, plain, cross-node",
        "rr-pinned",
        "p99 us",
        "cross-node",
        Goal::AtMost(1.0),
        "-",
    ),
    ei(
        "connection p50, ebpf / iptables, plain, cross-node",
        "conn-rate",
        "p50 us",
        "cross-node",
        Goal::AtMost(1.0),
        "prototype 0.79x",
    ),
    over_direct(
        "same-node fast path connection rate / direct",
        "conn-rate",
        "conn/s",
        FAST,
        Goal::AtLeast(0.8),
        "Istio ~0.25x",
    ),
    over_direct(
        "same-node fast path single-stream throughput / direct",
        "bulk-1",
        "Gbit/s",
        FAST,
        Goal::AtLeast(0.8),
        "Istio ~0.25x",
    ),
    over_direct(
        "same-node fast path via a service VIP, connection rate / direct",
        "conn-rate",
        "conn/s",
        FAST_VIP,
        Goal::AtLeast(0.8),
        "Istio ~0.25x",
    ),
    over_direct(
        "same-node fast path via a service VIP, single-stream throughput / direct",
        "bulk-1",
        "Gbit/s",
        FAST_VIP,
        Goal::AtLeast(0.8),
        "Istio ~0.25x",
    ),
    over_direct(
        "HBONE cross-node connection rate / direct",
        "conn-rate",
        "conn/s",
        HBONE,
        Goal::AtLeast(0.30),
        "Istio 0.17x",
    ),
    over_direct(
        "HBONE cross-node single-stream throughput / direct",
        "bulk-1",
        "Gbit/s",
        HBONE,
        Goal::AtLeast(0.5),
        "Istio 0.33x",
    ),
    over_direct(
        "HBONE cross-node 4-stream throughput / direct",
        "bulk-4",
        "Gbit/s",
        HBONE,
        Goal::AtLeast(0.30),
        "Istio 0.19x",
    ),
    over_direct(
        "HBONE cross-node RR p99 / direct",
        "rr",
        "p99 us",
        HBONE,
        Goal::AtMost(2.1),
        "Istio 2.6x",
    ),
    over_direct(
        "HBONE cross-node RR p99 / direct, pinned",
        "rr-pinned",
        "p99 us",
        HBONE,
        Goal::AtMost(2.1),
        "-",
    ),
    Target {
        label: "agent RSS, 10k idle connections, ebpf HBONE cross-node (largest agent; idle table for counts)",
        workload: "idle",
        metric: "MiB",
        measure: Measure::IdleRssMib {
            placement: "cross-node",
            protocol: "hbone",
        },
        goal: Goal::AtMost(50.0),
        reference: "Istio ~2 KB/conn",
    },
    Target {
        label: "agent RSS, most idle connections held (idle table), ebpf HBONE same-node",
        workload: "idle",
        metric: "MiB",
        measure: Measure::IdleRssMib {
            placement: "same-node",
            protocol: "hbone",
        },
        goal: Goal::AtMost(50.0),
        reference: "-",
    },
    Target {
        label: "agent RSS, most idle connections held (idle table), ebpf plain cross-node",
        workload: "idle",
        metric: "MiB",
        measure: Measure::IdleRssMib {
            placement: "cross-node",
            protocol: "plain",
        },
        goal: Goal::AtMost(50.0),
        reference: "-",
    },
];

/// A target with its measured figure.
#[derive(Debug, Clone)]
pub struct Checked {
    /// What it is.
    pub label: &'static str,
    /// The measured figure (ratio, or MiB), if the run has it.
    pub measured: Option<f64>,
    /// `>= 1.25x`, `<= 50 MiB`...
    pub goal: String,
    /// Whether it is met.
    pub met: Option<bool>,
    /// What the prototype or Istio gave.
    pub reference: &'static str,
    /// Whether the figure is a ratio (`x`) rather than MiB.
    pub is_ratio: bool,
}

/// Checks every target against the figures of one run.
pub fn check(figures: &Figures, idle: &[IdleRow]) -> Vec<Checked> {
    TARGETS
        .iter()
        .map(|t| {
            let (measured, is_ratio) = match t.measure {
                Measure::EbpfOverIptables {
                    placement,
                    protocol,
                } => (
                    figures.vs_iptables(
                        t.workload,
                        &Variant::new(placement, "ebpf", protocol),
                        t.metric,
                    ),
                    true,
                ),
                Measure::EbpfOverDirect {
                    placement,
                    protocol,
                } => (
                    figures.vs_direct(
                        t.workload,
                        &Variant::new(placement, "ebpf", protocol),
                        t.metric,
                    ),
                    true,
                ),
                Measure::IdleRssMib {
                    placement,
                    protocol,
                } => (
                    idle.iter()
                        .find(|r| r.variant == Variant::new(placement, "ebpf", protocol))
                        .and_then(IdleRow::largest_agent_mib),
                    false,
                ),
            };
            let unit = if is_ratio { "x" } else { " MiB" };
            let (goal, met) = match t.goal {
                Goal::AtLeast(g) => (format!(">= {g}{unit}"), measured.map(|m| m >= g)),
                Goal::AtMost(g) => (format!("<= {g}{unit}"), measured.map(|m| m <= g)),
            };
            Checked {
                label: t.label,
                measured,
                goal,
                met,
                reference: t.reference,
                is_ratio,
            }
        })
        .collect()
}

/// The checked targets as JSON for report.json.
pub fn to_json(checked: &[Checked]) -> Value {
    Value::Array(
        checked
            .iter()
            .map(|c| {
                serde_json::json!({
                    "target": c.label,
                    "measured": c.measured,
                    "unit": if c.is_ratio { "ratio" } else { "MiB" },
                    "goal": c.goal,
                    "met": c.met,
                    "reference": c.reference,
                })
            })
            .collect(),
    )
}
