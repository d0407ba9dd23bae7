//! Established HBONE connections whose peer certificate a reloaded CRL now
//! revokes are reset, as ztunnel resets them (`src/tls/revocation.rs`
//! `wait_for_revocation`, selected on by `src/proxy/inbound.rs`). The lists
//! are the trust bundle's ([`crate::identity::RevocationList`]); without
//! them nothing is watched and nothing changes. Inbound, the connection's
//! task selects on the revocation and drops the connection over a
//! [`ResetOnDrop`] stream; outbound, the pooled connection's stream
//! ([`RevocableClient`]) fails itself, which ends the HTTP/2 connection.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::Context;

use rustls::pki_types::UnixTime;
use socket2::SockRef;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio_rustls::server::TlsStream;

use crate::forward_io::{forward_async_read, forward_async_write};
use crate::identity::{PeerChain, PeerRole, RevocationList, TrustBundle};

/// What an inbound connection's peer presented, to be watched.
#[derive(Debug)]
pub(super) struct Watched {
    list: Arc<RevocationList>,
    peer: PeerChain,
}

impl Watched {
    /// The client of `tls`, if `roots` carries revocation lists.
    pub(super) fn client_of(roots: &TrustBundle, tls: &TlsStream<TcpStream>) -> Option<Self> {
        let list = roots.revocations()?;
        let certificates = tls.get_ref().1.peer_certificates()?.to_vec();
        Some(Self {
            list,
            peer: PeerChain {
                certificates,
                roots: roots.store(),
                verified_at: UnixTime::now(),
                role: PeerRole::Client,
            },
        })
    }

    /// Resolves once a reloaded list revokes the peer's chain.
    pub(super) async fn revoked(&self) {
        let algorithms = crate::tls::provider().signature_verification_algorithms.all;
        self.list.revoked(&self.peer, algorithms).await;
    }
}

/// An inbound TLS stream whose socket closes with a reset (linger 0) once
/// [`ResetSwitch::switch`] was flipped before it is dropped.
#[derive(Debug)]
pub(super) struct ResetOnDrop {
    inner: TlsStream<TcpStream>,
    reset: Arc<AtomicBool>,
}

/// Flips a [`ResetOnDrop`] to reset.
#[derive(Debug, Clone)]
pub(super) struct ResetSwitch(Arc<AtomicBool>);

impl ResetSwitch {
    /// The stream's close becomes a reset.
    pub(super) fn switch(&self) {
        self.0.store(true, Ordering::Release);
    }
}

impl ResetOnDrop {
    /// Wraps `inner`; the switch makes its close a reset.
    pub(super) fn new(inner: TlsStream<TcpStream>) -> (Self, ResetSwitch) {
        let reset = Arc::new(AtomicBool::new(false));
        (
            Self {
                inner,
                reset: Arc::clone(&reset),
            },
            ResetSwitch(reset),
        )
    }

    /// The wrapped stream.
    pub(super) fn get_ref(&self) -> &TlsStream<TcpStream> {
        &self.inner
    }
}

impl Drop for ResetOnDrop {
    fn drop(&mut self) {
        if self.reset.load(Ordering::Acquire) {
            let _ =
                SockRef::from(self.inner.get_ref().0).set_linger(Some(std::time::Duration::ZERO));
        }
    }
}

impl AsyncRead for ResetOnDrop {
    forward_async_read!(inner);
}

impl AsyncWrite for ResetOnDrop {
    forward_async_write!(inner);
}

/// An outbound HBONE connection's TLS stream that fails with a reset
/// (linger 0, then `ConnectionReset` to HTTP/2, which drops it) once a
/// reloaded list revokes the server's chain. The HTTP/2 connection task
/// polls it, so the revocation future wakes that task.
pub struct RevocableClient {
    inner: tokio_rustls::client::TlsStream<TcpStream>,
    revoked: Option<Pin<Box<dyn std::future::Future<Output = ()> + Send>>>,
    reset: bool,
}

impl std::fmt::Debug for RevocableClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RevocableClient")
            .field("watched", &self.revoked.is_some())
            .field("reset", &self.reset)
            .finish_non_exhaustive()
    }
}

impl RevocableClient {
    /// Watches the server of `tls` if `roots` carries revocation lists.
    pub(super) fn server_of(
        roots: &TrustBundle,
        tls: tokio_rustls::client::TlsStream<TcpStream>,
    ) -> Self {
        let revoked = roots.revocations().and_then(|list| {
            let peer = PeerChain {
                certificates: tls.get_ref().1.peer_certificates()?.to_vec(),
                roots: roots.store(),
                verified_at: UnixTime::now(),
                role: PeerRole::Server,
            };
            let algorithms = crate::tls::provider().signature_verification_algorithms.all;
            let revoked: Pin<Box<dyn std::future::Future<Output = ()> + Send>> =
                Box::pin(async move { list.revoked(&peer, algorithms).await });
            Some(revoked)
        });
        Self {
            inner: tls,
            revoked,
            reset: false,
        }
    }

    /// Fails with `ConnectionReset` once the server has been revoked (the
    /// socket then lingers 0): checked before every read and write.
    fn fail_if_revoked(&mut self, cx: &mut Context<'_>) -> io::Result<()> {
        if self.reset {
            return Err(revoked_error());
        }
        let Some(revoked) = self.revoked.as_mut() else {
            return Ok(());
        };
        if revoked.as_mut().poll(cx).is_pending() {
            return Ok(());
        }
        self.reset = true;
        self.revoked = None;
        let _ = SockRef::from(self.inner.get_ref().0).set_linger(Some(std::time::Duration::ZERO));
        tracing::warn!(target: "access", direction = "outbound", protocol = "HBONE", dst = ?self.inner.get_ref().0.peer_addr().ok(), "connection reset: the peer's certificate was revoked");
        Err(revoked_error())
    }
}

fn revoked_error() -> io::Error {
    io::Error::new(
        io::ErrorKind::ConnectionReset,
        "the HBONE server's certificate was revoked",
    )
}

impl AsyncRead for RevocableClient {
    forward_async_read!(inner, check = fail_if_revoked);
}

impl AsyncWrite for RevocableClient {
    forward_async_write!(inner, check = fail_if_revoked);
}
