//! The plain relay: bytes between two TCP connections, both ways, with TCP's
//! semantics carried across: a FIN (half-close) on one side becomes a
//! `shutdown(SHUT_WR)` on the other while the opposite direction keeps
//! flowing, and a reset on one side becomes a reset (close with
//! `SO_LINGER` 0) on the other. Both sockets are armed to reset from the
//! start and disarmed only once both directions finished cleanly, so a
//! relay that ends any other way (an error, its task dropped, the agent
//! killed) resets both.
//!
//! No connection owns a buffer while it is idle: each read goes into one
//! scratch buffer per thread, taken only between readiness and the
//! synchronous read, and is written on at once; only bytes the other side
//! cannot take yet are copied into a buffer of the connection's own, freed
//! once they are out. Ten thousand idle connections therefore hold no
//! relay buffer (they held 128 KiB each, zeroed, before), and the relay's
//! own state is a hand-written future of about 200 bytes (see
//! [`Relay`]).

use std::{
    cell::RefCell,
    future::Future,
    io,
    net::Shutdown,
    pin::Pin,
    task::{Context, Poll, ready},
};

use prometheus_client::metrics::counter::Counter;
use tokio::net::TcpStream;

use super::{Socket, Transferred, both, close_normally, reset_on_close};
use crate::telemetry::Meter;

/// Largest read: the per-thread scratch buffer's size.
const BUFFER_SIZE: usize = 64 * 1024;

thread_local! {
    /// Borrowed only between a read and the synchronous write attempt that
    /// follows it, never across a return to the runtime.
    static SCRATCH: RefCell<Box<[u8]>> = RefCell::new(vec![0u8; BUFFER_SIZE].into_boxed_slice());
}

/// How a plain relay ended badly.
#[derive(Debug, thiserror::Error)]
pub enum PlainRelayError {
    /// One side reset the connection; the other side was reset too.
    #[error("{side} side reset the connection (propagated)")]
    Reset {
        /// `downstream` or `upstream`.
        side: &'static str,
        /// Bytes carried before the reset.
        transferred: Transferred,
    },
    /// Another I/O error; both connections were reset.
    #[error("{side} side failed")]
    Io {
        /// `downstream` or `upstream`.
        side: &'static str,
        /// The error.
        #[source]
        source: io::Error,
    },
}

/// Relays until both directions have finished (each side half-closed) or
/// one side fails; on a failure, or if the relay is dropped before it
/// finished, both connections are closed with RST.
pub fn relay(downstream: TcpStream, upstream: TcpStream, meter: Meter) -> Relay {
    reset_on_close(&downstream);
    reset_on_close(&upstream);
    Relay {
        ends: Some(Ends {
            downstream: Socket::new(downstream),
            upstream: Socket::new(upstream),
            meter,
            forward: Pipe::Reading,
            backward: Pipe::Reading,
            sent: 0,
            received: 0,
        }),
    }
}

/// The future [`relay`] returns: a hand-written one, as the tunnel
/// relay's (see there), since it lives as long as the connection. Once it
/// has finished it holds nothing (the sockets are closed as the result is
/// returned) and polling it again stays pending, as a fused future does.
pub struct Relay {
    ends: Option<Ends>,
}

/// Everything a running relay holds.
struct Ends {
    downstream: Socket,
    upstream: Socket,
    meter: Meter,
    /// Downstream to upstream.
    forward: Pipe,
    /// Upstream to downstream.
    backward: Pipe,
    /// Bytes from downstream to upstream.
    sent: u64,
    /// Bytes from upstream to downstream.
    received: u64,
}

/// One direction.
enum Pipe {
    /// Waiting for the reader to turn readable.
    Reading,
    /// `read` bytes were read; the writer has not taken `pending` past
    /// `written` yet.
    Flushing {
        pending: Vec<u8>,
        written: usize,
        read: usize,
    },
    /// The reader's FIN was passed on.
    Done,
}

/// A direction's two ends and what it counts.
struct Way<'a> {
    reader: &'a TcpStream,
    writer: &'a TcpStream,
    /// The reader's side, then the writer's.
    sides: (&'static str, &'static str),
    total: &'a mut u64,
    counter: &'a Counter,
}

