//! Listener harvest: copies of an external in-pod proxy's listening sockets
//! (Istio's ztunnel), so that `sk_lookup` can hand the pod's inbound
//! connections to sockets another process owns.
//!
//! ztunnel opens its listeners inside each pod's network namespace itself
//! (after the agent hands it the namespace over ZDS); our `LISTENERS`
//! sockhash needs a descriptor of each to insert it. How one is found:
//!
//! 1. `pidfd_open(pid)` (kernel 5.3) pins the process, so a pid reused
//!    meanwhile cannot hand us another process's sockets;
//! 2. the inodes of the TCP sockets listening on the role ports *in the
//!    pod's namespace* are read from `/proc/thread-self/net/tcp` and
//!    `tcp6` on a thread that joined it, so a proxy holding thousands of
//!    connections costs one readlink per descriptor and no copy;
//! 3. `/proc/<pid>/fd` is walked (at most [`MAX_DESCRIPTORS`] entries),
//!    each `socket:[inode]` link with a candidate inode is copied with
//!    `pidfd_getfd` (kernel 5.6);
//! 4. each copy is checked: TCP, listening (`SO_ACCEPTCONN`), bound to a
//!    role port, and in the pod's namespace (`SIOCGSKNS` (4.9) compared by
//!    device and inode with the namespace file).
//!
//! Why not a BPF iterator over TCP sockets updating the sockhash (5.10+):
//! it would need one more program and a way to tell which of the
//! namespace's listeners belong to the proxy; the proxy's pid comes free
//! with the ZDS connection (`SO_PEERCRED`).
//!
//! Needs: `CAP_SYS_PTRACE` (`pidfd_getfd` asks for ptrace access to the
//! proxy), the proxy's pid visible in our pid namespace (on Kubernetes the
//! agent runs with `hostPID: true`), and `CAP_SYS_ADMIN` to join the pod's
//! namespace.

use std::{
    collections::HashSet,
    fs::File,
    io::{self, BufReader},
    net::SocketAddr,
    os::{
        fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd},
        linux::fs::MetadataExt,
    },
    path::PathBuf,
};

/// At most this many descriptors of the proxy are looked at (ztunnel's
/// own limit is the node's `RLIMIT_NOFILE`, typically 1,048,576; a proxy
/// with more open descriptors than this is refused with
/// [`HarvestError::TooManyDescriptors`] rather than walked for seconds).
pub const MAX_DESCRIPTORS: usize = 1 << 20;

/// `SIOCGSKNS` (`<linux/sockios.h>`): a descriptor of a socket's network
/// namespace.
const SIOCGSKNS: libc::c_ulong = 0x894c;

/// `TCP_LISTEN` as `/proc/net/tcp` prints a socket state.
const TCP_LISTEN: &str = "0A";

/// Errors of [`harvest_listeners`].
#[derive(Debug, thiserror::Error)]
pub enum HarvestError {
    /// The process is not there (it exited, or lives in a pid namespace the
    /// agent cannot see).
    #[error(
        "external proxy process {pid} is gone or not visible to the agent (on Kubernetes \
         the agent needs hostPID: true to see the proxy's pid)"
    )]
    ProcessGone {
        /// The proxy's pid, as the agent sees it.
        pid: u32,
    },
    /// The kernel refused access to the process's descriptors.
    #[error(
        "not allowed to copy descriptors of external proxy process {pid}: the agent needs \
         CAP_SYS_PTRACE (and hostPID: true on Kubernetes)"
    )]
    Permission {
        /// The proxy's pid.
        pid: u32,
        /// The OS error (`EPERM` or `EACCES`).
        #[source]
        source: io::Error,
    },
    /// A system call or `/proc` read failed for another reason.
    #[error("cannot {action} for external proxy process {pid}")]
    Os {
        /// What was being done (`pidfd_open`, `read /proc/<pid>/fd`, ...).
        action: String,
        /// The proxy's pid.
        pid: u32,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The pod's namespace could not be joined or inspected.
    #[error("cannot inspect the pod's network namespace ({what}); the agent needs CAP_SYS_ADMIN")]
    Netns {
        /// What failed.
        what: &'static str,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The process holds more descriptors than the harvest walks.
    #[error(
        "external proxy process {pid} holds more than {limit} descriptors; not walking them \
         (is it leaking descriptors?)"
    )]
    TooManyDescriptors {
        /// The proxy's pid.
        pid: u32,
        /// [`MAX_DESCRIPTORS`].
        limit: usize,
    },
    /// The process has no listener on a role port in the pod's namespace.
    #[error(
        "external proxy process {pid} has no TCP socket listening on port {port} in the pod's \
         network namespace (has it finished setting up the pod? harvest after it acknowledged \
         the pod)"
    )]
    NoListener {
        /// The proxy's pid.
        pid: u32,
        /// The port without a listener.
        port: u16,
    },
}

