//! Where a captured connection was going, from the one source the pod's
//! capture uses, chosen when the pod's proxy starts:
//!
//! - [`OrigDst::Kernel`] (the product): outbound connections were
//!   recorded by the `connect4`/`connect6` programs in a pinned map, read
//!   (and removed) once per connection; inbound, `sk_lookup` keeps the
//!   original destination as the accepted socket's local address.
//! - [`OrigDst::Netfilter`] (`--capture iptables`, the benchmarks'
//!   baseline only): Istio-style `REDIRECT` rules sent the connection to the
//!   listener and conntrack remembers the destination
//!   (`getsockopt(SO_ORIGINAL_DST)`, in the private `netfilter` module).
//!
//! A pod never mixes them: a connection the kernel programs did not record
//! is refused, not looked up in conntrack.

use std::{net::SocketAddr, os::fd::AsRawFd, sync::Mutex};

use dataplane_common::INBOUND_PLAINTEXT_PORT;

use super::netfilter;
use crate::{addr::canonical, logging::Chain, redirect::OrigDstTable};

/// The original-destination source of one pod.
#[derive(Debug)]
pub enum OrigDst {
    /// The kernel programs' record (locked: looked up in accept order).
    Kernel(Mutex<OrigDstTable>),
    /// Conntrack, behind iptables `REDIRECT` rules.
    Netfilter,
}

impl OrigDst {
    /// The kernel record when the pod is captured by our programs,
    /// netfilter when there are none (iptables capture).
    pub fn new(table: Option<OrigDstTable>) -> Self {
        match table {
            Some(table) => Self::Kernel(Mutex::new(table)),
            None => Self::Netfilter,
        }
    }

    /// Where the outbound connection accepted with `peer` and `local`
    /// addresses was going; `Ok(None)` when nothing recorded it. The
    /// kernel record is consumed: call once per connection, before the
    /// next accept.
    pub fn outbound(
        &self,
        stream: &impl AsRawFd,
        peer: SocketAddr,
        local: SocketAddr,
    ) -> Result<Option<SocketAddr>, String> {
        match self {
            Self::Kernel(table) => {
                let mut table = table.lock().map_err(|_| {
                    "the original-destination table lock is poisoned (a thread panicked holding it); restart the agent".to_owned()
                })?;
                table
                    .take(peer, local)
                    .map(|dst| dst.map(canonical))
                    .map_err(|e| Chain(&e).to_string())
            }
            Self::Netfilter => Ok(netfilter::original_dst(stream, local).ok().map(canonical)),
        }
    }

    /// Where the inbound connection with local address `local` was going.
    pub fn inbound(&self, stream: &impl AsRawFd, local: SocketAddr) -> SocketAddr {
        match self {
            Self::Kernel(_) => local,
            // Redirected to the plaintext listener: conntrack has the port
            // the client asked for.
            Self::Netfilter if local.port() == INBOUND_PLAINTEXT_PORT => {
                netfilter::original_dst(stream, local).unwrap_or(local)
            }
            Self::Netfilter => local,
        }
    }
}
