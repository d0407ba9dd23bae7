//! One agent per instance: `<state dir>/<instance>/agent.lock`, held with
//! `flock` for the agent's whole life and naming its pid.
//!
//! A new agent started with `--takeover` receives the running agent's
//! descriptor of the same open file ([`InstanceLock::share`],
//! [`InstanceLock::adopt`]) over the hand-over: the lock never lapses.
//!
//! Without it a second agent of the same instance would start, fail to
//! enroll anything (the ports are taken), replace the control socket, and
//! on exit delete it, leaving the running agent unreachable.

use std::{
    fs::File,
    io::{Read as _, Seek as _, Write as _},
    os::fd::OwnedFd,
    path::{Path, PathBuf},
};

use nix::errno::Errno;

/// Errors taking the instance lock.
#[derive(Debug, thiserror::Error)]
pub enum InstanceError {
    /// Another agent of this instance holds the lock.
    #[error(
        "another agent of instance {instance} is running ({holder}; lock {path}); stop it first, start this one with --takeover to take its pods over without refusing a connection, or give this one another --instance"
    )]
    Running {
        /// The instance name.
        instance: String,
        /// `pid N`, or what is known of the holder.
        holder: String,
        /// The lock file.
        path: PathBuf,
    },
    /// A descriptor handed over as the lock is not this instance's held
    /// lock.
    #[error("the descriptor handed over as the instance lock {path} is not it: {reason}")]
    NotTheLock {
        /// The lock file.
        path: PathBuf,
        /// What did not match.
        reason: &'static str,
    },
    /// The lock file could not be created, locked or written.
    #[error("cannot {action} the instance lock {path}")]
    Io {
        /// What was attempted.
        action: &'static str,
        /// The lock file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

/// The held lock. Closing the last descriptor of its open file (dropping
/// this in every process that shares it, or their exit) releases it; it is
/// never unlocked explicitly, because a lock shared with a new agent by
/// [`InstanceLock::share`] must survive this agent.
#[derive(Debug)]
pub struct InstanceLock {
    file: File,
}

impl InstanceLock {
    /// The lock file of `instance` in `state_dir`.
    pub fn path(state_dir: &Path, instance: &str) -> PathBuf {
        state_dir.join(instance).join("agent.lock")
    }

    /// Takes the lock of `instance` in `state_dir` without waiting, and
    /// writes this process's pid into it.
    pub fn take(state_dir: &Path, instance: &str) -> Result<Self, InstanceError> {
        let dir = state_dir.join(instance);
        let path = Self::path(state_dir, instance);
        let io = |action| {
            let path = path.clone();
            move |source| InstanceError::Io {
                action,
                path,
                source,
            }
        };
        std::fs::create_dir_all(&dir).map_err(io("create the directory of"))?;
        let mut file = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(io("open"))?;
        match try_lock(&file) {
            Ok(()) => {}
            Err(Errno::EWOULDBLOCK) => {
                let mut pid = String::new();
                let _ = file.read_to_string(&mut pid);
                let holder = match pid.trim() {
                    "" => "pid unknown".to_owned(),
                    pid => format!("pid {pid}"),
                };
                return Err(InstanceError::Running {
                    instance: instance.to_owned(),
                    holder,
                    path,
                });
            }
            Err(errno) => return Err(io("lock")(std::io::Error::from(errno))),
        }
        write_pid(&file).map_err(io("write"))?;
        Ok(Self { file })
    }

    /// A new descriptor of the same open lock file: `flock` locks belong
    /// to the open file description, so whoever holds this descriptor
    /// holds the lock too, even after this process exits. For the
    /// hand-over to a new agent.
    pub fn share(&self) -> std::io::Result<OwnedFd> {
        Ok(self.file.try_clone()?.into())
    }

    /// Writes this process's pid into the lock file again (after a new
    /// agent that adopted the lock gave up).
    pub fn reclaim(&self) -> std::io::Result<()> {
        write_pid(&self.file)
    }

    /// Adopts a lock handed over by the running agent ([`Self::share`]):
    /// `fd` must be the open lock file of `instance` and hold its lock.
    /// Writes this process's pid into it.
    pub fn adopt(fd: OwnedFd, state_dir: &Path, instance: &str) -> Result<Self, InstanceError> {
        use std::os::unix::fs::MetadataExt as _;
        let path = Self::path(state_dir, instance);
        let not = |reason| InstanceError::NotTheLock {
            path: path.clone(),
            reason,
        };
        let file = File::from(fd);
        let (held, named) = match (file.metadata(), std::fs::metadata(&path)) {
            (Ok(held), Ok(named)) => (held, named),
            _ => return Err(not("cannot compare it with the lock file")),
        };
        if (held.dev(), held.ino()) != (named.dev(), named.ino()) {
            return Err(not("another file"));
        }
        // On the open file description that holds the lock this succeeds
        // at once; on any other it would block.
        try_lock(&file).map_err(|_| not("it does not hold the lock"))?;
        write_pid(&file).map_err(|source| InstanceError::Io {
            action: "write",
            path: path.clone(),
            source,
        })?;
        Ok(Self { file })
    }
}

/// `flock(LOCK_EX | LOCK_NB)`.
fn try_lock(file: &File) -> Result<(), Errno> {
    use std::os::fd::AsRawFd as _;
    // SAFETY: flock on a descriptor we own; no memory is passed.
    Errno::result(unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) }).map(drop)
}

fn write_pid(mut file: &File) -> std::io::Result<()> {
    file.set_len(0)?;
    file.rewind()?;
    writeln!(file, "{}", std::process::id())
}
