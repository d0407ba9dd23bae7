//! Command-line interface of the `dataplane` binary.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

use crate::redirect::ExitMode;

/// eBPF-accelerated transparent redirection data plane for a service mesh.
///
/// Kernel programs steer every enrolled pod's TCP traffic into in-pod
/// listeners of this agent, which carries it in HBONE tunnels (HTTP/2
/// CONNECT over mutual TLS, wire-compatible with Istio ambient). No iptables.
#[derive(Debug, Parser)]
#[command(name = "dataplane", version, propagate_version = true)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the node agent: load and attach the kernel programs, serve
    /// enrolled pods, stop on SIGINT/SIGTERM.
    Run(RunArgs),
    /// Print the agent's version, its key dependencies, and every embedded
    /// kernel program with its type and attach point.
    Version {
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Inspect the kernel redirection state of an agent instance.
    #[command(subcommand)]
    Redirect(RedirectCommand),
}

/// `dataplane redirect ...`
#[derive(Debug, Subcommand)]
pub enum RedirectCommand {
    /// Print the kernel programs' decision counters (summed over CPUs).
    Stats {
        /// Which agent instance.
        #[command(flatten)]
        state: StateArgs,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
}

/// Where an agent instance keeps its kernel state.
#[derive(Debug, Clone, Args)]
pub struct StateArgs {
    /// Agent instance name: pins live under <bpffs>/dataplane/<instance>/, so
    /// several agents (simulated nodes) can share one kernel.
    #[arg(long, env = "DATAPLANE_INSTANCE", default_value = "default")]
    pub instance: String,
    /// bpffs directory that holds pinned maps and links.
    #[arg(long, env = "DATAPLANE_BPFFS", default_value = "/sys/fs/bpf")]
    pub bpffs: PathBuf,
}

/// `dataplane run` options.
#[derive(Debug, Clone, Args)]
pub struct RunArgs {
    /// Local config file (workloads, services, policies). Without it the
    /// embedded default is used.
    #[arg(long, env = "DATAPLANE_CONFIG")]
    pub config: Option<PathBuf>,
    /// Kernel state location.
    #[command(flatten)]
    pub state: StateArgs,
    /// cgroup v2 directory to attach the socket programs to [default: the
    /// cgroup v2 mount, detected from /proc/self/mountinfo].
    #[arg(long, env = "DATAPLANE_CGROUP")]
    pub cgroup: Option<PathBuf>,
    /// What to do with kernel state on SIGINT/SIGTERM: `keep` leaves programs
    /// attached and maps pinned for the next agent to re-adopt (pods stay
    /// captured; fail-closed while no agent runs); `detach` removes them
    /// (pods fall back to direct traffic).
    #[arg(long, env = "DATAPLANE_ON_EXIT", value_enum, default_value = "keep")]
    pub on_exit: ExitMode,
    /// Socket mark of the agent's own sockets, which capture never touches.
    #[arg(long, env = "DATAPLANE_PROXY_MARK", default_value_t = dataplane_common::DEFAULT_PROXY_MARK, value_parser = parse_u32)]
    pub proxy_mark: u32,
    /// Log output format.
    #[arg(long, env = "DATAPLANE_LOG_FORMAT", value_enum, default_value = "text")]
    pub log_format: LogFormat,
}

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// Accepts decimal or `0x` hexadecimal.
fn parse_u32(s: &str) -> Result<u32, String> {
    let parsed = match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(hex) => u32::from_str_radix(hex, 16),
        None => s.parse(),
    };
    parsed.map_err(|e| format!("`{s}` is not a 32-bit number (decimal or 0x hex): {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn proxy_mark_accepts_hex_and_decimal() {
        assert_eq!(parse_u32("0x539"), Ok(0x539));
        assert_eq!(parse_u32("1337"), Ok(1337));
        assert!(parse_u32("mark").is_err());
    }
}
