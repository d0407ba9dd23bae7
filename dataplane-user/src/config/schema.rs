//! The shapes of services and authorization policies in the local config
//! (camelCase, as Istio's node proxy accepts them).

use std::{collections::BTreeMap, net::IpAddr};

use ipnet::IpNet;
use serde::{Deserialize, Deserializer};

/// A service: virtual IPs and ports in front of the workloads that list it.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Service {
    /// Service name.
    pub name: String,
    /// Kubernetes namespace.
    pub namespace: String,
    /// DNS name, e.g. `web.shop.svc.cluster.local`; also accepted as an
    /// HBONE authority (`hostname:port`).
    pub hostname: String,
    /// Virtual IPs as `network/ip` (the network may be empty: `/10.96.0.10`).
    #[serde(default, deserialize_with = "vips")]
    pub vips: Vec<IpAddr>,
    /// Service port -> target port (0: the endpoint's own mapping decides).
    #[serde(default)]
    pub ports: BTreeMap<u16, u16>,
    /// Identities a server of this service may present besides the
    /// endpoint's own (SPIFFE URIs or `td/ns/x/sa/y`).
    #[serde(default)]
    pub subject_alt_names: Vec<String>,
    /// How endpoints are chosen.
    #[serde(default)]
    pub load_balancing: LoadBalancing,
}

impl Service {
    /// `namespace/hostname`, the key workloads use in their `services` map.
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.hostname)
    }
}

/// Endpoint selection for a service.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum LoadBalancing {
    /// Each new connection goes to the next endpoint.
    #[default]
    RoundRobin,
    /// Each new connection goes to a random endpoint.
    Random,
}

fn vips<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<IpAddr>, D::Error> {
    let raw: Vec<String> = Vec::deserialize(d)?;
    raw.iter()
        .map(|v| {
            let ip = v.rsplit_once('/').map_or(v.as_str(), |(_, ip)| ip);
            ip.parse().map_err(|_| {
                serde::de::Error::custom(format!(
                    "VIP `{v}` is not `network/ip` with a valid IP (e.g. `/10.96.0.10`)"
                ))
            })
        })
        .collect()
}

/// Which workloads a policy applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub enum Scope {
    /// Every workload.
    Global,
    /// Workloads in the policy's namespace.
    Namespace,
    /// Workloads that list the policy in `authorizationPolicies`.
    WorkloadSelector,
}

/// What a matching policy does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub enum Action {
    /// Allow matching connections (and deny the rest once any ALLOW
    /// policy applies).
    Allow,
    /// Deny matching connections.
    Deny,
}

/// An L4 authorization policy.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Policy {
    /// Policy name.
    pub name: String,
    /// Kubernetes namespace.
    pub namespace: String,
    /// Which workloads it applies to.
    pub scope: Scope,
    /// Allow or Deny.
    pub action: Action,
    /// Rules (ORed) of clauses (ANDed) of matches (ORed).
    #[serde(default)]
    pub rules: Vec<Vec<Vec<Match>>>,
    /// Only log what the policy would do.
    #[serde(default)]
    pub dry_run: bool,
}

impl Policy {
    /// `namespace/name`, the key workloads use in `authorizationPolicies`.
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}

/// One match: every non-empty positive field must match (values within a
/// field are ORed) and no `not*` field may match.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Match {
    /// Source namespaces.
    #[serde(default)]
    pub namespaces: Vec<String>,
    /// Source namespaces that must not match.
    #[serde(default)]
    pub not_namespaces: Vec<String>,
    /// Source service accounts (`name` or `namespace/name`).
    #[serde(default)]
    pub service_accounts: Vec<String>,
    /// Source service accounts that must not match.
    #[serde(default)]
    pub not_service_accounts: Vec<String>,
    /// Source principals (`td/ns/x/sa/y`, with or without `spiffe://`;
    /// `*` as a prefix or suffix wildcard).
    #[serde(default)]
    pub principals: Vec<String>,
    /// Source principals that must not match.
    #[serde(default)]
    pub not_principals: Vec<String>,
    /// Source IP ranges.
    #[serde(default)]
    pub source_ips: Vec<IpNet>,
    /// Source IP ranges that must not match.
    #[serde(default)]
    pub not_source_ips: Vec<IpNet>,
    /// Destination IP ranges.
    #[serde(default)]
    pub destination_ips: Vec<IpNet>,
    /// Destination IP ranges that must not match.
    #[serde(default)]
    pub not_destination_ips: Vec<IpNet>,
    /// Destination ports.
    #[serde(default)]
    pub destination_ports: Vec<u16>,
    /// Destination ports that must not match.
    #[serde(default)]
    pub not_destination_ports: Vec<u16>,
}
