//! Resetting one TCP socket of a pod through `sock_diag` (`SOCK_DESTROY`,
//! kernel 4.5 with `CONFIG_INET_DIAG_DESTROY`): the kernel aborts the
//! socket, its owner gets `ECONNABORTED` and the peer a reset.

use std::{
    io,
    mem::size_of,
    net::{IpAddr, SocketAddr},
    os::fd::{AsRawFd as _, BorrowedFd, FromRawFd as _, OwnedFd},
};

/// Why a socket could not be reset.
#[derive(Debug, thiserror::Error)]
pub enum DestroyError {
    /// Entering the pod's network namespace or the netlink exchange failed.
    #[error("sock_diag exchange in the pod's network namespace failed")]
    Io {
        /// The system error.
        #[source]
        source: io::Error,
    },
    /// The kernel refused (`EOPNOTSUPP`: built without
    /// `CONFIG_INET_DIAG_DESTROY`; the connection runs until it ends).
    #[error("the kernel refused SOCK_DESTROY (errno {errno}); is CONFIG_INET_DIAG_DESTROY set?")]
    Refused {
        /// The errno it answered.
        errno: i32,
    },
}

const SOCK_DESTROY: u16 = 21;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NLMSG_ERROR: u16 = 0x2;
const IPPROTO_TCP: u8 = 6;

/// `struct nlmsghdr` + `struct inet_diag_req_v2`.
#[repr(C)]
#[derive(Default)]
struct Request {
    len: u32,
    kind: u16,
    flags: u16,
    seq: u32,
    pid: u32,
    family: u8,
    protocol: u8,
    ext: u8,
    pad: u8,
    states: u32,
    sport_be: u16,
    dport_be: u16,
    src: [u8; 16],
    dst: [u8; 16],
    interface: u32,
    cookie: [u32; 2],
}

/// Resets the TCP socket with local address `local` and peer `remote` in
/// the network namespace `netns`. `Ok(false)`: no such socket (already
/// closed).
pub fn destroy(
    netns: BorrowedFd<'_>,
    local: SocketAddr,
    remote: SocketAddr,
) -> Result<bool, DestroyError> {
    let errno = crate::netns::run_in_netns_fd(netns, || exchange(local, remote))
        .and_then(|inner| inner)
        .map_err(|source| DestroyError::Io { source })?;
    match errno {
        0 => Ok(true),
        libc::ENOENT => Ok(false),
        errno => Err(DestroyError::Refused { errno }),
    }
}

/// Sends the request from inside the namespace; the errno of the ack.
fn exchange(local: SocketAddr, remote: SocketAddr) -> io::Result<i32> {
    // SAFETY: plain socket(2); the result is checked before use.
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            libc::NETLINK_SOCK_DIAG,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a descriptor we just created and own.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let timeout = libc::timeval {
        tv_sec: 2,
        tv_usec: 0,
    };
    // SAFETY: a valid option value of the right size.
    unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&raw const timeout).cast(),
            size_of::<libc::timeval>() as libc::socklen_t,
        )
    };
    let request = request(local, remote);
    // SAFETY: `request` is a plain repr(C) struct sent whole; the kernel
    // (pid 0) is the default destination of an unbound netlink socket.
    let sent = unsafe {
        libc::send(
            fd.as_raw_fd(),
            (&raw const request).cast(),
            size_of::<Request>(),
            0,
        )
    };
    if sent < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut answer = [0u8; 512];
    // SAFETY: the buffer is valid for its length.
    let got = unsafe { libc::recv(fd.as_raw_fd(), answer.as_mut_ptr().cast(), answer.len(), 0) };
    if got < 0 {
        return Err(io::Error::last_os_error());
    }
    let got = got as usize;
    // nlmsghdr (16 bytes), then for NLMSG_ERROR a negative errno.
    if got < 20 {
        return Err(io::Error::other("short sock_diag answer"));
    }
    let kind = u16::from_ne_bytes([answer[4], answer[5]]);
    if kind != NLMSG_ERROR {
        return Err(io::Error::other(format!(
            "unexpected sock_diag answer type {kind}"
        )));
    }
    let error = i32::from_ne_bytes([answer[16], answer[17], answer[18], answer[19]]);
    Ok(-error)
}

fn request(local: SocketAddr, remote: SocketAddr) -> Request {
    // An IPv4 connection (whatever the socket's family) is found through
    // the IPv4 tables; the kernel answers mapped IPv6 sockets there too.
    let (family, src, dst) = match (local.ip(), remote.ip()) {
        (IpAddr::V4(l), IpAddr::V4(r)) => (libc::AF_INET as u8, v4(l.octets()), v4(r.octets())),
        (l, r) => (libc::AF_INET6 as u8, to_v6(l).octets(), to_v6(r).octets()),
    };
    Request {
        len: size_of::<Request>() as u32,
        kind: SOCK_DESTROY,
        flags: NLM_F_REQUEST | NLM_F_ACK,
        family,
        protocol: IPPROTO_TCP,
        states: u32::MAX,
        sport_be: local.port().to_be(),
        dport_be: remote.port().to_be(),
        src,
        dst,
        // INET_DIAG_NOCOOKIE: match by the tuple alone.
        cookie: [u32::MAX, u32::MAX],
        ..Request::default()
    }
}

fn v4(octets: [u8; 4]) -> [u8; 16] {
    let mut out = [0; 16];
    out[..4].copy_from_slice(&octets);
    out
}

fn to_v6(ip: IpAddr) -> std::net::Ipv6Addr {
    match ip {
        IpAddr::V4(v4) => v4.to_ipv6_mapped(),
        IpAddr::V6(v6) => v6,
    }
}

const _: () = assert!(size_of::<Request>() == 16 + 56);
