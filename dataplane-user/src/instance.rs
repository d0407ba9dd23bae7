//! One agent per instance: `<state dir>/<instance>/agent.lock`, held with
//! `flock` for the agent's whole life and naming its pid.
//!
//! Without it a second agent of the same instance would start, fail to
//! enroll anything (the ports are taken), replace the control socket, and
//! on exit delete it, leaving the running agent unreachable.

use std::{
    fs::File,
    io::{Read as _, Seek as _, Write as _},
    path::{Path, PathBuf},
};

use nix::{
    errno::Errno,
    fcntl::{Flock, FlockArg},
};

/// Errors taking the instance lock.
#[derive(Debug, thiserror::Error)]
pub enum InstanceError {
    /// Another agent of this instance holds the lock.
    #[error(
        "another agent of instance {instance} is running ({holder}; lock {path}); stop it first, or give this one another --instance"
    )]
    Running {
        /// The instance name.
        instance: String,
        /// `pid N`, or what is known of the holder.
        holder: String,
        /// The lock file.
        path: PathBuf,
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

/// The held lock; released when dropped (or when the process dies).
#[derive(Debug)]
pub struct InstanceLock {
    _lock: Flock<File>,
}

impl InstanceLock {
    /// Takes the lock of `instance` in `state_dir` without waiting, and
    /// writes this process's pid into it.
    pub fn take(state_dir: &Path, instance: &str) -> Result<Self, InstanceError> {
        let dir = state_dir.join(instance);
        let path = dir.join("agent.lock");
        let io = |action| {
            let path = path.clone();
            move |source| InstanceError::Io {
                action,
                path,
                source,
            }
        };
        std::fs::create_dir_all(&dir).map_err(io("create the directory of"))?;
        let file = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(io("open"))?;
        let mut lock = match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(lock) => lock,
            Err((mut file, Errno::EWOULDBLOCK)) => {
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
            Err((_, errno)) => return Err(io("lock")(std::io::Error::from(errno))),
        };
        lock.set_len(0).map_err(io("write"))?;
        lock.rewind().map_err(io("write"))?;
        writeln!(lock, "{}", std::process::id()).map_err(io("write"))?;
        Ok(Self { _lock: lock })
    }
}
