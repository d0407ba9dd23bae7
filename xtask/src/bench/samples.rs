//! The harness's samples (`dp-bench --out`), read back as figures: one
//! value per metric per run, grouped by workload and variant (placement,
//! mode, protocol), summarised by the median over rounds.

use std::collections::BTreeMap;

use anyhow::{Context as _, Result};
use serde_json::Value;

/// What one row of a table is: where the server runs and how traffic gets
/// there.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Variant {
    /// `same-node` or `cross-node`.
    pub placement: String,
    /// `direct`, `iptables`, `ebpf` or `ztunnel`.
    pub mode: String,
    /// `plain`, `hbone` or `fast-path`.
    pub protocol: String,
}

impl Variant {
    /// A variant from its three names.
    pub fn new(placement: &str, mode: &str, protocol: &str) -> Self {
        Self {
            placement: placement.to_owned(),
            mode: mode.to_owned(),
            protocol: protocol.to_owned(),
        }
    }

    /// The direct run of the same placement.
    pub fn direct(&self) -> Self {
        Self::new(&self.placement, "direct", "plain")
    }

    /// The iptables run of the same placement and protocol.
    pub fn iptables(&self) -> Self {
        Self::new(&self.placement, "iptables", &self.protocol)
    }

    /// Rows in report order: placements, then direct, iptables and ebpf
    /// for plain, then iptables, ebpf and ztunnel for HBONE, then the fast
    /// path, then the fast path through a VIP.
    pub fn order_key(&self) -> (u8, u8, u8) {
        let placement = u8::from(self.placement != "same-node");
        let protocol = match (self.mode.as_str(), self.protocol.as_str()) {
            ("direct", _) | (_, "plain") => 0,
            (_, "hbone") => 1,
            (_, "fast-path") => 2,
            _ => 3,
        };
        let mode = match self.mode.as_str() {
            "direct" => 0,
            "iptables" => 1,
            "ztunnel" => 3,
            _ => 2,
        };
        (placement, protocol, mode)
    }
}

/// One metric of a workload.
#[derive(Debug, Clone, Copy)]
pub struct Metric {
    /// Column heading.
    pub name: &'static str,
    /// Whether more is better (rates, throughput) or less (latency, cost).
    pub higher_is_better: bool,
    /// Reads it from a sample.
    extract: fn(&Value) -> Option<f64>,
}

fn result(sample: &Value, key: &str) -> Option<f64> {
    sample["result"][key].as_f64()
}

fn latency(sample: &Value, key: &str) -> Option<f64> {
    sample["result"]["latency"][key].as_f64()
}

/// CPU seconds of `key` per 10k operations.
fn per_10k_ops(sample: &Value, key: &str) -> Option<f64> {
    let ops = result(sample, "ops")?;
    (ops > 0.0).then(|| sample[key].as_f64().unwrap_or(0.0) / ops * 1e4)
}

/// CPU seconds of `key` per GB moved.
fn per_gb(sample: &Value, key: &str) -> Option<f64> {
    let bytes = result(sample, "bytes")?;
    (bytes > 0.0).then(|| sample[key].as_f64().unwrap_or(0.0) / (bytes / 1e9))
}

const RATE: Metric = Metric {
    name: "conn/s",
    higher_is_better: true,
    extract: |s| result(s, "rate"),
};
const REQ_RATE: Metric = Metric {
    name: "req/s",
    higher_is_better: true,
    extract: |s| result(s, "rate"),
};
const P50: Metric = Metric {
    name: "p50 us",
    higher_is_better: false,
    extract: |s| latency(s, "p50_us"),
};
const P99: Metric = Metric {
    name: "p99 us",
    higher_is_better: false,
    extract: |s| latency(s, "p99_us"),
};
const P999: Metric = Metric {
    name: "p99.9 us",
    higher_is_better: false,
    extract: |s| latency(s, "p999_us"),
};
const AGENT_PER_10K: Metric = Metric {
    name: "agent CPU s/10k conn",
    higher_is_better: false,
    extract: |s| per_10k_ops(s, "agent_cpu_s"),
};
const MACHINE_PER_10K: Metric = Metric {
    name: "machine CPU s/10k conn",
    higher_is_better: false,
    extract: |s| per_10k_ops(s, "machine_cpu_s"),
};
const KERNEL_PER_10K: Metric = Metric {
    name: "kernel CPU s/10k conn",
    higher_is_better: false,
    extract: |s| per_10k_ops(s, "machine_kernel_s"),
};
const GBPS: Metric = Metric {
    name: "Gbit/s",
    higher_is_better: true,
    extract: |s| result(s, "gbps"),
};
const AGENT_PER_GB: Metric = Metric {
    name: "agent CPU s/GB",
    higher_is_better: false,
    extract: |s| per_gb(s, "agent_cpu_s"),
};
const MACHINE_PER_GB: Metric = Metric {
    name: "machine CPU s/GB",
    higher_is_better: false,
    extract: |s| per_gb(s, "machine_cpu_s"),
};
const KERNEL_PER_GB: Metric = Metric {
    name: "kernel CPU s/GB",
    higher_is_better: false,
    extract: |s| per_gb(s, "machine_kernel_s"),
};

