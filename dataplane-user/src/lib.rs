//! The dataplane node agent.
//!
//! The path of one outbound connection, by module: [`redirect`] (the
//! kernel's `connect4` program steers it to the pod's listener and records
//! where it was going) -> `proxy::outbound` (reads the record through
//! `proxy::orig_dst`; `proxy::outbound::plan()` decides from the
//! [`state`] in force, held by `mesh`) -> [`hbone::pool`] (a pooled
//! mutual-TLS HTTP/2 connection, dialled by `proxy`'s TLS dialer with
//! [`tls`] and [`identity`]) -> `relay` (bytes both ways, counted by
//! [`telemetry`]) -> on the peer's node, `proxy::inbound_hbone` ->
//! [`hbone::server`] -> [`policy`] (decides, and re-checks while open) ->
//! `relay` -> the app. Plaintext arrives at `proxy::inbound` and is
//! authorized by address. `addr` says how addresses compare.
//!
//! Around it: [`enroll`] puts pods in the mesh (listeners, kernel maps,
//! certificate) from one actor thread that owns the pods and the kernel
//! programs; [`control`] (the local socket), `reload` (config changes),
//! [`kube`] (the Kubernetes reconciler) and start-up send it commands;
//! `instance` keeps one agent per instance; [`handover`] passes an
//! instance's pods and listening sockets to a new agent without refusing a
//! connection; [`agent`] runs it all.
#![deny(missing_docs)]

pub(crate) mod admin;
pub mod agent;
pub mod cli;
pub mod cni;
pub use dataplane_model::config;
pub mod control;
pub use dataplane_engine::dns;
pub mod enroll;
pub use dataplane_engine::fast_path;
pub use dataplane_kernel::features;
#[cfg(test)]
mod fuzz_seeds;
pub mod handover;
pub use dataplane_engine::hbone;
pub(crate) mod heap;
pub(crate) use dataplane_engine::httpd;
pub use dataplane_identity::identity;
pub mod inspect;
pub(crate) mod instance;
pub use dataplane_identity::istiod;
pub use dataplane_istio_api as istio_api;
pub mod kube;
pub use dataplane_engine::logging;
pub(crate) use dataplane_engine::mesh;
pub(crate) use dataplane_engine::nofile;
pub(crate) use dataplane_engine::proxy;
/// A pod's network namespace and the in-pod routing that brings an app's
/// replies back to a proxy connected from the client's address: our
/// engine's pods and those of an external in-pod proxy
/// ([`redirect::ExternalPodCapture`]) both need it.
pub use dataplane_kernel::in_pod::{
    PodNetns,
    original_source::{OriginalSourceError, SourceRouting},
};
pub use dataplane_kernel::netns;
pub use dataplane_kernel::preflight;
pub use dataplane_model::policy;
pub(crate) mod readiness;
pub use dataplane_kernel::redirect;
pub(crate) mod reload;
pub mod render;
pub mod sources;
pub use dataplane_engine::telemetry;
pub use dataplane_identity::tls;
pub use dataplane_model::state;
pub mod version;
pub use dataplane_engine::workers;
pub use dataplane_model::xds;
pub mod zds;
