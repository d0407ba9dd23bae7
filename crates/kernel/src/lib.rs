//! The agent's kernel side: what talks to the kernel and knows nothing of
//! the mesh.
//!
//! - [`redirect`]: the embedded eBPF programs (built from `dataplane-ebpf`
//!   by this crate's `build.rs`) loaded, attached to the cgroup and pinned;
//!   pods registered in their maps; the engine's original-destination
//!   lookups.
//! - [`features`]: kernel features probed at start, with the fallbacks of
//!   older kernels.
//! - [`preflight`]: capabilities, filesystems and features checked before
//!   anything touches the kernel, reported at once.
//! - [`netns`]: entering network namespaces and their cookies.
//! - [`in_pod`]: sockets made inside a pod's namespace, their keepalive,
//!   and the in-pod routing of connections from the client's address.
//! - [`sock_diag`]: resetting one TCP socket (`SOCK_DESTROY`).
//! - `bpf_syscall`: the `bpf(2)` commands aya lacks.
//!
//! It depends on `dataplane-common` (the map types shared with the kernel
//! programs) and `dataplane-core`, on no crate of the mesh model, engine or
//! node above it, and not on clap. Building it needs the nightly
//! toolchain's `rust-src` and `bpf-linker` (`cargo xtask setup`).
#![deny(missing_docs)]

pub(crate) mod bpf_syscall;
pub mod features;
pub mod in_pod;
pub mod netns;
pub mod preflight;
pub mod redirect;
pub mod sock_diag;
mod sockopt;
