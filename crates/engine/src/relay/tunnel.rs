//! The tunnel relay: bytes between a TCP connection and an HBONE tunnel
//! stream (one HTTP/2 CONNECT stream), both ways.
//!
//! TCP semantics cross the tunnel: a FIN becomes END_STREAM and END_STREAM
//! becomes a FIN (`shutdown(SHUT_WR)`), each direction on its own; a TCP
//! reset becomes RST_STREAM(CANCEL) and RST_STREAM becomes a TCP reset.
//! So does any failure of the stream's HTTP/2 connection: the peer agent
//! killed (its TLS ends without close_notify, which h2 reports to every
//! open stream as an error), a GOAWAY that leaves the stream behind, the
//! connection closed under it. The TCP socket is armed to reset from the
//! start and disarmed only once both directions finished cleanly, so a
//! relay dropped half-way, or an agent killed, resets it too.
//!
//! HTTP/2 flow control is respected both ways: data is only sent when the
//! peer has granted window (`reserve_capacity`/`poll_capacity`), and receive
//! window is released only once bytes are written to the TCP side, so a
//! slow reader on either side stalls the sender instead of growing buffers.
//!
//! The relay is a hand-written [`Future`], not an `async fn`: it lives as
//! long as the connection, idle or not, on both agents of every tunnel, so
//! its size is memory per idle connection. Its state is the two ends, the
//! meter, and one small state per direction (about 200 bytes, against
//! about a kilobyte for the `async fn` with its joined and selected
//! futures). Each direction waits through the wakers the ends keep
//! themselves (`poll_read_ready`/`poll_write_ready` for the socket,
//! `poll_data`, `poll_capacity` and `poll_reset` for the stream), which
//! cost nothing while idle. Only the watch for a failure of a TCP side
//! nobody reads any more (see [`Socket`]) needs a future of its own, and it
//! is boxed and made only while needed.

use std::{
    future::Future,
    io,
    net::Shutdown,
    pin::Pin,
    task::{Context, Poll, ready},
};

use bytes::{Buf, Bytes, BytesMut};
use h2::{Reason, RecvStream, SendStream};
use tokio::net::TcpStream;

use super::{Socket, Transferred, both, close_normally, reset_on_close};
use crate::telemetry::Meter;

/// Largest read from the TCP side.
const CHUNK: usize = 64 * 1024;

/// Reads shorter than this are copied into a buffer of their own size, so
/// that a small message does not pin a whole [`CHUNK`] while HTTP/2 holds
/// it; longer ones are sent from the read buffer itself.
const COPY_BELOW: usize = 4 * 1024;

