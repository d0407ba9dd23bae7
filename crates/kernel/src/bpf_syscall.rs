//! Every `bpf(2)` command the agent issues itself rather than through aya,
//! in one place: the few aya 0.14 does not offer.
//!
//! - `BPF_PROG_LOAD` of the two-instruction `r0 = 1; exit` program with a
//!   chosen expected attach type: the feature probes ([`crate::features`])
//!   ask whether the kernel knows an attach type, which aya cannot probe;
//! - `BPF_LINK_CREATE` for a `cgroup/getsockopt` program: aya's
//!   `CgroupSockoptLink` has no conversion to a pinnable `FdLink`; the probes
//!   also issue it with an invalid descriptor to learn whether the command
//!   exists;
//! - `BPF_LINK_DETACH` (5.9), which detaches a link at once (dropping the
//!   last reference to a pinned link frees it later, from a work queue);
//! - `BPF_OBJ_PIN` and `BPF_OBJ_GET` for those links;
//! - `BPF_MAP_LOOKUP_AND_DELETE_ELEM` on a hash map (5.14; aya 0.14 issues
//!   it only for queues and stacks): one call where a lookup and a delete
//!   took two.
//!
//! Every attribute struct is the `repr(C)` prefix of `union bpf_attr` for its
//! command; the kernel treats the bytes it is not given as zero.

use std::{
    ffi::{CString, c_long},
    io,
    os::{
        fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd},
        unix::ffi::OsStrExt,
    },
    path::Path,
};

use aya_obj::generated::{bpf_attach_type, bpf_cmd, bpf_prog_type};

/// One eBPF instruction (`struct bpf_insn`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(C)]
pub(crate) struct Insn {
    code: u8,
    /// Destination register in the low nibble, source in the high one.
    regs: u8,
    off: i16,
    imm: i32,
}

/// `BPF_ALU64 | BPF_MOV | BPF_K`: `dst = imm`.
const MOV64_IMM: u8 = 0x07 | 0xb0;
/// `BPF_JMP | BPF_EXIT`.
const EXIT: u8 = 0x05 | 0x90;

/// The smallest program of every type: `r0 = 1; exit` (1 is the "allow"
/// verdict the cgroup hooks require). Real programs are built by
/// `dataplane-ebpf` and loaded through aya; this one only asks the kernel
/// whether it accepts a program type or attach type at all.
pub(crate) const ALLOW: [Insn; 2] = [
    Insn {
        code: MOV64_IMM,
        regs: 0,
        off: 0,
        imm: 1,
    },
    Insn {
        code: EXIT,
        regs: 0,
        off: 0,
        imm: 0,
    },
];

/// The `BPF_PROG_LOAD` member of `union bpf_attr`, up to
/// `expected_attach_type` (4.17).
#[repr(C)]
struct ProgLoadAttr {
    prog_type: u32,
    insn_cnt: u32,
    insns: u64,
    license: u64,
    log_level: u32,
    log_size: u32,
    log_buf: u64,
    kern_version: u32,
    prog_flags: u32,
    prog_name: [u8; 16],
    prog_ifindex: u32,
    expected_attach_type: u32,
}

/// The `BPF_LINK_CREATE` member of `union bpf_attr`, with room for the
/// type-specific tail (left zero, as the kernel requires).
#[repr(C)]
struct LinkCreateAttr {
    prog_fd: u32,
    target_fd: u32,
    attach_type: u32,
    flags: u32,
    tail: [u64; 4],
}

/// The `BPF_LINK_DETACH` member of `union bpf_attr`.
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

/// The `BPF_MAP_*_ELEM` member of `union bpf_attr`.
#[repr(C)]
struct MapElemAttr {
    map_fd: u32,
    pad: u32,
    key: u64,
    value: u64,
    flags: u64,
}

/// A failed program load: the OS error and what the verifier said.
#[derive(Debug)]
pub(crate) struct LoadError {
    /// The OS error.
    pub(crate) error: io::Error,
    /// The verifier log (empty when the load failed before the verifier).
    pub(crate) log: String,
}

/// An object name as the kernel stores it (15 bytes and a NUL at most).
fn object_name(name: &str) -> [u8; 16] {
    let mut out = [0u8; 16];
    for (slot, byte) in out.iter_mut().zip(name.bytes().take(15)) {
        *slot = byte;
    }
    out
}

/// `BPF_PROG_LOAD` of `insns` (GPL) as `prog_type`, expecting
/// `attach_type`; the verifier log is returned on failure.
pub(crate) fn prog_load(
    prog_type: bpf_prog_type,
    attach_type: Option<bpf_attach_type>,
    insns: &[Insn],
    name: &str,
) -> Result<OwnedFd, LoadError> {
    let license = c"GPL";
    let mut log = vec![0u8; 4096];
    let attr = ProgLoadAttr {
        prog_type: prog_type as u32,
        insn_cnt: u32::try_from(insns.len()).unwrap_or(u32::MAX),
        insns: insns.as_ptr() as u64,
        license: license.as_ptr() as u64,
        log_level: 1,
        log_size: u32::try_from(log.len()).unwrap_or(0),
        log_buf: log.as_mut_ptr() as u64,
        kern_version: 0,
        prog_flags: 0,
        prog_name: object_name(name),
        prog_ifindex: 0,
        expected_attach_type: attach_type.map_or(0, |t| t as u32),
    };
    sys_bpf_fd(bpf_cmd::BPF_PROG_LOAD, &attr).map_err(|error| {
        let end = log.iter().position(|b| *b == 0).unwrap_or(log.len());
        LoadError {
            error,
            log: String::from_utf8_lossy(&log[..end]).trim().to_owned(),
        }
    })
}

