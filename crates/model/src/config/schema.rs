//! The shapes of services and authorization policies in the local config
//! (camelCase, as Istio's node proxy accepts them).

use std::collections::BTreeMap;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

/// A service: virtual IPs and ports in front of the workloads that list it.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Service {
    /// Service name.
    pub name: String,
    /// Kubernetes namespace.
    pub namespace: String,
    /// DNS name, e.g. `web.shop.svc.cluster.local`; also accepted as an
    /// HBONE authority (`hostname:port`).
    pub hostname: String,
    /// Virtual IPs, each on its network, written `network/ip` (the
    /// network may be empty: `/10.96.0.10`, the default one).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub vips: Vec<super::Vip>,
    /// Address ranges that are the service's too (a ServiceEntry's
    /// `addresses` given as CIDRs), each on its network, written
    /// `network/cidr` (`/192.0.2.0/24` or a bare CIDR: the default one): a
    /// destination on that network in one, and at no VIP, is this
    /// service's (ztunnel `ServiceStore::get_best_by_cidr_vip`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cidr_vips: Vec<super::VipRange>,
    /// Service port -> target port (0: the endpoint's own mapping decides).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub ports: BTreeMap<u16, u16>,
    /// Identities a server of this service may present besides the
    /// endpoint's own (SPIFFE URIs or `td/ns/x/sa/y`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub subject_alt_names: Vec<String>,
    /// How endpoints are chosen.
    #[serde(default)]
    pub load_balancing: LoadBalancing,
    /// Whether unhealthy endpoints may be chosen.
    #[serde(default, skip_serializing_if = "HealthPolicy::is_default")]
    pub health_policy: HealthPolicy,
    /// Locality preferences (Istio's `trafficDistribution` and
    /// `ServiceEntry` load-balancing modes).
    #[serde(default, skip_serializing_if = "Routing::is_default")]
    pub routing: Routing,
    /// The waypoint in front of this service, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waypoint: Option<super::Waypoint>,
    /// Preferred when several services share a hostname or VIP and none
    /// is in the client's namespace (istiod sets it on Kubernetes'
    /// own services, over ServiceEntries naming the same host).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub canonical: bool,
    /// Which clients may resolve and reach it.
    #[serde(default, skip_serializing_if = "Visibility::is_default")]
    pub visibility: Visibility,
    /// Waypoints drawn per connection by weight in place of `waypoint`,
    /// to shift a share of the service's connections from one waypoint to
    /// another (a canary; ztunnel `sample_weighted_waypoint`). Empty, or
    /// all weights 0: `waypoint`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub weighted_waypoints: Vec<WeightedWaypoint>,
    /// The address families its endpoints are reached and resolved by
    /// (Kubernetes' `ipFamilies`, istiod's `IPFamilies`); absent: any, the
    /// destination's own preferred.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ip_families: Option<IpFamily>,
}

/// A service's address families ([`Service::ip_families`]), named as
/// ztunnel names them (`src/state/service.rs` `IpFamily`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
pub enum IpFamily {
    /// Both: an endpoint is reached at its address of the destination's
    /// family when it has one.
    Dual,
    /// IPv4 only: endpoints at their IPv4 address, no AAAA answer.
    IPv4,
    /// IPv6 only: endpoints at their IPv6 address, no A answer.
    IPv6,
}

impl IpFamily {
    /// Whether `ip` is of a family it allows (ztunnel `IpFamily::accepts_ip`).
    pub fn accepts(self, ip: std::net::IpAddr) -> bool {
        match self {
            Self::Dual => true,
            Self::IPv4 => ip.to_canonical().is_ipv4(),
            Self::IPv6 => !ip.to_canonical().is_ipv4(),
        }
    }
}

/// One waypoint of a weighted set ([`Service::weighted_waypoints`]).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct WeightedWaypoint {
    /// The waypoint, as [`Service::waypoint`] names one.
    pub waypoint: super::Waypoint,
    /// Its share of the connections against the others' (0: none).
    pub weight: u32,
}

/// Which clients may resolve and reach a service (istiod derives it from
/// `exportTo`; ztunnel `src/state/service.rs` `Visibility`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum Visibility {
    /// Every client.
    #[default]
    Public,
    /// Only clients in the service's own namespace: to the others its
    /// VIP and hostname are not the service's (their connections go to
    /// the address as dialled, their DNS queries upstream).
    Namespace,
}

impl Visibility {
    fn is_default(&self) -> bool {
        *self == Self::Public
    }
}

impl Service {
    /// Whether a client in `namespace` may resolve and reach it (ztunnel
    /// `Service::visible_to`).
    pub fn visible_to(&self, namespace: &str) -> bool {
        self.visibility != Visibility::Namespace || self.namespace == namespace
    }

