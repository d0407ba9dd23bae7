//! Attaching programs through BPF links and pinning those links, with
//! make-before-break replacement of a previous generation's link, and
//! detaching them again (at once, not when the kernel gets round to freeing
//! an unpinned link).

use std::{
    fs::File,
    io,
    os::fd::{AsFd, BorrowedFd},
    path::{Path, PathBuf},
};

use aya::{
    Ebpf,
    programs::{
        CgroupAttachMode, Program, SkLookup,
        links::{FdLink, PinnedLink},
    },
};
use aya_obj::generated::bpf_attach_type;
use dataplane_common::maps::PROG_SK_LOOKUP;
use tracing::{debug, warn};

use super::{PinLayout, RedirectError, raw_link};

/// Flags for cgroup attachment. With BPF links (kernel >= 5.7, which aya uses
/// whenever available) the kernel always attaches in multi mode and rejects
/// any flag, so "no flags" here still means programs of other tools run beside
/// ours.
const LINK_ATTACH_MODE: CgroupAttachMode = CgroupAttachMode::Single;

/// Loads the cgroup program `name` and attaches it to `cgroup` through a
/// BPF link the caller owns. `scratch` is a bpffs directory for a short-lived hand-over pin of the
/// `getsockopt` link (the instance directory, so the links directory only
/// ever holds real link pins).
pub(crate) fn attach_cgroup_program(
    ebpf: &mut Ebpf,
    name: &'static str,
    cgroup: &File,
    scratch: &Path,
) -> Result<FdLink, RedirectError> {
    let program = ebpf
        .program_mut(name)
        .ok_or(RedirectError::MissingProgram { name })?;
    let program_err = |source| RedirectError::Program { name, source };
    let not_a_link = |source| RedirectError::NotALink { name, source };
    // Each arm repeats the same steps: aya has no trait over "cgroup
    // program", and each type has its own link type.
    match program {
        Program::CgroupSockAddr(p) => {
            p.load().map_err(program_err)?;
            let id = p.attach(cgroup, LINK_ATTACH_MODE).map_err(program_err)?;
            let link = p.take_link(id).map_err(program_err)?;
            FdLink::try_from(link).map_err(not_a_link)
        }
        Program::SockOps(p) => {
            p.load().map_err(program_err)?;
            let id = p.attach(cgroup, LINK_ATTACH_MODE).map_err(program_err)?;
            let link = p.take_link(id).map_err(program_err)?;
            FdLink::try_from(link).map_err(not_a_link)
        }
        Program::CgroupSockopt(p) => {
            // aya 0.14 cannot convert this program's link into an `FdLink`:
            // create it directly (see `raw_link`).
            p.load().map_err(program_err)?;
            let program_fd = p.fd().map_err(program_err)?;
            // bpffs reserves names with dots.
            let scratch = scratch.join(format!("handover_{name}"));
            raw_link::cgroup_link(
                program_fd.as_fd(),
                cgroup.as_fd(),
                bpf_attach_type::BPF_CGROUP_GETSOCKOPT,
                &scratch,
            )
            .map_err(program_err)
        }
        _ => Err(RedirectError::MissingProgram { name }),
    }
}

/// Loads `dp_sk_lookup` (once per agent; it is attached per pod later).
pub(crate) fn load_sk_lookup(ebpf: &mut Ebpf) -> Result<(), RedirectError> {
    sk_lookup_program(ebpf)?
        .load()
        .map_err(|source| RedirectError::Program {
            name: PROG_SK_LOOKUP,
            source,
        })
}

fn sk_lookup_program(ebpf: &mut Ebpf) -> Result<&mut SkLookup, RedirectError> {
    match ebpf.program_mut(PROG_SK_LOOKUP) {
        Some(Program::SkLookup(p)) => Ok(p),
        _ => Err(RedirectError::MissingProgram {
            name: PROG_SK_LOOKUP,
        }),
    }
}

/// Attaches the loaded `dp_sk_lookup` to the network namespace `netns` and
/// pins the link for `netns_cookie`, replacing a previous link for the same
/// namespace only once the new one runs.
pub(crate) fn attach_sk_lookup(
    ebpf: &mut Ebpf,
    pins: &PinLayout,
    netns_cookie: u64,
    netns: BorrowedFd<'_>,
) -> Result<(), RedirectError> {
    let program = sk_lookup_program(ebpf)?;
    let attach_err = |source| RedirectError::AttachNetns {
        netns_cookie,
        source,
    };
    let id = program.attach(netns).map_err(attach_err)?;
    let link = FdLink::from(program.take_link(id).map_err(attach_err)?);
    // The pin keeps the link (and the program) alive; our descriptor is
    // dropped at once.
    drop(replace_pinned_link(
        pins.sk_lookup_link(netns_cookie),
        PROG_SK_LOOKUP,
        link,
    )?);
    Ok(())
}

/// Detaches and unpins the `sk_lookup` link of `netns_cookie`. Missing state
/// is not an error.
pub(crate) fn detach_sk_lookup(pins: &PinLayout, netns_cookie: u64) -> Result<(), RedirectError> {
    detach_pinned(pins.sk_lookup_link(netns_cookie), PROG_SK_LOOKUP)
}

/// Detaches and unpins every link of the instance (cgroup and per-pod);
/// returns how many `sk_lookup` links there were.
pub(crate) fn detach_all(pins: &PinLayout) -> Result<usize, RedirectError> {
    let dir = pins.links_dir();
    let entries = match std::fs::read_dir(&dir) {
        Ok(entries) => entries,
        Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(0),
        Err(source) => return Err(RedirectError::Unpin { path: dir, source }),
    };
    let mut pods = 0;
    for entry in entries {
        let entry = entry.map_err(|source| RedirectError::Unpin {
            path: dir.clone(),
            source,
        })?;
        let name = entry.file_name();
        let is_pod = name
            .to_str()
            .and_then(PinLayout::sk_lookup_link_cookie)
            .is_some();
        pods += usize::from(is_pod);
        detach_pinned(entry.path(), if is_pod { PROG_SK_LOOKUP } else { "cgroup" })?;
    }
    Ok(pods)
}

/// Detaches the link pinned at `path` at once and removes the pin. Missing
/// state is not an error; a link the kernel cannot detach on demand is left
/// to go with its pin.
fn detach_pinned(path: PathBuf, name: &str) -> Result<(), RedirectError> {
    match raw_link::detach_pinned_link(&path) {
        Ok(()) => debug!(program = name, path = %path.display(), "link detached"),
        Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(err) => {
            warn!(program = name, path = %path.display(), error = %err, "could not detach link at once; removing its pin")
        }
    }
    match std::fs::remove_file(&path) {
        Ok(()) => Ok(()),
        Err(err) if err.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(RedirectError::Unpin { path, source }),
    }
}

/// Pins `link` in place of the previous generation's link for `name`, which
/// is detached only after the new one is attached.
pub(crate) fn replace_pinned_link(
    path: PathBuf,
    name: &'static str,
    link: FdLink,
) -> Result<PinnedLink, RedirectError> {
    detach_pinned(path.clone(), name)?;
    link.pin(&path)
        .map_err(|source| RedirectError::PinLink { name, path, source })
}
