//! A network namespace's cookie on kernels without `SO_NETNS_COOKIE`
//! (before 5.14): the cookie the redirection programs key pods by is only
//! reachable from BPF there, so a tiny `cgroup/connect4` program reads it
//! (`dp_netns_cookie`, in `dataplane-ebpf/src/netns_cookie.rs`, built into
//! the embedded probe object [`PROBES_OBJECT`]).
//!
//! The program is attached (through a BPF link, not pinned) to the agent's
//! own cgroup, so it runs only for the agent's sockets. To learn the cookie
//! of a namespace, a helper thread joins it, creates a UDP socket and
//! `connect()`s it to `127.0.0.1:9`: nothing is sent (a UDP connect only
//! sets the default peer), but the program runs first and records
//! `socket cookie -> netns cookie` in its map, which the thread's caller
//! reads (with `SO_COOKIE`) and deletes. The link goes away with the agent,
//! so nothing outlives it. Minimum kernel: 5.7 (`bpf_get_netns_cookie` in
//! `cgroup/connect4`, BPF links for cgroup programs), below the agent's own
//! minimum.

use std::{
    fs::File,
    io,
    net::{Ipv4Addr, SocketAddrV4},
    os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd},
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
};

use aya::{
    Ebpf, EbpfLoader,
    maps::{HashMap, MapData},
    programs::{CgroupAttachMode, CgroupSockAddr},
};
use dataplane_common::maps::{
    NETNS_COOKIE_PROBE_ADDR, NETNS_COOKIE_PROBE_PORT, NETNS_COOKIES, PROG_NETNS_COOKIE,
};
use nix::sched::{CloneFlags, setns};
use socket2::{Domain, Socket, Type};

/// The probe object (`dataplane-ebpf/src/probes.rs`), built by `build.rs`
/// with the redirection object and kept apart from it so that loading the
/// probe creates none of the redirection maps.
pub static PROBES_OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/dataplane-probes"));

/// The destination the probe connection is addressed to.
const PROBE_DST: SocketAddrV4 = SocketAddrV4::new(
    Ipv4Addr::from_bits(NETNS_COOKIE_PROBE_ADDR),
    NETNS_COOKIE_PROBE_PORT,
);

/// `ioctl` that opens the network namespace of a socket (4.9).
const SIOCGSKNS: libc::c_ulong = 0x894c;

/// Why the fallback could not learn a cookie.
#[derive(Debug, thiserror::Error)]
pub enum CookieProbeError {
    /// The probe object (its map) could not be loaded.
    #[error("cannot load the netns-cookie probe object")]
    Object {
        /// aya's error.
        #[source]
        source: Box<aya::EbpfError>,
    },
    /// The probe object lacks its program or map, or it has the wrong type.
    #[error(
        "the embedded probe object has no usable `{name}`; agent and object are out of step \
         (rebuild)"
    )]
    Missing {
        /// Program or map name.
        name: &'static str,
    },
    /// Reading or deleting the probe map's entry failed.
    #[error("cannot read the netns-cookie probe map")]
    Map(#[source] aya::maps::MapError),
    /// The verifier or the kernel rejected the probe program.
    #[error("cannot load the netns-cookie probe program")]
    Load(#[source] aya::programs::ProgramError),
    /// The agent's cgroup v2 directory is unknown.
    #[error(
        "cannot find the agent's own cgroup v2 directory (in /proc/self/cgroup and \
         /proc/self/mountinfo)"
    )]
    NoCgroup,
    /// Attaching the probe program to the agent's cgroup failed.
    #[error("cannot attach the netns-cookie probe program to {cgroup}")]
    Attach {
        /// The agent's cgroup directory.
        cgroup: PathBuf,
        /// The OS or aya error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// Opening the socket's network namespace, entering it or making the
    /// probe socket failed.
    #[error("cannot open a probe socket in the socket's network namespace")]
    Socket(#[source] io::Error),
    /// The program did not record the probe connection.
    #[error(
        "the netns-cookie probe program did not see the probe connection (is another \
         cgroup program refusing connect() before it?)"
    )]
    NotRecorded,
}

/// The loaded and attached probe: held for the process's lifetime once
/// made (the object owns the program's link; dropping it detaches).
struct CookieProbe {
    /// `NETNS_COOKIES`, taken out of the object; locked because look-ups
    /// delete their entry.
    map: Mutex<HashMap<MapData, u64, u64>>,
    _object: Ebpf,
}

impl std::fmt::Debug for CookieProbe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CookieProbe").finish_non_exhaustive()
    }
}

/// The probe, made on first use.
static PROBE: Mutex<Option<Arc<CookieProbe>>> = Mutex::new(None);

