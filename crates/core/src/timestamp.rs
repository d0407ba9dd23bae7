//! Instants as the agent shows them to people and tools: RFC 3339 in UTC.
//!
//! One formatter for every status page, dump and CLI view (certificate
//! validity, xDS acknowledgements, the trust bundle's retiring roots), so
//! the same instant reads the same wherever it is shown.

use std::time::SystemTime;

/// `at` as RFC 3339 in UTC (`2024-05-01T12:00:00Z`, with a fraction of a
/// second only when there is one), or `-` for an instant RFC 3339 cannot
/// spell (a year past 9999).
pub fn rfc3339(at: SystemTime) -> String {
    time::OffsetDateTime::from(at)
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_else(|_| "-".to_owned())
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, UNIX_EPOCH};

    use super::*;

    #[test]
    fn whole_seconds_have_no_fraction() {
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00Z");
        assert_eq!(
            rfc3339(UNIX_EPOCH + Duration::from_secs(1_714_564_800)),
            "2024-05-01T12:00:00Z"
        );
    }

    #[test]
    fn fractions_keep_their_digits() {
        assert_eq!(
            rfc3339(UNIX_EPOCH + Duration::from_millis(1_500)),
            "1970-01-01T00:00:01.5Z"
        );
    }
}
