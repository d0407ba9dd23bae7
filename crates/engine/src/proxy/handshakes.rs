//! Inbound HBONE connections that have not finished their handshake (TCP
//! accepted, TLS and the HTTP/2 preface and first SETTINGS not yet all
//! in): anyone who can reach a pod's 15008 can open them, and each holds a
//! file descriptor and TLS state. They are bounded per source address, per
//! pod and node-wide; a new connection over a bound sheds the oldest
//! pending handshake of the same source, or, for the pod and node bounds,
//! of the source that holds the most (so a flood from some addresses
//! cannot shed a handshake of a source that opens one at a time). A new
//! connection is always admitted: refusing the newest instead would let
//! whoever filled the table first lock everyone else out.
//!
//! Each shed connection is counted by reason
//! (`dataplane_hbone_handshakes_shed_total{reason}`) and reset by its own
//! task, which gives its descriptor back. Until those tasks have run, the
//! shed connections still hold descriptors: when more than a quarter of the
//! node-wide bound are in that state, admission waits for them (new
//! connections wait in the kernel's backlog, which costs no descriptor), so
//! a flood faster than the tasks cannot outrun the bound. The node-wide
//! bound comes from the descriptor limit ([`crate::nofile`]) and leaves
//! most of it for established connections, so the node's own pods keep
//! connecting during a flood.

use std::{
    cmp::Reverse,
    collections::{BTreeMap, BTreeSet, HashMap, HashSet},
    net::IpAddr,
    sync::{Arc, Mutex, PoisonError},
    time::{Duration, Instant},
};

use tokio::sync::{Notify, oneshot};
use tracing::warn;

use crate::telemetry::Metrics;

/// How often, at most, a warning says handshakes are being shed.
const WARN_EVERY: Duration = Duration::from_secs(10);

/// The bounds on inbound handshakes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HandshakeLimits {
    /// Pending handshakes on the whole node.
    pub node: usize,
    /// Pending handshakes to one pod.
    pub per_pod: usize,
    /// Pending handshakes from one source address (to any pod).
    pub per_source: usize,
    /// How long the TLS handshake, the HTTP/2 preface and the client's
    /// first SETTINGS may take together.
    pub timeout: Duration,
}

/// Why a pending handshake was shed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShedReason {
    /// Its source had [`HandshakeLimits::per_source`] pending.
    Source,
    /// Its pod had [`HandshakeLimits::per_pod`] pending.
    Pod,
    /// The node had [`HandshakeLimits::node`] pending.
    Node,
}

impl ShedReason {
    /// The metric label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Source => "source_limit",
            Self::Pod => "pod_limit",
            Self::Node => "node_limit",
        }
    }
}

/// The node's pending inbound handshakes; one per agent, shared by every
/// pod's HBONE listener.
#[derive(Debug)]
pub struct PendingHandshakes {
    limits: HandshakeLimits,
    /// Shed connections whose descriptor may still be open before
    /// admission waits.
    max_shedding: usize,
    table: Mutex<Table>,
    /// Notified when a shed connection is gone.
    shed_gone: Notify,
    metrics: Arc<Metrics>,
}

/// Ids grow with admission time: the smallest is the oldest.
type Id = u64;

#[derive(Debug, Default)]
struct Table {
    next: Id,
    /// Pending handshakes not shed.
    entries: BTreeMap<Id, Entry>,
    /// Shed connections whose slot is not dropped yet.
    shedding: HashSet<Id>,
    /// Node-wide, by source address.
    sources: HashMap<IpAddr, BTreeSet<Id>>,
    /// By pod uid, then source address.
    pods: HashMap<String, Group>,
    /// Sheds since the last warning, and when that was.
    unreported: u64,
    warned: Option<Instant>,
}

#[derive(Debug, Default)]
struct Group {
    sources: HashMap<IpAddr, BTreeSet<Id>>,
    len: usize,
}

#[derive(Debug)]
struct Entry {
    pod: String,
    source: IpAddr,
    shed: oneshot::Sender<ShedReason>,
}

/// A connection's place among the pending handshakes, from admission
/// until it is dropped (its handshake is complete, or it failed).
#[derive(Debug)]
pub struct HandshakeSlot {
    id: Id,
    table: Arc<PendingHandshakes>,
}

