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

use std::{future::poll_fn, io, net::Shutdown};

use bytes::{Bytes, BytesMut};
use h2::{Reason, RecvStream, SendStream};
use prometheus_client::metrics::counter::Counter;
use tokio::net::TcpStream;

use super::{Meter, Transferred, close_normally, failed, flush, reset_on_close};

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
pub async fn relay(
    tcp: TcpStream,
    send: SendStream<Bytes>,
    recv: RecvStream,
    meter: Meter,
) -> Result<Transferred, TunnelRelayError> {
    reset_on_close(&tcp);
    let (sent, received) = tokio::try_join!(
        tcp_to_stream(&tcp, send, &meter.forward),
        stream_to_tcp(recv, &tcp, &meter.backward)
    )?;
    // END_STREAM and FIN both ways: the only end that may look clean.
    close_normally(&tcp);
    Ok(Transferred { sent, received })
}

/// TCP to the stream. No buffer is held while the connection is idle: one
/// is allocated when the socket turns readable.
async fn tcp_to_stream(
    tcp: &TcpStream,
    mut send: SendStream<Bytes>,
    counter: &Counter,
) -> Result<u64, TunnelRelayError> {
    let mut total = 0u64;
    loop {
        let mut buf = BytesMut::new();
        // While the TCP side is quiet, a reset of the stream (or the end of
        // its connection) must still reach it, not wait for its next byte.
        let readable = tokio::select! {
            readable = poll_fn(|cx| tcp.poll_read_ready(cx)) => readable,
            reset = poll_fn(|cx| send.poll_reset(cx)) => {
                return Err(TunnelRelayError::Stream { source: reset_error(reset) });
            }
        };
        let read = match readable {
            Ok(()) => {
                buf.reserve(CHUNK);
                tcp.try_read_buf(&mut buf)
            }
            Err(err) => Err(err),
        };
        let n = match read {
            Ok(n) => n,
            Err(err) if err.kind() == io::ErrorKind::WouldBlock => continue,
            Err(source) => {
                send.send_reset(Reason::CANCEL);
                return Err(TunnelRelayError::Tcp { source });
            }
        };
        if n == 0 {
            send.send_data(Bytes::new(), true)
                .map_err(|source| TunnelRelayError::Stream { source })?;
            return Ok(total);
        }
        let mut chunk = if n < COPY_BELOW {
            Bytes::copy_from_slice(&buf)
        } else {
            buf.freeze()
        };
        while !chunk.is_empty() {
            send.reserve_capacity(chunk.len());
            let granted = match poll_fn(|cx| send.poll_capacity(cx)).await {
                Some(Ok(granted)) => granted,
                Some(Err(source)) => return Err(TunnelRelayError::Stream { source }),
                None => {
                    // The stream can take no more data: the peer reset it.
                    let reset = poll_fn(|cx| send.poll_reset(cx)).await;
                    return Err(TunnelRelayError::Stream {
                        source: reset_error(reset),
                    });
                }
            };
            let piece = chunk.split_to(granted.min(chunk.len()));
            total += piece.len() as u64;
            counter.inc_by(piece.len() as u64);
            send.send_data(piece, false)
                .map_err(|source| TunnelRelayError::Stream { source })?;
        }
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

async fn stream_to_tcp(
    mut recv: RecvStream,
    tcp: &TcpStream,
    counter: &Counter,
) -> Result<u64, TunnelRelayError> {
    let mut total = 0u64;
    loop {
        // The TCP side may have half-closed and be waiting for the reply:
        // its reset must still reach the stream.
        let next = tokio::select! {
            next = recv.data() => Ok(next),
            err = failed(tcp) => Err(err),
        };
        let data = match next {
            Ok(Some(data)) => data,
            Ok(None) => break,
            Err(source) => {
                recv_reset(&mut recv);
                return Err(TunnelRelayError::Tcp { source });
            }
        };
        let data = match data {
            Ok(data) => data,
            Err(source) => return Err(TunnelRelayError::Stream { source }),
        };
        let len = data.len();
        if let Err(source) = flush(tcp, &data).await {
            recv_reset(&mut recv);
            return Err(TunnelRelayError::Tcp { source });
        }
        total += len as u64;
        counter.inc_by(len as u64);
        // Only now may the peer send more.
        let _ = recv.flow_control().release_capacity(len);
    }
    let _ = socket2::SockRef::from(tcp).shutdown(Shutdown::Write);
    Ok(total)
}

/// The TCP side cannot take data any more: stop the peer sending by
/// refusing further window (the stream is reset when both halves drop).
fn recv_reset(recv: &mut RecvStream) {
    let _ = recv.flow_control().release_capacity(0);
}
