//! The `bpf(2)` commands the probes and the netns-cookie fallback issue
//! directly: aya 0.14 cannot load a program with a chosen expected attach
//! type from instructions, nor tell whether a command exists.
//!
//! Every attribute struct is the `repr(C)` prefix of `union bpf_attr` for its
//! command; the kernel treats the bytes it is not given as zero.

use std::{
    ffi::c_long,
    io,
    os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd},
};

use aya_obj::generated::{bpf_attach_type, bpf_cmd, bpf_map_type, bpf_prog_type};

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

// Opcode parts (`include/uapi/linux/bpf_common.h`, `bpf.h`).
const BPF_LDX: u8 = 0x01;
const BPF_STX: u8 = 0x03;
const BPF_ALU64: u8 = 0x07;
const BPF_JMP: u8 = 0x05;
const BPF_LD: u8 = 0x00;
const BPF_W: u8 = 0x00;
const BPF_DW: u8 = 0x18;
const BPF_IMM: u8 = 0x00;
const BPF_MEM: u8 = 0x60;
const BPF_K: u8 = 0x00;
const BPF_X: u8 = 0x08;
const BPF_MOV: u8 = 0xb0;
const BPF_ADD: u8 = 0x00;
const BPF_JNE: u8 = 0x50;
const BPF_CALL: u8 = 0x80;
const BPF_EXIT: u8 = 0x90;
/// `src_reg` of a 64-bit immediate load that names a map by descriptor.
const BPF_PSEUDO_MAP_FD: u8 = 1;

/// Registers used by the programs built here.
pub(crate) const R0: u8 = 0;
pub(crate) const R1: u8 = 1;
pub(crate) const R2: u8 = 2;
pub(crate) const R3: u8 = 3;
pub(crate) const R4: u8 = 4;
pub(crate) const R6: u8 = 6;
pub(crate) const R10: u8 = 10;

impl Insn {
    const fn new(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> Self {
        Self {
            code,
            regs: (src << 4) | (dst & 0x0f),
            off,
            imm,
        }
    }

    /// `dst = imm`.
    pub(crate) const fn mov_imm(dst: u8, imm: i32) -> Self {
        Self::new(BPF_ALU64 | BPF_MOV | BPF_K, dst, 0, 0, imm)
    }

    /// `dst = src`.
    pub(crate) const fn mov_reg(dst: u8, src: u8) -> Self {
        Self::new(BPF_ALU64 | BPF_MOV | BPF_X, dst, src, 0, 0)
    }

    /// `dst += imm`.
    pub(crate) const fn add_imm(dst: u8, imm: i32) -> Self {
        Self::new(BPF_ALU64 | BPF_ADD | BPF_K, dst, 0, 0, imm)
    }

    /// `dst = *(u32 *)(src + off)`.
    pub(crate) const fn load_u32(dst: u8, src: u8, off: i16) -> Self {
        Self::new(BPF_LDX | BPF_MEM | BPF_W, dst, src, off, 0)
    }

    /// `*(u64 *)(dst + off) = src`.
    pub(crate) const fn store_u64(dst: u8, off: i16, src: u8) -> Self {
        Self::new(BPF_STX | BPF_MEM | BPF_DW, dst, src, off, 0)
    }

    /// `if dst != imm goto +off`.
    pub(crate) const fn jne_imm(dst: u8, imm: i32, off: i16) -> Self {
        Self::new(BPF_JMP | BPF_JNE | BPF_K, dst, 0, off, imm)
    }

    /// `call helper`.
    pub(crate) const fn call(helper: i32) -> Self {
        Self::new(BPF_JMP | BPF_CALL, 0, 0, 0, helper)
    }

    /// `exit`.
    pub(crate) const fn exit() -> Self {
        Self::new(BPF_JMP | BPF_EXIT, 0, 0, 0, 0)
    }

    /// The index this instruction at `at` jumps to, if it is a conditional
    /// jump.
    #[cfg(test)]
    pub(crate) fn jump_target(&self, at: usize) -> Option<usize> {
        let conditional = self.code & 0x07 == BPF_JMP && self.code & 0xf0 == BPF_JNE;
        conditional.then(|| at.wrapping_add_signed(1 + isize::from(self.off)))
    }

    /// `dst = map` (two instructions: a 64-bit immediate load naming the map
    /// by descriptor).
    pub(crate) fn load_map_fd(dst: u8, map: BorrowedFd<'_>) -> [Self; 2] {
        [
            Self::new(
                BPF_LD | BPF_DW | BPF_IMM,
                dst,
                BPF_PSEUDO_MAP_FD,
                0,
                map.as_raw_fd(),
            ),
            Self::new(0, 0, 0, 0, 0),
        ]
    }
}

/// The smallest program of every type: `r0 = 1; exit` (1 is the "allow"
/// verdict the cgroup hooks require).
pub(crate) const ALLOW: [Insn; 2] = [Insn::mov_imm(R0, 1), Insn::exit()];

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

/// The `BPF_MAP_CREATE` member of `union bpf_attr`, up to `map_name` (4.15).
#[repr(C)]
struct MapCreateAttr {
    map_type: u32,
    key_size: u32,
    value_size: u32,
    max_entries: u32,
    map_flags: u32,
    inner_map_fd: u32,
    numa_node: u32,
    map_name: [u8; 16],
}

/// The map element commands' member of `union bpf_attr`.
#[repr(C)]
struct MapElemAttr {
    map_fd: u32,
    pad: u32,
    key: u64,
    value: u64,
    flags: u64,
}

/// The `BPF_LINK_CREATE` member of `union bpf_attr` (type-specific tail
/// left zero).
#[repr(C)]
struct LinkCreateAttr {
    prog_fd: u32,
    target_fd: u32,
    attach_type: u32,
    flags: u32,
}

/// The `BPF_LINK_DETACH` member of `union bpf_attr`.
#[repr(C)]
struct LinkDetachAttr {
    link_fd: u32,
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

/// `BPF_MAP_CREATE` of a map with `u64` keys and values.
pub(crate) fn map_create_u64(
    map_type: bpf_map_type,
    max_entries: u32,
    name: &str,
) -> io::Result<OwnedFd> {
    let attr = MapCreateAttr {
        map_type: map_type as u32,
        key_size: 8,
        value_size: 8,
        max_entries,
        map_flags: 0,
        inner_map_fd: 0,
        numa_node: 0,
        map_name: object_name(name),
    };
    sys_bpf_fd(bpf_cmd::BPF_MAP_CREATE, &attr)
}

/// `BPF_MAP_LOOKUP_ELEM` in a `u64 -> u64` map; `None` when absent.
pub(crate) fn map_lookup_u64(map: BorrowedFd<'_>, key: u64) -> io::Result<Option<u64>> {
    let mut value = 0u64;
    let attr = MapElemAttr {
        map_fd: fd_u32(map)?,
        pad: 0,
        key: (&raw const key) as u64,
        value: (&raw mut value) as u64,
        flags: 0,
    };
    match sys_bpf(bpf_cmd::BPF_MAP_LOOKUP_ELEM, &attr) {
        Ok(_) => Ok(Some(value)),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(None),
        Err(e) => Err(e),
    }
}

/// `BPF_MAP_DELETE_ELEM` in a map with `u64` keys; absent keys are fine.
pub(crate) fn map_delete_u64(map: BorrowedFd<'_>, key: u64) -> io::Result<()> {
    let attr = MapElemAttr {
        map_fd: fd_u32(map)?,
        pad: 0,
        key: (&raw const key) as u64,
        value: 0,
        flags: 0,
    };
    match sys_bpf(bpf_cmd::BPF_MAP_DELETE_ELEM, &attr) {
        Err(e) if e.raw_os_error() != Some(libc::ENOENT) => Err(e),
        _ => Ok(()),
    }
}

/// `BPF_LINK_CREATE`: attaches `program` to `target` (a raw descriptor, so
/// that probes can pass an invalid one).
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
    };
    sys_bpf_fd(bpf_cmd::BPF_LINK_CREATE, &attr)
}