/// `BPF_LINK_CREATE`: attaches `program` to `target` (a raw descriptor, so
/// that probes can pass an invalid one) at `attach_type`.
pub(crate) fn link_create(
    program: BorrowedFd<'_>,
    target: u32,
    attach_type: bpf_attach_type,
) -> io::Result<OwnedFd> {
    let attr = LinkCreateAttr {
        prog_fd: fd_u32(program)?,
        target_fd: target,
        attach_type: attach_type as u32,
        flags: 0,
        tail: [0; 4],
    };
    sys_bpf_fd(bpf_cmd::BPF_LINK_CREATE, &attr)
}

/// `BPF_LINK_DETACH` of the link with raw descriptor `link` (a probe passes
/// an invalid one).
pub(crate) fn link_detach(link: u32) -> io::Result<()> {
    sys_bpf(bpf_cmd::BPF_LINK_DETACH, &LinkDetachAttr { link_fd: link }).map(|_| ())
}

/// `BPF_MAP_LOOKUP_AND_DELETE_ELEM`: removes `key` from the hash map
/// `map` and returns its value. `ENOENT` when the key is absent; kernels
/// before 5.14 refuse the command on hash maps ([`unsupported`]).
///
/// `K` and `V` must be the map's key and value types, as for aya's typed
/// maps (whose `Pod` bound says they are plain data).
pub(crate) fn map_lookup_and_delete<K: aya::Pod, V: aya::Pod + Default>(
    map: BorrowedFd<'_>,
    key: &K,
) -> io::Result<V> {
    let mut value = V::default();
    let attr = MapElemAttr {
        map_fd: fd_u32(map)?,
        pad: 0,
        key: std::ptr::from_ref(key) as u64,
        value: std::ptr::from_mut(&mut value) as u64,
        flags: 0,
    };
    sys_bpf(bpf_cmd::BPF_MAP_LOOKUP_AND_DELETE_ELEM, &attr)?;
    Ok(value)
}

/// Whether `error` says the kernel lacks a command or does not offer it
/// for this kind of object (`ENOTSUPP`, 524, is the kernel's own code and
/// reaches user space as is; older kernels also answer `EINVAL`).
pub(crate) fn unsupported(error: &io::Error) -> bool {
    const ENOTSUPP: i32 = 524;
    matches!(
        error.raw_os_error(),
        Some(ENOTSUPP | libc::EOPNOTSUPP | libc::EINVAL)
    )
}

/// `BPF_OBJ_GET`: opens the object pinned at `path`.
pub(crate) fn obj_get(path: &Path) -> io::Result<OwnedFd> {
    let path = c_path(path)?;
    let attr = ObjPinAttr {
        pathname: path.as_ptr() as u64,
        bpf_fd: 0,
        file_flags: 0,
        path_fd: 0,
        pad: 0,
    };
    sys_bpf_fd(bpf_cmd::BPF_OBJ_GET, &attr)
}

/// `BPF_OBJ_PIN`: pins `object` at `path` on bpffs.
pub(crate) fn obj_pin(object: BorrowedFd<'_>, path: &Path) -> io::Result<()> {
    let path = c_path(path)?;
    let attr = ObjPinAttr {
        pathname: path.as_ptr() as u64,
        bpf_fd: fd_u32(object)?,
        file_flags: 0,
        path_fd: 0,
        pad: 0,
    };
    sys_bpf(bpf_cmd::BPF_OBJ_PIN, &attr).map(|_| ())
}

fn c_path(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes()).map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} contains a NUL byte", path.display()),
        )
    })
}

/// A `bpf(2)` command that returns a new descriptor.
fn sys_bpf_fd<T>(cmd: bpf_cmd, attr: &T) -> io::Result<OwnedFd> {
    let rc = sys_bpf(cmd, attr)?;
    let fd = i32::try_from(rc).map_err(|_| io::Error::from(io::ErrorKind::InvalidData))?;
    // SAFETY: the kernel just returned this new descriptor; nobody else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// One `bpf(2)` call with `attr` as the (prefix of the) attribute union.
fn sys_bpf<T>(cmd: bpf_cmd, attr: &T) -> io::Result<c_long> {
    // SAFETY: `attr` is a live `repr(C)` prefix of `union bpf_attr` of the
    // size passed, every byte of it initialised; the pointers it holds
    // (instructions, license, log, path) outlive the call, and the kernel
    // keeps none of them.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd as c_long,
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

fn fd_u32(fd: BorrowedFd<'_>) -> io::Result<u32> {
    u32::try_from(fd.as_raw_fd()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_allow_program_encodes_as_the_kernel_expects() {
        // r0 = 1: BPF_ALU64 | BPF_MOV | BPF_K (0xb7), dst r0; exit: 0x95.
        assert_eq!((ALLOW[0].code, ALLOW[0].regs, ALLOW[0].imm), (0xb7, 0, 1));
        assert_eq!(ALLOW[1].code, 0x95);
        assert_eq!(std::mem::size_of::<Insn>(), 8);
    }

    #[test]
    fn attribute_layouts_match_the_uapi() {
        assert_eq!(std::mem::size_of::<ProgLoadAttr>(), 72);
        assert_eq!(std::mem::offset_of!(ProgLoadAttr, expected_attach_type), 68);
        assert_eq!(std::mem::offset_of!(LinkCreateAttr, tail), 16);
        assert_eq!(std::mem::size_of::<ObjPinAttr>(), 24);
    }

    #[test]
    fn object_names_are_truncated_and_terminated() {
        let name = object_name("a_very_long_program_name");
        assert_eq!(&name[..15], b"a_very_long_pro");
        assert_eq!(name[15], 0);
    }
}
