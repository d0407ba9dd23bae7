//! The bottom layer of the dataplane agent: what every other crate may use
//! and which itself uses nothing of the agent's.
//!
//! - [`addr`]: addresses as the mesh compares them.
//! - [`error`]: [`Chain`](error::Chain), an error with its whole source
//!   chain, for log fields and messages.
//! - [`fs`]: bounded file reads and `/proc/self/mountinfo`.
//! - `fuzz_seed` (feature `test-util`): the writer of fuzz seeds that unit
//!   tests of every crate use.
//! - [`intern`]: one shared copy of each value many entries repeat.
//! - [`parse`]: durations as flags and files spell them, Go-style booleans
//!   as Kubernetes annotations carry them.
//! - [`timestamp`]: instants as RFC 3339 for status pages and dumps.
//!
//! It depends on no other crate of the agent but `dataplane-common` (for the
//! engine's port numbers), on `time` only to format instants, and not on
//! clap: flag types live with the binary.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod addr;
pub mod error;
pub mod fs;
#[cfg(feature = "test-util")]
pub mod fuzz_seed;
pub mod intern;
pub mod parse;
pub mod timestamp;
