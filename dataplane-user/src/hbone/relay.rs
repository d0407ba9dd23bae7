//! Copying between a plain TCP connection and an HBONE tunnel stream (one
//! HTTP/2 CONNECT stream), both ways.
//!
//! TCP semantics cross the tunnel: a FIN becomes END_STREAM and END_STREAM
//! becomes a FIN (`shutdown(SHUT_WR)`), each direction on its own; a TCP
//! reset becomes RST_STREAM(CANCEL) and RST_STREAM becomes a TCP reset.
//!
//! HTTP/2 flow control is respected both ways: data is only sent when the
//! peer has granted window (`reserve_capacity`/`poll_capacity`), and receive
//! window is released only once bytes are written to the TCP side, so a
//! slow reader on either side stalls the sender instead of growing buffers.

use std::{future::poll_fn, io};

use bytes::{Bytes, BytesMut};
use h2::{Reason, RecvStream, SendStream};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{
        TcpStream,
        tcp::{ReadHalf, WriteHalf},
    },
};

use crate::engine::{Transferred, reset_on_close};

/// Read buffer per direction; reused for every chunk.
const CHUNK: usize = 64 * 1024;

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
pub async fn relay(
    mut tcp: TcpStream,
    send: SendStream<Bytes>,
    recv: RecvStream,
) -> Result<Transferred, TunnelRelayError> {
    let result = {
        // Borrowed halves: dropping them sends no FIN, so a failure can
        // still end in a reset below.
        let (tcp_read, tcp_write) = tcp.split();
        tokio::try_join!(
            tcp_to_stream(tcp_read, send),
            stream_to_tcp(recv, tcp_write)
        )
    };
    match result {
        Ok((sent, received)) => Ok(Transferred { sent, received }),
        Err(err) => {
            // The stream side failed: reset the TCP side. (A TCP failure
            // has already reset the stream.)
            if matches!(err, TunnelRelayError::Stream { .. }) {
                reset_on_close(&tcp);
            }
            Err(err)
        }
    }
}

async fn tcp_to_stream(
    mut tcp: ReadHalf<'_>,
    mut send: SendStream<Bytes>,
) -> Result<u64, TunnelRelayError> {
    let mut buf = BytesMut::with_capacity(CHUNK);
    let mut total = 0u64;
    loop {
        // Reuses the allocation once h2 has written the previous chunk out.
        buf.reserve(CHUNK);
        let n = match tcp.read_buf(&mut buf).await {
            Ok(n) => n,
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
        let mut chunk = buf.split().freeze();
        while !chunk.is_empty() {
            send.reserve_capacity(chunk.len());
            let granted = match poll_fn(|cx| send.poll_capacity(cx)).await {
                Some(Ok(granted)) => granted,
                Some(Err(source)) => return Err(TunnelRelayError::Stream { source }),
                None => {
                    // The stream can take no more data: the peer reset it.
                    let reason = poll_fn(|cx| send.poll_reset(cx)).await;
                    let source = match reason {
                        Ok(reason) => h2::Error::from(reason),
                        Err(err) => err,
                    };
                    return Err(TunnelRelayError::Stream { source });
                }
            };
            let piece = chunk.split_to(granted.min(chunk.len()));
            total += piece.len() as u64;
            send.send_data(piece, false)
                .map_err(|source| TunnelRelayError::Stream { source })?;
        }
    }
}

async fn stream_to_tcp(
    mut recv: RecvStream,
    mut tcp: WriteHalf<'_>,
) -> Result<u64, TunnelRelayError> {
    let mut total = 0u64;
    while let Some(data) = recv.data().await {
        let data = match data {
            Ok(data) => data,
            Err(source) => return Err(TunnelRelayError::Stream { source }),
        };
        let len = data.len();
        if let Err(source) = tcp.write_all(&data).await {
            recv_reset(&mut recv);
            return Err(TunnelRelayError::Tcp { source });
        }
        total += len as u64;
        // Only now may the peer send more.
        let _ = recv.flow_control().release_capacity(len);
    }
    let _ = tcp.shutdown().await;
    Ok(total)
}

/// The TCP side cannot take data any more: stop the peer sending by
/// refusing further window (the stream is reset when both halves drop).
fn recv_reset(recv: &mut RecvStream) {
    let _ = recv.flow_control().release_capacity(0);
}
