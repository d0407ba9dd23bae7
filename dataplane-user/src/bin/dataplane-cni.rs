//! `dataplane-cni`: the chained CNI plugin that enrolls each new pod with
//! the node agent before its first packet (see `dataplane_user::cni`).
//!
//! A binary of its own rather than a mode of `dataplane`: the container
//! runtime runs it by its `type` name from the host's CNI bin directory for
//! every pod, so it is copied onto the host; it carries neither the kernel
//! object nor the tunnel engine, and starts in a few milliseconds.

use std::{
    io::{Read as _, Write as _},
    process::ExitCode,
};

use dataplane_user::cni::{self, spec::CniEnv};

fn main() -> ExitCode {
    let mut stdin = Vec::new();
    // The runtime closes stdin after writing the configuration; VERSION may
    // come with none at all.
    let _ = std::io::stdin()
        .take(cni::MAX_CONFIG)
        .read_to_end(&mut stdin);
    let outcome = cni::plugin::run(&CniEnv::from_process(), &stdin);
    let mut stdout = std::io::stdout().lock();
    let _ = stdout.write_all(outcome.stdout.as_bytes());
    let _ = stdout.flush();
    if outcome.success {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
