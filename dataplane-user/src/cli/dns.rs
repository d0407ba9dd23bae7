//! The DNS capture flags (`--dns-capture`, `--dns-upstream`,
//! `--dns-domain`). They convert into the plain [`DnsConfig`] the `dns`
//! module takes, so that module knows nothing of clap.

use clap::{ArgAction, Args};

use crate::dns::DnsConfig;

/// The agent's DNS flags.
#[derive(Debug, Clone, Args)]
pub struct DnsArgs {
    /// Capture enrolled pods' DNS into the in-pod resolver by default
    /// (Istio's `cni.ambient.dnsCapture`, on by default since Istio 1.29).
    /// A pod overrides it with the `ambient.istio.io/dns-capture`
    /// annotation or its workload's `dnsCapture` setting.
    #[arg(
        long,
        env = "DATAPLANE_DNS_CAPTURE",
        default_value_t = true,
        num_args = 0..=1,
        default_missing_value = "true",
        action = ArgAction::Set
    )]
    pub dns_capture: bool,
    /// Upstream DNS servers for names the mesh does not know, as `IP` or
    /// `IP:PORT` (repeatable, comma-separated) [default: the nameservers of
    /// the node's /etc/resolv.conf].
    #[arg(
        long = "dns-upstream",
        env = "DATAPLANE_DNS_UPSTREAM",
        value_delimiter = ','
    )]
    pub dns_upstream: Vec<String>,
    /// The cluster's DNS domain (search domains `<ns>.svc.<domain>`,
    /// `svc.<domain>`, `<domain>`).
    #[arg(long, env = "DATAPLANE_DNS_DOMAIN", default_value = "cluster.local")]
    pub dns_domain: String,
}

impl From<&DnsArgs> for DnsConfig {
    fn from(args: &DnsArgs) -> Self {
        Self {
            default_capture: args.dns_capture,
            upstream: args.dns_upstream.clone(),
            domain: args.dns_domain.clone(),
        }
    }
}
