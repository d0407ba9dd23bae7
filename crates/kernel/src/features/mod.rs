//! Kernel features the redirection programs need, probed when the agent
//! starts (before anything is loaded), so that a kernel lacking one is
//! refused with a message naming the feature and the kernel that brought it
//! (`needs sk_lookup programs: kernel >= 5.9`) instead of a verifier dump
//! half-way through loading.
//!
//! Probes load two-instruction programs, or issue a `bpf(2)` command with an
//! invalid descriptor whose error (`EBADF` rather than `EINVAL`) shows the
//! kernel knows the command; nothing is attached and nothing outlives a
//! probe. Program types and helpers go through aya's probes; expected
//! attach types and link commands, which aya cannot probe, through
//! `bpf(2)` directly (`bpf_syscall`).
//!
//! Three features have a cheaper fallback on older kernels, used and logged
//! ([`Fallback`]):
//!
//! - memory-cgroup accounting of BPF memory (5.11): before it, maps and
//!   programs count against `RLIMIT_MEMLOCK`, which is raised to unlimited;
//! - `SO_NETNS_COOKIE` (5.14): before it, a network namespace's cookie is
//!   read by a tiny `cgroup/connect4` program from the embedded probe
//!   object ([`netns_cookie_by_program`]);
//! - `bpf_get_netns_cookie` in `cgroup/getsockopt` programs (5.15): before
//!   it, the pods of external proxies have their original destinations
//!   keyed by tuple alone ([`SOCKOPT_NETNS_COOKIE`]).
//!
//! Every [`REQUIRED`] feature is in 5.9; the project is tested on 5.10, 6.1,
//! 6.12 and the host's kernel (`cargo xtask vm-test`).
//!
//! ```no_run
//! let support = dataplane_kernel::features::probe();
//! for missing in &support.missing {
//!     eprintln!("{}", missing.message()); // needs sk_lookup programs: kernel >= 5.9
//! }
//! ```

mod memlock;
mod netns_cookie;

use std::{
    fmt, io,
    os::{fd::AsFd, unix::net::UnixDatagram},
};

use aya::{
    programs::ProgramType,
    sys::{BpfHelper, is_helper_supported, is_program_supported},
};
use aya_obj::generated::{bpf_attach_type, bpf_func_id, bpf_prog_type};

use crate::bpf_syscall;

pub use netns_cookie::{CookieProbeError, PROBES_OBJECT, netns_cookie_by_program};

/// A kernel version: `(major, minor)`.
pub type KernelVersion = (u32, u32);

/// Oldest kernel the redirector works on: `sk_lookup` and `BPF_LINK_DETACH`
/// (5.9); `getpeername` hooks need 5.8, BPF links for cgroup programs and
/// netns cookies in `connect4`/`connect6` 5.7, `getsockopt` hooks 5.3 (5.15
/// to key external proxies' pods by namespace, see `dp_gsopt_tuple`).
pub const MIN_KERNEL: KernelVersion = (5, 9);

/// Test hook: the [`Requirement::key`] named here is probed with a probe no
/// kernel passes (a call to a helper beyond the last one), so the refusal
/// path runs against the real kernel. Not for production use.
pub const TEST_UNSUPPORTED_ENV: &str = "DATAPLANE_TEST_UNSUPPORTED_FEATURE";

/// One thing the agent needs from the kernel.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Requirement {
    /// Short stable name (`sk-lookup`).
    pub key: &'static str,
    /// What it is, as the refusal names it (`sk_lookup programs`).
    pub what: &'static str,
    /// The first kernel release that has it.
    pub since: KernelVersion,
    /// How to tell whether the running kernel has it.
    pub probe: Probe,
}

impl Requirement {
    /// The refusal line: `needs sk_lookup programs: kernel >= 5.9`.
    pub fn message(&self) -> String {
        format!(
            "needs {}: kernel >= {}.{}",
            self.what, self.since.0, self.since.1
        )
    }
}

/// How a feature is detected.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Probe {
    /// The kernel loads a trivial program of this type.
    Program(ProgramType),
    /// The kernel loads a trivial program of `program` type expecting
    /// `attach` (attach types were added after their program types).
    AttachType {
        /// The program type.
        program: bpf_prog_type,
        /// The expected attach type.
        attach: bpf_attach_type,
    },
    /// Programs of `program` type may call `helper`.
    Helper {
        /// The program type.
        program: ProgramType,
        /// The helper.
        helper: BpfHelper,
    },
    /// `BPF_LINK_CREATE` attaches cgroup programs (5.7).
    CgroupLink,
    /// `BPF_LINK_DETACH` exists (5.9).
    LinkDetach,
}

