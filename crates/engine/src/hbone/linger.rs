//! A server connection that, when HTTP/2 closes it, reads the peer's last
//! frames before letting the socket go.
//!
//! Closing a TCP socket whose receive queue holds unread bytes makes the
//! kernel send a reset instead of a FIN, and a reset makes the peer's
//! kernel drop what it had not yet read. When the server ends a connection
//! (a drain's GOAWAY, the idle timeout) the client is often still sending
//! small frames (WINDOW_UPDATE for data it just read, its own GOAWAY, a
//! PING): closing at once then cut the last bytes of a stream the client
//! was still reading. So on shutdown this adapter sends TLS close_notify
//! and FIN, then reads and discards until the peer closes too, for at most
//! [`LINGER`]; only then is the socket dropped.

use std::future::Future as _;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Sleep;

use crate::forward_io::{forward_async_read, forward_async_write};

/// Longest wait for the peer's close after the server closed its side.
pub const LINGER: Duration = Duration::from_secs(2);

/// See the module documentation.
#[derive(Debug)]
pub struct LingerOnClose<IO> {
    inner: IO,
    /// Set once the inner shutdown finished: the wait for the peer.
    waiting: Option<Pin<Box<Sleep>>>,
    linger: Duration,
}

impl<IO> LingerOnClose<IO> {
    /// Wraps `inner`, lingering at most [`LINGER`].
    pub fn new(inner: IO) -> Self {
        Self::with_linger(inner, LINGER)
    }

    /// Wraps `inner`, lingering at most `linger`.
    pub fn with_linger(inner: IO, linger: Duration) -> Self {
        Self {
            inner,
            waiting: None,
            linger,
        }
    }

    /// The wrapped stream.
    pub fn get_ref(&self) -> &IO {
        &self.inner
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for LingerOnClose<IO> {
    forward_async_read!(inner);
}

impl<IO: AsyncRead + AsyncWrite + Unpin> AsyncWrite for LingerOnClose<IO> {
    forward_async_write!(inner, except poll_shutdown);

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if this.waiting.is_none() {
            // A failed shutdown has nothing left to wait for.
            ready!(Pin::new(&mut this.inner).poll_shutdown(cx))?;
            this.waiting = Some(Box::pin(tokio::time::sleep(this.linger)));
        }
        let mut scratch = [0u8; 4096];
        loop {
            if let Some(waiting) = this.waiting.as_mut()
                && waiting.as_mut().poll(cx).is_ready()
            {
                return Poll::Ready(Ok(()));
            }
            let mut buf = ReadBuf::new(&mut scratch);
            match Pin::new(&mut this.inner).poll_read(cx, &mut buf) {
                // The peer closed too (or the socket failed): done.
                Poll::Ready(Ok(())) if buf.filled().is_empty() => return Poll::Ready(Ok(())),
                Poll::Ready(Err(_)) => return Poll::Ready(Ok(())),
                // Its last frames: read and dropped.
                Poll::Ready(Ok(())) => {}
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

#[cfg(test)]
#[expect(
    clippy::unwrap_used,
    reason = "a bad fixture should fail the test loudly"
)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    use tokio::net::{TcpListener, TcpStream};

    /// The server writes until the client's window is full (the client
    /// reads nothing yet) and closes while the client's last bytes are
    /// unread on its side; returns what the server wrote, what the client
    /// then read, and how its read ended.
    async fn close_with_unread_bytes(lingering: bool) -> (usize, usize, io::Result<usize>) {
        async fn write_and_close(mut conn: impl AsyncWrite + Unpin) -> usize {
            let chunk = [7u8; 65_536];
            let mut written = 0;
            while let Ok(Ok(n)) =
                tokio::time::timeout(Duration::from_millis(200), conn.write(&chunk)).await
            {
                written += n;
            }
            conn.shutdown().await.unwrap();
            written
        }
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (closed, written) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            let (tcp, _) = listener.accept().await.unwrap();
            // The socket is dropped (closed) before the client is told.
            let n = if lingering {
                write_and_close(LingerOnClose::with_linger(tcp, Duration::from_millis(300))).await
            } else {
                write_and_close(tcp).await
            };
            let _ = closed.send(n);
        });
        let mut client = TcpStream::connect(addr).await.unwrap();
        client.write_all(b"unread frames").await.unwrap();
        // Read only once the server has given up writing and closed.
        let written = written.await.unwrap();
        let mut got = Vec::new();
        let read = client.read_to_end(&mut got).await;
        (written, got.len(), read)
    }

    /// With the adapter the close reaches the peer as a FIN after every
    /// byte; a bare socket closes with the reset this adapter exists to
    /// avoid, which drops what the server's kernel had not sent yet.
    #[tokio::test]
    async fn a_close_with_unread_bytes_reaches_the_peer_as_a_fin() {
        let (written, got, read) = close_with_unread_bytes(true).await;
        assert!(
            read.is_ok(),
            "the client saw {read:?} after {got} of {written} bytes"
        );
        assert_eq!(got, written);
        let (written, got, read) = close_with_unread_bytes(false).await;
        let reset = read
            .as_ref()
            .is_err_and(|e| e.kind() == io::ErrorKind::ConnectionReset);
        assert!(
            reset && got < written,
            "a bare socket: {read:?} after {got} of {written} bytes"
        );
    }

    /// A peer that never closes cannot hold the socket longer than the
    /// linger.
    #[tokio::test]
    async fn a_silent_peer_is_waited_for_at_most_the_linger() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let _client = TcpStream::connect(addr).await.unwrap();
        let (tcp, _) = listener.accept().await.unwrap();
        let mut conn = LingerOnClose::with_linger(tcp, Duration::from_millis(50));
        let closed = tokio::time::timeout(Duration::from_secs(10), conn.shutdown()).await;
        assert!(matches!(closed, Ok(Ok(()))), "{closed:?}");
    }
}