/// Resolves when the connection's handshake is shed; see
/// [`ShedSignal::recv`].
#[derive(Debug)]
pub struct ShedSignal(oneshot::Receiver<ShedReason>);

impl ShedSignal {
    /// `Some(reason)` once the handshake is shed, `None` once its
    /// [`HandshakeSlot`] is dropped (the handshake is complete).
    pub async fn recv(&mut self) -> Option<ShedReason> {
        (&mut self.0).await.ok()
    }

    /// Whether the slot was dropped without the handshake being shed.
    pub fn is_released(&mut self) -> bool {
        matches!(self.0.try_recv(), Err(oneshot::error::TryRecvError::Closed))
    }
}

impl PendingHandshakes {
    /// An empty table with `limits` (each at least 1).
    pub fn new(limits: HandshakeLimits, metrics: Arc<Metrics>) -> Self {
        let limits = HandshakeLimits {
            node: limits.node.max(1),
            per_pod: limits.per_pod.max(1),
            per_source: limits.per_source.max(1),
            timeout: limits.timeout,
        };
        Self {
            limits,
            max_shedding: (limits.node / 4).max(16),
            table: Mutex::new(Table::default()),
            shed_gone: Notify::new(),
            metrics,
        }
    }

    /// The bounds in force.
    pub fn limits(&self) -> HandshakeLimits {
        self.limits
    }

    /// Admits a new connection from `source` to pod `pod`, shedding what
    /// the bounds require first. Waits while too many shed connections
    /// have not been closed yet.
    pub async fn admit(self: &Arc<Self>, pod: &str, source: IpAddr) -> (HandshakeSlot, ShedSignal) {
        loop {
            // Registered before looking, so a release in between is not
            // missed.
            let gone = self.shed_gone.notified();
            tokio::pin!(gone);
            gone.as_mut().enable();
            if let Some(admitted) = self.try_admit(pod, source) {
                return admitted;
            }
            gone.await;
        }
    }

    /// [`PendingHandshakes::admit`] unless it has to wait.
    pub fn try_admit(
        self: &Arc<Self>,
        pod: &str,
        source: IpAddr,
    ) -> Option<(HandshakeSlot, ShedSignal)> {
        let (tx, rx) = oneshot::channel();
        let mut shed = Vec::new();
        let (id, pending, warn_now) = {
            let mut table = self.table.lock().unwrap_or_else(PoisonError::into_inner);
            if table.shedding.len() >= self.max_shedding {
                return None;
            }
            let limits = self.limits;
            if let Some(victim) = table
                .sources
                .get(&source)
                .filter(|ids| ids.len() >= limits.per_source)
                .and_then(|ids| ids.first().copied())
            {
                shed.push(table.shed(victim, ShedReason::Source));
            }
            if let Some(victim) = table
                .pods
                .get(pod)
                .filter(|group| group.len >= limits.per_pod)
                .and_then(|group| oldest_of_busiest(&group.sources))
            {
                shed.push(table.shed(victim, ShedReason::Pod));
            }
            if table.entries.len() >= limits.node
                && let Some(victim) = oldest_of_busiest(&table.sources)
            {
                shed.push(table.shed(victim, ShedReason::Node));
            }
            let id = table.insert(pod, source, tx);
            let shed_count = shed.iter().flatten().count() as u64;
            table.unreported += shed_count;
            let now = Instant::now();
            let warn_now = (table.unreported > 0
                && table
                    .warned
                    .is_none_or(|at| now.duration_since(at) >= WARN_EVERY))
            .then(|| {
                table.warned = Some(now);
                std::mem::take(&mut table.unreported)
            });
            (id, table.entries.len(), warn_now)
        };
        for reason in shed.into_iter().flatten() {
            self.metrics.handshake_shed(reason.as_str());
        }
        self.metrics.set_pending_handshakes(pending);
        if let Some(count) = warn_now {
            warn!(
                shed = count,
                node_limit = self.limits.node,
                per_pod = self.limits.per_pod,
                per_source = self.limits.per_source,
                "inbound HBONE handshakes shed: too many connections still in their handshake \
                 (oldest reset first; see dataplane_hbone_handshakes_shed_total)"
            );
        }
        Some((
            HandshakeSlot {
                id,
                table: Arc::clone(self),
            },
            ShedSignal(rx),
        ))
    }