/// The metrics a workload reports; the first is its headline (charted).
pub fn metrics(workload: &str) -> &'static [Metric] {
    match workload {
        "conn-rate" => &[
            RATE,
            P50,
            P99,
            AGENT_PER_10K,
            KERNEL_PER_10K,
            MACHINE_PER_10K,
        ],
        "rr" | "rr-pinned" => &[P99, P50, P999, REQ_RATE],
        "conn-rr" => &[P99, P50, P999, AGENT_PER_10K, MACHINE_PER_10K],
        _ if workload.starts_with("bulk-") => &[GBPS, AGENT_PER_GB, KERNEL_PER_GB, MACHINE_PER_GB],
        _ => &[],
    }
}

/// What a workload does, for table captions.
pub fn describe(workload: &str, counts: &Value) -> String {
    let n = |key: &str| counts[key].as_u64().unwrap_or(0);
    match workload {
        "conn-rate" => format!(
            "new connection, 1-byte echo, close; {} connections over {} threads",
            n("conns"),
            n("conn_concurrency")
        ),
        "rr" => format!(
            "1 KiB ping-pong on one persistent connection; {} requests",
            n("rr")
        ),
        "rr-pinned" => format!(
            "as rr, with client, server and agents pinned to CPU 0 (no cross-CPU wakeups); {} requests",
            n("rr")
        ),
        "conn-rr" => format!(
            "1 KiB request and response on a new connection each, one at a time; {} connections",
            n("conn_rr")
        ),
        _ => match workload.strip_prefix("bulk-") {
            Some(streams) => format!(
                "bulk transfer to a sink over {streams} stream(s); {} MiB per run",
                n("bulk_bytes") >> 20
            ),
            None => workload.to_owned(),
        },
    }
}

/// Values of one metric over the rounds.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Figure {
    /// One value per successful run.
    pub values: Vec<f64>,
}

impl Figure {
    /// Median (the headline).
    pub fn median(&self) -> Option<f64> {
        if self.values.is_empty() {
            return None;
        }
        let mut v = self.values.clone();
        v.sort_by(f64::total_cmp);
        let mid = v.len() / 2;
        Some(if v.len().is_multiple_of(2) {
            (v[mid - 1] + v[mid]) / 2.0
        } else {
            v[mid]
        })
    }

    /// Smallest value.
    pub fn min(&self) -> Option<f64> {
        self.values.iter().copied().reduce(f64::min)
    }

    /// Largest value.
    pub fn max(&self) -> Option<f64> {
        self.values.iter().copied().reduce(f64::max)
    }
}

/// Every figure of a run: workload -> variant -> metric name -> values.
#[derive(Debug, Default)]
pub struct Figures {
    /// The figures.
    pub by_workload: BTreeMap<String, BTreeMap<Variant, BTreeMap<&'static str, Figure>>>,
    /// Workloads in the order they ran.
    pub workloads: Vec<String>,
    /// Runs that failed, with their error.
    pub failures: Vec<String>,
}

impl Figures {
    /// Groups the samples.
    pub fn from_samples(samples: &[Value]) -> Result<Self> {
        let mut figures = Self::default();
        for sample in samples {
            let text = |key: &str| {
                sample[key]
                    .as_str()
                    .with_context(|| format!("sample without {key}: {sample}"))
            };
            let workload = text("workload")?.to_owned();
            let variant = Variant::new(text("placement")?, text("mode")?, text("protocol")?);
            if !figures.workloads.contains(&workload) {
                figures.workloads.push(workload.clone());
            }
            if !sample["ok"].as_bool().unwrap_or(false) {
                figures.failures.push(format!(
                    "{workload} {} {} {}: {}",
                    variant.placement,
                    variant.mode,
                    variant.protocol,
                    sample["error"].as_str().unwrap_or("unknown error")
                ));
                continue;
            }
            let entry = figures
                .by_workload
                .entry(workload.clone())
                .or_default()
                .entry(variant)
                .or_default();
            for metric in metrics(&workload) {
                if let Some(value) = (metric.extract)(sample) {
                    entry.entry(metric.name).or_default().values.push(value);
                }
            }
        }
        Ok(figures)
    }

