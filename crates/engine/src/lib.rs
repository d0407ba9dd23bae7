//! The tunnel engine: what carries an enrolled pod's connections.
//!
//! - [`proxy`]: the in-pod listeners by direction (`outbound` with its pure
//!   plan, plaintext `inbound`, `inbound_hbone`), the TLS dialer and the
//!   original-destination source.
//! - [`hbone`]: HTTP/2 CONNECT over mutual TLS: the pooled client and the
//!   server on 15008.
//! - [`relay`]: bytes both ways, plain and tunnelled, counted as they go.
//! - [`fast_path`]: same-node pairs handed to the kernel, socket to socket.
//! - [`dns`]: the in-pod DNS proxy.
//! - [`mesh`]: what every pod's proxy shares (state in force, certificates,
//!   pools, metrics).
//! - [`telemetry`]: Istio's metrics and access records, and `/metrics`.
//! - [`workers`]: the threads connections run on.
//! - [`logging`], [`httpd`], [`nofile`]: log set-up, the small HTTP server
//!   of the agent's ports, the open-file limit.
//! - `test_util` (feature `test-util`, for tests): a pod's context without
//!   enrollment or kernel programs.
//!
//! It depends on the crates below it (`dataplane-core`,
//! `dataplane-kernel`, `dataplane-identity`, `dataplane-model`), not on
//! clap, and knows nothing of how pods are enrolled: enrollment, ZDS,
//! hand-over and the agent itself live in `dataplane-user` above it.
#![deny(missing_docs)]

pub mod dns;
pub mod fast_path;
mod forward_io;
#[cfg(test)]
mod fuzz_seeds;
pub mod hbone;
pub mod httpd;
pub mod logging;
pub mod mesh;
pub mod nofile;
pub mod proxy;
pub mod relay;
pub mod telemetry;
#[cfg(any(test, feature = "test-util"))]
pub mod test_util;
pub mod workers;

// The paths these modules were written against in `dataplane-user`.
pub(crate) use dataplane_core::addr;
pub(crate) use dataplane_identity::{identity, tls};
pub(crate) use dataplane_kernel::redirect;
pub(crate) use dataplane_model::{config, policy, state};
