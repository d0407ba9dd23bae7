//! The mesh as the agent holds it, from its sources to the state the
//! connection path reads.
//!
//! - [`config`]: the local config file's schema, parsing and validation,
//!   and the entries both sources (the file, istiod) are made of.
//! - [`xds`]: istiod's delta xDS client (workloads, services,
//!   authorizations) and the translation of its resources into config
//!   entries, change by change.
//! - [`state`]: the merged mesh state (address, VIP, service and waypoint
//!   indexes, each change applied to persistent maps) and what a change
//!   affects.
//! - [`policy`]: L4 authorization, decided per connection and re-checked
//!   when policies change.
//!
//! It depends on `dataplane-core`, `dataplane-istio-api` and
//! `dataplane-identity` only: not on the kernel crate (so it builds on
//! stable without `bpf-linker`), not on clap, and has no `unsafe`.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod config;
#[cfg(test)]
mod fuzz_seeds;
pub mod policy;
pub mod state;
pub mod xds;

// The paths these modules were written against in `dataplane-user`.
pub(crate) use dataplane_identity::{identity, istiod};
pub(crate) use dataplane_istio_api as istio_api;