/// One listening socket copied from the proxy.
#[derive(Debug)]
pub struct HarvestedListener {
    /// Our copy of the socket (the proxy keeps its own).
    pub socket: OwnedFd,
    /// The address it listens on (`[::]:15006`, ...).
    pub local: SocketAddr,
    /// The socket's inode (as `/proc/<pid>/fd` names it).
    pub inode: u64,
}

/// Copies of every TCP socket the process `pid` has listening on one of
/// `ports` in the network namespace `netns`, each port at least once
/// (several sockets of one port are all returned: a `SO_REUSEPORT`
/// group). Fails with [`HarvestError::NoListener`] naming the first port
/// without one.
///
/// Blocking (reads `/proc`, briefly joins the namespace on a thread of its
/// own); call it from the enrollment thread, not from a thread carrying
/// traffic.
pub fn harvest_listeners(
    pid: u32,
    netns: BorrowedFd<'_>,
    ports: &[u16],
) -> Result<Vec<HarvestedListener>, HarvestError> {
    let pidfd = pidfd_open(pid)?;
    let wanted_ns =
        File::from(
            netns
                .try_clone_to_owned()
                .map_err(|source| HarvestError::Netns {
                    what: "duplicate its descriptor",
                    source,
                })?,
        )
        .metadata()
        .map_err(|source| HarvestError::Netns {
            what: "stat the namespace file",
            source,
        })?;
    let wanted_ns = (wanted_ns.st_dev(), wanted_ns.st_ino());
    let candidates = listening_inodes(netns, ports)?;

    let mut found = Vec::new();
    let fd_dir = PathBuf::from(format!("/proc/{pid}/fd"));
    let entries = std::fs::read_dir(&fd_dir).map_err(|source| proc_error(pid, &fd_dir, source))?;
    for (seen, entry) in entries.enumerate() {
        if seen >= MAX_DESCRIPTORS {
            return Err(HarvestError::TooManyDescriptors {
                pid,
                limit: MAX_DESCRIPTORS,
            });
        }
        // A descriptor closed while we walk is simply not there.
        let Ok(entry) = entry else { continue };
        let Some(target_fd) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
        else {
            continue;
        };
        let Ok(link) = std::fs::read_link(entry.path()) else {
            continue;
        };
        let Some(inode) = socket_inode(&link.to_string_lossy()) else {
            continue;
        };
        if !candidates.contains(&inode) {
            continue;
        }
        let socket = match pidfd_getfd(pidfd.as_fd(), target_fd) {
            Ok(socket) => socket,
            // Closed since the readlink.
            Err(err) if err.raw_os_error() == Some(libc::EBADF) => continue,
            Err(err) => return Err(getfd_error(pid, err)),
        };
        if let Some(local) = usable(socket.as_fd(), ports, wanted_ns) {
            found.push(HarvestedListener {
                socket,
                local,
                inode,
            });
        }
    }
    for port in ports {
        if !found.iter().any(|l| l.local.port() == *port) {
            return Err(HarvestError::NoListener { pid, port: *port });
        }
    }
    tracing::debug!(
        pid,
        listeners = found.len(),
        "external proxy listeners harvested"
    );
    Ok(found)
}

/// The listener's address when `socket` is a listening TCP socket on one
/// of `ports` in the namespace `(dev, ino)`.
fn usable(socket: BorrowedFd<'_>, ports: &[u16], netns: (u64, u64)) -> Option<SocketAddr> {
    let sock = socket2::SockRef::from(&socket);
    if sock.protocol().ok()?? != socket2::Protocol::TCP || !sock.is_listener().ok()? {
        return None;
    }
    let local = sock.local_addr().ok()?.as_socket()?;
    if !ports.contains(&local.port()) {
        return None;
    }
    let ns = socket_netns(socket).ok()?;
    let meta = File::from(ns).metadata().ok()?;
    ((meta.st_dev(), meta.st_ino()) == netns).then_some(local)
}

/// The inode in a `socket:[inode]` link.
fn socket_inode(link: &str) -> Option<u64> {
    link.strip_prefix("socket:[")?
        .strip_suffix(']')?
        .parse()
        .ok()
}

/// Inodes of the TCP sockets listening on `ports` in the namespace
/// `netns`, read on a thread that joined it.
fn listening_inodes(netns: BorrowedFd<'_>, ports: &[u16]) -> Result<HashSet<u64>, HarvestError> {
    crate::netns::run_in_netns_fd(netns, || -> Result<HashSet<u64>, HarvestError> {
        let mut inodes = HashSet::new();
        for table in ["/proc/thread-self/net/tcp", "/proc/thread-self/net/tcp6"] {
            match File::open(table) {
                Ok(file) => {
                    read_listeners(BufReader::new(file), ports, &mut inodes).map_err(|source| {
                        HarvestError::Netns {
                            what: "read its TCP socket table",
                            source,
                        }
                    })?
                }
                // No IPv6 in this kernel.
                Err(err) if err.kind() == io::ErrorKind::NotFound => {}
                Err(source) => {
                    return Err(HarvestError::Netns {
                        what: "open its TCP socket table",
                        source,
                    });
                }
            }
        }
        Ok(inodes)
    })
    .map_err(|source| HarvestError::Netns {
        what: "join it",
        source,
    })?
}

