//! Istio's and Envoy's wire types (`proto/`), as Rust with tonic clients
//! and servers (the servers are for the test control plane in `tests/`).
//! `spiffe/workload.proto` is the SPIFFE Workload API (X.509 profile).
//! `zds.proto` declares messages only (ZDS is not gRPC), so it adds no
//! client or server.

use anyhow::{Context as _, bail};

fn main() -> anyhow::Result<()> {
    const PROTOS: [&str; 6] = [
        "proto/envoy/discovery.proto",
        "proto/istio/workload.proto",
        "proto/istio/authorization.proto",
        "proto/istio/ca.proto",
        "proto/istio/zds.proto",
        "proto/spiffe/workload.proto",
    ];
    println!("cargo:rerun-if-changed=proto");
    if which::which("protoc").is_err() && std::env::var_os("PROTOC").is_none() {
        bail!("protoc is not on PATH: run `cargo xtask setup` (Debian's protobuf-compiler)");
    }
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_protos(&PROTOS, &["proto"])
        .context("compiling proto/ (Istio's wire types) failed")
}
