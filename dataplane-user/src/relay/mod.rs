//! Moving a connection's bytes once its ends are known, for every path:
//! [`plain`] between two TCP connections (plaintext inbound, passthrough
//! and plain-TCP workloads), [`tunnel`] between a TCP connection and an
//! HBONE stream (both directions of the tunnel).
//!
//! Both carry TCP's semantics across (half-close stays half-close, a reset
//! becomes a reset, and any other end short of both FINs, a crash of the
//! agent included, becomes a reset: see [`reset_on_close`]), count bytes
//! into a [`Meter`] as they pass so metrics show a long-lived connection's
//! traffic before it closes, and hold no buffer while a connection is
//! idle. What they share lives here, owned by
//! neither direction of the proxy nor by the HBONE protocol code.

pub mod plain;
pub mod tunnel;

use std::{future::poll_fn, io, time::Duration};

use prometheus_client::metrics::counter::Counter;
use tokio::{io::Interest, net::TcpStream};

pub use plain::relay as relay_plain;
pub use tunnel::relay as relay_tunnel;
// Only the HBONE tests match on the tunnel relay's error; callers report
// it through its `Display`.
#[cfg(test)]
pub use tunnel::TunnelRelayError;

/// Where a relay counts bytes as they pass. `Meter::default()` counts into
/// counters nobody reads.
#[derive(Debug, Clone, Default)]
pub struct Meter {
    /// Bytes from the first end to the second (downstream to upstream; for
    /// a tunnel relay, TCP into the tunnel).
    pub forward: Counter,
    /// Bytes the other way.
    pub backward: Counter,
}

/// Bytes carried each way when a relay ends.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Transferred {
    /// From the first end (the accepted, downstream side) to the second.
    pub sent: u64,
    /// From the second end back to the first.
    pub received: u64,
}

/// Writes all of `bytes`, waiting for the writer to take them.
///
/// The relays wait for readiness through the socket's own waker slots
/// (`poll_read_ready`, `poll_write_ready`: each socket has one reader and
/// one writer in a relay), not `readable()`/`writable()`, whose futures
/// carry a waiter node of 152 bytes: that state stays in every open
/// connection's task.
async fn flush(writer: &TcpStream, mut bytes: &[u8]) -> io::Result<()> {
    while !bytes.is_empty() {
        poll_fn(|cx| writer.poll_write_ready(cx)).await?;
        match writer.try_write(bytes) {
            Ok(n) => bytes = &bytes[n..],
            Err(err) if err.kind() == io::ErrorKind::WouldBlock => {}
            Err(err) => return Err(err),
        }
    }
    Ok(())
}

/// Resolves once `stream` has failed (its peer reset it), with the error.
///
/// A relay waits on one side at a time per direction; once a side has
/// half-closed, nothing reads it any more, and a reset arriving on it
/// would only be learnt at the next write to it, which may never come
/// (the other side is waiting for the reply). Watching for the error
/// passes the reset on at once.
async fn failed(stream: &TcpStream) -> io::Error {
    if let Err(err) = stream.ready(Interest::ERROR).await {
        return err;
    }
    match stream.take_error() {
        Ok(Some(err)) | Err(err) => err,
        // Reported and consumed by a read or write in the meantime.
        Ok(None) => io::ErrorKind::ConnectionReset.into(),
    }
}

/// Makes the eventual close of `stream` send RST instead of FIN: how a
/// failure on one end is passed to a TCP peer.
///
/// Relays arm every TCP socket they carry with this from the start (and
/// the listeners as soon as a client socket is accepted), not only once
/// something failed: a socket closed before its relay finished cleanly is
/// then always reset, whoever closes it. The relay task being dropped (the
/// drain deadline, a policy change, the pod leaving) closes it; so does
/// the kernel when the agent is killed or runs out of memory, and nothing
/// of ours runs then. A FIN in those cases would tell the application its
/// peer finished, after part of the bytes.
pub fn reset_on_close(stream: &TcpStream) {
    let socket = socket2::SockRef::from(stream);
    let _ = socket.set_linger(Some(Duration::ZERO));
}

/// Undoes [`reset_on_close`] once both directions have finished cleanly
/// (each side's FIN passed on): the socket then closes normally and the
/// bytes still in its send buffer are delivered, not dropped by a reset.
pub fn close_normally(stream: &TcpStream) {
    let socket = socket2::SockRef::from(stream);
    let _ = socket.set_linger(None);
}
