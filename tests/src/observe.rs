//! What a running agent shows the outside, parsed for assertions: its
//! Prometheus exposition (`/metrics`) and its text access records.

use std::collections::HashMap;

use crate::{Agent, traffic::http};

/// One sample of the Prometheus text exposition.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// Metric name (with `_total` for counters).
    pub name: String,
    /// Labels in exposition order.
    pub labels: Vec<(String, String)>,
    /// The value.
    pub value: f64,
}

/// Parses `name{k="v",...} value [timestamp]` lines; comments skipped.
pub fn parse_exposition(text: &str) -> anyhow::Result<Vec<Sample>> {
    let mut samples = Vec::new();
    for line in text.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let bad = || anyhow::anyhow!("malformed sample line {line:?}");
        let end = line.find(['{', ' ']).ok_or_else(bad)?;
        let mut chars = line[end..].chars().peekable();
        let mut labels = Vec::new();
        if chars.next_if_eq(&'{').is_some() {
            loop {
                while chars.next_if(|c| *c == ',' || *c == ' ').is_some() {}
                if chars.next_if_eq(&'}').is_some() {
                    break;
                }
                let key: String = std::iter::from_fn(|| chars.next_if(|c| *c != '=')).collect();
                anyhow::ensure!(
                    chars.next() == Some('=') && chars.next() == Some('"'),
                    bad()
                );
                let mut value = String::new();
                loop {
                    match chars.next().ok_or_else(bad)? {
                        '"' => break,
                        '\\' => match chars.next().ok_or_else(bad)? {
                            'n' => value.push('\n'),
                            other => value.push(other),
                        },
                        c => value.push(c),
                    }
                }
                labels.push((key, value));
            }
        }
        let rest: String = chars.collect();
        let number = rest.split_whitespace().next().ok_or_else(bad)?;
        let value = match number {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            n => n.parse().map_err(|_| bad())?,
        };
        let name = line[..end].to_owned();
        samples.push(Sample {
            name,
            labels,
            value,
        });
    }
    Ok(samples)
}

/// Fetches and parses an agent's `/metrics`.
pub fn scrape(agent: &Agent) -> anyhow::Result<Vec<Sample>> {
    let (status, body) = http(agent.metrics_addr()?, "GET", "/metrics")?;
    anyhow::ensure!(status == 200, "metrics answered {status}: {body}");
    parse_exposition(&body)
}

/// The sum of a family's samples.
pub fn sum(samples: &[Sample], name: &str) -> f64 {
    family(samples, name).iter().map(|s| s.value).sum()
}

/// The sum of the samples of `name` whose labels include every pair of
/// `want` (others may be present).
pub fn sum_matching(samples: &[Sample], name: &str, want: &[(&str, &str)]) -> f64 {
    family(samples, name)
        .iter()
        .filter(|s| {
            want.iter()
                .all(|(k, v)| s.labels.iter().any(|(lk, lv)| lk == k && lv == v))
        })
        .map(|s| s.value)
        .sum()
}

/// Every sample named `name`.
pub fn family<'a>(samples: &'a [Sample], name: &str) -> Vec<&'a Sample> {
    samples.iter().filter(|s| s.name == name).collect()
}

/// The value of the sample with exactly `labels` (in any order).
pub fn value(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let mut want: Vec<(&str, &str)> = labels.to_vec();
    want.sort_unstable();
    family(samples, name).into_iter().find_map(|s| {
        let mut have: Vec<(&str, &str)> = s
            .labels
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        have.sort_unstable();
        (have == want).then_some(s.value)
    })
}

/// The fields of every access record with `message` in an agent log.
pub fn access_records(log: &str, message: &str) -> Vec<HashMap<String, String>> {
    let marker = format!(" access: {message} ");
    log.lines()
        .filter_map(|line| {
            line.split_once(&marker)
                .map(|(_, fields)| parse_fields(fields))
        })
        .collect()
}

/// A field of an access record ("" when absent).
pub fn field<'a>(record: &'a HashMap<String, String>, key: &str) -> &'a str {
    record.get(key).map_or("", String::as_str)
}

/// `key=value key="quoted \"value\""` as the text log writes fields.
pub fn parse_fields(text: &str) -> HashMap<String, String> {
    let mut fields = HashMap::new();
    let mut chars = text.chars().peekable();
    loop {
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        let key: String =
            std::iter::from_fn(|| chars.next_if(|c| *c != '=' && !c.is_whitespace())).collect();
        if key.is_empty() {
            return fields;
        }
        if chars.next_if_eq(&'=').is_none() {
            continue;
        }
        let mut value = String::new();
        if chars.next_if_eq(&'"').is_some() {
            while let Some(c) = chars.next() {
                match c {
                    '"' => break,
                    '\\' => value.extend(chars.next()),
                    c => value.push(c),
                }
            }
        } else {
            value.extend(std::iter::from_fn(|| chars.next_if(|c| !c.is_whitespace())));
        }
        fields.insert(key, value);
    }
}
