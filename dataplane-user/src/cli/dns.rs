//! The DNS capture flags (`--dns-capture`, `--dns-upstream`,
//! `--dns-domain`). They convert into the plain [`DnsConfig`] the `dns`
//! module takes, so that module knows nothing of clap.

use std::collections::BTreeMap;

use clap::{ArgAction, Args};

use crate::dns::DnsConfig;

/// The agent's DNS flags.
#[derive(Debug, Clone, Args)]
pub struct DnsArgs {
    /// Capture enrolled pods' DNS into the in-pod resolver by default
    /// (Istio's `cni.ambient.dnsCapture`, on by default since Istio 1.29).
    /// A pod overrides it with the `ambient.istio.io/dns-capture`
    /// annotation or its workload's `dnsCapture` setting. [default: the
    /// proxy metadata's `DNS_CAPTURE` (`ISTIO_META_DNS_CAPTURE`, or the
    /// mesh config's `proxyMetadata`) when set, on unless it is `true` in
    /// any case, as ztunnel reads it; else true]
    #[arg(
        long,
        env = "DATAPLANE_DNS_CAPTURE",
        num_args = 0..=1,
        default_missing_value = "true",
        action = ArgAction::Set
    )]
    pub dns_capture: Option<bool>,
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

/// The proxy metadata key that turns ztunnel's DNS proxy on or off
/// (ztunnel `src/config.rs` `DNS_CAPTURE_METADATA`).
pub const DNS_CAPTURE_METADATA: &str = "DNS_CAPTURE";
/// The proxy metadata key of ztunnel's DNS proxy address
/// (`DNS_PROXY_ADDR_METADATA`).
pub const DNS_PROXY_ADDR_METADATA: &str = "DNS_PROXY_ADDR";

impl DnsArgs {
    /// The DNS configuration, `--dns-capture` unset taking the proxy
    /// metadata's `DNS_CAPTURE` as ztunnel does in `construct_config`
    /// (`dns_proxy`: absent, or `true` in any case, is on).
    pub fn to_config(&self, metadata: &BTreeMap<String, String>) -> DnsConfig {
        let from_metadata = || {
            metadata
                .get(DNS_CAPTURE_METADATA)
                .is_none_or(|value| value.to_lowercase() == "true")
        };
        DnsConfig {
            default_capture: self.dns_capture.unwrap_or_else(from_metadata),
            upstream: self.dns_upstream.clone(),
            domain: self.dns_domain.clone(),
        }
    }
}

impl From<&DnsArgs> for DnsConfig {
    /// Without proxy metadata.
    fn from(args: &DnsArgs) -> Self {
        args.to_config(&BTreeMap::new())
    }
}