/// The cookie of the network namespace `socket` belongs to, learned through
/// the probe program (loaded and attached on first use).
pub fn netns_cookie_by_program(socket: BorrowedFd<'_>) -> Result<u64, CookieProbeError> {
    let probe = shared_probe()?;
    let netns = netns_of(socket).map_err(CookieProbeError::Socket)?;
    let socket_cookie = std::thread::scope(|scope| {
        scope
            .spawn(|| probe_connect(netns.as_fd()))
            .join()
            .unwrap_or_else(|_| Err(io::Error::other("the probe thread panicked")))
    })
    .map_err(CookieProbeError::Socket)?;
    let mut map = probe
        .map
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let recorded = match map.get(&socket_cookie, 0) {
        Ok(netns_cookie) => Some(netns_cookie),
        Err(aya::maps::MapError::KeyNotFound) => None,
        Err(err) => return Err(CookieProbeError::Map(err)),
    };
    // The socket is gone: its entry can only be stale now.
    let _ = map.remove(&socket_cookie);
    recorded.ok_or(CookieProbeError::NotRecorded)
}

fn shared_probe() -> Result<Arc<CookieProbe>, CookieProbeError> {
    let mut slot = PROBE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(probe) = slot.as_ref() {
        return Ok(Arc::clone(probe));
    }
    let probe = Arc::new(CookieProbe::attach()?);
    *slot = Some(Arc::clone(&probe));
    Ok(probe)
}

impl CookieProbe {
    fn attach() -> Result<Self, CookieProbeError> {
        let mut object = load_object()?;
        let program: &mut CgroupSockAddr = object
            .program_mut(PROG_NETNS_COOKIE)
            .and_then(|p| p.try_into().ok())
            .ok_or(CookieProbeError::Missing {
                name: PROG_NETNS_COOKIE,
            })?;
        program.load().map_err(CookieProbeError::Load)?;
        let cgroup = own_cgroup().ok_or(CookieProbeError::NoCgroup)?;
        let dir = File::open(&cgroup).map_err(|source| CookieProbeError::Attach {
            cgroup: cgroup.clone(),
            source: Box::new(source),
        })?;
        // Through a BPF link (5.7; aya uses one whenever the kernel has
        // them): other programs on the cgroup keep running beside it.
        program
            .attach(dir, CgroupAttachMode::Single)
            .map_err(|source| CookieProbeError::Attach {
                cgroup,
                source: Box::new(source),
            })?;
        let map = object
            .take_map(NETNS_COOKIES)
            .and_then(|map| HashMap::try_from(map).ok())
            .ok_or(CookieProbeError::Missing {
                name: NETNS_COOKIES,
            })?;
        Ok(Self {
            map: Mutex::new(map),
            _object: object,
        })
    }
}

/// Loads the probe object, creating its map (aya raises `RLIMIT_MEMLOCK`
/// itself when a kernel before 5.11 counts BPF memory against it).
fn load_object() -> Result<Ebpf, CookieProbeError> {
    EbpfLoader::new()
        .load(PROBES_OBJECT)
        .map_err(|source| CookieProbeError::Object {
            source: Box::new(source),
        })
}

/// On a fresh thread inside `netns`: a UDP socket connected to
/// [`PROBE_DST`]; returns its socket cookie.
fn probe_connect(netns: BorrowedFd<'_>) -> io::Result<u64> {
    setns(netns, CloneFlags::CLONE_NEWNET).map_err(io::Error::from)?;
    let socket = Socket::new(Domain::IPV4, Type::DGRAM.cloexec(), None)?;
    let cookie = socket_cookie(socket.as_fd())?;
    // The program has run once connect() returns, whatever it returns (a
    // namespace whose loopback is down answers ENETUNREACH).
    let _ = socket.connect(&PROBE_DST.into());
    Ok(cookie)
}

/// `SO_COOKIE` (4.12) of `socket`.
fn socket_cookie(socket: BorrowedFd<'_>) -> io::Result<u64> {
    crate::sockopt::sol_socket_u64(socket, libc::SO_COOKIE)
}

/// The network namespace `socket` belongs to (`SIOCGSKNS`).
fn netns_of(socket: BorrowedFd<'_>) -> io::Result<OwnedFd> {
    // SAFETY: SIOCGSKNS takes no argument and returns a new descriptor.
    let fd = unsafe { libc::ioctl(socket.as_raw_fd(), SIOCGSKNS as _) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel just returned this new descriptor; nobody else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The agent's own cgroup v2 directory: its `0::` line of
/// `/proc/self/cgroup` under the cgroup2 mount.
fn own_cgroup() -> Option<PathBuf> {
    let membership = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let relative = cgroup_v2_path(&membership)?;
    let mount = dataplane_core::fs::cgroup2_mount()?;
    Some(mount.join(relative.strip_prefix("/").unwrap_or(relative)))
}

/// The cgroup v2 path in `/proc/<pid>/cgroup` text (`0::/a/b`).
fn cgroup_v2_path(membership: &str) -> Option<&Path> {
    membership
        .lines()
        .find_map(|line| line.strip_prefix("0::"))
        .map(Path::new)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_cgroup_v2_line() {
        let hybrid = "12:cpuset:/\n1:name=systemd:/user.slice\n0::/user.slice/session-1.scope\n";
        assert_eq!(
            cgroup_v2_path(hybrid),
            Some(Path::new("/user.slice/session-1.scope"))
        );
        assert_eq!(cgroup_v2_path("0::/\n"), Some(Path::new("/")));
        assert_eq!(cgroup_v2_path("3:memory:/x\n"), None);
    }
}
