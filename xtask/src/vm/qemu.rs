//! One guest under qemu's TCG (software emulation): `/dev/kvm` on these
//! machines cannot run stock kernels, and TCG boots a cloud kernel in 3-7 s.
//!
//! The qemu process is owned by a guard that kills and reaps it on drop;
//! it also dies with xtask (`PR_SET_PDEATHSIG`) if xtask itself is killed,
//! so no qemu outlives a run.
//!
//! `-cpu max,cx16=off`: qemu 7.2's TCG corrupts the flags of a
//! `cmpxchg16b` with a segment prefix (what SLUB's per-CPU fast path issues
//! when the CPU has CX16), which double-faults 6.12 guests within seconds
//! under load; without CX16 the kernel takes its ordinary path.

use std::{
    os::unix::process::CommandExt as _,
    path::Path,
    process::{Child, Command, Stdio},
    sync::atomic::{AtomicBool, Ordering},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};

use crate::cmd;

/// The qemu binary.
const QEMU: &str = "qemu-system-x86_64";
/// Guest memory: the unpacked initramfs (about 100 MB) plus the tests.
const MEMORY_MIB: &str = "2048";
/// Guest CPUs (one host thread each under `thread=multi`).
const CPUS: &str = "2";

/// Set by SIGINT/SIGTERM handlers while guests run.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// How a guest ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// qemu exited (the guest powered off or its kernel panicked).
    Exited,
    /// The time limit passed; qemu was killed.
    TimedOut,
    /// xtask was interrupted; qemu was killed.
    Interrupted,
}

/// What to boot.
#[derive(Debug)]
pub struct Boot<'a> {
    /// The kernel image.
    pub image: &'a Path,
    /// The initramfs.
    pub initramfs: &'a Path,
    /// Where the kernel console (first serial port) goes.
    pub console: &'a Path,
    /// Where the guest's report (second serial port) goes.
    pub report: &'a Path,
    /// Kill the guest after this long.
    pub limit: Duration,
}

/// A running qemu, killed and reaped on drop.
struct Guard(Child);

impl Drop for Guard {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
        }
        let _ = self.0.wait();
    }
}

/// Boots `boot` and waits for the guest to end.
pub fn run(boot: &Boot<'_>) -> Result<Ending> {
    let mut qemu = Command::new(QEMU);
    qemu.args(["-accel", "tcg,thread=multi", "-cpu", "max,cx16=off"])
        .args(["-m", MEMORY_MIB, "-smp", CPUS])
        .args(["-display", "none", "-monitor", "none", "-nic", "none"])
        .arg("-no-reboot")
        .arg("-kernel")
        .arg(boot.image)
        .arg("-initrd")
        .arg(boot.initramfs)
        .args([
            "-append",
            "console=ttyS0 panic=-1 oops=panic quiet loglevel=4",
        ])
        .arg("-serial")
        .arg(format!("file:{}", boot.console.display()))
        .arg("-serial")
        .arg(format!("file:{}", boot.report.display()))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit());
    // SAFETY: prctl is async-signal-safe and touches no memory of ours.
    unsafe {
        qemu.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let shown = cmd::display(&qemu);
    println!("+ {shown}");
    let mut guard = Guard(
        qemu.spawn()
            .with_context(|| format!("cannot start {QEMU} (cargo xtask setup installs it)"))?,
    );
    let deadline = Instant::now() + boot.limit;
    loop {
        if guard.0.try_wait()?.is_some() {
            return Ok(Ending::Exited);
        }
        if INTERRUPTED.load(Ordering::SeqCst) {
            return Ok(Ending::Interrupted);
        }
        if Instant::now() >= deadline {
            return Ok(Ending::TimedOut);
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Whether SIGINT or SIGTERM arrived since [`catch_interrupts`].
pub fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::SeqCst)
}

extern "C" fn on_interrupt(_signal: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// Turns SIGINT and SIGTERM into a flag the wait loops check, so that an
/// interrupted run still kills its guest and removes its files.
pub fn catch_interrupts() -> Result<()> {
    for signal in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: `sigaction` is plain-old-data; zeroed is a valid empty
        // value that is filled in before use.
        let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
        action.sa_sigaction = on_interrupt as *const () as libc::sighandler_t;
        action.sa_flags = libc::SA_RESTART;
        // SAFETY: the handler only stores to an atomic; a null old-action
        // pointer is allowed.
        let rc = unsafe {
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(signal, &action, std::ptr::null_mut())
        };
        if rc != 0 {
            return Err(std::io::Error::last_os_error())
                .with_context(|| format!("cannot install a handler for signal {signal}"));
        }
    }
    Ok(())
}
