//! `RLIMIT_NOFILE`: every connection the agent carries costs descriptors
//! (two per relayed connection, one per HBONE connection), and container
//! runtimes start processes with a soft limit of 1,024 however high the
//! hard limit is. The agent raises the soft limit to the hard one at start
//! ([`raise_to_hard`]), and the budget of descriptors strangers may hold in
//! unfinished handshakes is derived from the result
//! ([`default_handshake_budget`]), so that a flood of them cannot take the
//! descriptors the node's own pods need.

use std::io;

use tracing::{info, warn};

/// Fraction of the descriptor limit that connections still in their TLS or
/// HTTP/2 handshake may hold, node-wide: the other three quarters stay for
/// established connections, captured outbound ones above all.
const HANDSHAKE_SHARE: u64 = 4;

/// Node-wide handshake budget whatever the limit: each pending handshake
/// also holds TLS state (a few KiB), so a huge limit must not turn into a
/// huge amount of memory a stranger can pin.
const HANDSHAKE_BUDGET_MAX: u64 = 16_384;

/// Node-wide handshake budget however low the limit (a node whose limit
/// is this low cannot serve anyway; the log says so).
const HANDSHAKE_BUDGET_MIN: u64 = 16;

/// The descriptor limits once [`raise_to_hard`] is done.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NofileLimit {
    /// The soft limit the agent was started with.
    pub soft_before: u64,
    /// The soft limit now in force.
    pub soft: u64,
    /// The hard limit (the most the soft one can be raised to without
    /// `CAP_SYS_RESOURCE`; the agent does not raise it).
    pub hard: u64,
}

/// Raises the soft `RLIMIT_NOFILE` to the hard limit (capped at the
/// kernel's `fs.nr_open`, the most any process may have) and logs both.
/// Never fails: an agent that cannot raise it still runs, with the limit
/// it has, and says so.
pub fn raise_to_hard() -> NofileLimit {
    let current = match get() {
        Ok(limit) => limit,
        Err(err) => {
            warn!(error = %err, "cannot read the file descriptor limit (RLIMIT_NOFILE); assuming 1024");
            return NofileLimit {
                soft_before: 1024,
                soft: 1024,
                hard: 1024,
            };
        }
    };
    let target = match nr_open() {
        Some(cap) => current.rlim_max.min(cap),
        None => current.rlim_max,
    };
    let mut limit = NofileLimit {
        soft_before: current.rlim_cur,
        soft: current.rlim_cur,
        hard: current.rlim_max,
    };
    if target > current.rlim_cur {
        let raised = libc::rlimit {
            rlim_cur: target,
            rlim_max: current.rlim_max,
        };
        // SAFETY: a valid pointer to an initialised rlimit.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            limit.soft = target;
        } else {
            let err = io::Error::last_os_error();
            warn!(soft = limit.soft, hard = limit.hard, error = %err, "cannot raise the file descriptor limit (RLIMIT_NOFILE) to the hard limit; keeping the soft one");
        }
    }
    if limit.soft > limit.soft_before {
        info!(
            soft_before = limit.soft_before,
            soft = limit.soft,
            hard = limit.hard,
            "file descriptor limit (RLIMIT_NOFILE): soft limit raised to the hard limit"
        );
    } else {
        info!(
            soft = limit.soft,
            hard = limit.hard,
            "file descriptor limit (RLIMIT_NOFILE): soft limit already at the hard limit"
        );
    }
    limit
}

impl NofileLimit {
    /// How many inbound connections may be in their TLS or HTTP/2
    /// handshake at once, node-wide, by default: a quarter of the soft
    /// limit, between 16 and 16,384.
    pub fn default_handshake_budget(&self) -> usize {
        let budget =
            (self.soft / HANDSHAKE_SHARE).clamp(HANDSHAKE_BUDGET_MIN, HANDSHAKE_BUDGET_MAX);
        usize::try_from(budget).unwrap_or(usize::MAX)
    }
}

fn get() -> io::Result<libc::rlimit> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: a valid out-pointer to an rlimit.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(limit)
}

/// `fs.nr_open`: setting a soft limit above it fails with `EPERM`.
fn nr_open() -> Option<u64> {
    std::fs::read_to_string("/proc/sys/fs/nr_open")
        .ok()
        .and_then(|text| text.trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limit(soft: u64) -> NofileLimit {
        NofileLimit {
            soft_before: soft,
            soft,
            hard: soft,
        }
    }

    #[test]
    fn the_handshake_budget_is_a_quarter_of_the_limit_within_bounds() {
        assert_eq!(limit(1024).default_handshake_budget(), 256);
        assert_eq!(limit(1 << 20).default_handshake_budget(), 16_384);
        assert_eq!(limit(20).default_handshake_budget(), 16);
    }
}
