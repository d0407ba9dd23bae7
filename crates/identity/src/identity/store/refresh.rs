//! The store's worker: the task that fetches missing certificates,
//! refreshes them at half-life and on root changes, re-reads mounted files,
//! and backs off after failures.
//!
//! Kept apart from the slots in [`super`] because it is the only part of the
//! store with timing policy (check interval, backoff, request timeout,
//! concurrency) and the only part that talks to the source asynchronously;
//! the slots themselves stay a plain map behind a lock that handshakes read.
//! The worker reaches the slots through the store's private helpers
//! (`install`, `with_slot`, `load`, `issue_local`), never the reverse.

use std::sync::atomic::Ordering;
use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use futures::StreamExt as _;
use tokio::task::JoinHandle;

use super::CertStore;
use crate::identity::{CertSourceError, Fetched, Identity};

/// Longest pause between two checks.
const MAX_CHECK_INTERVAL: Duration = Duration::from_secs(1);
/// Shortest pause between two checks, so a tiny validity cannot make the
/// task spin.
const MIN_CHECK_INTERVAL: Duration = Duration::from_millis(10);
/// How often mounted files are read again.
pub const FILES_POLL: Duration = Duration::from_secs(1);
/// First retry after a failed request to a CA; doubled on each failure.
const BACKOFF_FIRST: Duration = Duration::from_millis(500);
/// Longest wait between two retries.
const BACKOFF_MAX: Duration = Duration::from_secs(30);
/// Longest wait for one answer from the source.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(15);
/// Requests to the source in flight at once.
const CONCURRENT_FETCHES: usize = 8;

