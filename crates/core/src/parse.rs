//! Small parsers shared by flags, files and Kubernetes objects.

use std::{collections::BTreeMap, time::Duration};

/// A duration such as `24h`, `30m`, `90s` or `1500ms`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (number, unit) = s.split_at(split);
    let n: u64 = number
        .parse()
        .map_err(|_| format!("`{s}` is not a duration (e.g. 24h, 30m, 90s, 500ms)"))?;
    let secs = match unit {
        "ms" => return Ok(Duration::from_millis(n)),
        "s" | "" => n,
        "m" => n * 60,
        "h" => n * 3600,
        "d" => n * 86_400,
        _ => {
            return Err(format!(
                "`{s}`: unknown unit `{unit}` (use ms, s, m, h or d)"
            ));
        }
    };
    Ok(Duration::from_secs(secs))
}

/// The boolean value of the annotation `key`, read as Go's
/// `strconv.ParseBool` reads it (which Istio's agents use for theirs);
/// `None` when absent or not a boolean.
pub fn annotation_flag(annotations: &BTreeMap<String, String>, key: &str) -> Option<bool> {
    match annotations.get(key)?.as_str() {
        "1" | "t" | "T" | "true" | "TRUE" | "True" => Some(true),
        "0" | "f" | "F" | "false" | "FALSE" | "False" => Some(false),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse() {
        assert_eq!(parse_duration("24h"), Ok(Duration::from_secs(86_400)));
        assert_eq!(parse_duration("90s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert!(parse_duration("soon").is_err());
        assert!(parse_duration("5y").is_err());
    }

    #[test]
    fn annotation_flags_read_as_go_parse_bool() {
        let annotations: BTreeMap<String, String> = [("a", "True"), ("b", "0"), ("c", "yes")]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect();
        assert_eq!(annotation_flag(&annotations, "a"), Some(true));
        assert_eq!(annotation_flag(&annotations, "b"), Some(false));
        assert_eq!(annotation_flag(&annotations, "c"), None);
        assert_eq!(annotation_flag(&annotations, "d"), None);
    }
}
