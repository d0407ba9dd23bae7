//! `cargo xtask run`: set up, build, then run the agent in the foreground.
//!
//! Signals: the agent shares xtask's process group, so a terminal's Ctrl-C
//! reaches it directly; xtask catches SIGINT only to outlive the agent and
//! report its exit. A SIGTERM sent to xtask alone (a supervisor, `kill`) is
//! forwarded to the agent. Handlers, unlike ignored dispositions, reset to
//! the default on exec, so the agent starts with ordinary signal handling.

use std::process::{Command, ExitCode, ExitStatus};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context as _, Result};

use crate::{build, cmd, setup};

/// Set by the SIGTERM handler, cleared once forwarded.
static SIGTERM_PENDING: AtomicBool = AtomicBool::new(false);

/// How often the wait loop checks for the agent's exit and for a SIGTERM.
const POLL: Duration = Duration::from_millis(50);

/// The agent's option that chooses what happens to kernel state on exit.
const ON_EXIT: &str = "--on-exit";

/// `cargo xtask run [--release] [-- AGENT_ARGS...]`.
pub fn run(release: bool, agent_args: &[String]) -> Result<ExitCode> {
    setup::setup(None)?;
    build::build_bins(release)?;
    let binary = cmd::target_dir()
        .join(build::profile(release).1)
        .join("dataplane");
    let mut agent = Command::new(binary);
    agent.arg("run").args(agent_command_line(
        agent_args,
        std::env::var_os("DATAPLANE_ON_EXIT").is_some(),
    ));
    let status = run_forwarding_sigterm(&mut agent)?;
    if !status.success() {
        eprintln!("xtask: the agent exited with {}", cmd::describe(status));
    }
    Ok(exit_code(status))
}

/// The arguments after `dataplane run`: the user's, preceded by
/// `--on-exit detach` unless the user chose an exit mode (by option or by
/// `DATAPLANE_ON_EXIT`), so that stopping the dev loop leaves no pins.
fn agent_command_line(user_args: &[String], on_exit_in_env: bool) -> Vec<String> {
    let chosen = on_exit_in_env
        || user_args
            .iter()
            .any(|arg| arg == ON_EXIT || arg.starts_with(&format!("{ON_EXIT}=")));
    let ours = if chosen {
        Vec::new()
    } else {
        vec![ON_EXIT.to_owned(), "detach".to_owned()]
    };
    ours.into_iter().chain(user_args.iter().cloned()).collect()
}

/// Maps the agent's exit to xtask's: its code, or 128 + the signal that
/// killed it, as a shell reports it.
fn exit_code(status: ExitStatus) -> ExitCode {
    use std::os::unix::process::ExitStatusExt as _;
    let code = match (status.code(), status.signal()) {
        (Some(code), _) => code,
        (None, Some(signal)) => 128 + signal,
        (None, None) => 1,
    };
    ExitCode::from(u8::try_from(code & 0xff).unwrap_or(1))
}

/// Records a SIGTERM for the wait loop (only async-signal-safe work here).
extern "C" fn on_sigterm(_signal: libc::c_int) {
    SIGTERM_PENDING.store(true, Ordering::SeqCst);
}

/// Catches SIGINT without acting: the terminal already delivered it to the
/// agent, which decides how to stop.
extern "C" fn on_sigint(_signal: libc::c_int) {}

/// Installs `handler` for `signal` with `SA_RESTART`.
fn catch(signal: libc::c_int, handler: extern "C" fn(libc::c_int)) -> Result<()> {
    // SAFETY: `sigaction` is plain-old-data; zeroed is a valid empty value
    // (no flags, empty mask) that is filled in before use.
    let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
    action.sa_sigaction = handler as libc::sighandler_t;
    action.sa_flags = libc::SA_RESTART;
    // SAFETY: `action.sa_mask` is a valid, owned sigset; the handler only
    // touches an atomic, which is async-signal-safe; a null old-action
    // pointer is allowed.
    let rc = unsafe {
        libc::sigemptyset(&mut action.sa_mask);
        libc::sigaction(signal, &action, std::ptr::null_mut())
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error())
            .with_context(|| format!("cannot install a handler for signal {signal}"));
    }
    Ok(())
}

/// Spawns `cmd` and waits for it, forwarding SIGTERM and outliving SIGINT.
pub(crate) fn run_forwarding_sigterm(cmd: &mut Command) -> Result<ExitStatus> {
    catch(libc::SIGINT, on_sigint)?;
    catch(libc::SIGTERM, on_sigterm)?;
    let shown = cmd::display(cmd);
    println!("+ {shown}");
    let mut child = cmd
        .spawn()
        .with_context(|| format!("cannot start `{shown}`"))?;
    let pid = libc::pid_t::try_from(child.id()).context("child pid out of range")?;
    loop {
        if let Some(status) = child
            .try_wait()
            .with_context(|| format!("waiting for `{shown}` failed"))?
        {
            return Ok(status);
        }
        if SIGTERM_PENDING.swap(false, Ordering::SeqCst) {
            eprintln!("xtask: forwarding SIGTERM to the agent (pid {pid})");
            // SAFETY: `kill` has no memory-safety preconditions; `pid` is our
            // child, not yet reaped (try_wait returned None), so it cannot
            // have been reused.
            unsafe { libc::kill(pid, libc::SIGTERM) };
        }
        std::thread::sleep(POLL);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn detaches_by_default() {
        assert_eq!(
            agent_command_line(&args(&["--instance", "a"]), false),
            args(&["--on-exit", "detach", "--instance", "a"])
        );
    }

    #[test]
    fn user_exit_mode_wins() {
        for user in [&["--on-exit", "keep"][..], &["--on-exit=keep"][..]] {
            assert_eq!(agent_command_line(&args(user), false), args(user));
        }
        assert_eq!(agent_command_line(&[], true), Vec::<String>::new());
    }

    #[test]
    fn sigterm_is_forwarded_and_exit_code_kept() {
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "trap 'exit 7' TERM; while :; do sleep 0.01; done"]);
        let killer = std::thread::spawn(|| {
            std::thread::sleep(Duration::from_millis(300));
            // SAFETY: signals our own process; the handler is installed.
            unsafe { libc::kill(libc::getpid(), libc::SIGTERM) };
        });
        let status = run_forwarding_sigterm(&mut cmd).expect("child runs");
        killer.join().expect("killer thread");
        assert_eq!(status.code(), Some(7));
        assert_eq!(exit_code(status), ExitCode::from(7));
    }
}
