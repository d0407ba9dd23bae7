//! Agent memory with idle connections held open through the engine: the
//! harness reads every agent's RSS before and at each step (e.g. 1k and
//! 10k connections), on freshly started agents.

use serde_json::Value;

use super::samples::Variant;

/// One idle measurement.
#[derive(Debug, Clone, PartialEq)]
pub struct IdleRow {
    /// Mode, placement, protocol.
    pub variant: Variant,
    /// RSS of each agent (node 1, node 2) before, bytes.
    pub base: Vec<u64>,
    /// Connections and each agent's RSS at each step.
    pub steps: Vec<(u64, Vec<u64>)>,
    /// Why it failed, when it did.
    pub error: Option<String>,
}

impl IdleRow {
    /// Reads the harness's `idle` array.
    pub fn parse_all(idle: &Value) -> Vec<IdleRow> {
        let bytes = |v: &Value| -> Vec<u64> {
            v.as_array()
                .map(|a| a.iter().filter_map(Value::as_u64).collect())
                .unwrap_or_default()
        };
        idle.as_array()
            .map(|rows| {
                rows.iter()
                    .map(|r| IdleRow {
                        variant: Variant::new(
                            r["placement"].as_str().unwrap_or("?"),
                            r["mode"].as_str().unwrap_or("?"),
                            r["protocol"].as_str().unwrap_or("?"),
                        ),
                        base: bytes(&r["base_rss_bytes"]),
                        steps: r["steps"]
                            .as_array()
                            .map(|s| {
                                s.iter()
                                    .map(|s| {
                                        (
                                            s["connections"].as_u64().unwrap_or(0),
                                            bytes(&s["rss_bytes"]),
                                        )
                                    })
                                    .collect()
                            })
                            .unwrap_or_default(),
                        error: (!r["ok"].as_bool().unwrap_or(false))
                            .then(|| r["error"].as_str().unwrap_or("unknown error").to_owned()),
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The largest agent's RSS at the last step, MiB.
    pub fn largest_agent_mib(&self) -> Option<f64> {
        let (_, rss) = self.steps.last()?;
        rss.iter().copied().max().map(mib)
    }

    /// Memory the agents grew by per connection from the base to the last
    /// step, in KiB (all agents together: both ends of the path).
    pub fn kib_per_connection(&self) -> Option<f64> {
        let (conns, rss) = self.steps.last()?;
        let grown = rss.iter().sum::<u64>() as f64 - self.base.iter().sum::<u64>() as f64;
        (*conns > 0).then(|| grown / *conns as f64 / 1024.0)
    }
}

/// Bytes as MiB.
pub fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn per_connection_growth_counts_both_agents() {
        let rows = IdleRow::parse_all(&json!([{
            "ok": true, "mode": "ebpf", "placement": "cross-node", "protocol": "hbone",
            "base_rss_bytes": [10 << 20, 8 << 20],
            "steps": [
                {"connections": 1000, "rss_bytes": [12 << 20, 9 << 20]},
                {"connections": 10240, "rss_bytes": [30 << 20, 18 << 20]},
            ],
        }]));
        assert_eq!(rows.len(), 1);
        assert_eq!(rows[0].largest_agent_mib(), Some(30.0));
        // 30 MiB grown over 10240 connections = 3 KiB each.
        assert_eq!(rows[0].kib_per_connection(), Some(3.0));
    }
}