/// Everything the redirection programs and their loader need; all in 5.9.
pub const REQUIRED: &[Requirement] = &[
    Requirement {
        key: "cgroup-connect",
        what: "cgroup/connect4 and connect6 programs",
        since: (4, 17),
        probe: Probe::Program(ProgramType::CgroupSockAddr),
    },
    Requirement {
        key: "sockops",
        what: "sock_ops programs calling bpf_get_socket_cookie",
        since: (4, 20),
        probe: Probe::Helper {
            program: ProgramType::SockOps,
            helper: bpf_func_id::BPF_FUNC_get_socket_cookie,
        },
    },
    Requirement {
        key: "cgroup-getsockopt",
        what: "cgroup/getsockopt programs",
        since: (5, 3),
        probe: Probe::Program(ProgramType::CgroupSockopt),
    },
    Requirement {
        key: "netns-cookie-helper",
        what: "bpf_get_netns_cookie in cgroup/connect programs",
        since: (5, 7),
        probe: Probe::Helper {
            program: ProgramType::CgroupSockAddr,
            helper: bpf_func_id::BPF_FUNC_get_netns_cookie,
        },
    },
    Requirement {
        key: "cgroup-links",
        what: "BPF links for cgroup programs",
        since: (5, 7),
        probe: Probe::CgroupLink,
    },
    Requirement {
        key: "cgroup-getpeername",
        what: "cgroup/getpeername4 and getpeername6 programs",
        since: (5, 8),
        probe: Probe::AttachType {
            program: bpf_prog_type::BPF_PROG_TYPE_CGROUP_SOCK_ADDR,
            attach: bpf_attach_type::BPF_CGROUP_INET4_GETPEERNAME,
        },
    },
    Requirement {
        key: "sk-lookup",
        what: "sk_lookup programs",
        since: (5, 9),
        probe: Probe::Program(ProgramType::SkLookup),
    },
    Requirement {
        key: "link-detach",
        what: "BPF_LINK_DETACH",
        since: (5, 9),
        probe: Probe::LinkDetach,
    },
];

/// A probe no kernel passes: a call to the helper after the last one.
pub const NEVER_SUPPORTED: Probe = Probe::Helper {
    program: ProgramType::SocketFilter,
    helper: bpf_func_id::__BPF_FUNC_MAX_ID,
};

/// Whether `cgroup/getsockopt` programs can ask for the socket's network
/// namespace (5.15), which `SO_ORIGINAL_DST` answers for external proxies
/// need to tell pods apart.
pub const SOCKOPT_NETNS_COOKIE: Probe = Probe::Helper {
    program: ProgramType::CgroupSockopt,
    helper: bpf_func_id::BPF_FUNC_get_netns_cookie,
};

/// Memory-cgroup accounting of BPF memory arrived with this helper (libbpf
/// detects it the same way).
const MEMCG_ACCOUNTING: Probe = Probe::Helper {
    program: ProgramType::SocketFilter,
    helper: bpf_func_id::BPF_FUNC_ktime_get_coarse_ns,
};

/// A probe that could not decide (an unexpected error, e.g. `EPERM`).
#[derive(Debug, thiserror::Error)]
#[error("cannot probe for {what}: {reason}")]
pub struct ProbeError {
    /// The feature.
    pub what: &'static str,
    /// What went wrong.
    pub reason: String,
}

/// A cheaper way the agent works on a kernel that lacks a newer feature.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fallback {
    /// BPF memory counts against `RLIMIT_MEMLOCK` (no memory-cgroup
    /// accounting before 5.11): the limit is raised to unlimited.
    RaiseMemlock,
    /// No `SO_NETNS_COOKIE` (5.14): namespace cookies are read by a
    /// `cgroup/connect4` probe program.
    NetnsCookieByProgram,
    /// No `bpf_get_netns_cookie` in `cgroup/getsockopt` programs (5.15):
    /// the original destinations of pods served by external proxies are
    /// keyed by tuple alone.
    OrigDstByTuple,
}

