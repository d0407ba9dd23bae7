//! The few `bpf(2)` link commands aya 0.14 does not offer, issued directly:
//!
//! - creating a `cgroup/getsockopt` link: aya's `CgroupSockoptLink` has no
//!   conversion to `FdLink`, so the link is created here, pinned at a
//!   temporary path, and re-opened through aya as an ordinary [`FdLink`];
//!   every other step (make-before-break replacement, unpinning) stays the
//!   same for all programs;
//! - `BPF_LINK_DETACH` (kernel 5.9), which detaches a link at once. Dropping
//!   the last reference detaches too, but when that reference is a bpffs pin
//!   the kernel frees it later from a work queue, so a program would keep
//!   running for a moment after its pin is gone.

use std::{
    ffi::CString,
    io,
    os::{
        fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd},
        unix::ffi::OsStrExt,
    },
    path::Path,
};

use aya::{
    programs::{
        ProgramError,
        links::{FdLink, PinnedLink},
    },
    sys::SyscallError,
};

/// `BPF_OBJ_PIN`.
const BPF_OBJ_PIN: libc::c_long = 6;
/// `BPF_OBJ_GET`.
const BPF_OBJ_GET: libc::c_long = 7;
/// `BPF_LINK_DETACH`.
const BPF_LINK_DETACH: libc::c_long = 34;
/// `BPF_LINK_CREATE`.
const BPF_LINK_CREATE: libc::c_long = 28;

/// The `link_create` member of `union bpf_attr`, with room for the
/// type-specific tail (left zero, as the kernel requires).
#[repr(C)]
struct LinkCreateAttr {
    prog_fd: u32,
    target_fd: u32,
    attach_type: u32,
    flags: u32,
    tail: [u64; 4],
}

/// The `link_detach` member of `union bpf_attr`.
#[repr(C)]
struct LinkDetachAttr {
    link_fd: u32,
}

/// The `BPF_OBJ_PIN`/`BPF_OBJ_GET` member of `union bpf_attr`.
#[repr(C)]
struct ObjPinAttr {
    pathname: u64,
    bpf_fd: u32,
    file_flags: u32,
    path_fd: i32,
    pad: u32,
}

/// Attaches `program` to `target` (a cgroup directory) at `attach_type`
/// through a new BPF link, returned as an aya [`FdLink`]. `scratch` is a
/// free path on bpffs used for the hand-over; it is removed again.
pub(crate) fn cgroup_link(
    program: BorrowedFd<'_>,
    target: BorrowedFd<'_>,
    attach_type: u32,
    scratch: &Path,
) -> Result<FdLink, ProgramError> {
    let link = link_create(program, target, attach_type)?;
    // A stale scratch pin (a crash half-way) would make the pin fail.
    let _ = std::fs::remove_file(scratch);
    obj_pin(link.as_fd(), scratch)?;
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

/// `BPF_LINK_CREATE`: the new link's descriptor.
fn link_create(
    program: BorrowedFd<'_>,
    target: BorrowedFd<'_>,
    attach_type: u32,
) -> Result<OwnedFd, ProgramError> {
    let attr = LinkCreateAttr {
        prog_fd: fd_u32(program)?,
        target_fd: fd_u32(target)?,
        attach_type,
        flags: 0,
        tail: [0; 4],
    };
    let rc = sys_bpf(BPF_LINK_CREATE, &attr)
        .map_err(|io_error| syscall_error("bpf_link_create", io_error))?;
    let fd = i32::try_from(rc).map_err(|_| {
        syscall_error(
            "bpf_link_create",
            io::Error::from(io::ErrorKind::InvalidData),
        )
    })?;
    // SAFETY: the kernel just returned this new descriptor; nobody else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Detaches the link pinned at `path` at once (`BPF_LINK_DETACH`); the pin
/// itself stays for the caller to remove. `NotFound` when nothing is pinned
/// there.
pub(crate) fn detach_pinned_link(path: &Path) -> io::Result<()> {
    let link = obj_get(path)?;
    let attr = LinkDetachAttr {
        link_fd: u32::try_from(link.as_raw_fd())
            .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?,
    };
    sys_bpf(BPF_LINK_DETACH, &attr)?;
    Ok(())
}

/// `BPF_OBJ_GET`: opens the object pinned at `path`.
fn obj_get(path: &Path) -> io::Result<OwnedFd> {
    let path = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let attr = ObjPinAttr {
        pathname: path.as_ptr() as u64,
        bpf_fd: 0,
        file_flags: 0,
        path_fd: 0,
        pad: 0,
    };
    let rc = sys_bpf(BPF_OBJ_GET, &attr)?;
    let fd = i32::try_from(rc).map_err(|_| io::Error::from(io::ErrorKind::InvalidData))?;
    // SAFETY: the kernel just returned this new descriptor; nobody else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `BPF_OBJ_PIN`: pins `object` at `path` on bpffs.
fn obj_pin(object: BorrowedFd<'_>, path: &Path) -> Result<(), ProgramError> {
    let path = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| syscall_error("BPF_OBJ_PIN", io::Error::from(io::ErrorKind::InvalidInput)))?;
    let attr = ObjPinAttr {
        pathname: path.as_ptr() as u64,
        bpf_fd: fd_u32(object)?,
        file_flags: 0,
        path_fd: 0,
        pad: 0,
    };
    sys_bpf(BPF_OBJ_PIN, &attr).map_err(|io_error| syscall_error("BPF_OBJ_PIN", io_error))?;
    Ok(())
}

/// One `bpf(2)` call with `attr` as the (prefix of the) attribute union.
fn sys_bpf<T>(cmd: libc::c_long, attr: &T) -> io::Result<libc::c_long> {
    // SAFETY: `attr` is a live `repr(C)` prefix of `union bpf_attr` of the
    // size passed, with every unused byte zero; the kernel copies it in and
    // keeps no pointer (a path pointer in it outlives the call).
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            std::ptr::from_ref(attr),
            std::mem::size_of::<T>(),
        )
    };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

fn fd_u32(fd: BorrowedFd<'_>) -> Result<u32, ProgramError> {
    u32::try_from(fd.as_raw_fd())
        .map_err(|_| syscall_error("bpf", io::Error::from(io::ErrorKind::InvalidInput)))
}

fn syscall_error(call: &'static str, io_error: io::Error) -> ProgramError {
    ProgramError::SyscallError(SyscallError { call, io_error })
}