    /// Pending handshakes now.
    pub fn pending(&self) -> usize {
        self.table
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entries
            .len()
    }

    fn release(&self, id: Id) {
        let pending = {
            let mut table = self.table.lock().unwrap_or_else(PoisonError::into_inner);
            if table.shedding.remove(&id) {
                drop(table);
                self.shed_gone.notify_waiters();
                return;
            }
            if table.remove(id).is_none() {
                return;
            }
            table.entries.len()
        };
        self.metrics.set_pending_handshakes(pending);
    }
}

impl Drop for HandshakeSlot {
    fn drop(&mut self) {
        self.table.release(self.id);
    }
}

impl Table {
    fn insert(&mut self, pod: &str, source: IpAddr, shed: oneshot::Sender<ShedReason>) -> Id {
        let id = self.next;
        self.next += 1;
        self.sources.entry(source).or_default().insert(id);
        let group = match self.pods.get_mut(pod) {
            Some(group) => group,
            None => self.pods.entry(pod.to_owned()).or_default(),
        };
        group.sources.entry(source).or_default().insert(id);
        group.len += 1;
        self.entries.insert(
            id,
            Entry {
                pod: pod.to_owned(),
                source,
                shed,
            },
        );
        id
    }

    /// Moves `id` to the shed connections and tells it why; `None` if it
    /// was gone.
    fn shed(&mut self, id: Id, reason: ShedReason) -> Option<ShedReason> {
        let entry = self.remove(id)?;
        // The connection may be finishing at this very moment: then nobody
        // listens, and its slot is dropped (or is being dropped) anyway.
        if entry.shed.send(reason).is_ok() {
            self.shedding.insert(id);
        }
        Some(reason)
    }

    fn remove(&mut self, id: Id) -> Option<Entry> {
        let entry = self.entries.remove(&id)?;
        remove_from(&mut self.sources, entry.source, id);
        if let Some(group) = self.pods.get_mut(&entry.pod) {
            remove_from(&mut group.sources, entry.source, id);
            group.len -= 1;
            if group.len == 0 {
                self.pods.remove(&entry.pod);
            }
        }
        Some(entry)
    }
}

fn remove_from(sources: &mut HashMap<IpAddr, BTreeSet<Id>>, source: IpAddr, id: Id) {
    if let Some(ids) = sources.get_mut(&source) {
        ids.remove(&id);
        if ids.is_empty() {
            sources.remove(&source);
        }
    }
}