impl CertStore {
    /// Starts the task that fetches missing certificates, refreshes them
    /// at half-life and on root changes, re-reads mounted files, and
    /// prunes retiring roots: every `min(1s, validity/20)` and whenever an
    /// identity is wanted. It stops by itself when the store is dropped;
    /// abort the handle to stop it sooner.
    ///
    /// # Panics
    ///
    /// Outside a tokio runtime, like [`tokio::spawn`].
    pub fn spawn_rotation(self: Arc<Self>) -> JoinHandle<()> {
        let interval = (self.validity / 20).clamp(MIN_CHECK_INTERVAL, MAX_CHECK_INTERVAL);
        let store = Arc::downgrade(&self);
        drop(self);
        tokio::spawn(async move {
            let mut ticker = tokio::time::interval(interval);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                let Some(strong) = store.upgrade() else { break };
                let woken = async {
                    tokio::select! {
                        _ = ticker.tick() => {}
                        () = strong.wake.notified() => {}
                    }
                };
                woken.await;
                strong.refresh_due(SystemTime::now()).await;
            }
        })
    }

    /// One pass of the task: fetches every certificate missing, past its
    /// refresh time (half-life, at or before `now`), issued under older
    /// roots, or (files) not read for [`FILES_POLL`]; returns how many were
    /// replaced. Identities backing off after a failure wait their turn.
    pub async fn refresh_due(&self, now: SystemTime) -> usize {
        self.bundle.prune(now);
        let due = self.due(now, Instant::now());
        if due.is_empty() {
            return 0;
        }
        let mut results = futures::stream::iter(due)
            .map(|(identity, in_use)| async move {
                // A CA that accepts the request and never answers must not
                // stall every other identity's refresh.
                let fetch = self.source.fetch(&identity, self.validity, in_use);
                let result = tokio::time::timeout(REQUEST_TIMEOUT, fetch)
                    .await
                    .unwrap_or_else(|_| {
                        Err(CertSourceError::Timeout {
                            source_name: self.source.describe(),
                            after: REQUEST_TIMEOUT,
                        })
                    });
                (identity, result)
            })
            .buffer_unordered(CONCURRENT_FETCHES);
        let mut replaced = 0;
        while let Some((identity, result)) = results.next().await {
            match result {
                Ok(fetched) => replaced += usize::from(self.accept(&identity, fetched, now)),
                Err(error) => self.refuse(&identity, &error, now),
            }
        }
        replaced
    }

    /// Re-issues every certificate past half-life at `now` (the built-in
    /// CA signs inline); returns how many were replaced.
    pub fn rotate_due(&self, now: SystemTime) -> usize {
        let due = self.due(now, Instant::now());
        let mut rotated = 0;
        for (identity, _) in due {
            match self.issue_local(&identity) {
                Ok(fresh) => {
                    if self.install(&identity, fresh, now) {
                        rotated += 1;
                    }
                }
                Err(e) => tracing::warn!(
                    identity = %identity,
                    error = %e,
                    "certificate rotation failed; keeping the current certificate and retrying"
                ),
            }
        }
        rotated
    }

    /// Identities due for a request, with the digest of the files in use.
    fn due(&self, now: SystemTime, instant: Instant) -> Vec<(Identity, Option<u64>)> {
        let generation = self.bundle.generation();
        let files = self.source.is_polled();
        let slots = self.slots.read().unwrap_or_else(PoisonError::into_inner);
        slots
            .iter()
            .filter(|(_, s)| s.retry_at.is_none_or(|at| at <= instant))
            .filter(|(_, s)| match (&s.current, files) {
                (_, true) => s.checked_at.is_none_or(|at| at + FILES_POLL <= instant),
                (None, false) => true,
                (Some(c), false) => c.issued.refresh_at() <= now || c.generation < generation,
            })
            .map(|(id, s)| {
                let in_use = s.current.as_ref().and_then(|c| c.fingerprint);
                // Refused files are not checked (nor counted) again until
                // they change.
                (id.clone(), in_use.or(s.refused))
            })
            .collect()
    }

    /// Takes what the source answered; returns whether a certificate was
    /// replaced.
    fn accept(&self, identity: &Identity, fetched: Fetched, now: SystemTime) -> bool {
        let (cert, roots, fingerprint) = match fetched {
            Fetched::Unchanged => {
                self.with_slot(identity, |slot| slot.checked_at = Some(Instant::now()));
                return false;
            }
            Fetched::Issued {
                cert,
                roots,
                fingerprint,
            } => (cert, roots, fingerprint),
        };
        if let Some(roots) = roots {
            // Peers' certificates from a root leaving the set stay
            // verifiable until they have rotated: one certificate lifetime.
            let overlap = cert
                .not_after
                .duration_since(cert.not_before)
                .unwrap_or(self.validity)
                .max(self.validity);
            match self.bundle.update(roots, overlap, now) {
                Ok(true) => {
                    self.wake.notify_one();
                    tracing::info!(
                        source = self.source.kind(),
                        roots = self.bundle.current_roots().len(),
                        trusted = self.bundle.roots().len(),
                        overlap_secs = overlap.as_secs(),
                        "trust bundle changed; previous roots stay trusted for the overlap, local certificates are re-issued"
                    );
                }
                Ok(false) => {}
                Err(e) => {
                    let error = CertSourceError::Roots {
                        source_name: self.source.describe(),
                        source: e,
                    };
                    self.refuse(identity, &error, now);
                    return false;
                }
            }
        }
        let current = match self.load(cert, fingerprint) {
            Ok(current) => current,
            Err(e) => {
                tracing::warn!(identity = %identity, error = %e, "certificate refused");
                return false;
            }
        };
        self.successes.fetch_add(1, Ordering::Relaxed);
        self.install(identity, current, now)
    }

    /// Records a failure; the current certificate stays.
    fn refuse(&self, identity: &Identity, error: &CertSourceError, now: SystemTime) {
        let message = error.to_string();
        let files = self.source.is_polled();
        let mut repeated = false;
        let mut held = false;
        self.with_slot(identity, |slot| {
            repeated = slot.last_error.as_deref() == Some(message.as_str());
            held = slot.current.is_some();
            slot.failures = slot.failures.saturating_add(1);
            if files {
                slot.refused = error.fingerprint();
                slot.checked_at = Some(Instant::now());
            } else {
                let backoff = BACKOFF_FIRST
                    .saturating_mul(1 << slot.failures.saturating_sub(1).min(8))
                    .min(BACKOFF_MAX);
                slot.retry_at = Some(Instant::now() + backoff);
            }
            slot.last_error = Some(message.clone());
        });
        // Files that stay missing or bad are one failure, not one a poll.
        if files && repeated {
            return;
        }
        self.failures.fetch_add(1, Ordering::Relaxed);
        self.stats
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .last_failure = Some((now, format!("{identity}: {message}")));
        if held {
            tracing::warn!(identity = %identity, source = self.source.kind(), error = %message, "certificate refresh failed; keeping the current certificate and retrying");
        } else {
            tracing::warn!(identity = %identity, source = self.source.kind(), error = %message, "no certificate yet; retrying");
        }
    }
}