impl fmt::Display for Fallback {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Fallback::RaiseMemlock => write!(
                f,
                "BPF memory counts against RLIMIT_MEMLOCK (memory-cgroup accounting needs \
                 kernel >= 5.11): raising RLIMIT_MEMLOCK to unlimited"
            ),
            Fallback::NetnsCookieByProgram => write!(
                f,
                "no SO_NETNS_COOKIE (kernel >= 5.14): reading network namespace cookies \
                 through a cgroup/connect4 probe program attached to the agent's own cgroup"
            ),
            Fallback::OrigDstByTuple => write!(
                f,
                "cgroup/getsockopt programs cannot read a socket's network namespace \
                 (kernel >= 5.15): pods served by an external proxy have their original \
                 destinations keyed by connection tuple alone, and two such pods dialling \
                 from the same source port at once may take each other's"
            ),
        }
    }
}

/// What the running kernel offers.
#[derive(Debug)]
pub struct KernelSupport {
    /// The running kernel's release (`uname -r`).
    pub release: String,
    /// Required features it lacks.
    pub missing: Vec<Requirement>,
    /// Probes that could not decide; loading will tell.
    pub undecided: Vec<ProbeError>,
    /// Fallbacks it needs.
    pub fallbacks: Vec<Fallback>,
}

/// Probes every [`REQUIRED`] feature and the fallbacks.
pub fn probe() -> KernelSupport {
    let pretend = std::env::var(TEST_UNSUPPORTED_ENV).ok();
    let requirements: Vec<Requirement> = REQUIRED
        .iter()
        .map(|r| match pretend.as_deref() {
            Some(key) if key == r.key => Requirement {
                probe: NEVER_SUPPORTED,
                ..*r
            },
            _ => *r,
        })
        .collect();
    let mut support = KernelSupport {
        release: kernel_release(),
        missing: Vec::new(),
        undecided: Vec::new(),
        fallbacks: Vec::new(),
    };
    // First, so that the other probes run under the limit the loader will
    // have (aya raises it by itself on EPERM too).
    if is_supported(MEMCG_ACCOUNTING) == Ok(false) {
        support.fallbacks.push(Fallback::RaiseMemlock);
    }
    for requirement in requirements {
        match is_supported(requirement.probe) {
            Ok(true) => {}
            Ok(false) => support.missing.push(requirement),
            Err(reason) => support.undecided.push(ProbeError {
                what: requirement.what,
                reason,
            }),
        }
    }
    if !has_so_netns_cookie() {
        support.fallbacks.push(Fallback::NetnsCookieByProgram);
    }
    if !sockopt_knows_netns() {
        support.fallbacks.push(Fallback::OrigDstByTuple);
    }
    support
}

/// Why a fallback could not be put in place.
#[derive(Debug, thiserror::Error)]
pub enum FallbackError {
    /// `RLIMIT_MEMLOCK` could not be raised.
    #[error(
        "BPF memory counts against RLIMIT_MEMLOCK on this kernel (memory-cgroup accounting \
         needs kernel >= 5.11) and it cannot be raised: grant CAP_SYS_RESOURCE or raise \
         the limit (ulimit -l unlimited; LimitMEMLOCK=infinity)"
    )]
    Memlock(#[source] io::Error),
    /// The netns-cookie probe program does not work.
    #[error(
        "this kernel has no SO_NETNS_COOKIE (kernel >= 5.14) and its fallback, a \
         cgroup/connect4 probe program, fails"
    )]
    NetnsCookie(#[source] CookieProbeError),
}

/// Puts `fallback` in place: raises the limit, or loads and tries the
/// netns-cookie probe on the agent's own namespace.
pub fn apply(fallback: Fallback) -> Result<(), FallbackError> {
    match fallback {
        Fallback::RaiseMemlock => memlock::raise().map(|_| ()).map_err(FallbackError::Memlock),
        // The redirector picks its getsockopt program by itself.
        Fallback::OrigDstByTuple => Ok(()),
        Fallback::NetnsCookieByProgram => {
            let (socket, _peer) = UnixDatagram::pair()
                .map_err(|e| FallbackError::NetnsCookie(CookieProbeError::Socket(e)))?;
            netns_cookie_by_program(socket.as_fd())
                .map(|_| ())
                .map_err(FallbackError::NetnsCookie)
        }
    }
}

