//! `dataplane pod ...`: enrolling and unenrolling pods by hand (what the
//! CNI plugin and the node agent do through the control socket).

use std::path::PathBuf;

use clap::{Args, Subcommand};

use super::StateArgs;

/// `dataplane pod ...`
#[derive(Debug, Subcommand)]
pub enum PodCommand {
    /// Enroll a pod: its TCP traffic is captured from now on. Idempotent.
    Add(Box<PodAddArgs>),
    /// Unenroll a pod by uid or network namespace. Idempotent.
    Remove {
        /// Which agent instance.
        #[command(flatten)]
        state: StateArgs,
        /// The pod's uid.
        #[arg(long, required_unless_present = "netns", conflicts_with = "netns")]
        uid: Option<String>,
        /// The pod's network namespace path.
        #[arg(long)]
        netns: Option<PathBuf>,
    },
    /// List enrolled pods.
    List {
        /// Which agent instance.
        #[command(flatten)]
        state: StateArgs,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
}

/// `dataplane pod add` options.
#[derive(Debug, Clone, Args)]
pub struct PodAddArgs {
    /// Which agent instance.
    #[command(flatten)]
    pub state: StateArgs,
    /// Unique id of the pod (e.g. its Kubernetes uid).
    #[arg(long)]
    pub uid: String,
    /// Pod name.
    #[arg(long)]
    pub name: String,
    /// Kubernetes namespace.
    #[arg(long)]
    pub namespace: String,
    /// Service account.
    #[arg(long, default_value = "default")]
    pub service_account: String,
    /// SPIFFE trust domain of the pod's identity.
    #[arg(long, default_value = "cluster.local")]
    pub trust_domain: String,
    /// Network namespace path (e.g. /var/run/netns/NAME or /proc/PID/ns/net).
    #[arg(long)]
    pub netns: PathBuf,
    /// A pod IP (repeat for dual-stack).
    #[arg(long = "ip", required = true)]
    pub ips: Vec<std::net::IpAddr>,
    /// Node-side address toward the pod: kubelet probes from it are not
    /// captured.
    #[arg(long)]
    pub node_addr: Option<std::net::IpAddr>,
    /// Outbound destination port never captured (repeatable).
    #[arg(long = "exclude-outbound-port")]
    pub exclude_outbound_ports: Vec<u16>,
    /// Outbound destination CIDR never captured (repeatable).
    #[arg(long = "exclude-outbound-cidr")]
    pub exclude_outbound_cidrs: Vec<ipnet::IpNet>,
    /// Inbound port never captured (repeatable).
    #[arg(long = "exclude-inbound-port")]
    pub exclude_inbound_ports: Vec<u16>,
    /// Capture none of the pod's inbound connections (Istio's
    /// `ambient.istio.io/bypass-inbound-capture`); outbound and DNS stay
    /// captured and HBONE tunnels still reach it.
    #[arg(long)]
    pub bypass_inbound_capture: bool,
    /// Capture the pod's DNS (`true`/`false`) [default: the agent's
    /// `--dns-capture`].
    #[arg(long = "dns-capture")]
    pub dns_capture: Option<bool>,
    /// Allow the same-node fast path for the pod (`true`/`false`)
    /// [default: its workload's `fastPath`, else the agent's
    /// `--fast-path`].
    #[arg(long = "fast-path")]
    pub fast_path: Option<bool>,
}