impl Future for Relay {
    type Output = Result<Transferred, PlainRelayError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let Some(mut ends) = this.ends.take() else {
            return Poll::Pending;
        };
        let result = ends.poll_directions(cx);
        if result.is_pending() {
            // Once one side's read has ended nothing reads it: its reset
            // must still end the relay, not wait for the next write to it
            // (see `Socket`). Only needed while the other direction waits
            // to read, not while it writes there.
            let forward_reads = matches!(ends.forward, Pipe::Reading);
            let backward_reads = matches!(ends.backward, Pipe::Reading);
            ends.upstream = if forward_reads && !backward_reads {
                ends.upstream.watched()
            } else {
                ends.upstream.alone()
            };
            ends.downstream = if backward_reads && !forward_reads {
                ends.downstream.watched()
            } else {
                ends.downstream.alone()
            };
            if let Poll::Ready(err) = ends.upstream.poll_failed(cx) {
                return Poll::Ready(Err(classify(err, "upstream", ends.sent)));
            }
            if let Poll::Ready(err) = ends.downstream.poll_failed(cx) {
                return Poll::Ready(Err(classify(err, "downstream", ends.received)));
            }
            this.ends = Some(ends);
            return Poll::Pending;
        }
        result.map_ok(|()| {
            // Both FINs passed on: the only end that may look clean.
            close_normally(&ends.downstream);
            close_normally(&ends.upstream);
            Transferred {
                sent: ends.sent,
                received: ends.received,
            }
        })
    }
}

impl Ends {
    /// Drives both directions; ready once both finished, or at the first
    /// failure.
    fn poll_directions(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), PlainRelayError>> {
        let forward = Way {
            reader: &self.downstream,
            writer: &self.upstream,
            sides: ("downstream", "upstream"),
            total: &mut self.sent,
            counter: &self.meter.forward,
        }
        .poll(&mut self.forward, cx)?;
        let backward = Way {
            reader: &self.upstream,
            writer: &self.downstream,
            sides: ("upstream", "downstream"),
            total: &mut self.received,
            counter: &self.meter.backward,
        }
        .poll(&mut self.backward, cx)?;
        both(forward, backward).map(Ok)
    }
}

/// What one read did.
enum Read {
    /// The peer half-closed.
    Eof,
    /// `n` bytes were read and all written on.
    Passed(usize),
    /// `n` bytes were read; the writer could not take those in the
    /// buffer yet.
    Blocked(usize, Vec<u8>),
    /// Readiness was stale.
    WouldBlock,
}

