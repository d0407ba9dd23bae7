//! A ZDS client that behaves as ztunnel's in-pod mode does toward the node
//! agent (its `src/inpod/protocol.rs`, `packet.rs` and `statemanager.rs`):
//! it connects over unix `SOCK_SEQPACKET`, says `ZdsHello{V1}`, reads
//! every request with `recvmsg` into a 1,024-byte buffer, rejects a
//! truncated one, takes exactly one descriptor with an Add and none with
//! anything else, and treats what ztunnel treats as protocol errors (an
//! Add without `workload_info`, Keep after the snapshot, a second
//! `SnapshotSent`) as errors. Acks and nacks are the test's choice.
//!
//! Blocking, with a generous read timeout, so a test never hangs.

use std::{
    io::{IoSlice, IoSliceMut},
    os::{
        fd::{AsRawFd, FromRawFd, OwnedFd, RawFd},
        unix::fs::MetadataExt,
    },
    path::Path,
    time::Duration,
};

use anyhow::{Context as _, anyhow, bail};
use dataplane_user::istio_api::zds::{
    Ack, Version, WorkloadRequest, WorkloadResponse, ZdsHello, workload_request::Payload,
    workload_response,
};
use nix::sys::socket::{
    self, AddressFamily, ControlMessageOwned, MsgFlags, SockFlag, SockType, UnixAddr, sockopt,
};
use prost::Message as _;

/// How long a read waits before the test fails (a liveness bound, not a
/// speed assertion).
pub const READ_TIMEOUT: Duration = Duration::from_secs(30);

/// One request from the node agent, as ztunnel parses it.
#[derive(Debug)]
pub enum ZdsRequest {
    /// Start proxying a pod.
    Add {
        /// The pod's uid.
        uid: String,
        /// Pod name.
        name: String,
        /// Kubernetes namespace.
        namespace: String,
        /// Service account.
        service_account: String,
        /// The network namespace that came with it.
        netns: OwnedFd,
    },
    /// Keep a pod (only inside the snapshot).
    Keep {
        /// The pod's uid.
        uid: String,
    },
    /// Stop proxying a pod.
    Del {
        /// The pod's uid.
        uid: String,
    },
    /// The snapshot is complete.
    SnapshotSent,
}

impl ZdsRequest {
    /// The uid of an Add, Keep or Del.
    pub fn uid(&self) -> Option<&str> {
        match self {
            Self::Add { uid, .. } | Self::Keep { uid } | Self::Del { uid } => Some(uid),
            Self::SnapshotSent => None,
        }
    }
}

/// A connected stand-in for ztunnel.
#[derive(Debug)]
pub struct ZdsClient {
    sock: OwnedFd,
    snapshot_received: bool,
}

impl ZdsClient {
    /// Connects and says hello, as ztunnel does.
    pub fn connect(path: &Path) -> anyhow::Result<Self> {
        let client = Self::connect_silent(path)?;
        client.send_raw(
            &ZdsHello {
                version: Version::V1 as i32,
            }
            .encode_to_vec(),
        )?;
        Ok(client)
    }

    /// Connects without saying anything (for tests of misbehaving peers).
    pub fn connect_silent(path: &Path) -> anyhow::Result<Self> {
        let sock = socket::socket(
            AddressFamily::Unix,
            SockType::SeqPacket,
            SockFlag::SOCK_CLOEXEC,
            None,
        )?;
        let addr = UnixAddr::new(path)?;
        socket::connect(sock.as_raw_fd(), &addr)
            .with_context(|| format!("connecting to the ZDS server at {}", path.display()))?;
        let timeout = nix::sys::time::TimeVal::new(READ_TIMEOUT.as_secs() as _, 0);
        socket::setsockopt(&sock, sockopt::ReceiveTimeout, &timeout)?;
        socket::setsockopt(&sock, sockopt::SendTimeout, &timeout)?;
        Ok(Self {
            sock,
            snapshot_received: false,
        })
    }

    /// Sends one datagram as is.
    pub fn send_raw(&self, data: &[u8]) -> anyhow::Result<()> {
        let iov = [IoSlice::new(data)];
        socket::sendmsg::<()>(
            self.sock.as_raw_fd(),
            &iov,
            &[],
            MsgFlags::MSG_NOSIGNAL,
            None,
        )
        .context("sending to the ZDS server")?;
        Ok(())
    }

    /// Sends one datagram with a descriptor attached (ztunnel never does).
    pub fn send_with_fd(&self, data: &[u8], fd: &OwnedFd) -> anyhow::Result<()> {
        let iov = [IoSlice::new(data)];
        let fds = [fd.as_raw_fd()];
        let rights = [socket::ControlMessage::ScmRights(&fds)];
        socket::sendmsg::<()>(
            self.sock.as_raw_fd(),
            &iov,
            &rights,
            MsgFlags::MSG_NOSIGNAL,
            None,
        )
        .context("sending to the ZDS server")?;
        Ok(())
    }

    /// Answers the last request with success.
    pub fn ack(&self) -> anyhow::Result<()> {
        self.answer(String::new())
    }

