//! Unix `SOCK_SEQPACKET` sockets on tokio: whole datagrams, each with at
//! most one descriptor attached, and the peer's credentials.
//!
//! tokio has no seqpacket type, so the sockets are nix/socket2 descriptors
//! driven by [`AsyncFd`]. Every syscall is non-blocking; callers bound the
//! waits.

use std::{
    io::{self, IoSlice, IoSliceMut},
    os::{
        fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd},
        unix::fs::{FileTypeExt, MetadataExt},
    },
    path::{Path, PathBuf},
};

use nix::sys::socket::{
    self, AddressFamily, Backlog, ControlMessage, ControlMessageOwned, MsgFlags, SockFlag,
    SockType, UnixAddr, sockopt,
};
use tokio::io::{Interest, unix::AsyncFd};

use super::{ZdsError, types::ZtunnelPeer};

/// Largest datagram either side accepts: ztunnel and Istio's node agent
/// both read into 1,024-byte buffers.
pub const MAX_DATAGRAM: usize = 1024;

/// Descriptors one received datagram may bring before the kernel truncates
/// the control data; any received are closed (ztunnel sends none).
const RECV_FDS: usize = 4;

/// A listening seqpacket socket bound to a path. Dropping it removes the
/// socket file if it is still the one it bound (a successor agent may have
/// replaced it).
#[derive(Debug)]
pub(super) struct SeqpacketListener {
    fd: AsyncFd<OwnedFd>,
    path: PathBuf,
    /// Device and inode of the socket file it bound.
    file_id: (u64, u64),
}

impl SeqpacketListener {
    /// Removes a stale socket file at `path` (refusing to remove anything
    /// else), creates the parent directory if needed, binds and listens.
    pub(super) fn bind(path: &Path, backlog: i32) -> Result<Self, ZdsError> {
        let fail = |step, source| ZdsError::Listen {
            path: path.to_owned(),
            step,
            source,
        };
        match std::fs::symlink_metadata(path) {
            Ok(meta) if meta.file_type().is_socket() => {
                std::fs::remove_file(path).map_err(|e| fail("remove stale socket", e))?;
            }
            Ok(_) => {
                return Err(ZdsError::NotASocket {
                    path: path.to_owned(),
                });
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(fail("inspect path", e)),
        }
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(|e| fail("create directory", e))?;
        }
        let fd = socket::socket(
            AddressFamily::Unix,
            SockType::SeqPacket,
            SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
            None,
        )
        .map_err(|e| fail("socket", e.into()))?;
        let addr = UnixAddr::new(path).map_err(|e| fail("socket address", e.into()))?;
        socket::bind(fd.as_raw_fd(), &addr).map_err(|e| fail("bind", e.into()))?;
        let backlog = Backlog::new(backlog).map_err(|e| fail("listen backlog", e.into()))?;
        socket::listen(&fd, backlog).map_err(|e| fail("listen", e.into()))?;
        let meta = std::fs::symlink_metadata(path).map_err(|e| fail("inspect bound socket", e))?;
        // SAFETY: an OwnedFd is open and names the same descriptor for as
        // long as the AsyncFd owns it.
        let fd = unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }
            .map_err(|e| fail("register with tokio", e.into()))?;
        Ok(Self {
            fd,
            path: path.to_owned(),
            file_id: (meta.dev(), meta.ino()),
        })
    }

    /// The next connection, with its peer's credentials read.
    pub(super) async fn accept(&self, connection: u64) -> io::Result<SeqpacketConn> {
        let fd = self
            .fd
            .async_io(Interest::READABLE, |listener| {
                socket::accept4(
                    listener.as_raw_fd(),
                    SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
                )
                .map_err(io::Error::from)
            })
            .await?;
        // SAFETY: accept4 returned a new descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let creds = socket::getsockopt(&fd, sockopt::PeerCredentials).map_err(io::Error::from)?;
        let peer = ZtunnelPeer {
            connection,
            pid: creds.pid(),
            uid: creds.uid(),
            gid: creds.gid(),
        };
        // SAFETY: as for the listener.
        let fd = unsafe { AsyncFd::register(fd) }?;
        Ok(SeqpacketConn { fd, peer })
    }
}

