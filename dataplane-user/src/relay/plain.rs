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
//! relay memory (they held 128 KiB each, zeroed, before).

use std::{cell::RefCell, future::poll_fn, io, net::Shutdown};

use prometheus_client::metrics::counter::Counter;
use tokio::net::TcpStream;

use super::{Meter, Transferred, close_normally, failed, flush, reset_on_close};

/// Largest read: the per-thread scratch buffer's size.
const BUFFER_SIZE: usize = 64 * 1024;

thread_local! {
    /// Borrowed only between a read and the synchronous write attempt that
    /// follows it, never across an await.
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
pub async fn relay(
    downstream: TcpStream,
    upstream: TcpStream,
    meter: Meter,
) -> Result<Transferred, PlainRelayError> {
    reset_on_close(&downstream);
    reset_on_close(&upstream);
    let (sent, received) = tokio::try_join!(
        pipe(&downstream, &upstream, "downstream", &meter.forward),
        pipe(&upstream, &downstream, "upstream", &meter.backward)
    )?;
    // Both FINs passed on: the only end that may look clean.
    close_normally(&downstream);
    close_normally(&upstream);
    Ok(Transferred { sent, received })
}

/// What one read did.
enum Read {
    /// The peer half-closed.
    Eof,
    /// `n` bytes were read and all written on.
    Passed(usize),
    /// `n` bytes were read; those the writer could not take yet are in the
    /// pending buffer.
    Blocked(usize),
    /// Readiness was stale.
    WouldBlock,
}

/// One direction: `reader`'s bytes to `writer`. On end of stream,
/// half-closes the writer (passes the FIN on) while the other direction
/// keeps flowing.
async fn pipe(
    reader: &TcpStream,
    writer: &TcpStream,
    side: &'static str,
    counter: &Counter,
) -> Result<u64, PlainRelayError> {
    let other = if side == "downstream" {
        "upstream"
    } else {
        "downstream"
    };
    let mut pending: Vec<u8> = Vec::new();
    let mut total: u64 = 0;
    loop {
        // Once the writer's side has half-closed nothing reads it; its
        // reset must still end the relay, not wait for the next write.
        let readable = tokio::select! {
            readable = poll_fn(|cx| reader.poll_read_ready(cx)) => readable,
            err = failed(writer) => return Err(classify(err, other, total)),
        };
        if let Err(err) = readable {
            return Err(classify(err, side, total));
        }
        let read = SCRATCH.with(|scratch| {
            let mut scratch = scratch.borrow_mut();
            let n = match reader.try_read(&mut scratch) {
                Ok(0) => return Ok(Read::Eof),
                Ok(n) => n,
                Err(err) if err.kind() == io::ErrorKind::WouldBlock => return Ok(Read::WouldBlock),
                Err(err) => return Err(classify(err, side, total)),
            };
            let written = match writer.try_write(&scratch[..n]) {
                Ok(written) => written,
                Err(err) if err.kind() == io::ErrorKind::WouldBlock => 0,
                Err(err) => return Err(classify(err, other, total)),
            };
            if written == n {
                Ok(Read::Passed(n))
            } else {
                pending.extend_from_slice(&scratch[written..n]);
                Ok(Read::Blocked(n))
            }
        })?;
        match read {
            Read::Eof => break,
            Read::WouldBlock => continue,
            Read::Passed(n) => {
                total += n as u64;
                counter.inc_by(n as u64);
            }
            Read::Blocked(n) => {
                flush(writer, &pending)
                    .await
                    .map_err(|err| classify(err, other, total))?;
                // Freed, not kept: an idle connection holds nothing.
                pending = Vec::new();
                total += n as u64;
                counter.inc_by(n as u64);
            }
        }
    }
    // A failure here means the other side is gone already, which its own
    // direction reports.
    let _ = socket2::SockRef::from(writer).shutdown(Shutdown::Write);
    Ok(total)
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
