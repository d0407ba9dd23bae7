//! Telemetry of fast-path connections: the kernel writes one record per
//! closed connection into a ring buffer; each becomes the same
//! `istio_tcp_*` samples (reported by source and by destination, as the two
//! proxies would have) and the same access record as a proxied connection,
//! with `connection_security_policy="fast_path"`.
//!
//! The kernel wakes the agent for the first record it writes once the
//! agent has read all before it (the ring's adaptive wake-up) and for a
//! batch; after reading a few, the agent waits [`DRAIN_PERIOD`] before it
//! listens again, so at thousands of closes a second it is woken about ten
//! times a second, not for each (a wake-up each cost more of its CPU than
//! the reports themselves), and while no fast-path connection closes it is
//! not woken at all (a periodic drain cost an idle agent 0.7 ms of CPU a
//! second, a fifth of what it spends idle).

use std::{
    sync::{Arc, Weak},
    time::Duration,
};

use aya::maps::{MapData, RingBuf};
use dataplane_common::{FastClose, FastCloseVip, FastVip};
use tokio::io::{Interest, unix::AsyncFd};
use tracing::warn;

use super::{FastPath, socket_addr};
use crate::{
    mesh::MeshContext,
    telemetry::{Direction, Flow, Protocol},
};

/// How long the agent lets records gather after reading a few: bounds
/// how late one is reported (the first after the pause woke it already).
const DRAIN_PERIOD: Duration = Duration::from_millis(100);

/// How often a quiet ring is checked for the end of the agent's mesh
/// context (which no record may ever announce).
const LIVENESS: Duration = Duration::from_secs(10);

/// Records read at once below which the agent pauses [`DRAIN_PERIOD`]
/// before reading again: the batch the kernel wakes it for
/// ([`dataplane_common::maps::FAST_CLOSED_WAKE_BYTES`] of records), so a
/// burst is read as fast as it comes.
const BATCH: usize =
    dataplane_common::maps::FAST_CLOSED_WAKE_BYTES as usize / size_of::<FastClose>();

/// Reads `ring` until the agent's mesh context is gone.
pub(super) fn spawn(fast_path: Arc<FastPath>, ring: RingBuf<MapData>, mesh: Weak<MeshContext>) {
    tokio::spawn(async move {
        // SAFETY: the ring buffer owns its descriptor, which stays open and
        // names the same map for as long as the AsyncFd owns the ring.
        let mut ring = match unsafe { AsyncFd::register_with_interest(ring, Interest::READABLE) } {
            Ok(ring) => ring,
            Err(err) => {
                return warn!(error = %err, "cannot watch the fast-path close records; fast-path connections go unreported");
            }
        };
        loop {
            let mut guard = match tokio::time::timeout(LIVENESS, ring.readable_mut()).await {
                Err(_) if mesh.strong_count() == 0 => return,
                Err(_) => continue,
                Ok(Ok(guard)) => guard,
                Ok(Err(err)) => {
                    return warn!(error = %err, "fast-path close records unreadable; fast-path connections go unreported from now on");
                }
            };
            let Some(mesh) = mesh.upgrade() else {
                return;
            };
            let mut read = 0usize;
            while let Some(item) = guard.get_inner_mut().next() {
                read += 1;
                if let Some((record, vip)) = parse(&item) {
                    fast_path.report(&mesh, &record, vip.as_ref());
                }
            }
            // A record written since the last read woke the ring's
            // descriptor again (the kernel's wake-up is edge-triggered and
            // waits in epoll's ready list): clearing loses none.
            guard.clear_ready();
            drop(mesh);
            if read < BATCH {
                tokio::time::sleep(DRAIN_PERIOD).await;
            }
        }
    });
}

/// The record in `bytes`, if it has a record's size, with the service VIP
/// dialled when it is a [`FastCloseVip`].
fn parse(bytes: &[u8]) -> Option<(FastClose, Option<FastVip>)> {
    if bytes.len() >= size_of::<FastCloseVip>() {
        // SAFETY: `FastCloseVip` is plain old data of which any bit
        // pattern is valid; the length was checked; the read is
        // unaligned-safe.
        let record = unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast::<FastCloseVip>()) };
        return Some((record.close, Some(record.vip)));
    }
    if bytes.len() < size_of::<FastClose>() {
        return None;
    }
    // SAFETY: as above, for `FastClose`.
    Some((
        unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast::<FastClose>()) },
        None,
    ))
}

impl FastPath {
    /// One closed fast-path connection into metrics and the access log,
    /// attributed to the service of `vip` when it dialled one.
    fn report(&self, mesh: &Arc<MeshContext>, record: &FastClose, vip: Option<&FastVip>) {
        let state = mesh.state();
        let tuple = &record.tuple;
        let src = socket_addr(tuple.src_addr, tuple.src_port);
        let dst = socket_addr(tuple.dst_addr, tuple.dst_port);
        let end = |cookie: u64, ip| match self.pod(cookie) {
            Some(pod) => pod.own_peer(&state),
            None => state.peer_at(ip),
        };
        let source = end(record.src_netns_cookie, src.ip());
        let destination = end(record.dst_netns_cookie, dst.ip());
        let duration = Duration::from_nanos(record.duration_ns);
        let service = vip.and_then(|vip| {
            let vip = socket_addr(vip.addr, vip.port);
            // As the client's plan chose it, when the client is known.
            let entry = match &source.namespace {
                Some(ns) => state.services.by_vip_for(vip.ip(), ns)?,
                None => state.services.by_vip(vip.ip())?,
            };
            Some(Arc::clone(&entry.label))
        });
        for direction in [Direction::Outbound, Direction::Inbound] {
            Flow {
                direction,
                protocol: Protocol::FastPath,
                src,
                dst: Some(dst),
                source: Arc::clone(&source),
                destination: Arc::clone(&destination),
                service: service.clone(),
                trace: None,
            }
            .record_closed(
                &mesh.metrics,
                record.bytes_sent,
                record.bytes_received,
                duration,
            );
        }
    }
}
