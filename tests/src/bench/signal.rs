//! Ctrl-C and SIGTERM: recorded, so the run stops between two measurements
//! and every guard (namespaces, cgroups, agents, pins) is dropped normally,
//! instead of the default action killing the harness and leaving them
//! behind.

use std::sync::atomic::{AtomicBool, Ordering};

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_signal: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// Installs the handlers for SIGINT, SIGTERM and SIGHUP.
pub fn install() {
    for signal in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: the handler only stores to an atomic (async-signal-safe).
        unsafe {
            libc::signal(signal, on_signal as *const () as libc::sighandler_t);
        }
    }
}

/// Whether a stop was requested.
pub fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::SeqCst)
}

/// Fails once a stop was requested.
pub fn check() -> anyhow::Result<()> {
    anyhow::ensure!(!interrupted(), "interrupted; cleaning up");
    Ok(())
}
