//! Child processes placed in a test's network namespace and cgroup, killed
//! on drop.

use anyhow::Context as _;
use std::{
    fs::File,
    io::Read,
    os::{
        fd::{AsRawFd, BorrowedFd, RawFd},
        unix::process::CommandExt,
    },
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

/// Path of the `dp-probe` test client (built by cargo alongside this
/// package's integration tests).
pub fn probe_binary() -> anyhow::Result<PathBuf> {
    target_binary("dp-probe", "cargo builds it with this package's tests")
}

/// Path of the agent binary under test: `$DATAPLANE_BIN`, else `dataplane`
/// in the same target directory as the running test (which `cargo xtask
/// test` builds first).
pub fn agent_binary() -> anyhow::Result<PathBuf> {
    if let Some(path) = std::env::var_os("DATAPLANE_BIN") {
        return Ok(PathBuf::from(path));
    }
    target_binary(
        "dataplane",
        "build it with `cargo build -p dataplane-user` (`cargo xtask test` does) or set DATAPLANE_BIN",
    )
}

/// `target/<profile>/<name>`, found from the running test executable
/// (`target/<profile>/deps/<test>`).
pub fn target_binary(name: &str, hint: &str) -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    // Test executables live in target/<profile>/deps, binaries (such as
    // dp-demo) in target/<profile>: look beside the executable, then above.
    let dir = exe
        .parent()
        .ok_or_else(|| anyhow::anyhow!("cannot locate the target directory from {exe:?}"))?;
    let candidates = [Some(dir.join(name)), dir.parent().map(|d| d.join(name))];
    candidates
        .into_iter()
        .flatten()
        .find(|path| path.exists() && path != &exe)
        .ok_or_else(|| anyhow::anyhow!("{name} not found beside {}: {hint}", exe.display()))
}

/// A child process killed (and reaped) on drop.
#[derive(Debug)]
pub struct ChildGuard {
    child: Option<Child>,
}

/// What a finished child produced.
#[derive(Debug)]
pub struct Finished {
    /// Exit code, or `None` if killed by a signal.
    pub code: Option<i32>,
    /// Captured stdout.
    pub stdout: String,
    /// Captured stderr.
    pub stderr: String,
}

impl ChildGuard {
    /// Wraps a spawned child.
    pub fn new(child: Child) -> Self {
        Self { child: Some(child) }
    }

