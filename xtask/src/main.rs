//! Developer tasks for the dataplane workspace, run as `cargo xtask <task>`.
//!
//! `setup` installs what a fresh machine lacks; the others wrap the cargo
//! invocations this workspace needs (the kernel crate only builds for
//! `bpfel-unknown-none`, so plain `--workspace` commands must leave it out).

mod bench;
mod build;
mod cmd;
mod demo;
mod fuzz;
mod lint;
mod run;
mod setup;
mod test;
mod vm;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Developer tasks for the dataplane workspace.
#[derive(Debug, Parser)]
#[command(name = "cargo xtask", bin_name = "cargo xtask")]
struct Cli {
    /// The task to run.
    #[command(subcommand)]
    task: Task,
}

/// The tasks.
#[derive(Debug, Subcommand)]
enum Task {
    /// Install what this machine lacks to build and test the project
    /// (nightly rust-src, bpf-linker, Debian packages, bpffs and cgroup v2
    /// mounts). Safe to re-run: present things are only checked.
    Setup {
        /// Look for and install bpf-linker under DIR/bin instead of cargo's
        /// default root (exercises the install path without replacing the
        /// bpf-linker in use).
        #[arg(long, value_name = "DIR", hide = true)]
        bpf_linker_root: Option<PathBuf>,
    },
    /// Build every binary (the agent embeds its kernel programs).
    Build {
        /// Build with the release profile.
        #[arg(long)]
        release: bool,
    },
    /// Set up, build, then run the agent in the foreground (`dataplane run`).
    /// Unless you pass --on-exit, kernel state is detached on exit.
    Run {
        /// Build and run the release profile.
        #[arg(long)]
        release: bool,
        /// Arguments for `dataplane run`, after `--`.
        #[arg(last = true, value_name = "AGENT_ARGS")]
        agent_args: Vec<String>,
    },
    /// Run every test: set up, build the binaries the integration tests
    /// spawn, then `cargo test` over the workspace without stopping at the
    /// first failure.
    Test {
        /// Build and test the release profile.
        #[arg(long)]
        release: bool,
        /// Arguments for the test harness, after `--` (e.g. a name filter).
        #[arg(last = true, value_name = "EXTRA")]
        extra: Vec<String>,
    },
    /// Set up, build, then show the whole mesh on two simulated nodes:
    /// same-node, cross-node, service and policy-denied flows over HBONE and
    /// a plaintext passthrough, with a report; everything is torn down after.
    Demo {
        /// Leave the mesh running to explore (Enter tears it down).
        #[arg(long)]
        keep: bool,
    },
    /// Check formatting and run clippy on the user-space and kernel crates.
    Lint,
    /// Kernel-level benchmarks (no mesh vs iptables vs eBPF capture, plain
    /// and HBONE, same-node and cross-node) and micro-benchmarks; the report
    /// goes to stdout and target/bench/.
    Bench(bench::BenchArgs),
    /// Fuzz what a stranger can hand the agent (config, CNI stdin, control
    /// requests, HBONE request heads, SPIFFE ids, certificates) with
    /// cargo-fuzz on nightly, seeded by the unit tests; prints executions
    /// per target. Not part of CI.
    Fuzz(fuzz::FuzzArgs),
    /// Run the redirection suite on Linux 5.10, 6.1 and 6.12 (in qemu VMs,
    /// kernels fetched once and cached) and on the host's kernel; prints a
    /// pass/fail table per kernel.
    VmTest(vm::VmTestArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.task {
        Task::Setup { bpf_linker_root } => {
            setup::setup(bpf_linker_root.as_deref()).map(|()| ExitCode::SUCCESS)
        }
        Task::Build { release } => build::build(release),
        Task::Run {
            release,
            agent_args,
        } => run::run(release, &agent_args),
        Task::Test { release, extra } => test::test(release, &extra),
        Task::Demo { keep } => demo::demo(keep),
        Task::Lint => lint::lint(),
        Task::Bench(args) => bench::bench(&args),
        Task::VmTest(args) => vm::vm_test(&args),
        Task::Fuzz(args) => fuzz::fuzz(&args),
    };
    match result {
        Ok(code) => code,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory as _;

    #[test]
    fn cli_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn agent_args_follow_the_double_dash() {
        let cli = Cli::try_parse_from(["xtask", "run", "--release", "--", "--instance", "a"])
            .expect("valid command line");
        match cli.task {
            Task::Run {
                release,
                agent_args,
            } => {
                assert!(release);
                assert_eq!(agent_args, ["--instance", "a"]);
            }
            other => panic!("parsed as {other:?}"),
        }
    }
}