/// `BPF_LINK_DETACH` of the link with raw descriptor `link` (a probe passes
/// an invalid one).
pub(crate) fn link_detach(link: u32) -> io::Result<()> {
    sys_bpf(bpf_cmd::BPF_LINK_DETACH, &LinkDetachAttr { link_fd: link }).map(|_| ())
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
    // (instructions, license, log, keys, values) outlive the call.
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
    fn instructions_encode_as_the_kernel_expects() {
        // r0 = 1: BPF_ALU64 | BPF_MOV | BPF_K, dst r0.
        assert_eq!(
            ALLOW[0],
            Insn {
                code: 0xb7,
                regs: 0,
                off: 0,
                imm: 1
            }
        );
        // r2 = *(u32 *)(r6 + 24): src r6 in the high nibble.
        let load = Insn::load_u32(R2, R6, 24);
        assert_eq!((load.code, load.regs, load.off), (0x61, 0x62, 24));
        // *(u64 *)(r10 - 8) = r0.
        let store = Insn::store_u64(R10, -8, R0);
        assert_eq!((store.code, store.regs, store.off), (0x7b, 0x0a, -8));
        assert_eq!(Insn::exit().code, 0x95);
        assert_eq!(std::mem::size_of::<Insn>(), 8);
    }

    #[test]
    fn attribute_layouts_match_the_uapi() {
        assert_eq!(std::mem::size_of::<ProgLoadAttr>(), 72);
        assert_eq!(std::mem::offset_of!(ProgLoadAttr, expected_attach_type), 68);
        assert_eq!(std::mem::offset_of!(MapCreateAttr, map_name), 28);
        assert_eq!(std::mem::offset_of!(MapElemAttr, flags), 24);
    }

    #[test]
    fn object_names_are_truncated_and_terminated() {
        let name = object_name("a_very_long_program_name");
        assert_eq!(&name[..15], b"a_very_long_pro");
        assert_eq!(name[15], 0);
    }
}
