//! The `--threading` flag: how pods' connections are spread over the
//! worker threads. The flag's value converts into the plain
//! [`Threading`] that `workers` and the runtime set-up take, so that
//! module knows nothing of clap.

use clap::ValueEnum;

use crate::workers::Threading;

/// The values of `--threading` (their docs are the flag's help).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ThreadingFlag {
    /// Each pod on one single-threaded worker; pods spread over workers.
    Pinned,
    /// All pods on one multi-thread runtime with work stealing.
    Shared,
}

impl From<ThreadingFlag> for Threading {
    fn from(flag: ThreadingFlag) -> Self {
        match flag {
            ThreadingFlag::Pinned => Self::Pinned,
            ThreadingFlag::Shared => Self::Shared,
        }
    }
}
