//! The dataplane node agent.
//!
//! The path of one connection, by module: [`redirect`] (kernel programs and
//! their maps) -> in-pod listeners -> policy -> pool -> tunnel -> app. This
//! first cut holds the redirector, the host checks and the CLI; the engine
//! modules arrive with the redirection and HBONE work.
#![deny(missing_docs)]

pub mod agent;
pub mod cli;
pub mod config;
pub mod logging;
pub mod netns;
pub mod preflight;
pub mod redirect;
pub mod version;
