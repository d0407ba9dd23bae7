//! When has an HTTP/2 client finished its handshake? Once its connection
//! preface (24 bytes) and the SETTINGS frame that must follow it (RFC 9113
//! §3.4) have been read. The h2 crate checks both but does not say when
//! they are in, so [`PrefaceWatch`] counts the bytes read through it and
//! calls a hook at that moment (the inbound listener's gives the
//! connection's place among pending handshakes back). Whether the bytes are a valid preface and SETTINGS frame is
//! still h2's to judge: anything else ends the connection there.

use std::{
    io,
    pin::Pin,
    task::{Context, Poll},
};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// `PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n`.
const PREFACE_LEN: usize = 24;
/// Length (3 bytes), type, flags, stream id (4 bytes).
const FRAME_HEADER_LEN: usize = 9;
const HEAD_LEN: usize = PREFACE_LEN + FRAME_HEADER_LEN;

/// An HTTP/2 server connection's I/O that calls `on_complete` once the
/// client's preface and first frame (its SETTINGS) have been read.
pub struct PrefaceWatch<IO, F> {
    io: IO,
    on_complete: Option<F>,
    head: [u8; HEAD_LEN],
    read: usize,
}

impl<IO, F> std::fmt::Debug for PrefaceWatch<IO, F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefaceWatch")
            .field("read", &self.read)
            .field("complete", &self.on_complete.is_none())
            .finish()
    }
}

impl<IO, F: FnOnce(&IO)> PrefaceWatch<IO, F> {
    /// Wraps `io`; `on_complete` runs once the handshake bytes are in
    /// (and is dropped uncalled with the connection otherwise).
    pub fn new(io: IO, on_complete: F) -> Self {
        Self {
            io,
            on_complete: Some(on_complete),
            head: [0; HEAD_LEN],
            read: 0,
        }
    }

    /// Whether the preface and first SETTINGS frame have been read.
    pub fn is_complete(&self) -> bool {
        self.on_complete.is_none()
    }

    fn saw(&mut self, bytes: &[u8]) {
        if self.on_complete.is_none() {
            return;
        }
        if self.read < HEAD_LEN {
            let take = (HEAD_LEN - self.read).min(bytes.len());
            self.head[self.read..self.read + take].copy_from_slice(&bytes[..take]);
        }
        self.read = self.read.saturating_add(bytes.len());
        if self.read < HEAD_LEN {
            return;
        }
        let length = (usize::from(self.head[PREFACE_LEN]) << 16)
            | (usize::from(self.head[PREFACE_LEN + 1]) << 8)
            | usize::from(self.head[PREFACE_LEN + 2]);
        if self.read >= HEAD_LEN + length
            && let Some(on_complete) = self.on_complete.take()
        {
            on_complete(&self.io);
        }
    }
}

impl<IO: AsyncRead + Unpin, F: FnOnce(&IO) + Unpin> AsyncRead for PrefaceWatch<IO, F> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.io).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = polled {
            this.saw(&buf.filled()[before..]);
        }
        polled
    }
}

impl<IO: AsyncWrite + Unpin, F: Unpin> AsyncWrite for PrefaceWatch<IO, F> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PREFACE: &[u8; PREFACE_LEN] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

    fn settings(payload: usize) -> Vec<u8> {
        let mut frame = vec![0, 0, payload as u8, 4, 0, 0, 0, 0, 0];
        frame.resize(FRAME_HEADER_LEN + payload, 0);
        frame
    }

    #[test]
    fn the_guard_goes_once_the_whole_first_settings_frame_is_in() {
        let mut watch = PrefaceWatch::new((), |_: &()| {});
        watch.saw(PREFACE);
        assert!(!watch.is_complete(), "preface alone");
        let frame = settings(12);
        watch.saw(&frame[..FRAME_HEADER_LEN + 5]);
        assert!(!watch.is_complete(), "half a SETTINGS payload");
        watch.saw(&frame[FRAME_HEADER_LEN + 5..]);
        assert!(watch.is_complete());
    }

    #[test]
    fn bytes_arriving_one_at_a_time_count_the_same() {
        let mut watch = PrefaceWatch::new((), |_: &()| {});
        let mut all = PREFACE.to_vec();
        all.extend(settings(0));
        for (i, byte) in all.iter().enumerate() {
            assert!(!watch.is_complete(), "complete after {i} bytes");
            watch.saw(std::slice::from_ref(byte));
        }
        assert!(watch.is_complete());
    }

    #[test]
    fn an_empty_settings_frame_with_more_after_it_completes_in_one_read() {
        let mut watch = PrefaceWatch::new((), |_: &()| {});
        let mut all = PREFACE.to_vec();
        all.extend(settings(0));
        all.extend([0, 0, 4, 8, 0, 0, 0, 0, 0, 0, 1, 0, 0]);
        watch.saw(&all);
        assert!(watch.is_complete());
    }
}
