//! Attaching `dp_proxy_syn` (a tc classifier) to ingress of `lo` inside a
//! pod's network namespace, and detaching it.
//!
//! Attached through netlink (a `clsact` qdisc and a `bpf` filter in
//! direct-action mode), not TCX links (6.6), so that it works on 5.10. The
//! filter lives in the pod's namespace, independent of the agent process:
//! it survives an agent restart (re-enrolling replaces it with the new
//! generation's program in place) and goes away with the namespace. It has
//! a fixed priority and handle so that it is found again.

use std::{io, os::fd::BorrowedFd};

use aya::{
    Ebpf,
    programs::{
        Program, SchedClassifier, TcAttachType,
        tc::{self, NlOptions, SchedClassifierLink, TcAttachOptions, TcError, TcHandle},
    },
};
use dataplane_common::maps::PROG_PROXY_SYN;
use tracing::debug;

use super::RedirectError;
use crate::netns::run_in_netns_fd;

/// The device: every namespace has one, always index 1.
const LOOPBACK: &str = "lo";
/// Filter priority on `lo` ingress (lower runs first). The program never
/// drops and hands on to the next filter, so going first costs others
/// nothing.
const PRIORITY: u16 = 1;
/// Filter handle, fixed so that a re-enrollment replaces our filter.
const HANDLE: TcHandle = TcHandle::new(0, 0x539);

/// Loads `dp_proxy_syn` (once per agent; attached per pod later).
pub(crate) fn load(ebpf: &mut Ebpf) -> Result<(), RedirectError> {
    program(ebpf)?
        .load()
        .map_err(|source| RedirectError::Program {
            name: PROG_PROXY_SYN,
            source,
        })
}

fn program(ebpf: &mut Ebpf) -> Result<&mut SchedClassifier, RedirectError> {
    match ebpf.program_mut(PROG_PROXY_SYN) {
        Some(Program::SchedClassifier(p)) => Ok(p),
        _ => Err(RedirectError::MissingProgram {
            name: PROG_PROXY_SYN,
        }),
    }
}

/// Attaches the loaded program to ingress of `lo` in `netns`, replacing
/// the filter an earlier generation left there.
pub(crate) fn attach(
    ebpf: &mut Ebpf,
    netns_cookie: u64,
    netns: BorrowedFd<'_>,
) -> Result<(), RedirectError> {
    let program = program(ebpf)?;
    let fail = |action: &'static str| {
        move |source: Box<dyn std::error::Error + Send + Sync>| RedirectError::ProxySyn {
            netns_cookie,
            action,
            source,
        }
    };
    run_in_netns_fd(netns, move || -> Result<(), RedirectError> {
        match tc::qdisc_add_clsact(LOOPBACK) {
            Ok(()) => {}
            Err(TcError::NetlinkError(err)) if err.raw_os_error() == Some(libc::EEXIST) => {}
            Err(err) => return Err(fail("add the clsact qdisc for")(err.into())),
        }
        let options = TcAttachOptions::Netlink(NlOptions {
            priority: PRIORITY,
            handle: HANDLE,
            classid: None,
        });
        let id = match program.attach_with_options(LOOPBACK, TcAttachType::Ingress, options) {
            Ok(id) => id,
            Err(_) => {
                // Most likely there already (an earlier generation): replace
                // it in place; a real failure shows up here.
                let existing = SchedClassifierLink::attached(
                    LOOPBACK,
                    TcAttachType::Ingress,
                    PRIORITY,
                    HANDLE,
                    None,
                )
                .map_err(|e| fail("find")(e.into()))?;
                program
                    .attach_to_link(existing)
                    .map_err(|e| fail("attach")(e.into()))?
            }
        };
        let link = program
            .take_link(id)
            .map_err(|e| fail("attach")(e.into()))?;
        // Dropping aya's link would delete the filter: it must outlive
        // this process. The link is only a description (no descriptor).
        std::mem::forget(link);
        Ok(())
    })
    .map_err(|e| fail("enter the namespace to attach")(e.into()))??;
    debug!(netns_cookie, "external proxy SYN program attached to lo");
    Ok(())
}

/// Removes the filter from `lo` in `netns`. Absent is fine.
pub(crate) fn detach(netns_cookie: u64, netns: BorrowedFd<'_>) -> Result<(), RedirectError> {
    let fail = |source: Box<dyn std::error::Error + Send + Sync>| RedirectError::ProxySyn {
        netns_cookie,
        action: "detach",
        source,
    };
    run_in_netns_fd(netns, || {
        match tc::qdisc_detach_program(LOOPBACK, TcAttachType::Ingress, PROG_PROXY_SYN) {
            Ok(()) => Ok(()),
            Err(TcError::IoError(err)) if err.kind() == io::ErrorKind::NotFound => Ok(()),
            // No clsact qdisc: nothing was ever attached.
            Err(TcError::NetlinkError(err))
                if matches!(err.raw_os_error(), Some(libc::ENOENT | libc::EINVAL)) =>
            {
                Ok(())
            }
            Err(err) => Err(fail(err.into())),
        }
    })
    .map_err(|e| fail(e.into()))??;
    debug!(netns_cookie, "external proxy SYN program detached from lo");
    Ok(())
}
