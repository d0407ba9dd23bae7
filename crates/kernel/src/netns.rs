//! Network namespaces: their cookies (how the kernel programs name them) and
//! running code inside one.
//!
//! Cookies come from `SO_NETNS_COOKIE` (5.14); older kernels answer through
//! a BPF probe program ([`crate::features::netns_cookie_by_program`]).

use std::{
    fs::File,
    io,
    os::fd::{AsFd, BorrowedFd},
    path::{Path, PathBuf},
};

use nix::sched::{CloneFlags, setns};

/// Errors entering or inspecting a network namespace.
#[derive(Debug, thiserror::Error)]
pub enum NetnsError {
    /// The namespace file could not be opened.
    #[error("cannot open network namespace {path}")]
    Open {
        /// The namespace path (e.g. `/var/run/netns/NAME`, `/proc/PID/ns/net`).
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// `setns(2)` failed.
    #[error("cannot enter network namespace {path} (the agent needs CAP_SYS_ADMIN)")]
    Enter {
        /// The namespace path.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: nix::Error,
    },
    /// Reading the cookie failed.
    #[error("cannot read the cookie of network namespace {path}")]
    Cookie {
        /// The namespace path.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The helper thread died.
    #[error("the thread working in network namespace {path} panicked")]
    ThreadPanicked {
        /// The namespace path.
        path: PathBuf,
    },
}

/// The cookie of the network namespace `socket` belongs to.
pub fn socket_netns_cookie(socket: BorrowedFd<'_>) -> io::Result<u64> {
    let error = match crate::sockopt::sol_socket_u64(socket, libc::SO_NETNS_COOKIE) {
        Ok(cookie) => return Ok(cookie),
        Err(error) => error,
    };
    if error.raw_os_error() == Some(libc::ENOPROTOOPT) {
        // Before 5.14 only BPF programs can read the cookie.
        return crate::features::netns_cookie_by_program(socket).map_err(io::Error::other);
    }
    Err(error)
}

/// The cookie of the calling thread's network namespace.
pub fn current_netns_cookie() -> io::Result<u64> {
    // Any socket will do; a Unix datagram socket needs no address family
    // support beyond the basics and touches no network state.
    let (a, _b) = std::os::unix::net::UnixDatagram::pair()?;
    socket_netns_cookie(a.as_fd())
}

/// Runs `f` on a fresh thread that has joined the network namespace at
/// `path`. Sockets `f` creates stay in that namespace after it returns, which
/// is how in-pod listeners are made; the caller's threads never switch.
pub fn run_in_netns<T, F>(path: &Path, f: F) -> Result<T, NetnsError>
where
    T: Send + 'static,
    F: FnOnce() -> T + Send + 'static,
{
    let ns = File::open(path).map_err(|source| NetnsError::Open {
        path: path.to_path_buf(),
        source,
    })?;
    let owned_path = path.to_path_buf();
    let handle = std::thread::spawn(move || -> Result<T, NetnsError> {
        setns(ns.as_fd(), CloneFlags::CLONE_NEWNET).map_err(|source| NetnsError::Enter {
            path: owned_path,
            source,
        })?;
        Ok(f())
    });
    handle.join().map_err(|_| NetnsError::ThreadPanicked {
        path: path.to_path_buf(),
    })?
}

/// Runs `f` on a scoped thread that has joined the network namespace open
/// as `netns` (so `f` may borrow); the caller's thread never switches.
/// Netlink sockets, interface names and `/proc/thread-self/net` then
/// describe that namespace.
pub fn run_in_netns_fd<T: Send>(
    netns: BorrowedFd<'_>,
    f: impl FnOnce() -> T + Send,
) -> io::Result<T> {
    std::thread::scope(|scope| {
        scope
            .spawn(|| -> io::Result<T> {
                setns(netns, CloneFlags::CLONE_NEWNET).map_err(io::Error::from)?;
                Ok(f())
            })
            .join()
            .map_err(|_| io::Error::other("the thread inside the network namespace panicked"))?
    })
}

/// The cookie of the network namespace at `path`.
pub fn netns_cookie_of_path(path: &Path) -> Result<u64, NetnsError> {
    let owned = path.to_path_buf();
    run_in_netns(path, current_netns_cookie)?.map_err(|source| NetnsError::Cookie {
        path: owned,
        source,
    })
}
