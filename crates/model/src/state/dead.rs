//! Endpoints that recently failed to answer, and the cheap random draw
//! endpoint choice uses.

use std::{
    collections::HashMap,
    net::IpAddr,
    sync::{
        Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

/// How long an endpoint whose node did not answer is skipped.
pub const DEAD_ENDPOINT_HOLD: Duration = Duration::from_secs(30);

/// Endpoint IPs that recently failed to answer, skipped for
/// [`DEAD_ENDPOINT_HOLD`]. Shared across config generations.
#[derive(Debug, Default)]
pub struct DeadEndpoints {
    until: Mutex<HashMap<IpAddr, Instant>>,
}

impl DeadEndpoints {
    /// Marks `ip` dead for a while.
    pub fn mark(&self, ip: IpAddr) {
        if let Ok(mut until) = self.until.lock() {
            until.insert(ip, Instant::now() + DEAD_ENDPOINT_HOLD);
        }
    }

    /// Whether `ip` is being skipped.
    pub fn is_dead(&self, ip: IpAddr) -> bool {
        self.until
            .lock()
            .map(|until| until.get(&ip).is_some_and(|t| *t > Instant::now()))
            .unwrap_or(false)
    }
}

/// A cheap random index below `n` (at least 1; no `rand` dependency):
/// the std hasher's random keys over a counter.
pub fn random_index(n: usize) -> usize {
    let n = n.max(1);
    use std::hash::{BuildHasher, Hasher};
    static COUNTER: AtomicUsize = AtomicUsize::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_usize(COUNTER.fetch_add(1, Ordering::Relaxed));
    (h.finish() as usize) % n
}
