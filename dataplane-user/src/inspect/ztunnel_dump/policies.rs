//! Authorization policies as ztunnel writes them (`policies`).

use ipnet::IpNet;
use serde::Serialize;

use crate::config::{Match, Policy};

/// ztunnel's `rbac::Authorization` (`src/rbac.rs`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ZtunnelPolicy {
    name: String,
    namespace: String,
    /// `RbacScope`: `Global`, `Namespace`, `WorkloadSelector` (our enum
    /// serializes the same names).
    scope: crate::config::Scope,
    /// `RbacAction`: `Allow`, `Deny`.
    action: crate::config::Action,
    /// Rules (any) of clauses (all) of matches (any).
    rules: Vec<Vec<Vec<RbacMatch>>>,
    dry_run: bool,
}

/// ztunnel's `RbacMatch`: every list left out when empty.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RbacMatch {
    #[serde(skip_serializing_if = "Vec::is_empty")]
    namespaces: Vec<StringMatch>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    not_namespaces: Vec<StringMatch>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    service_accounts: Vec<ServiceAccountMatch>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    not_service_accounts: Vec<ServiceAccountMatch>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    principals: Vec<StringMatch>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    not_principals: Vec<StringMatch>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    source_ips: Vec<IpNet>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    not_source_ips: Vec<IpNet>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    destination_ips: Vec<IpNet>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    not_destination_ips: Vec<IpNet>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    destination_ports: Vec<u16>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    not_destination_ports: Vec<u16>,
}

/// ztunnel's `rbac::StringMatch`, an externally tagged enum:
/// `{"Exact": "x"}`, `{"Prefix": "x"}`, `{"Suffix": "x"}`,
/// `{"Presence": []}` (a tuple variant with no fields).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub enum StringMatch {
    /// Starts with.
    Prefix(String),
    /// Ends with.
    Suffix(String),
    /// Equals.
    Exact(String),
    /// Is set.
    Presence(),
}

/// ztunnel's `rbac::ServiceAccountMatch`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ServiceAccountMatch {
    namespace: String,
    service_account: String,
}

/// Every policy of the mesh, sorted by namespace and name.
pub(super) fn sorted(policies: &[Policy]) -> Vec<ZtunnelPolicy> {
    let mut policies: Vec<ZtunnelPolicy> = policies.iter().map(policy).collect();
    policies.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
    policies
}

fn policy(p: &Policy) -> ZtunnelPolicy {
    ZtunnelPolicy {
        name: p.name.clone(),
        namespace: p.namespace.clone(),
        scope: p.scope,
        action: p.action,
        rules: p
            .rules
            .iter()
            .map(|clauses| {
                clauses
                    .iter()
                    .map(|matches| matches.iter().map(rbac_match).collect())
                    .collect()
            })
            .collect(),
        dry_run: p.dry_run,
    }
}

fn rbac_match(m: &Match) -> RbacMatch {
    let strings = |list: &[String]| list.iter().map(|s| string_match(s)).collect();
    let accounts = |list: &[String]| list.iter().map(|s| account(s)).collect();
    RbacMatch {
        namespaces: strings(&m.namespaces),
        not_namespaces: strings(&m.not_namespaces),
        service_accounts: accounts(&m.service_accounts),
        not_service_accounts: accounts(&m.not_service_accounts),
        principals: strings(&m.principals),
        not_principals: strings(&m.not_principals),
        source_ips: m.source_ips.clone(),
        not_source_ips: m.not_source_ips.clone(),
        destination_ips: m.destination_ips.clone(),
        not_destination_ips: m.not_destination_ips.clone(),
        destination_ports: m.destination_ports.clone(),
        not_destination_ports: m.not_destination_ports.clone(),
    }
}

/// Our wildcard form back into Istio's StringMatch: the inverse of
/// `xds::translate::pattern` (`x`, `x*`, `*x`, `*`).
pub(super) fn string_match(pattern: &str) -> StringMatch {
    if pattern == "*" {
        StringMatch::Presence()
    } else if let Some(suffix) = pattern.strip_prefix('*') {
        StringMatch::Suffix(suffix.to_owned())
    } else if let Some(prefix) = pattern.strip_suffix('*') {
        StringMatch::Prefix(prefix.to_owned())
    } else {
        StringMatch::Exact(pattern.to_owned())
    }
}

/// `namespace/name`, or `name` when istiod gave no namespace (the
/// translation writes it so).
fn account(value: &str) -> ServiceAccountMatch {
    let (namespace, service_account) = value.split_once('/').unwrap_or(("", value));
    ServiceAccountMatch {
        namespace: namespace.to_owned(),
        service_account: service_account.to_owned(),
    }
}