/// Whether the running kernel passes `probe`; `Err` with the reason when
/// the probe could not decide.
pub fn is_supported(probe: Probe) -> Result<bool, String> {
    match probe {
        Probe::Program(program) => is_program_supported(program).map_err(|e| e.to_string()),
        Probe::Helper { program, helper } => {
            is_helper_supported(program, helper).map_err(|e| e.to_string())
        }
        Probe::AttachType { program, attach } => {
            match bpf_syscall::prog_load(program, Some(attach), &bpf_syscall::ALLOW, "dp_probe") {
                Ok(_) => Ok(true),
                // The kernel rejects an unknown expected attach type before
                // the verifier runs.
                Err(e) if e.log.is_empty() && e.error.raw_os_error() == Some(libc::EINVAL) => {
                    Ok(false)
                }
                Err(e) => Err(format!("{} ({})", e.error, e.log)),
            }
        }
        Probe::CgroupLink => {
            let program = bpf_syscall::prog_load(
                bpf_prog_type::BPF_PROG_TYPE_CGROUP_SOCK_ADDR,
                Some(bpf_attach_type::BPF_CGROUP_INET4_CONNECT),
                &bpf_syscall::ALLOW,
                "dp_probe",
            )
            .map_err(|e| format!("{} ({})", e.error, e.log))?;
            // An invalid cgroup descriptor: EBADF once the command exists.
            let result = bpf_syscall::link_create(
                program.as_fd(),
                u32::MAX,
                bpf_attach_type::BPF_CGROUP_INET4_CONNECT,
            );
            command_exists(result.map(drop))
        }
        Probe::LinkDetach => command_exists(bpf_syscall::link_detach(u32::MAX)),
    }
}

/// Reads the answer to a command issued with an invalid descriptor:
/// `EBADF` means the kernel knows the command, `EINVAL` that it does not.
fn command_exists(result: io::Result<()>) -> Result<bool, String> {
    match result {
        Err(e) if e.raw_os_error() == Some(libc::EBADF) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(false),
        Err(e) => Err(e.to_string()),
        Ok(()) => Err("the kernel accepted an invalid descriptor".to_owned()),
    }
}

/// Whether [`SOCKOPT_NETNS_COOKIE`] holds. A probe that cannot decide
/// counts as no: the fallback works on every kernel.
pub fn sockopt_knows_netns() -> bool {
    is_supported(SOCKOPT_NETNS_COOKIE) == Ok(true)
}

/// Whether `getsockopt(SO_NETNS_COOKIE)` works (5.14). Any other failure
/// than "no such option" counts as support: the option is then not the
/// problem.
pub fn has_so_netns_cookie() -> bool {
    let Ok((socket, _peer)) = UnixDatagram::pair() else {
        return true;
    };
    match crate::sockopt::sol_socket_u64(socket.as_fd(), libc::SO_NETNS_COOKIE) {
        Ok(_) => true,
        Err(err) => err.raw_os_error() != Some(libc::ENOPROTOOPT),
    }
}

/// `uname -r`, or `unknown`.
pub fn kernel_release() -> String {
    nix::sys::utsname::uname()
        .map(|u| u.release().to_string_lossy().into_owned())
        .unwrap_or_else(|_| "unknown".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_name_the_feature_and_the_kernel() {
        let sk_lookup = REQUIRED
            .iter()
            .find(|r| r.key == "sk-lookup")
            .expect("sk_lookup is required");
        assert_eq!(
            sk_lookup.message(),
            "needs sk_lookup programs: kernel >= 5.9"
        );
    }

    #[test]
    fn every_requirement_is_in_the_minimum_kernel() {
        for r in REQUIRED {
            assert!(r.since <= MIN_KERNEL, "{} needs {:?}", r.key, r.since);
        }
        let mut keys: Vec<_> = REQUIRED.iter().map(|r| r.key).collect();
        keys.sort_unstable();
        keys.dedup();
        assert_eq!(keys.len(), REQUIRED.len(), "keys are unique");
    }

    #[test]
    fn invalid_descriptor_answers_tell_whether_a_command_exists() {
        let err = |code| Err(io::Error::from_raw_os_error(code));
        assert_eq!(command_exists(err(libc::EBADF)), Ok(true));
        assert_eq!(command_exists(err(libc::EINVAL)), Ok(false));
        assert!(command_exists(err(libc::EPERM)).is_err());
    }
}
