//! Messages with descriptors attached (`SCM_RIGHTS`) between the two
//! agents of a hand-over: one JSON [`Message`] per packet of a
//! `SOCK_SEQPACKET` pair, so a message and its descriptors always arrive
//! together, and a peer that dies closes its end (the other sees the end
//! of the channel at once).
//!
//! The pair is set up over the control socket: the running agent answers
//! the `handOver` request with the `ok` response and one end of the pair
//! attached ([`send_reply`], [`recv_reply`]).

use std::{
    io::{self, IoSlice, IoSliceMut},
    os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd},
    time::Duration,
};

use nix::sys::socket::{
    AddressFamily, ControlMessage, ControlMessageOwned, MsgFlags, SockFlag, SockType, recvmsg,
    sendmsg, socketpair,
};

use super::Message;

/// Largest message (a pod's spec is well below it).
const MAX_PACKET: usize = 64 * 1024;

/// Most descriptors one message carries (a pod's four listeners).
const MAX_FDS: usize = 8;

/// Largest reply to the `handOver` request on the control socket.
const MAX_REPLY: usize = 64 * 1024;

/// One end of the hand-over channel.
#[derive(Debug)]
pub(super) struct Channel {
    socket: OwnedFd,
}

impl Channel {
    /// A connected pair: this end, and the descriptor to hand the peer.
    pub(super) fn pair() -> io::Result<(Self, OwnedFd)> {
        let (mine, theirs) = socketpair(
            AddressFamily::Unix,
            SockType::SeqPacket,
            None,
            SockFlag::SOCK_CLOEXEC,
        )?;
        Ok((Self { socket: mine }, theirs))
    }

    /// The end received from the peer.
    pub(super) fn from_fd(socket: OwnedFd) -> io::Result<Self> {
        let kind = socket2::SockRef::from(&socket).r#type()?;
        if kind != socket2::Type::SEQPACKET {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "the hand-over channel is not a SOCK_SEQPACKET socket",
            ));
        }
        Ok(Self { socket })
    }

    /// Every later send and receive fails after `limit` (`WouldBlock`).
    pub(super) fn set_timeout(&self, limit: Duration) -> io::Result<()> {
        let socket = socket2::SockRef::from(&self.socket);
        socket.set_read_timeout(Some(limit))?;
        socket.set_write_timeout(Some(limit))
    }

    /// Sends `message` with `fds` attached.
    pub(super) fn send(&self, message: &Message, fds: &[BorrowedFd<'_>]) -> io::Result<()> {
        let body = serde_json::to_vec(message).map_err(io::Error::other)?;
        if body.len() > MAX_PACKET || fds.len() > MAX_FDS {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "hand-over message too large",
            ));
        }
        send_with_fds(self.socket.as_fd(), &body, fds)
    }

    /// The next message and the descriptors that came with it; `Ok(None)`
    /// when the peer closed its end.
    pub(super) fn recv(&self) -> io::Result<Option<(Message, Vec<OwnedFd>)>> {
        let mut body = vec![0u8; MAX_PACKET];
        let (len, fds, truncated) = recv_with_fds(self.socket.as_fd(), &mut body)?;
        if len == 0 && fds.is_empty() {
            return Ok(None);
        }
        if truncated {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "hand-over message or its descriptors truncated",
            ));
        }
        let message = serde_json::from_slice(&body[..len]).map_err(|e| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("invalid hand-over message: {e}"),
            )
        })?;
        Ok(Some((message, fds)))
    }
}

/// Writes `body` on the control connection `stream` with `fds` attached
/// to its first byte, then the rest of it.
pub(super) fn send_reply(
    stream: BorrowedFd<'_>,
    body: &[u8],
    fds: &[BorrowedFd<'_>],
) -> io::Result<()> {
    // The descriptors travel with the first write; a short write's rest
    // goes plainly.
    let sent = send_with_fds_partial(stream, body, fds)?;
    let mut rest = &body[sent..];
    while !rest.is_empty() {
        let n = send_with_fds_partial(stream, rest, &[])?;
        rest = &rest[n..];
    }
    Ok(())
}

/// Reads the control connection `stream` to its end: the reply and every
/// descriptor attached to it.
pub(super) fn recv_reply(stream: BorrowedFd<'_>) -> io::Result<(Vec<u8>, Vec<OwnedFd>)> {
    let mut body = Vec::new();
    let mut all_fds = Vec::new();
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let (len, fds, truncated) = recv_with_fds(stream, &mut buf)?;
        all_fds.extend(fds);
        if truncated {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "descriptors of the hand-over reply truncated",
            ));
        }
        if len == 0 {
            return Ok((body, all_fds));
        }
        body.extend_from_slice(&buf[..len]);
        if body.len() > MAX_REPLY {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "hand-over reply too large",
            ));
        }
    }
}