/// The oldest pending handshake of the source that has the most (of two
/// as busy, the one whose oldest is older).
fn oldest_of_busiest(sources: &HashMap<IpAddr, BTreeSet<Id>>) -> Option<Id> {
    sources
        .values()
        .filter_map(|ids| ids.first().map(|oldest| (ids.len(), Reverse(*oldest))))
        .max()
        .map(|(_, Reverse(oldest))| oldest)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(node: usize, per_pod: usize, per_source: usize) -> Arc<PendingHandshakes> {
        Arc::new(PendingHandshakes::new(
            HandshakeLimits {
                node,
                per_pod,
                per_source,
                timeout: Duration::from_secs(10),
            },
            Arc::new(Metrics::new()),
        ))
    }

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([10, 0, 0, last])
    }

    fn shed(signal: &mut ShedSignal) -> Option<ShedReason> {
        signal.0.try_recv().ok()
    }

    trait Admit {
        fn admit_now(&self, pod: &str, source: IpAddr) -> (HandshakeSlot, ShedSignal);
    }

    impl Admit for Arc<PendingHandshakes> {
        fn admit_now(&self, pod: &str, source: IpAddr) -> (HandshakeSlot, ShedSignal) {
            self.try_admit(pod, source)
                .expect("admitted without waiting")
        }
    }

    #[test]
    fn a_source_over_its_bound_loses_its_own_oldest() {
        let t = table(100, 100, 2);
        let (_a, mut a) = t.admit_now("p", ip(1));
        let (_b, mut b) = t.admit_now("p", ip(1));
        let (_other, mut other) = t.admit_now("p", ip(2));
        let (_c, mut c) = t.admit_now("p", ip(1));
        assert_eq!(shed(&mut a), Some(ShedReason::Source));
        assert_eq!(shed(&mut b), None);
        assert_eq!(shed(&mut other), None);
        assert_eq!(shed(&mut c), None);
        assert_eq!(t.pending(), 3);
    }

    #[test]
    fn a_pod_over_its_bound_sheds_from_its_busiest_source() {
        let t = table(100, 3, 100);
        // The lone source came first: it is the oldest but not the busiest.
        let (_lone, mut lone) = t.admit_now("p", ip(9));
        let (_f1, mut f1) = t.admit_now("p", ip(1));
        let (_f2, mut f2) = t.admit_now("p", ip(1));
        // Another pod's handshakes do not count against "p".
        let (_q, mut q) = t.admit_now("q", ip(1));
        let (_new, _) = t.admit_now("p", ip(3));
        assert_eq!(shed(&mut lone), None);
        assert_eq!(shed(&mut f1), Some(ShedReason::Pod));
        assert_eq!(shed(&mut f2), None);
        assert_eq!(shed(&mut q), None);
    }

    #[test]
    fn the_node_bound_sheds_across_pods() {
        let t = table(3, 100, 100);
        let (_a, mut a) = t.admit_now("p", ip(1));
        let (_b, mut b) = t.admit_now("q", ip(1));
        let (_c, mut c) = t.admit_now("r", ip(2));
        let (_d, _) = t.admit_now("s", ip(3));
        assert_eq!(shed(&mut a), Some(ShedReason::Node));
        assert_eq!(shed(&mut b), None);
        assert_eq!(shed(&mut c), None);
        assert_eq!(t.pending(), 3);
    }

    #[test]
    fn a_finished_handshake_frees_its_place_and_is_never_shed() {
        let t = table(1, 1, 1);
        let (slot, mut signal) = t.admit_now("p", ip(1));
        drop(slot);
        assert!(signal.is_released());
        assert_eq!(t.pending(), 0);
        let (_next, mut next) = t.admit_now("p", ip(1));
        assert_eq!(shed(&mut next), None);
        assert_eq!(t.pending(), 1);
    }

    #[test]
    fn a_shed_slot_dropped_later_changes_nothing() {
        let t = table(100, 100, 1);
        let (old, mut old_signal) = t.admit_now("p", ip(1));
        let (_new, mut new_signal) = t.admit_now("p", ip(1));
        assert_eq!(shed(&mut old_signal), Some(ShedReason::Source));
        drop(old);
        assert_eq!(t.pending(), 1);
        assert_eq!(shed(&mut new_signal), None);
    }

    #[test]
    fn admission_waits_while_too_many_shed_connections_are_still_open() {
        // A node bound of 64 lets 16 shed connections stay open.
        let t = table(64, 100, 1);
        // Each admission from the one source sheds the previous one, whose
        // task has not run yet (its slot is kept here).
        let mut kept = vec![t.admit_now("p", ip(1))];
        for _ in 0..16 {
            kept.push(t.admit_now("p", ip(1)));
        }
        assert!(t.try_admit("p", ip(2)).is_none(), "16 shed and not closed");
        // The first shed connection closes: room for one more.
        kept.remove(0);
        assert!(t.try_admit("p", ip(2)).is_some());
    }

    #[tokio::test]
    async fn a_waiting_admission_goes_on_when_a_shed_connection_closes() {
        let t = table(64, 100, 1);
        let mut kept = vec![t.admit_now("p", ip(1))];
        for _ in 0..16 {
            kept.push(t.admit_now("p", ip(1)));
        }
        let waiting = tokio::spawn({
            let t = Arc::clone(&t);
            async move {
                let _ = t.admit("p", ip(2)).await;
            }
        });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished(), "admitted over the shed bound");
        kept.remove(0);
        tokio::time::timeout(Duration::from_secs(10), waiting)
            .await
            .expect("admitted once a shed connection closed")
            .expect("the admitting task");
    }
}