/// How a tunnel relay ended badly.
#[derive(Debug, thiserror::Error)]
pub enum TunnelRelayError {
    /// The TCP side reset or failed; the stream was reset too.
    #[error("the TCP side failed (stream reset)")]
    Tcp {
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The stream was reset or the HTTP/2 connection failed; the TCP side
    /// was reset too.
    #[error("the tunnel stream failed (TCP side reset)")]
    Stream {
        /// The HTTP/2 error.
        #[source]
        source: h2::Error,
    },
}

/// Relays until both directions finished or one side failed.
/// `meter.forward` counts TCP bytes into the tunnel, `meter.backward` the
/// tunnel's bytes written to TCP. On a failure, or if the relay is dropped
/// before it finished, the TCP side is reset (and the stream too: h2 resets
/// a stream whose handles are dropped before it closed).
pub fn relay(tcp: TcpStream, send: SendStream<Bytes>, recv: RecvStream, meter: Meter) -> Relay {
    reset_on_close(&tcp);
    Relay {
        ends: Some(Ends {
            tcp: Socket::new(tcp),
            send,
            recv,
            meter,
            forward: Forward::Reading,
            backward: Backward::Receiving,
            sent: 0,
            received: 0,
        }),
    }
}

/// The future [`relay`] returns. Once it has finished it holds nothing:
/// the ends are closed as the result is returned, and polling it again
/// stays pending, as a fused future does.
pub struct Relay {
    ends: Option<Ends>,
}

impl Relay {
    /// Counts `n` bytes from the TCP side that were sent into the stream
    /// before the relay began (with the tunnel's request).
    pub fn sent_before(mut self, n: u64) -> Self {
        if let Some(ends) = &mut self.ends {
            ends.sent += n;
            ends.meter.forward.inc_by(n);
        }
        self
    }
}

/// Everything a running relay holds.
struct Ends {
    tcp: Socket,
    send: SendStream<Bytes>,
    recv: RecvStream,
    meter: Meter,
    forward: Forward,
    backward: Backward,
    /// TCP bytes sent into the stream.
    sent: u64,
    /// Stream bytes written to TCP.
    received: u64,
}

/// TCP to the stream.
enum Forward {
    /// Waiting for the socket to turn readable; no buffer is held until it
    /// does.
    Reading,
    /// Bytes read, waiting for the stream's window to send the rest.
    Sending(Bytes),
    /// The socket's FIN was passed on as END_STREAM.
    Done,
}

/// The stream to TCP.
enum Backward {
    /// Waiting for the stream's data.
    Receiving,
    /// Writing `data`, what is left of a frame of `len` bytes whose window
    /// is released once all of it is written.
    Writing { data: Bytes, len: usize },
    /// END_STREAM was passed on as a FIN.
    Done,
}

impl Future for Relay {
    type Output = Result<Transferred, TunnelRelayError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let Some(mut ends) = this.ends.take() else {
            return Poll::Pending;
        };
        let result = ends.poll_directions(cx);
        if result.is_pending() {
            // The watch is needed while the stream's data is awaited and
            // nothing reads the socket (see [`Socket`]), and only then.
            let unread = !matches!(ends.forward, Forward::Reading);
            let awaiting = matches!(ends.backward, Backward::Receiving);
            ends.tcp = if unread && awaiting {
                ends.tcp.watched()
            } else {
                ends.tcp.alone()
            };
            if let Poll::Ready(source) = ends.tcp.poll_failed(cx) {
                ends.tcp_failed();
                return Poll::Ready(Err(TunnelRelayError::Tcp { source }));
            }
            this.ends = Some(ends);
            return Poll::Pending;
        }
        // `ends` is dropped as the result goes: on a failure the socket is
        // reset and the stream too (its handles dropped before it closed).
        result.map_ok(|()| {
            // END_STREAM and FIN both ways: the only end that may look
            // clean.
            close_normally(&ends.tcp);
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
    fn poll_directions(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), TunnelRelayError>> {
        let forward = self.poll_forward(cx)?;
        let backward = self.poll_backward(cx)?;
        both(forward, backward).map(Ok)
    }

    /// TCP to the stream; ready once the FIN was passed on.
    fn poll_forward(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), TunnelRelayError>> {
        loop {
            match &mut self.forward {
                Forward::Done => return Poll::Ready(Ok(())),
                Forward::Reading => {
                    let Some(chunk) = ready!(self.poll_read(cx))? else {
                        self.send
                            .send_data(Bytes::new(), true)
                            .map_err(|source| TunnelRelayError::Stream { source })?;
                        self.forward = Forward::Done;
                        continue;
                    };
                    self.send.reserve_capacity(chunk.len());
                    self.forward = Forward::Sending(chunk);
                }
                Forward::Sending(chunk) => {
                    let granted = match ready!(self.send.poll_capacity(cx)) {
                        Some(Ok(granted)) => granted,
                        Some(Err(source)) => {
                            return Poll::Ready(Err(TunnelRelayError::Stream { source }));
                        }
                        None => {
                            // The stream can take no more data: the peer
                            // reset it.
                            let reset = ready!(self.send.poll_reset(cx));
                            return Poll::Ready(Err(TunnelRelayError::Stream {
                                source: reset_error(reset),
                            }));
                        }
                    };
                    let piece = chunk.split_to(granted.min(chunk.len()));
                    let rest = chunk.len();
                    let len = piece.len() as u64;
                    self.sent += len;
                    self.meter.forward.inc_by(len);
                    self.send
                        .send_data(piece, false)
                        .map_err(|source| TunnelRelayError::Stream { source })?;
                    if rest == 0 {
                        self.forward = Forward::Reading;
                    } else {
                        self.send.reserve_capacity(rest);
                    }
                }
            }
        }
    }

    /// One read from the TCP side: its bytes, or `None` at its FIN. While
    /// the socket is quiet, a reset of the stream (or the end of its
    /// connection) must still reach it, not wait for its next byte.
    fn poll_read(&mut self, cx: &mut Context<'_>) -> Poll<Result<Option<Bytes>, TunnelRelayError>> {
        loop {
            let readable = match self.tcp.poll_read_ready(cx) {
                Poll::Ready(readable) => readable,
                Poll::Pending => {
                    let reset = ready!(self.send.poll_reset(cx));
                    return Poll::Ready(Err(TunnelRelayError::Stream {
                        source: reset_error(reset),
                    }));
                }
            };
            // Allocated only now: an idle connection holds no buffer.
            let mut buf = BytesMut::new();
            let read = readable.and_then(|()| {
                buf.reserve(CHUNK);
                self.tcp.try_read_buf(&mut buf)
            });
            return Poll::Ready(match read {
                Ok(0) => Ok(None),
                Ok(n) if n < COPY_BELOW => Ok(Some(Bytes::copy_from_slice(&buf))),
                Ok(_) => Ok(Some(buf.freeze())),
                Err(err) if err.kind() == io::ErrorKind::WouldBlock => continue,
                Err(source) => {
                    self.send.send_reset(Reason::CANCEL);
                    Err(TunnelRelayError::Tcp { source })
                }
            });
        }
    }

    /// The stream to TCP; ready once END_STREAM was passed on as a FIN.
    fn poll_backward(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), TunnelRelayError>> {
        loop {
            match &mut self.backward {
                Backward::Done => return Poll::Ready(Ok(())),
                Backward::Receiving => match ready!(self.recv.poll_data(cx)) {
                    Some(Ok(data)) => {
                        let len = data.len();
                        self.backward = Backward::Writing { data, len };
                    }
                    Some(Err(source)) => {
                        return Poll::Ready(Err(TunnelRelayError::Stream { source }));
                    }
                    None => {
                        let _ = socket2::SockRef::from(&*self.tcp).shutdown(Shutdown::Write);
                        self.backward = Backward::Done;
                    }
                },
                Backward::Writing { data, len } => {
                    while !data.is_empty() {
                        let written = match self.tcp.poll_write_ready(cx) {
                            Poll::Ready(Ok(())) => self.tcp.try_write(data),
                            Poll::Ready(Err(err)) => Err(err),
                            // Nothing written yet: the socket may be the
                            // app's, connected within this turn, whose
                            // writability the runtime learns only at its
                            // next look at readiness, after every other
                            // ready task (the early data would wait for
                            // it). Written at once instead; the waker
                            // stays registered for a full buffer.
                            Poll::Pending if self.received == 0 => {
                                match socket2::SockRef::from(&*self.tcp)
                                    .send_with_flags(data, libc::MSG_NOSIGNAL)
                                {
                                    Err(err) if err.kind() == io::ErrorKind::WouldBlock => {
                                        return Poll::Pending;
                                    }
                                    written => written,
                                }
                            }
                            Poll::Pending => return Poll::Pending,
                        };
                        match written {
                            Ok(n) => data.advance(n),
                            Err(err) if err.kind() == io::ErrorKind::WouldBlock => {}
                            Err(source) => {
                                recv_reset(&mut self.recv);
                                return Poll::Ready(Err(TunnelRelayError::Tcp { source }));
                            }
                        }
                    }
                    let len = *len;
                    self.received += len as u64;
                    self.meter.backward.inc_by(len as u64);
                    // Only now may the peer send more.
                    let _ = self.recv.flow_control().release_capacity(len);
                    self.backward = Backward::Receiving;
                }
            }
        }
    }

    /// The watched TCP side failed: the stream is reset.
    fn tcp_failed(&mut self) {
        recv_reset(&mut self.recv);
        self.send.send_reset(Reason::CANCEL);
    }
}

/// What `SendStream::poll_reset` reported, as an error: the peer's
/// RST_STREAM reason, or the connection's failure.
fn reset_error(reset: Result<Reason, h2::Error>) -> h2::Error {
    match reset {
        Ok(reason) => h2::Error::from(reason),
        Err(err) => err,
    }
}

/// The TCP side cannot take data any more: stop the peer sending by
/// refusing further window (the stream is reset when both halves drop).
fn recv_reset(recv: &mut RecvStream) {
    let _ = recv.flow_control().release_capacity(0);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The relay's state is what every tunnelled connection holds on each
    /// agent for its whole life, idle or not.
    #[test]
    fn the_relay_state_stays_small() {
        let size = std::mem::size_of::<Relay>();
        println!("tunnel relay future: {size} bytes");
        assert!(size <= 256, "the tunnel relay grew to {size} bytes");
    }
}
