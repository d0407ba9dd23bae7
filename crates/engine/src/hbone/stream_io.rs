//! One HBONE stream as a byte stream (`AsyncRead` + `AsyncWrite`), so that
//! a second tunnel's TLS and HTTP/2 can run inside it: the inner tunnel
//! of double HBONE, carried through a network gateway's outer one (ztunnel
//! `src/proxy/h2.rs` `H2Stream`, which `proxy_to_double_hbone` wraps the
//! same way).

use std::{
    io,
    pin::Pin,
    task::{Context, Poll, ready},
};

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::StreamSlot;

/// An open tunnel's two halves read and written as one byte stream; its
/// pool slot is held as long as it lives.
pub struct StreamIo {
    send: h2::SendStream<Bytes>,
    recv: h2::RecvStream,
    /// Received and not yet read.
    pending: Bytes,
    /// Whether the write side was ended.
    ended: bool,
    _slot: StreamSlot,
}

impl StreamIo {
    /// The tunnel of `send` and `recv`, keeping its pool `slot`.
    pub fn new(send: h2::SendStream<Bytes>, recv: h2::RecvStream, slot: StreamSlot) -> Self {
        Self {
            send,
            recv,
            pending: Bytes::new(),
            ended: false,
            _slot: slot,
        }
    }
}

/// A stream error as an I/O error; a reset that says "done" is a broken
/// pipe.
fn io_error(err: h2::Error) -> io::Error {
    match err.reason() {
        Some(h2::Reason::NO_ERROR | h2::Reason::CANCEL | h2::Reason::STREAM_CLOSED) => {
            io::ErrorKind::BrokenPipe.into()
        }
        _ => io::Error::other(err),
    }
}

impl AsyncRead for StreamIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        while this.pending.is_empty() {
            match ready!(this.recv.poll_data(cx)) {
                // The peer ended its side: end of file.
                None => return Poll::Ready(Ok(())),
                Some(Ok(chunk)) => {
                    // Read data frees window at once: the reader is the
                    // TLS layer, which buffers what it does not use.
                    let _ = this.recv.flow_control().release_capacity(chunk.len());
                    this.pending = chunk;
                }
                Some(Err(err)) => return Poll::Ready(Err(io_error(err))),
            }
        }
        let n = this.pending.len().min(out.remaining());
        out.put_slice(&this.pending.split_to(n));
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for StreamIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if data.is_empty() {
            return Poll::Ready(Ok(0));
        }
        this.send.reserve_capacity(data.len());
        loop {
            match ready!(this.send.poll_capacity(cx)) {
                Some(Ok(0)) => continue,
                Some(Ok(granted)) => {
                    let n = granted.min(data.len());
                    this.send
                        .send_data(Bytes::copy_from_slice(&data[..n]), false)
                        .map_err(io_error)?;
                    return Poll::Ready(Ok(n));
                }
                Some(Err(err)) => return Poll::Ready(Err(io_error(err))),
                // No more data can be sent: the peer reset the stream.
                None => {
                    let err = match ready!(this.send.poll_reset(cx)) {
                        Ok(reason) => h2::Error::from(reason),
                        Err(err) => err,
                    };
                    return Poll::Ready(Err(io_error(err)));
                }
            }
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        // Data handed to the stream is queued on its connection already.
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if !this.ended {
            this.ended = true;
            this.send.send_data(Bytes::new(), true).map_err(io_error)?;
        }
        Poll::Ready(Ok(()))
    }
}
