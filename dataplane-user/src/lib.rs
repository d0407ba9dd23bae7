//! The dataplane node agent.
//!
//! The path of one connection, by module: [`redirect`] (kernel programs and
//! their maps) -> [`engine`] (in-pod listeners, forwarding) -> policy -> pool
//! -> tunnel -> app. [`enroll`] puts pods in the mesh, [`control`] takes
//! requests for it on a local socket, [`agent`] runs it all.
#![deny(missing_docs)]

pub mod admin;
pub mod agent;
pub(crate) mod bpf_syscall;
pub mod cli;
pub mod cni;
pub mod config;
pub mod control;
pub mod engine;
pub mod enroll;
pub mod features;
pub mod hbone;
pub mod httpd;
pub mod identity;
pub mod inspect;
pub mod instance;
pub mod kube;
pub mod logging;
pub mod netns;
pub mod policy;
pub mod preflight;
pub mod readiness;
pub mod redirect;
pub mod reload;
pub mod render;
pub mod state;
pub mod telemetry;
pub mod tls;
pub mod version;
