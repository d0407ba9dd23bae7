//! Telemetry of fast-path connections: the kernel writes one record per
//! closed connection into a ring buffer; each becomes the same
//! `istio_tcp_*` samples (reported by source and by destination, as the two
//! proxies would have) and the same access record as a proxied connection,
//! with `connection_security_policy="fast_path"`.
//!
//! The kernel wakes the agent for a batch of records, not for each (see
//! [`DRAIN_PERIOD`]): at thousands of closes a second, a wake-up each cost
//! more of the agent's CPU than the reports themselves.

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

/// How often the ring is drained without a wake-up: the kernel wakes the
/// agent only once [`dataplane_common::maps::FAST_CLOSED_WAKE_BYTES`] of
/// records wait, so at a low rate of closes this bounds how late one is
/// reported.
const DRAIN_PERIOD: Duration = Duration::from_millis(100);

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
        let mut drain = tokio::time::interval(DRAIN_PERIOD);
        drain.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let woken = tokio::select! {
                woken = ring.readable_mut() => match woken {
                    Ok(guard) => Some(guard),
                    Err(err) => {
                        return warn!(error = %err, "fast-path close records unreadable; fast-path connections go unreported from now on");
                    }
                },
                _ = drain.tick() => None,
            };
            let Some(mesh) = mesh.upgrade() else {
                return;
            };
            let report = |ring: &mut RingBuf<MapData>| {
                while let Some(item) = ring.next() {
                    if let Some((record, vip)) = parse(&item) {
                        fast_path.report(&mesh, &record, vip.as_ref());
                    }
                }
            };
            match woken {
                Some(mut guard) => {
                    report(guard.get_inner_mut());
                    guard.clear_ready();
                }
                None => report(ring.get_mut()),
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