impl Drop for SeqpacketListener {
    fn drop(&mut self) {
        let ours = std::fs::symlink_metadata(&self.path)
            .is_ok_and(|meta| (meta.dev(), meta.ino()) == self.file_id);
        if ours && let Err(error) = std::fs::remove_file(&self.path) {
            tracing::warn!(path = %self.path.display(), %error, "cannot remove the ZDS socket file");
        }
    }
}

/// One received datagram.
#[derive(Debug)]
pub(super) enum Received {
    /// A whole datagram of at most [`MAX_DATAGRAM`] bytes and no
    /// descriptors.
    Datagram(Vec<u8>),
    /// The peer closed (or sent an empty datagram, which seqpacket cannot
    /// tell apart).
    End,
    /// Longer than [`MAX_DATAGRAM`] (the rest was discarded).
    Truncated,
    /// It carried descriptors (closed on arrival) or control data that did
    /// not fit.
    Descriptors,
}

/// An accepted seqpacket connection.
#[derive(Debug)]
pub(super) struct SeqpacketConn {
    fd: AsyncFd<OwnedFd>,
    peer: ZtunnelPeer,
}

impl SeqpacketConn {
    /// Who connected.
    pub(super) fn peer(&self) -> ZtunnelPeer {
        self.peer
    }

    /// Sends `data` as one datagram, with `fd` attached if given.
    pub(super) async fn send(&self, data: &[u8], fd: Option<BorrowedFd<'_>>) -> io::Result<()> {
        let raw: Vec<RawFd> = fd.iter().map(AsRawFd::as_raw_fd).collect();
        let rights = [ControlMessage::ScmRights(&raw)];
        let cmsgs: &[ControlMessage<'_>] = if raw.is_empty() { &[] } else { &rights };
        let iov = [IoSlice::new(data)];
        let sent = self
            .fd
            .async_io(Interest::WRITABLE, |sock| {
                // MSG_NOSIGNAL: a peer that went away is an error, not SIGPIPE.
                socket::sendmsg::<()>(sock.as_raw_fd(), &iov, cmsgs, MsgFlags::MSG_NOSIGNAL, None)
                    .map_err(io::Error::from)
            })
            .await?;
        if sent != data.len() {
            return Err(io::Error::new(
                io::ErrorKind::WriteZero,
                format!("sent {sent} of {} bytes", data.len()),
            ));
        }
        Ok(())
    }

    /// Receives one datagram. Cancel-safe: nothing is consumed unless the
    /// future completes.
    pub(super) async fn recv(&self) -> io::Result<Received> {
        let mut buf = vec![0u8; MAX_DATAGRAM];
        let (len, flags, fds) = self
            .fd
            .async_io(Interest::READABLE, |sock| recv_once(sock.as_fd(), &mut buf))
            .await?;
        if fds > 0 || flags.contains(MsgFlags::MSG_CTRUNC) {
            return Ok(Received::Descriptors);
        }
        if flags.contains(MsgFlags::MSG_TRUNC) {
            return Ok(Received::Truncated);
        }
        if len == 0 {
            return Ok(Received::End);
        }
        buf.truncate(len);
        Ok(Received::Datagram(buf))
    }
}

/// One `recvmsg`: bytes read, flags, and how many descriptors arrived
/// (already closed).
fn recv_once(sock: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<(usize, MsgFlags, usize)> {
    let mut cmsg = nix::cmsg_space!([RawFd; RECV_FDS]);
    let mut iov = [IoSliceMut::new(buf)];
    let msg = socket::recvmsg::<()>(
        sock.as_raw_fd(),
        &mut iov,
        Some(&mut cmsg),
        MsgFlags::MSG_CMSG_CLOEXEC,
    )
    .map_err(io::Error::from)?;
    let mut fds = 0;
    // Own (and so close) every descriptor before judging the datagram, so
    // a misbehaving peer cannot leak them into the agent.
    if let Ok(cmsgs) = msg.cmsgs() {
        for cmsg in cmsgs {
            if let ControlMessageOwned::ScmRights(received) = cmsg {
                for raw in received {
                    // SAFETY: SCM_RIGHTS installed these descriptors for us.
                    drop(unsafe { OwnedFd::from_raw_fd(raw) });
                    fds += 1;
                }
            }
        }
    }
    Ok((msg.bytes, msg.flags, fds))
}
