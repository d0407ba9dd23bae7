//! Moving a connection's bytes once its ends are known, for every path:
//! [`plain`] between two TCP connections (plaintext inbound, passthrough
//! and plain-TCP workloads), [`tunnel`] between a TCP connection and an
//! HBONE stream (both directions of the tunnel).
//!
//! Both carry TCP's semantics across (half-close stays half-close, a reset
//! becomes a reset, and any other end short of both FINs, a crash of the
//! agent included, becomes a reset: see [`reset_on_close`]), count bytes
//! into a [`Meter`](crate::telemetry::Meter) as they pass so metrics show a long-lived connection's
//! traffic before it closes, and hold no buffer while a connection is
//! idle. What they share lives here, owned by
//! neither direction of the proxy nor by the HBONE protocol code.
//!
//! Both are hand-written futures, not `async fn`s: a relay lives as long
//! as its connection, so its state is memory per idle connection. They
//! wait for readiness through the wakers the ends keep themselves
//! (`poll_read_ready`, `poll_write_ready`: each socket has one reader and
//! one writer in a relay; h2's `poll_*` for a stream), which cost nothing
//! while idle, not through `readable()`/`writable()`, whose futures carry
//! a waiter node of 152 bytes, nor through joined and selected futures.

pub mod plain;
pub mod tunnel;

use std::{
    future::Future,
    io,
    ops::Deref,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::Duration,
};

use tokio::{io::Interest, net::TcpStream};

pub use plain::relay as relay_plain;
pub use tunnel::relay as relay_tunnel;
// Only the HBONE tests match on the tunnel relay's error; callers report
// it through its `Display`.
#[cfg(test)]
pub use tunnel::TunnelRelayError;

/// Bytes carried each way when a relay ends.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Transferred {
    /// From the first end (the accepted, downstream side) to the second.
    pub sent: u64,
    /// From the second end back to the first.
    pub received: u64,
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

/// Ready once both directions of a relay are (each is ready when it has
/// finished).
fn both(forward: Poll<()>, backward: Poll<()>) -> Poll<()> {
    if forward.is_ready() && backward.is_ready() {
        Poll::Ready(())
    } else {
        Poll::Pending
    }
}

/// A relay's TCP socket, and the watch for its failure when needed.
///
/// Once a socket's read side has ended (or while its bytes wait to be
/// passed on) nothing reads it, and a reset arriving on it would
/// only be learnt at the next write to it, which may never come (the
/// client is waiting for the reply). Read readiness cannot tell: it stays
/// ready for good after the FIN. Tokio offers the error readiness only as
/// a future (`ready(Interest::ERROR)`, see [`failed`]), which borrows the
/// socket; so while the watch is needed the socket is shared with the
/// watch's box, and both go once the relay reads or writes the socket
/// again. An idle connection, both ways open, holds neither.
pub(super) enum Socket {
    /// The relay's alone.
    Alone(TcpStream),
    /// Shared with the watch for its failure (if its box is not dropped
    /// yet).
    Watched(Arc<TcpStream>, Option<FailedWatch>),
}

type FailedWatch = Pin<Box<dyn Future<Output = io::Error> + Send>>;

impl Deref for Socket {
    type Target = TcpStream;

    fn deref(&self) -> &TcpStream {
        match self {
            Socket::Alone(stream) => stream,
            Socket::Watched(stream, _) => stream,
        }
    }
}

impl Socket {
    /// A socket nothing watches yet.
    pub(super) fn new(stream: TcpStream) -> Socket {
        Socket::Alone(stream)
    }

    /// The socket with its failure watched.
    pub(super) fn watched(self) -> Socket {
        let stream = match self {
            watched @ Socket::Watched(_, Some(_)) => return watched,
            Socket::Watched(stream, None) => stream,
            Socket::Alone(stream) => Arc::new(stream),
        };
        let watched = Arc::clone(&stream);
        let watch: FailedWatch = Box::pin(async move { failed(&watched).await });
        Socket::Watched(stream, Some(watch))
    }

    /// The socket without its watch, back alone.
    pub(super) fn alone(self) -> Socket {
        match self {
            Socket::Watched(stream, watch) => {
                // The watch's share of the socket goes with it.
                drop(watch);
                match Arc::try_unwrap(stream) {
                    Ok(stream) => Socket::Alone(stream),
                    Err(stream) => Socket::Watched(stream, None),
                }
            }
            alone => alone,
        }
    }

    /// Polls the watch, if there is one.
    pub(super) fn poll_failed(&mut self, cx: &mut Context<'_>) -> Poll<io::Error> {
        match self {
            Socket::Watched(_, Some(watch)) => watch.as_mut().poll(cx),
            _ => Poll::Pending,
        }
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
