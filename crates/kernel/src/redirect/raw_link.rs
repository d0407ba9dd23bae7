//! The link steps aya 0.14 does not offer, on top of the agent's own
//! `bpf(2)` commands ([`crate::bpf_syscall`]):
//!
//! - creating a `cgroup/getsockopt` link: aya's `CgroupSockoptLink` has no
//!   conversion to `FdLink`, so the link is created directly, pinned at a
//!   temporary path, and re-opened through aya as an ordinary [`FdLink`];
//!   every other step (make-before-break replacement, unpinning) stays the
//!   same for all programs;
//! - `BPF_LINK_DETACH` (kernel 5.9), which detaches a link at once. Dropping
//!   the last reference detaches too, but when that reference is a bpffs pin
//!   the kernel frees it later from a work queue, so a program would keep
//!   running for a moment after its pin is gone.

use std::{
    io,
    os::fd::{AsFd, AsRawFd, BorrowedFd},
    path::Path,
};

use aya::{
    programs::{
        ProgramError,
        links::{FdLink, PinnedLink},
    },
    sys::SyscallError,
};
use aya_obj::generated::bpf_attach_type;

use crate::bpf_syscall;

/// Attaches `program` to `target` (a cgroup directory) at `attach_type`
/// through a new BPF link, returned as an aya [`FdLink`]. `scratch` is a
/// free path on bpffs used for the hand-over; it is removed again.
pub(crate) fn cgroup_link(
    program: BorrowedFd<'_>,
    target: BorrowedFd<'_>,
    attach_type: bpf_attach_type,
    scratch: &Path,
) -> Result<FdLink, ProgramError> {
    let target = u32::try_from(target.as_raw_fd())
        .map_err(|_| syscall_error("bpf_link_create", io::ErrorKind::InvalidInput.into()))?;
    let link = bpf_syscall::link_create(program, target, attach_type)
        .map_err(|io_error| syscall_error("bpf_link_create", io_error))?;
    // A stale scratch pin (a crash half-way) would make the pin fail.
    let _ = std::fs::remove_file(scratch);
    bpf_syscall::obj_pin(link.as_fd(), scratch)
        .map_err(|io_error| syscall_error("BPF_OBJ_PIN", io_error))?;
    let pinned = PinnedLink::from_pin(scratch)
        .map_err(|err| syscall_error("BPF_OBJ_GET", io::Error::other(err)));
    // The pin (and `pinned`) hold the link now.
    drop(link);
    match pinned {
        Ok(pinned) => pinned
            .unpin()
            .map_err(|io_error| syscall_error("unlink", io_error)),
        Err(err) => {
            let _ = std::fs::remove_file(scratch);
            Err(err)
        }
    }
}

/// Detaches the link pinned at `path` at once (`BPF_LINK_DETACH`); the pin
/// itself stays for the caller to remove. `NotFound` when nothing is pinned
/// there.
pub(crate) fn detach_pinned_link(path: &Path) -> io::Result<()> {
    let link = bpf_syscall::obj_get(path)?;
    let link_fd = u32::try_from(link.as_raw_fd())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    bpf_syscall::link_detach(link_fd)
}

fn syscall_error(call: &'static str, io_error: io::Error) -> ProgramError {
    ProgramError::SyscallError(SyscallError { call, io_error })
}