    /// Every waypoint it names: the primary, then the weighted set.
    pub fn waypoints(&self) -> impl Iterator<Item = &super::Waypoint> {
        self.waypoint
            .iter()
            .chain(self.weighted_waypoints.iter().map(|w| &w.waypoint))
    }

    /// The waypoint of one connection: one of the weighted set, drawn by
    /// weight (`draw` gives a number below its argument, at least 1), else
    /// the primary.
    pub fn waypoint_for(&self, draw: impl FnOnce(u64) -> u64) -> Option<&super::Waypoint> {
        let total: u64 = self
            .weighted_waypoints
            .iter()
            .map(|w| u64::from(w.weight))
            .sum();
        if total == 0 {
            return self.waypoint.as_ref();
        }
        let mut left = draw(total).min(total - 1);
        for weighted in &self.weighted_waypoints {
            let weight = u64::from(weighted.weight);
            if left < weight {
                return Some(&weighted.waypoint);
            }
            left -= weight;
        }
        self.waypoint.as_ref()
    }

    /// `namespace/hostname`, the key workloads use in their `services` map.
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.hostname)
    }
}

/// Endpoint selection for a service.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum LoadBalancing {
    /// Each new connection goes to the next endpoint.
    #[default]
    RoundRobin,
    /// Each new connection goes to a random endpoint.
    Random,
}

/// Which endpoints a service may choose by health.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum HealthPolicy {
    /// Only endpoints whose status is `Healthy`.
    #[default]
    OnlyHealthy,
    /// Every endpoint, ready or not (e.g. `publishNotReadyAddresses`).
    AllowAll,
}

impl HealthPolicy {
    fn is_default(&self) -> bool {
        *self == Self::default()
    }
}

/// How locality narrows or orders a service's endpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum RoutingMode {
    /// Locality is not considered.
    #[default]
    Standard,
    /// Only endpoints matching every preference, in order, with the client.
    Strict,
    /// Endpoints matching the most preferences (in order) first; the rest
    /// only when those fail.
    Failover,
    /// No endpoint is chosen: the connection goes to the address the
    /// client dialled, as is.
    Passthrough,
}

/// A locality property compared between client and endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum RoutingScope {
    /// Same region.
    Region,
    /// Same zone.
    Zone,
    /// Same subzone.
    Subzone,
    /// Same node.
    Node,
    /// Same cluster.
    Cluster,
    /// Same network.
    Network,
}

/// Locality-aware endpoint choice of a service.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Routing {
    /// What the preferences do.
    #[serde(default)]
    pub mode: RoutingMode,
    /// Properties compared, most important first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub preferences: Vec<RoutingScope>,
}

impl Routing {
    fn is_default(&self) -> bool {
        *self == Self::default()
    }
}

/// `skip_serializing_if` for flags that default to `false`.
fn is_false(b: &bool) -> bool {
    !*b
}

/// Which workloads a policy applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
pub enum Scope {
    /// Every workload.
    Global,
    /// Workloads in the policy's namespace.
    Namespace,
    /// Workloads that list the policy in `authorizationPolicies`.
    WorkloadSelector,
}

/// What a matching policy does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
pub enum Action {
    /// Allow matching connections (and deny the rest once any ALLOW
    /// policy applies).
    Allow,
    /// Deny matching connections.
    Deny,
}

/// An L4 authorization policy.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
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
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rules: Vec<Vec<Vec<Match>>>,
    /// Only log what the policy would do.
    #[serde(default, skip_serializing_if = "is_false")]
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
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Match {
    /// Source namespaces.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub namespaces: Vec<String>,
    /// Source namespaces that must not match.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub not_namespaces: Vec<String>,
    /// Source service accounts (`name` or `namespace/name`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub service_accounts: Vec<String>,
    /// Source service accounts that must not match.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub not_service_accounts: Vec<String>,
    /// Source principals (`td/ns/x/sa/y`, with or without `spiffe://`;
    /// `*` as a prefix or suffix wildcard).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub principals: Vec<String>,
    /// Source principals that must not match.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub not_principals: Vec<String>,
    /// Source IP ranges.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub source_ips: Vec<IpNet>,
    /// Source IP ranges that must not match.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub not_source_ips: Vec<IpNet>,
    /// Destination IP ranges.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub destination_ips: Vec<IpNet>,
    /// Destination IP ranges that must not match.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub not_destination_ips: Vec<IpNet>,
    /// Destination ports.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub destination_ports: Vec<u16>,
    /// Destination ports that must not match.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub not_destination_ports: Vec<u16>,
}