    /// The child's pid.
    pub fn id(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Waits for the child to exit, killing it after `limit` (a guard
    /// against hangs, not a timing assertion), and returns its output.
    pub fn wait(mut self, limit: Duration) -> anyhow::Result<Finished> {
        let mut child = self
            .child
            .take()
            .ok_or_else(|| anyhow::anyhow!("child already taken"))?;
        let deadline = Instant::now() + limit;
        let status = loop {
            if let Some(status) = child
                .try_wait()
                .with_context(|| format!("waiting for child {}", child.id()))?
            {
                break status;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                anyhow::bail!("child {} did not exit within {limit:?}", child.id());
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        let mut stdout = String::new();
        let mut stderr = String::new();
        if let Some(mut out) = child.stdout.take() {
            out.read_to_string(&mut stdout)
                .context("reading the child's stdout")?;
        }
        if let Some(mut err) = child.stderr.take() {
            err.read_to_string(&mut stderr)
                .context("reading the child's stderr")?;
        }
        Ok(Finished {
            code: status.code(),
            stdout,
            stderr,
        })
    }

    /// The first line the child writes to stdout, waiting at most `limit`
    /// (a guard against hangs). Takes the child's stdout.
    pub fn first_line(&mut self, limit: Duration) -> anyhow::Result<String> {
        use std::io::BufRead as _;
        let out = self
            .child
            .as_mut()
            .and_then(|c| c.stdout.take())
            .ok_or_else(|| anyhow::anyhow!("the child's stdout is already taken"))?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let read = std::io::BufReader::new(out).read_line(&mut line);
            let _ = tx.send(read.map(|_| line));
        });
        let line = rx
            .recv_timeout(limit)
            .map_err(|_| anyhow::anyhow!("the child wrote no line within {limit:?}"))??;
        Ok(line.trim_end().to_string())
    }

    /// Whether the child has not exited yet.
    pub fn is_running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// Sends `signal` to the child.
    pub fn signal(&self, signal: nix::sys::signal::Signal) -> anyhow::Result<()> {
        let pid = self.id().ok_or_else(|| anyhow::anyhow!("no child"))?;
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), signal)?;
        Ok(())
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Spawns `command` with stdout and stderr captured, inside the network
/// namespace `netns` (if any) and the cgroup `cgroup` (if any), joined
/// between fork and exec so the program never runs outside them.
pub fn spawn_in(
    mut command: Command,
    netns: Option<&Path>,
    cgroup: Option<&Path>,
) -> anyhow::Result<ChildGuard> {
    command.stdout(Stdio::piped()).stderr(Stdio::piped());
    spawn_joined(command, netns, cgroup, None)
}

/// As [`spawn_in`], handing the child `pass` as its descriptor 3. The
/// descriptor is placed after the namespace and cgroup are joined: placing
/// it first (a `pre_exec` of the caller's, which runs before ours) would
/// overwrite the namespace or `cgroup.procs` descriptor whenever that one
/// happened to be 3 in the parent.
pub fn spawn_in_passing(
    mut command: Command,
    netns: Option<&Path>,
    cgroup: Option<&Path>,
    pass: BorrowedFd<'_>,
) -> anyhow::Result<ChildGuard> {
    command.stdout(Stdio::piped()).stderr(Stdio::piped());
    spawn_joined(command, netns, cgroup, Some(pass.as_raw_fd()))
}

/// As [`spawn_in`], for a long-running program that logs much: its stdout
/// and stderr are appended to `log` instead of a pipe nobody drains.
pub fn spawn_logged_in(
    mut command: Command,
    netns: Option<&Path>,
    cgroup: Option<&Path>,
    log: &Path,
) -> anyhow::Result<ChildGuard> {
    let file = File::options()
        .create(true)
        .append(true)
        .open(log)
        .with_context(|| format!("opening log {}", log.display()))?;
    command.stdout(file.try_clone()?).stderr(file);
    spawn_joined(command, netns, cgroup, None)
}

fn spawn_joined(
    mut command: Command,
    netns: Option<&Path>,
    cgroup: Option<&Path>,
    pass: Option<RawFd>,
) -> anyhow::Result<ChildGuard> {
    let netns_file = netns
        .map(|path| File::open(path).with_context(|| format!("opening netns {}", path.display())))
        .transpose()?;
    let procs_file = cgroup
        .map(|dir| {
            std::fs::OpenOptions::new()
                .write(true)
                .open(dir.join("cgroup.procs"))
                .with_context(|| format!("opening {}/cgroup.procs", dir.display()))
        })
        .transpose()?;
    let netns_fd = netns_file.as_ref().map(AsRawFd::as_raw_fd);
    let procs_fd = procs_file.as_ref().map(AsRawFd::as_raw_fd);
    // SAFETY: the closure only makes async-signal-safe system calls on file
    // descriptors opened before the fork.
    unsafe {
        command.pre_exec(move || {
            if let Some(fd) = procs_fd {
                // Writing "0" moves the writing process itself.
                if libc::write(fd, b"0".as_ptr().cast(), 1) != 1 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            if let Some(fd) = netns_fd
                && libc::setns(fd, libc::CLONE_NEWNET) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            // dup2 onto itself keeps close-on-exec, hence the fcntl.
            if let Some(fd) = pass
                && (libc::dup2(fd, 3) < 0 || libc::fcntl(3, libc::F_SETFD, 0) < 0)
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    // A failure in the child before exec (joining the cgroup or the
    // namespace) comes back from `spawn`; name both, as the error alone
    // cannot say which step failed.
    let child = command.spawn().with_context(|| {
        format!(
            "spawning {:?} (netns {:?}, cgroup {:?})",
            command.get_program(),
            netns,
            cgroup
        )
    })?;
    drop(netns_file);
    drop(procs_file);
    Ok(ChildGuard::new(child))
}

/// Raises the descriptor limit as far as allowed (10k idle connections,
/// and agents holding two descriptors per relayed connection, need more
/// than the usual 1024); children inherit it. Where the hard limit cannot
/// be raised (many containers) the soft one goes up to it.
pub fn raise_nofile() {
    let limit = libc::rlimit {
        rlim_cur: 1 << 20,
        rlim_max: 1 << 20,
    };
    // SAFETY: setrlimit and getrlimit only read and write the structs.
    unsafe {
        if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) != 0 {
            let mut current: libc::rlimit = std::mem::zeroed();
            if libc::getrlimit(libc::RLIMIT_NOFILE, &mut current) == 0 {
                current.rlim_cur = current.rlim_max;
                libc::setrlimit(libc::RLIMIT_NOFILE, &current);
            }
        }
    }
}
