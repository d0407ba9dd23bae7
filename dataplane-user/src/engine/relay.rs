//! Copying bytes between two TCP connections, both ways, with TCP's
//! semantics carried across: a FIN (half-close) on one side becomes a
//! `shutdown(SHUT_WR)` on the other while the opposite direction keeps
//! flowing, and a reset on one side becomes a reset (close with
//! `SO_LINGER` 0) on the other.

use std::{io, time::Duration};

use tokio::{
    io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt},
    net::TcpStream,
};

/// Per-direction buffer: one allocation per connection and direction, none
/// per chunk.
const BUFFER_SIZE: usize = 64 * 1024;

/// Bytes carried each way when a relay ends.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Transferred {
    /// From the first stream (the accepted, downstream side) to the second.
    pub sent: u64,
    /// From the second stream back to the first.
    pub received: u64,
}

/// How a relay ended badly.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
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
/// one side fails; on a failure both connections are closed with RST.
pub async fn relay(
    mut downstream: TcpStream,
    mut upstream: TcpStream,
) -> Result<Transferred, RelayError> {
    let result = {
        // Borrowed halves: unlike owned ones they do not send a FIN when
        // dropped, so a failure can still end in a clean reset below.
        let (mut down_read, mut down_write) = downstream.split();
        let (mut up_read, mut up_write) = upstream.split();
        tokio::try_join!(
            pipe(&mut down_read, &mut up_write, "downstream"),
            pipe(&mut up_read, &mut down_write, "upstream")
        )
    };
    match result {
        Ok((sent, received)) => Ok(Transferred { sent, received }),
        Err(err) => {
            reset_on_close(&downstream);
            reset_on_close(&upstream);
            Err(err)
        }
    }
}

/// One direction. On end of stream, half-closes the writer (passes the
/// FIN on) while the other direction keeps flowing.
async fn pipe<R, W>(reader: &mut R, writer: &mut W, side: &'static str) -> Result<u64, RelayError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut buf = vec![0u8; BUFFER_SIZE];
    let mut total: u64 = 0;
    loop {
        let n = match reader.read(&mut buf).await {
            Ok(0) => break,
            Ok(n) => n,
            Err(err) => return Err(classify(err, side, total)),
        };
        if let Err(err) = writer.write_all(&buf[..n]).await {
            let other = if side == "downstream" {
                "upstream"
            } else {
                "downstream"
            };
            return Err(classify(err, other, total));
        }
        total += n as u64;
    }
    // A failure here means the other side is gone already, which its own
    // direction reports.
    let _ = writer.shutdown().await;
    Ok(total)
}

fn classify(err: io::Error, side: &'static str, bytes: u64) -> RelayError {
    match err.kind() {
        io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe => RelayError::Reset {
            side,
            transferred: Transferred {
                sent: bytes,
                received: 0,
            },
        },
        _ => RelayError::Io { side, source: err },
    }
}

/// Makes the eventual close of `stream` send RST.
pub(crate) fn reset_on_close(stream: &TcpStream) {
    let socket = socket2::SockRef::from(stream);
    let _ = socket.set_linger(Some(Duration::ZERO));
}