    /// The median of a metric for a variant.
    pub fn median(&self, workload: &str, variant: &Variant, metric: &str) -> Option<f64> {
        self.by_workload
            .get(workload)?
            .get(variant)?
            .get(metric)?
            .median()
    }

    /// Ratio of a variant's median to its direct run's (same placement).
    pub fn vs_direct(&self, workload: &str, variant: &Variant, metric: &str) -> Option<f64> {
        if variant.mode == "direct" {
            return None;
        }
        ratio(
            self.median(workload, variant, metric)?,
            self.median(workload, &variant.direct(), metric)?,
        )
    }

    /// Ratio of an ebpf variant's median to the iptables one's (same
    /// placement and protocol).
    pub fn vs_iptables(&self, workload: &str, variant: &Variant, metric: &str) -> Option<f64> {
        if variant.mode != "ebpf" {
            return None;
        }
        ratio(
            self.median(workload, variant, metric)?,
            self.median(workload, &variant.iptables(), metric)?,
        )
    }

    /// Variants of a workload in report order.
    pub fn variants(&self, workload: &str) -> Vec<Variant> {
        let mut variants: Vec<Variant> = self
            .by_workload
            .get(workload)
            .map(|m| m.keys().cloned().collect())
            .unwrap_or_default();
        variants.sort_by_key(Variant::order_key);
        variants
    }
}

/// `a / b`, when `b` is meaningfully non-zero.
pub fn ratio(a: f64, b: f64) -> Option<f64> {
    (b.abs() > f64::EPSILON * 1e3).then(|| a / b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn sample(mode: &str, protocol: &str, round: u64, rate: f64) -> Value {
        json!({
            "ok": true, "workload": "conn-rate", "placement": "same-node",
            "mode": mode, "protocol": protocol, "round": round,
            "result": {"ops": 1000, "rate": rate, "latency": {"p50_us": 10.0, "p99_us": 20.0}},
            "agent_cpu_s": 0.5, "machine_cpu_s": 1.0, "machine_kernel_s": 0.6,
        })
    }

    #[test]
    fn medians_and_ratios_come_from_the_same_run() -> Result<()> {
        let samples = [
            sample("direct", "plain", 0, 1000.0),
            sample("direct", "plain", 1, 3000.0),
            sample("direct", "plain", 2, 2000.0),
            sample("iptables", "plain", 0, 400.0),
            sample("ebpf", "plain", 0, 500.0),
            json!({"ok": false, "error": "boom", "workload": "conn-rate",
                   "placement": "same-node", "mode": "ebpf", "protocol": "hbone"}),
        ];
        let f = Figures::from_samples(&samples)?;
        let ebpf = Variant::new("same-node", "ebpf", "plain");
        assert_eq!(
            f.median("conn-rate", &ebpf.direct(), "conn/s"),
            Some(2000.0)
        );
        assert_eq!(f.vs_direct("conn-rate", &ebpf, "conn/s"), Some(0.25));
        assert_eq!(f.vs_iptables("conn-rate", &ebpf, "conn/s"), Some(1.25));
        assert_eq!(
            f.median("conn-rate", &ebpf, "agent CPU s/10k conn"),
            Some(5.0)
        );
        assert_eq!(f.failures.len(), 1);
        assert_eq!(
            f.variants("conn-rate")
                .iter()
                .map(|v| v.mode.as_str())
                .collect::<Vec<_>>(),
            ["direct", "iptables", "ebpf"]
        );
        Ok(())
    }

    #[test]
    fn median_of_even_count_is_the_mean_of_the_middle_two() {
        let f = Figure {
            values: vec![4.0, 1.0, 3.0, 2.0],
        };
        assert_eq!(f.median(), Some(2.5));
        assert_eq!(f.min(), Some(1.0));
        assert_eq!(f.max(), Some(4.0));
    }
}
