//! `RLIMIT_MEMLOCK`, which BPF maps and programs count against on kernels
//! without memory-cgroup accounting of BPF memory (before 5.11).

use std::io;

/// Raises `RLIMIT_MEMLOCK` to unlimited (needs `CAP_SYS_RESOURCE` unless
/// the hard limit already is). Returns the soft limit it replaced, `None`
/// when it already was unlimited.
pub(crate) fn raise() -> io::Result<Option<u64>> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: a valid out-pointer to an rlimit.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut limit) } != 0 {
        return Err(io::Error::last_os_error());
    }
    if limit.rlim_cur == libc::RLIM_INFINITY {
        return Ok(None);
    }
    let unlimited = libc::rlimit {
        rlim_cur: libc::RLIM_INFINITY,
        rlim_max: libc::RLIM_INFINITY,
    };
    // SAFETY: a valid pointer to an initialised rlimit.
    if unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &unlimited) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(Some(limit.rlim_cur))
}