/// Adds the inodes of the lines of a `/proc/net/tcp{,6}` table that
/// listen on one of `ports`.
fn read_listeners(
    table: impl io::BufRead,
    ports: &[u16],
    inodes: &mut HashSet<u64>,
) -> io::Result<()> {
    // `sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode ...`
    for line in table.lines().skip(1) {
        let line = line?;
        let fields: Vec<&str> = line.split_whitespace().take(10).collect();
        let [_, local, _, state, _, _, _, _, _, inode] = fields[..] else {
            continue;
        };
        if state != TCP_LISTEN {
            continue;
        }
        let port = local
            .rsplit_once(':')
            .and_then(|(_, port)| u16::from_str_radix(port, 16).ok());
        if port.is_some_and(|p| ports.contains(&p))
            && let Ok(inode) = inode.parse()
        {
            inodes.insert(inode);
        }
    }
    Ok(())
}

fn pidfd_open(pid: u32) -> Result<OwnedFd, HarvestError> {
    let raw_pid = libc::pid_t::try_from(pid).map_err(|_| HarvestError::ProcessGone { pid })?;
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, raw_pid, 0) };
    if fd < 0 {
        let err = io::Error::last_os_error();
        return Err(match err.raw_os_error() {
            Some(libc::ESRCH) => HarvestError::ProcessGone { pid },
            _ => HarvestError::Os {
                action: "pidfd_open (kernel >= 5.3)".into(),
                pid,
                source: err,
            },
        });
    }
    // SAFETY: a descriptor the kernel just created for us.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

fn pidfd_getfd(pidfd: BorrowedFd<'_>, target_fd: i32) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_getfd takes a pidfd, a descriptor number and flags and
    // returns a new descriptor in our table.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), target_fd, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a descriptor the kernel just installed for us.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// A descriptor of the network namespace `socket` lives in.
fn socket_netns(socket: BorrowedFd<'_>) -> io::Result<OwnedFd> {
    // SAFETY: SIOCGSKNS takes no argument and returns a new descriptor.
    let fd = unsafe { libc::ioctl(socket.as_raw_fd(), SIOCGSKNS as _) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a descriptor the kernel just created for us.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn proc_error(pid: u32, path: &std::path::Path, source: io::Error) -> HarvestError {
    match source.raw_os_error() {
        Some(libc::ENOENT | libc::ESRCH) => HarvestError::ProcessGone { pid },
        Some(libc::EPERM | libc::EACCES) => HarvestError::Permission { pid, source },
        _ => HarvestError::Os {
            action: format!("read {}", path.display()),
            pid,
            source,
        },
    }
}

fn getfd_error(pid: u32, source: io::Error) -> HarvestError {
    match source.raw_os_error() {
        Some(libc::ESRCH) => HarvestError::ProcessGone { pid },
        Some(libc::EPERM | libc::EACCES) => HarvestError::Permission { pid, source },
        _ => HarvestError::Os {
            action: "pidfd_getfd (kernel >= 5.6)".into(),
            pid,
            source,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tcp_table_yields_the_listeners_on_the_ports_asked() {
        let table = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000:3A9E 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 111 1 0000000000000000 100 0 0 10 0
   1: 00000000:3A98 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 222 1 0000000000000000 100 0 0 10 0
   2: 0A01000B:3A9E 0A01000C:C350 01 00000000:00000000 00:00000000 00000000     0        0 333 1 0000000000000000 20 4 30 10 -1
   3: 00000000000000000000000000000000:3AA0 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 444 1
";
        let mut inodes = HashSet::new();
        read_listeners(table.as_bytes(), &[15006, 15008], &mut inodes).expect("in memory");
        // 0x3A9E = 15006 listening, 0x3AA0 = 15008 (IPv6); 15000 is not
        // asked for and 333 is an established connection.
        assert_eq!(inodes, HashSet::from([111, 444]));
    }

    #[test]
    fn only_socket_links_name_an_inode() {
        assert_eq!(socket_inode("socket:[4242]"), Some(4242));
        assert_eq!(socket_inode("pipe:[4242]"), None);
        assert_eq!(socket_inode("/dev/null"), None);
    }

    #[test]
    fn a_missing_process_is_named_as_gone() {
        // Pid numbers never reach i32::MAX on Linux (pid_max <= 2^22).
        let netns = File::open("/proc/self/ns/net").expect("own namespace");
        let Err(err) = harvest_listeners(i32::MAX as u32, netns.as_fd(), &[15006]) else {
            panic!("no such process, yet a harvest");
        };
        assert!(matches!(err, HarvestError::ProcessGone { .. }), "{err}");
    }
}