fn send_with_fds(socket: BorrowedFd<'_>, body: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    let sent = send_with_fds_partial(socket, body, fds)?;
    if sent == body.len() {
        Ok(())
    } else {
        Err(io::Error::new(
            io::ErrorKind::WriteZero,
            "hand-over message sent in part",
        ))
    }
}

fn send_with_fds_partial(
    socket: BorrowedFd<'_>,
    body: &[u8],
    fds: &[BorrowedFd<'_>],
) -> io::Result<usize> {
    let raw: Vec<RawFd> = fds.iter().map(AsRawFd::as_raw_fd).collect();
    let rights = [ControlMessage::ScmRights(&raw)];
    let cmsgs: &[ControlMessage<'_>] = if raw.is_empty() { &[] } else { &rights };
    loop {
        match sendmsg::<()>(
            socket.as_raw_fd(),
            &[IoSlice::new(body)],
            cmsgs,
            MsgFlags::MSG_NOSIGNAL,
            None,
        ) {
            Ok(n) => return Ok(n),
            Err(nix::errno::Errno::EINTR) => {}
            Err(errno) => return Err(errno.into()),
        }
    }
}

/// One `recvmsg`: bytes read, descriptors received (owned at once so that
/// every error path closes them), and whether anything was truncated.
fn recv_with_fds(
    socket: BorrowedFd<'_>,
    buf: &mut [u8],
) -> io::Result<(usize, Vec<OwnedFd>, bool)> {
    let mut space = nix::cmsg_space!([RawFd; MAX_FDS]);
    loop {
        let mut iov = [IoSliceMut::new(buf)];
        let msg = match recvmsg::<()>(
            socket.as_raw_fd(),
            &mut iov,
            Some(&mut space),
            MsgFlags::MSG_CMSG_CLOEXEC,
        ) {
            Ok(msg) => msg,
            Err(nix::errno::Errno::EINTR) => continue,
            Err(errno) => return Err(errno.into()),
        };
        let mut fds = Vec::new();
        for cmsg in msg.cmsgs()? {
            if let ControlMessageOwned::ScmRights(received) = cmsg {
                // SAFETY: the kernel just installed these descriptors in
                // this process for us; nothing else owns them.
                fds.extend(
                    received
                        .into_iter()
                        .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }),
                );
            }
        }
        let truncated = msg
            .flags
            .intersects(MsgFlags::MSG_TRUNC | MsgFlags::MSG_CTRUNC);
        return Ok((msg.bytes, fds, truncated));
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt as _;

    use super::*;

    #[test]
    fn a_message_arrives_with_its_descriptors_and_a_closed_peer_ends_the_channel() {
        let (mine, theirs) = Channel::pair().expect("pair");
        let theirs = Channel::from_fd(theirs).expect("seqpacket");
        theirs
            .set_timeout(Duration::from_secs(10))
            .expect("timeout");
        let file = std::fs::File::open("/proc/self/exe").expect("a file to pass");
        mine.send(&Message::Offer { pid: 7, pods: 0 }, &[file.as_fd()])
            .expect("send");
        let (message, fds) = theirs.recv().expect("recv").expect("a message");
        assert!(matches!(message, Message::Offer { pid: 7, pods: 0 }));
        assert_eq!(fds.len(), 1);
        let passed = std::fs::File::from(fds.into_iter().next().expect("fd"));
        let (a, b) = (
            file.metadata().expect("stat"),
            passed.metadata().expect("stat"),
        );
        assert_eq!((a.dev(), a.ino()), (b.dev(), b.ino()));
        drop(mine);
        assert!(theirs.recv().expect("recv").is_none());
    }

    #[test]
    fn the_reply_carries_the_channel_over_a_stream() {
        let (a, b) = std::os::unix::net::UnixStream::pair().expect("pair");
        let (_mine, theirs) = Channel::pair().expect("channel");
        send_reply(a.as_fd(), b"{\"ok\":true}", &[theirs.as_fd()]).expect("send");
        drop(a);
        let (body, fds) = recv_reply(b.as_fd()).expect("recv");
        assert_eq!(body, b"{\"ok\":true}");
        assert_eq!(fds.len(), 1);
        assert!(Channel::from_fd(fds.into_iter().next().expect("fd")).is_ok());
    }
}