impl Way<'_> {
    /// The reader's bytes to the writer; ready once the reader's FIN was
    /// passed on (the writer half-closed) while the other direction keeps
    /// flowing.
    fn poll(mut self, pipe: &mut Pipe, cx: &mut Context<'_>) -> Poll<Result<(), PlainRelayError>> {
        let (side, other) = self.sides;
        loop {
            match pipe {
                Pipe::Done => return Poll::Ready(Ok(())),
                Pipe::Reading => {
                    if let Err(err) = ready!(self.reader.poll_read_ready(cx)) {
                        return Poll::Ready(Err(classify(err, side, *self.total)));
                    }
                    match self.read()? {
                        Read::Eof => {
                            // A failure here means the other side is gone
                            // already, which its own direction reports.
                            let _ = socket2::SockRef::from(self.writer).shutdown(Shutdown::Write);
                            *pipe = Pipe::Done;
                        }
                        Read::WouldBlock => {}
                        Read::Passed(n) => self.count(n),
                        Read::Blocked(read, pending) => {
                            *pipe = Pipe::Flushing {
                                pending,
                                written: 0,
                                read,
                            };
                        }
                    }
                }
                Pipe::Flushing {
                    pending,
                    written,
                    read,
                } => {
                    while *written < pending.len() {
                        let result = match ready!(self.writer.poll_write_ready(cx)) {
                            Ok(()) => self.writer.try_write(&pending[*written..]),
                            Err(err) => Err(err),
                        };
                        match result {
                            Ok(n) => *written += n,
                            Err(err) if err.kind() == io::ErrorKind::WouldBlock => {}
                            Err(err) => {
                                return Poll::Ready(Err(classify(err, other, *self.total)));
                            }
                        }
                    }
                    let read = *read;
                    self.count(read);
                    // Freed, not kept: an idle connection holds nothing.
                    *pipe = Pipe::Reading;
                }
            }
        }
    }

    /// Reads into the thread's scratch buffer and writes on at once what
    /// the writer takes; only the rest is copied into a buffer of the
    /// connection's own.
    fn read(&self) -> Result<Read, PlainRelayError> {
        let (side, other) = self.sides;
        SCRATCH.with(|scratch| {
            let mut scratch = scratch.borrow_mut();
            let n = match self.reader.try_read(&mut scratch) {
                Ok(0) => return Ok(Read::Eof),
                Ok(n) => n,
                Err(err) if err.kind() == io::ErrorKind::WouldBlock => return Ok(Read::WouldBlock),
                Err(err) => return Err(classify(err, side, *self.total)),
            };
            let written = match self.writer.try_write(&scratch[..n]) {
                Ok(written) => written,
                Err(err) if err.kind() == io::ErrorKind::WouldBlock => 0,
                Err(err) => return Err(classify(err, other, *self.total)),
            };
            if written == n {
                Ok(Read::Passed(n))
            } else {
                Ok(Read::Blocked(n, scratch[written..n].to_vec()))
            }
        })
    }

    fn count(&mut self, n: usize) {
        *self.total += n as u64;
        self.counter.inc_by(n as u64);
    }
}

fn classify(err: io::Error, side: &'static str, bytes: u64) -> PlainRelayError {
    match err.kind() {
        io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe => PlainRelayError::Reset {
            side,
            transferred: Transferred {
                sent: bytes,
                received: 0,
            },
        },
        _ => PlainRelayError::Io { side, source: err },
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::{
        io::{AsyncReadExt, AsyncWriteExt, Interest},
        net::{TcpListener, TcpStream},
    };

    use super::*;

    /// A connected pair of loopback sockets: (the outer end, the relay's).
    async fn tcp_pair() -> io::Result<(TcpStream, TcpStream)> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let outer = TcpStream::connect(listener.local_addr()?).await?;
        let (inner, _) = listener.accept().await?;
        Ok((outer, inner))
    }

    /// The relay's state is what every plain connection holds for its
    /// whole life, idle or not.
    #[test]
    fn the_relay_state_stays_small() {
        let size = std::mem::size_of::<Relay>();
        println!("plain relay future: {size} bytes");
        assert!(size <= 256, "the plain relay grew to {size} bytes");
    }

    #[tokio::test]
    async fn a_client_reset_after_its_half_close_reaches_the_waiting_app() -> anyhow::Result<()> {
        let (mut client, downstream) = tcp_pair().await?;
        let (mut app, upstream) = tcp_pair().await?;
        let relay_task = tokio::spawn(relay(downstream, upstream, Meter::default()));
        client.write_all(b"request").await?;
        client.shutdown().await?;
        let mut request = Vec::new();
        app.read_to_end(&mut request).await?;
        assert_eq!(request, b"request");
        // The client gives up waiting for the reply: it resets.
        socket2::SockRef::from(&client).set_linger(Some(Duration::ZERO))?;
        drop(client);
        let Ok(ended) = tokio::time::timeout(Duration::from_secs(10), relay_task).await else {
            anyhow::bail!("the relay did not notice its half-closed client's reset");
        };
        assert!(
            matches!(
                ended?,
                Err(PlainRelayError::Reset {
                    side: "downstream",
                    ..
                })
            ),
            "the relay did not end with the client's reset"
        );
        // The app, still holding its side, is reset too.
        let reset = tokio::time::timeout(Duration::from_secs(10), app.ready(Interest::ERROR)).await;
        assert!(reset.is_ok(), "the app was not reset");
        assert!(app.take_error()?.is_some(), "the app was not reset");
        Ok(())
    }
}