    /// Answers the last request with an error, as ztunnel does when it
    /// cannot start a pod's proxy.
    pub fn nack(&self, error: &str) -> anyhow::Result<()> {
        self.answer(error.to_owned())
    }

    fn answer(&self, error: String) -> anyhow::Result<()> {
        let response = WorkloadResponse {
            payload: Some(workload_response::Payload::Ack(Ack { error })),
        };
        self.send_raw(&response.encode_to_vec())
    }

    /// The next request, or `None` when the server closed the connection.
    /// Fails as ztunnel would on a malformed one.
    pub fn recv(&mut self) -> anyhow::Result<Option<ZdsRequest>> {
        let mut buf = [0u8; 1024];
        let mut cmsg = nix::cmsg_space!([RawFd; 2]);
        let mut iov = [IoSliceMut::new(&mut buf)];
        let msg = socket::recvmsg::<()>(
            self.sock.as_raw_fd(),
            &mut iov,
            Some(&mut cmsg),
            MsgFlags::MSG_CMSG_CLOEXEC,
        )
        .map_err(|e| {
            anyhow!("reading from the ZDS server: {e} (nothing within {READ_TIMEOUT:?}?)")
        })?;
        let mut fds = Vec::new();
        for cmsg in msg.cmsgs()? {
            if let ControlMessageOwned::ScmRights(received) = cmsg {
                // SAFETY: SCM_RIGHTS installed these descriptors for us.
                fds.extend(
                    received
                        .into_iter()
                        .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }),
                );
            }
        }
        let (len, flags) = (msg.bytes, msg.flags);
        if flags.intersects(MsgFlags::MSG_TRUNC | MsgFlags::MSG_CTRUNC) {
            bail!("received truncated message");
        }
        if len == 0 && fds.is_empty() {
            return Ok(None);
        }
        let request = WorkloadRequest::decode(&buf[..len])?;
        let payload = request.payload.ok_or_else(|| anyhow!("no payload"))?;
        let mut fds = fds.into_iter();
        let (fd, extra) = (fds.next(), fds.next());
        if extra.is_some() {
            bail!("expected one descriptor, got more");
        }
        Ok(Some(match (payload, fd) {
            (Payload::Add(add), Some(netns)) => {
                let info = add
                    .workload_info
                    .ok_or_else(|| anyhow!("protocol error: workload_info is required"))?;
                ZdsRequest::Add {
                    uid: add.uid,
                    name: info.name,
                    namespace: info.namespace,
                    service_account: info.service_account,
                    netns,
                }
            }
            (Payload::Add(_), None) => bail!("an Add without a descriptor"),
            (_, Some(_)) => bail!("a descriptor with something other than an Add"),
            (Payload::Keep(keep), None) => {
                if self.snapshot_received {
                    bail!("protocol error: keep after the snapshot");
                }
                ZdsRequest::Keep { uid: keep.uid }
            }
            (Payload::Del(del), None) => ZdsRequest::Del { uid: del.uid },
            (Payload::SnapshotSent(_), None) => {
                if self.snapshot_received {
                    bail!("protocol error: a second SnapshotSent");
                }
                self.snapshot_received = true;
                ZdsRequest::SnapshotSent
            }
        }))
    }

    /// The next request, failing if the server closed instead.
    pub fn expect(&mut self) -> anyhow::Result<ZdsRequest> {
        self.recv()?
            .ok_or_else(|| anyhow!("the ZDS server closed the connection"))
    }

    /// Reads and acks everything up to and including `SnapshotSent`;
    /// returns the Adds (and Keeps) of the snapshot.
    pub fn ack_snapshot(&mut self) -> anyhow::Result<Vec<ZdsRequest>> {
        let mut snapshot = Vec::new();
        loop {
            let request = self.expect()?;
            self.ack()?;
            match request {
                ZdsRequest::SnapshotSent => return Ok(snapshot),
                ZdsRequest::Del { uid } => bail!("a Del of {uid} inside the snapshot"),
                other => snapshot.push(other),
            }
        }
    }

    /// Waits until the server closes the connection, failing on any
    /// request meanwhile.
    pub fn expect_closed(&mut self) -> anyhow::Result<()> {
        match self.recv() {
            Ok(None) => Ok(()),
            // A reset is a close too.
            Err(e) if is_reset(&e) => Ok(()),
            Ok(Some(request)) => bail!("expected the server to close, got {request:?}"),
            Err(e) => Err(e),
        }
    }
}

fn is_reset(error: &anyhow::Error) -> bool {
    error.to_string().contains("ECONNRESET")
}

/// The inode of a namespace descriptor or file (how ztunnel tells pods'
/// namespaces apart).
pub fn inode_of_fd(fd: &OwnedFd) -> anyhow::Result<u64> {
    let stat = nix::sys::stat::fstat(fd)?;
    Ok(stat.st_ino)
}

/// The inode of the namespace file at `path`.
pub fn inode_of_path(path: &Path) -> anyhow::Result<u64> {
    Ok(std::fs::metadata(path)?.ino())
}
