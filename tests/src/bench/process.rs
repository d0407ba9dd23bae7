//! Benchmark processes: a child placed in a pod's network namespace and
//! cgroup (joined between fork and exec, so it never runs outside them),
//! with its stdout read line by line on a thread so the harness can wait
//! for a line with a time limit. Killed and reaped on drop.

use std::{
    fs::File,
    io::{BufRead, BufReader, Read, Write},
    os::{fd::AsRawFd, unix::process::CommandExt},
    path::Path,
    process::{Child, ChildStdin, Command, ExitStatus, Stdio},
    sync::{Arc, Mutex, mpsc},
    time::{Duration, Instant},
};

/// A running child.
#[derive(Debug)]
pub struct BenchProcess {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
    stderr: Arc<Mutex<String>>,
    what: String,
}

impl BenchProcess {
    /// Spawns `command` (stdout and stderr captured, stdin piped) inside
    /// `netns` and `cgroup` when given.
    pub fn spawn(
        mut command: Command,
        netns: Option<&Path>,
        cgroup: Option<&Path>,
    ) -> anyhow::Result<Self> {
        let what = format!(
            "{} {}",
            command.get_program().to_string_lossy(),
            command
                .get_args()
                .map(|a| a.to_string_lossy().into_owned())
                .collect::<Vec<_>>()
                .join(" ")
        );
        command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        join_on_exec(&mut command, netns, cgroup)?;
        let mut child = command
            .spawn()
            .map_err(|e| anyhow::anyhow!("cannot start `{what}`: {e}"))?;
        let stdin = child.stdin.take();
        let (tx, lines) = mpsc::channel();
        if let Some(stdout) = child.stdout.take() {
            std::thread::spawn(move || {
                for line in BufReader::new(stdout).lines() {
                    let Ok(line) = line else { break };
                    if tx.send(line).is_err() {
                        break;
                    }
                }
            });
        }
        let stderr = Arc::new(Mutex::new(String::new()));
        if let Some(mut err) = child.stderr.take() {
            let sink = Arc::clone(&stderr);
            std::thread::spawn(move || {
                let mut text = String::new();
                let _ = err.read_to_string(&mut text);
                if let Ok(mut s) = sink.lock() {
                    s.push_str(&text);
                }
            });
        }
        Ok(Self {
            child,
            stdin,
            lines,
            stderr,
            what,
        })
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The next stdout line, waiting up to `limit` (a hang guard).
    pub fn line(&mut self, limit: Duration) -> anyhow::Result<String> {
        match self.lines.recv_timeout(limit) {
            Ok(line) => Ok(line),
            Err(_) => {
                let status = self.child.try_wait().ok().flatten();
                anyhow::bail!(
                    "`{}` printed nothing more (exit: {status:?}): {}",
                    self.what,
                    self.stderr_text().trim()
                )
            }
        }
    }

    /// Writes one line to its stdin.
    pub fn send_line(&mut self, line: &str) -> anyhow::Result<()> {
        let stdin = self
            .stdin
            .as_mut()
            .ok_or_else(|| anyhow::anyhow!("stdin of `{}` already closed", self.what))?;
        writeln!(stdin, "{line}")?;
        stdin.flush()?;
        Ok(())
    }

    /// Closes its stdin (end of input).
    pub fn close_stdin(&mut self) {
        self.stdin = None;
    }

    /// What it wrote on stderr so far.
    pub fn stderr_text(&self) -> String {
        self.stderr.lock().map(|s| s.clone()).unwrap_or_default()
    }

    /// Waits for the exit, killing it after `limit` (a hang guard, not a
    /// timing assertion); returns the status and every stdout line left.
    pub fn finish(mut self, limit: Duration) -> anyhow::Result<(ExitStatus, Vec<String>)> {
        self.close_stdin();
        let deadline = Instant::now() + limit;
        let status = loop {
            if let Some(status) = self.child.try_wait()? {
                break status;
            }
            if Instant::now() > deadline || crate::bench::signal::interrupted() {
                anyhow::bail!("`{}` did not finish within {limit:?}", self.what);
            }
            std::thread::sleep(Duration::from_millis(2));
        };
        // The reader thread ends at end of file.
        let mut lines = Vec::new();
        while let Ok(line) = self.lines.recv_timeout(Duration::from_secs(5)) {
            lines.push(line);
        }
        Ok((status, lines))
    }

    /// Runs to completion and returns its last stdout line, failing with
    /// its stderr unless it exits 0.
    pub fn output(self, limit: Duration) -> anyhow::Result<String> {
        let what = self.what.clone();
        let stderr = Arc::clone(&self.stderr);
        let (status, lines) = self.finish(limit)?;
        if !status.success() {
            // Give the stderr reader a moment to collect the message.
            std::thread::sleep(Duration::from_millis(20));
            let text = stderr.lock().map(|s| s.clone()).unwrap_or_default();
            anyhow::bail!("`{what}` failed ({status}): {}", text.trim());
        }
        lines
            .into_iter()
            .last()
            .ok_or_else(|| anyhow::anyhow!("`{what}` printed nothing"))
    }
}

impl Drop for BenchProcess {
    fn drop(&mut self) {
        self.stdin = None;
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

/// Makes `command` join `cgroup` and `netns` between fork and exec.
pub fn join_on_exec(
    command: &mut Command,
    netns: Option<&Path>,
    cgroup: Option<&Path>,
) -> anyhow::Result<()> {
    let netns_file = netns.map(File::open).transpose()?;
    let procs_file = cgroup
        .map(|dir| {
            std::fs::OpenOptions::new()
                .write(true)
                .open(dir.join("cgroup.procs"))
        })
        .transpose()?;
    // The files must outlive the fork: the closure owns them.
    // SAFETY: the closure only makes async-signal-safe system calls on
    // descriptors opened before the fork.
    unsafe {
        command.pre_exec(move || {
            if let Some(file) = &procs_file {
                // Writing "0" moves the writing process itself.
                if libc::write(file.as_raw_fd(), b"0".as_ptr().cast(), 1) != 1 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            if let Some(file) = &netns_file
                && libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    Ok(())
}
