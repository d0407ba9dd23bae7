//! A network namespace's cookie on kernels without `SO_NETNS_COOKIE`
//! (before 5.14): the cookie the redirection programs key pods by is only
//! reachable from BPF there, so a tiny `cgroup/connect4` program reads it.
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

use aya_obj::generated::{bpf_attach_type, bpf_func_id, bpf_map_type, bpf_prog_type};
use nix::sched::{CloneFlags, setns};
use socket2::{Domain, Socket, Type};

use super::{
    memlock,
    sys::{self, Insn, R0, R1, R2, R3, R4, R6, R10},
};

/// The destination the probe connection is addressed to.
const PROBE_DST: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::LOCALHOST, PROBE_PORT);
/// The discard port: nothing listens there, and nothing is sent anyway.
const PROBE_PORT: u16 = 9;
/// Entries in the probe map: concurrent look-ups in flight at most.
const MAX_IN_FLIGHT: u32 = 256;

/// `ioctl` that opens the network namespace of a socket (4.9).
const SIOCGSKNS: libc::c_ulong = 0x894c;

// Offsets in `struct bpf_sock_addr` (`include/uapi/linux/bpf.h`).
const USER_IP4: i16 = 4;
const USER_PORT: i16 = 24;

/// Why the fallback could not learn a cookie.
#[derive(Debug, thiserror::Error)]
pub enum CookieProbeError {
    /// The probe map could not be created.
    #[error("cannot create the netns-cookie probe map")]
    Map(#[source] io::Error),
    /// The verifier or the kernel rejected the probe program.
    #[error("cannot load the netns-cookie probe program: {log}")]
    Load {
        /// The verifier's log (empty if it did not run).
        log: String,
        /// The OS error.
        #[source]
        source: io::Error,
    },
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
        /// The OS error.
        #[source]
        source: io::Error,
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
/// made (closing the link's descriptor detaches it).
#[derive(Debug)]
struct CookieProbe {
    map: OwnedFd,
    _program: OwnedFd,
    _link: OwnedFd,
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
    let map = probe.map.as_fd();
    let recorded = sys::map_lookup_u64(map, socket_cookie).map_err(CookieProbeError::Map)?;
    let _ = sys::map_delete_u64(map, socket_cookie);
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
        let map = memlock::retry_raised(|| {
            sys::map_create_u64(
                bpf_map_type::BPF_MAP_TYPE_LRU_HASH,
                MAX_IN_FLIGHT,
                "dp_netns_cookie",
            )
        })
        .map_err(CookieProbeError::Map)?;
        let insns = program(map.as_fd());
        let mut log = String::new();
        let program = memlock::retry_raised(|| {
            sys::prog_load(
                bpf_prog_type::BPF_PROG_TYPE_CGROUP_SOCK_ADDR,
                Some(bpf_attach_type::BPF_CGROUP_INET4_CONNECT),
                &insns,
                "dp_netns_cookie",
            )
            .map_err(|e| {
                log = e.log;
                e.error
            })
        })
        .map_err(|source| CookieProbeError::Load {
            log: log.clone(),
            source,
        })?;
        let cgroup = own_cgroup().ok_or(CookieProbeError::NoCgroup)?;
        let dir = File::open(&cgroup).map_err(|source| CookieProbeError::Attach {
            cgroup: cgroup.clone(),
            source,
        })?;
        let target = u32::try_from(dir.as_raw_fd()).unwrap_or(u32::MAX);
        let link = sys::link_create(
            program.as_fd(),
            target,
            bpf_attach_type::BPF_CGROUP_INET4_CONNECT,
        )
        .map_err(|source| CookieProbeError::Attach { cgroup, source })?;
        Ok(Self {
            map,
            _program: program,
            _link: link,
        })
    }
}

/// The probe program: for a `connect()` to [`PROBE_DST`], records
/// `socket cookie -> netns cookie` in `map`; always allows the call.
fn program(map: BorrowedFd<'_>) -> Vec<Insn> {
    // Both fields hold network byte order in their low bytes.
    let ip = i32::from_ne_bytes(PROBE_DST.ip().octets());
    let port = i32::from(PROBE_PORT.to_be());
    let [map_lo, map_hi] = Insn::load_map_fd(R1, map);
    vec![
        Insn::mov_reg(R6, R1),
        Insn::load_u32(R2, R6, USER_PORT),
        Insn::jne_imm(R2, port, 16),
        Insn::load_u32(R2, R6, USER_IP4),
        Insn::jne_imm(R2, ip, 14),
        Insn::mov_reg(R1, R6),
        Insn::call(bpf_func_id::BPF_FUNC_get_socket_cookie as i32),
        Insn::store_u64(R10, -8, R0),
        Insn::mov_reg(R1, R6),
        Insn::call(bpf_func_id::BPF_FUNC_get_netns_cookie as i32),
        Insn::store_u64(R10, -16, R0),
        map_lo,
        map_hi,
        Insn::mov_reg(R2, R10),
        Insn::add_imm(R2, -8),
        Insn::mov_reg(R3, R10),
        Insn::add_imm(R3, -16),
        Insn::mov_imm(R4, 0),
        Insn::call(bpf_func_id::BPF_FUNC_map_update_elem as i32),
        // Both jumps land here.
        Insn::mov_imm(R0, 1),
        Insn::exit(),
    ]
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
    crate::netns::sol_socket_u64(socket, libc::SO_COOKIE)
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
    let mount = crate::preflight::cgroup2_mount()?;
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

    #[test]
    fn both_jumps_land_on_the_allow_verdict() {
        let dummy = std::fs::File::open("/dev/null").expect("open /dev/null");
        let insns = program(dummy.as_fd());
        let allow = insns.len() - 2;
        assert_eq!(insns[allow], Insn::mov_imm(R0, 1));
        let targets: Vec<_> = insns
            .iter()
            .enumerate()
            .filter_map(|(at, insn)| insn.jump_target(at))
            .collect();
        assert_eq!(targets, [allow, allow]);
    }
}
