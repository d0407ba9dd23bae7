//! The sections of ztunnel's admin `/config_dump` that `istioctl
//! ztunnel-config workloads|services|policies|certificates|all` decodes
//! (istio `istioctl/pkg/writer/ztunnel/configdump/api.go`, `ZtunnelDump`),
//! built from our mesh state with ztunnel's field names and value forms so
//! that Istio's tooling reads our dump unchanged. The agent's own sections
//! stay beside them under their own keys.
//!
//! Every form below is ztunnel's (commit 62d82653), cited where it is
//! made. What our model does not hold is either written as ztunnel
//! defaults it for istiod's usual input, or left out; the list is in
//! [`NOT_CARRIED`].

use std::{collections::BTreeMap, net::IpAddr, sync::Arc};

use ipnet::IpNet;
use rustls::pki_types::CertificateDer;
use serde::Serialize;

use crate::{
    config::{
        ApplicationTunnel, HealthPolicy, LocalConfig, Match, Policy, Protocol, RoutingMode,
        RoutingScope, Service, Waypoint, Workload, WorkloadStatus,
    },
    enroll::PodStatus,
    identity::IssuedCert,
};

/// What ztunnel's dump carries that ours writes differently or not at all,
/// and why (our mesh model does not keep it). Said here so a reader of a
/// dump diff knows which differences are expected.
pub const NOT_CARRIED: &[&str] = &[
    "workloads[].workloadType: not kept from xDS, left out (ztunnel: `deployment`, `pod`, ...)",
    "workloads[].nativeTunnel: not kept, left out",
    "workloads[].capacity: not kept, written as ztunnel's default 1",
    "workloads[].networkMode: not kept, written as `Standard`",
    "workloads[].waypoint, networkGateway / services[].waypoint by address: the gateway's \
     network is written as istiod sent it; one from the config file without a network is \
     written empty (`/10.0.0.1`)",
    "services[].ipFamilies: not kept, left out",
    "services[].subjectAltNames: only the SANs that are SPIFFE identities (the rest are dropped \
     on arrival)",
    "services[].loadBalancer: written when any setting differs from the default (ztunnel: \
     whenever istiod sent one)",
    "policies[].rules: a StringMatch `Exact` value ending or starting with `*` reads back as \
     `Prefix`/`Suffix` (our model writes the wildcard form)",
    "certificates[]: only issued certificates (`Available`); identities still waiting are not \
     listed (ztunnel: `Initializing`)",
    "workloadState[].connections: not written (ztunnel: only with connection tracking)",
];

/// ztunnel's sections of the dump, flattened into its top level.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ZtunnelSections {
    /// `ProxyStateSerialization.workloads` (ztunnel `src/state.rs`,
    /// `impl Serialize for ProxyState`), sorted by uid as it sorts them.
    pub workloads: Vec<ZtunnelWorkload>,
    /// Sorted by hostname (same function).
    pub services: Vec<ZtunnelService>,
    /// Sorted by `namespace/name` (same function).
    pub policies: Vec<ZtunnelPolicy>,
    /// `ConfigDump.certificates` (ztunnel `src/admin.rs`, `dump_certs`),
    /// sorted by identity.
    pub certificates: Vec<CertsDump>,
    /// The node agent's per-pod state (ztunnel `src/inpod/admin.rs`,
    /// `WorkloadManagerAdminHandler`, key `workloadState`), by pod uid.
    pub workload_state: BTreeMap<String, PodProxyState>,
}

/// A workload as ztunnel serializes `state::workload::Workload` (ztunnel
/// `src/state/workload.rs`: `rename_all = "camelCase"`, the
/// `skip_serializing_if = "is_default"` fields left out when empty).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ZtunnelWorkload {
    workload_ips: Vec<IpAddr>,
    #[serde(skip_serializing_if = "Option::is_none")]
    waypoint: Option<GatewayAddress>,
    #[serde(skip_serializing_if = "Option::is_none")]
    network_gateway: Option<GatewayAddress>,
    /// `InboundProtocol`: `HBONE` or `TCP`.
    protocol: Protocol,
    network_mode: &'static str,
    #[serde(skip_serializing_if = "str::is_empty")]
    uid: String,
    name: String,
    namespace: String,
    #[serde(skip_serializing_if = "str::is_empty")]
    trust_domain: String,
    #[serde(skip_serializing_if = "str::is_empty")]
    service_account: String,
    #[serde(skip_serializing_if = "str::is_empty")]
    network: String,
    #[serde(skip_serializing_if = "str::is_empty")]
    workload_name: String,
    #[serde(skip_serializing_if = "str::is_empty")]
    canonical_name: String,
    #[serde(skip_serializing_if = "str::is_empty")]
    canonical_revision: String,
    #[serde(skip_serializing_if = "str::is_empty")]
    hostname: String,
    #[serde(skip_serializing_if = "str::is_empty")]
    node: String,
    /// ztunnel's `ApplicationTunnel` (`src/state/workload.rs`):
    /// `{protocol: NONE|PROXY, port}`, `port` null when unset; ours
    /// serializes to the same form.
    #[serde(skip_serializing_if = "Option::is_none")]
    application_tunnel: Option<ApplicationTunnel>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    authorization_policies: Vec<String>,
    /// `HealthStatus`: `Healthy` or `Unhealthy` (our enum's own names).
    status: WorkloadStatus,
    cluster_id: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    locality: Option<Locality>,
    /// `NamespacedHostname`s, serialized `namespace/hostname`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    services: Vec<String>,
    capacity: u32,
}

/// ztunnel's `Locality`: no rename, no skip, so all three keys appear once
/// one is set (the whole struct is skipped when all are empty).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Locality {
    region: String,
    zone: String,
    subzone: String,
}

/// ztunnel's `GatewayAddress`: the destination is `NetworkAddress`
/// (`network/ip`) or `NamespacedHostname` (`namespace/hostname`), both
/// written with `collect_str` (`src/state/workload.rs`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GatewayAddress {
    destination: String,
    hbone_mtls_port: u16,
}

/// A service as ztunnel serializes `state::service::Service`
/// (`src/state/service.rs`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ZtunnelService {
    name: String,
    namespace: String,
    hostname: String,
    /// `NetworkAddress`es, `network/ip`.
    vips: Vec<String>,
    /// `NetworkCidr`s: `{network, cidr}`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    cidr_vips: Vec<NetworkCidr>,
    /// `HashMap<u16, u16>`: service port -> target port, keys as strings.
    ports: BTreeMap<u16, u16>,
    /// `EndpointSet`: a map keyed by workload uid.
    endpoints: BTreeMap<String, ZtunnelEndpoint>,
    subject_alt_names: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    waypoint: Option<GatewayAddress>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    weighted_waypoints: Vec<WeightedWaypoint>,
    #[serde(skip_serializing_if = "Option::is_none")]
    load_balancer: Option<LoadBalancer>,
    /// `Option<IpFamily>`: `Dual`, `IPv4` or `IPv6`; absent for automatic.
    #[serde(skip_serializing_if = "Option::is_none")]
    ip_families: Option<crate::config::IpFamily>,
    canonical: bool,
    /// Always written, `Public` by default (`Visibility`).
    visibility: &'static str,
}

/// ztunnel's `WeightedWaypoint` (`src/state/service.rs`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct WeightedWaypoint {
    destination: GatewayAddress,
    weight: u32,
}

/// ztunnel's `NetworkCidr` (`src/state/workload.rs`: derived, no rename).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NetworkCidr {
    network: String,
    cidr: String,
}

/// ztunnel's `Endpoint` (`src/state/service.rs`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ZtunnelEndpoint {
    workload_uid: String,
    /// The workload's own port list for this service.
    port: BTreeMap<u16, u16>,
    status: WorkloadStatus,
}

/// ztunnel's `LoadBalancer`: enum variants by their Rust names
/// (`LoadBalancerScopes`, `LoadBalancerMode`, `LoadBalancerHealthPolicy`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct LoadBalancer {
    routing_preferences: Vec<&'static str>,
    mode: &'static str,
    health_policy: &'static str,
}

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

/// ztunnel's `admin::CertsDump`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CertsDump {
    identity: String,
    state: &'static str,
    cert_chain: Vec<CertDump>,
    root_certs: Vec<CertDump>,
}

/// ztunnel's `admin::CertDump` (`dump_cert`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CertDump {
    /// The PEM text, base64 encoded again (`base64_encode(cert.as_pem())`).
    pem: String,
    /// Decimal (`x509_parser`'s `serial.to_string()`).
    serial_number: String,
    /// RFC 3339, whole seconds, `Z`.
    valid_from: String,
    expiration_time: String,
}

/// ztunnel's `inpod::admin::ProxyState` without `connections`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PodProxyState {
    /// `Up` once the pod is served (`State`).
    state: &'static str,
    info: PodInfo,
}

/// ztunnel's `state::WorkloadInfo`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PodInfo {
    name: String,
    namespace: String,
    service_account: String,
}

impl ZtunnelSections {
    /// ztunnel's sections for the mesh `config`, the certificates `issued`
    /// (chains checked against `roots`) and the enrolled `pods`.
    pub fn build(
        config: &LocalConfig,
        issued: &[Arc<IssuedCert>],
        roots: &[CertificateDer<'static>],
        pods: &[PodStatus],
    ) -> Self {
        let mut workloads: Vec<ZtunnelWorkload> =
            config.workloads.iter().map(|w| workload(w)).collect();
        workloads.sort_by(|a, b| a.uid.cmp(&b.uid));
        let mut services: Vec<ZtunnelService> = config
            .services
            .iter()
            .map(|s| service(s, &config.workloads))
            .collect();
        services.sort_by(|a, b| a.hostname.cmp(&b.hostname));
        let mut policies: Vec<ZtunnelPolicy> = config.policies.iter().map(policy).collect();
        policies.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
        let mut certificates: Vec<CertsDump> = issued.iter().map(|c| certs(c, roots)).collect();
        certificates.sort_by(|a, b| a.identity.cmp(&b.identity));
        let workload_state = pods
            .iter()
            .map(|pod| {
                let info = PodInfo {
                    name: pod.spec.name.clone(),
                    namespace: pod.spec.namespace.clone(),
                    service_account: pod.spec.service_account.clone(),
                };
                (pod.spec.uid.clone(), PodProxyState { state: "Up", info })
            })
            .collect();
        Self {
            workloads,
            services,
            policies,
            certificates,
            workload_state,
        }
    }
}

/// ztunnel `TryFrom<XdsWorkload> for Workload` defaults an empty cluster
/// id to `Kubernetes`; trust domain and service account are defaulted
/// the same way by our translation already.
const DEFAULT_CLUSTER_ID: &str = "Kubernetes";

fn workload(w: &Workload) -> ZtunnelWorkload {
    let known = w.locality();
    let locality = (!known.is_empty()).then(|| Locality {
        region: known.region.to_string(),
        zone: known.zone.to_string(),
        subzone: known.subzone.to_string(),
    });
    let mut services: Vec<String> = w.services.keys().map(str::to_owned).collect();
    services.sort();
    ZtunnelWorkload {
        workload_ips: w.workload_ips.to_vec(),
        waypoint: w.waypoint.as_deref().and_then(gateway),
        network_gateway: w.network_gateway.as_deref().and_then(gateway),
        protocol: w.protocol,
        // ztunnel's `NetworkMode` variant names.
        network_mode: if w.host_network {
            "HostNetwork"
        } else {
            "Standard"
        },
        uid: w.uid.to_string(),
        name: w.name.clone(),
        namespace: w.namespace.to_string(),
        trust_domain: w.trust_domain.to_string(),
        service_account: w.service_account.to_string(),
        network: w.network.to_string(),
        workload_name: w.workload_name.to_string(),
        canonical_name: w.canonical_name.to_string(),
        canonical_revision: w.canonical_revision.to_string(),
        hostname: w.hostname.to_string(),
        node: w.node.to_string(),
        application_tunnel: w.application_tunnel,
        authorization_policies: w.authorization_policies.to_vec(),
        status: w.status,
        cluster_id: match &*w.cluster_id {
            "" => DEFAULT_CLUSTER_ID.to_owned(),
            id => id.to_owned(),
        },
        locality,
        services,
        // `capacity: resource.capacity.unwrap_or(1)`.
        capacity: w.weight(),
    }
}

/// `network/ip` (the network empty when not given), or
/// `namespace/hostname` as we already hold it; none if the waypoint
/// names neither.
fn gateway(w: &Waypoint) -> Option<GatewayAddress> {
    let destination = match (&w.address, &w.hostname) {
        (Some(ip), _) => format!("{}/{ip}", w.network.as_deref().unwrap_or_default()),
        (None, Some(hostname)) => hostname.clone(),
        (None, None) => return None,
    };
    Some(GatewayAddress {
        destination,
        hbone_mtls_port: w.hbone_port,
    })
}

fn service(s: &Service, workloads: &[Arc<Workload>]) -> ZtunnelService {
    let key = s.key();
    // ztunnel fills `endpoints` from each workload's `services` entry for
    // this service (`ServiceStore::insert_endpoint`), keyed by workload
    // uid, whatever the workload's health.
    let endpoints = workloads
        .iter()
        .filter_map(|w| {
            let ports = w.services.get(&key)?;
            Some((
                w.uid.to_string(),
                ZtunnelEndpoint {
                    workload_uid: w.uid.to_string(),
                    port: ports.iter().collect(),
                    status: w.status,
                },
            ))
        })
        .collect();
    let load_balancer = (s.health_policy != HealthPolicy::default()
        || s.routing != crate::config::Routing::default())
    .then(|| LoadBalancer {
        routing_preferences: s.routing.preferences.iter().map(|p| scope(*p)).collect(),
        mode: mode(s.routing.mode),
        health_policy: match s.health_policy {
            HealthPolicy::OnlyHealthy => "OnlyHealthy",
            HealthPolicy::AllowAll => "AllowAll",
        },
    });
    ZtunnelService {
        name: s.name.clone(),
        namespace: s.namespace.clone(),
        hostname: s.hostname.clone(),
        vips: s.vips.iter().map(ToString::to_string).collect(),
        cidr_vips: s
            .cidr_vips
            .iter()
            .map(|range| NetworkCidr {
                network: range.network.to_string(),
                cidr: range.net.to_string(),
            })
            .collect(),
        ports: s.ports.clone(),
        endpoints,
        subject_alt_names: s.subject_alt_names.clone(),
        waypoint: s.waypoint.as_ref().and_then(gateway),
        weighted_waypoints: s
            .weighted_waypoints
            .iter()
            .filter_map(|w| {
                Some(WeightedWaypoint {
                    destination: gateway(&w.waypoint)?,
                    weight: w.weight,
                })
            })
            .collect(),
        load_balancer,
        ip_families: s.ip_families,
        canonical: s.canonical,
        visibility: match s.visibility {
            crate::config::Visibility::Public => "Public",
            crate::config::Visibility::Namespace => "Namespace",
        },
    }
}

/// `LoadBalancerScopes` variant names.
fn scope(scope: RoutingScope) -> &'static str {
    match scope {
        RoutingScope::Region => "Region",
        RoutingScope::Zone => "Zone",
        RoutingScope::Subzone => "Subzone",
        RoutingScope::Node => "Node",
        RoutingScope::Cluster => "Cluster",
        RoutingScope::Network => "Network",
    }
}

/// `LoadBalancerMode` variant names.
fn mode(mode: RoutingMode) -> &'static str {
    match mode {
        RoutingMode::Standard => "Standard",
        RoutingMode::Strict => "Strict",
        RoutingMode::Failover => "Failover",
        RoutingMode::Passthrough => "Passthrough",
    }
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
fn string_match(pattern: &str) -> StringMatch {
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

/// ztunnel `dump_certs`: `Available` certificates list the leaf and its
/// intermediates (`cert_and_intermediates`, so not the roots) and the
/// roots trusted.
fn certs(cert: &IssuedCert, roots: &[CertificateDer<'static>]) -> CertsDump {
    CertsDump {
        identity: cert.identity.to_uri(),
        state: "Available",
        cert_chain: cert
            .chain
            .iter()
            .filter(|c| !roots.contains(c))
            .filter_map(|c| cert_dump(c))
            .collect(),
        root_certs: roots.iter().filter_map(|c| cert_dump(c)).collect(),
    }
}

/// ztunnel `dump_cert`; none for a certificate that does not parse (we
/// only hold ones that did).
fn cert_dump(der: &CertificateDer<'_>) -> Option<CertDump> {
    use base64::Engine as _;
    let (_, parsed) = x509_parser::parse_x509_certificate(der).ok()?;
    let validity = parsed.validity();
    Some(CertDump {
        pem: base64::engine::general_purpose::STANDARD.encode(der_to_pem(der)),
        serial_number: parsed.tbs_certificate.serial.to_string(),
        valid_from: rfc3339_secs(validity.not_before.timestamp()),
        expiration_time: rfc3339_secs(validity.not_after.timestamp()),
    })
}

/// ztunnel `tls::certificate::der_to_pem`: 60 base64 characters a line
/// (not PEM's usual 64), each line and the footer ending in `\n`.
fn der_to_pem(der: &[u8]) -> String {
    let config = pem::EncodeConfig::new()
        .set_line_ending(pem::LineEnding::LF)
        .set_line_wrap(60);
    pem::encode_config(&pem::Pem::new("CERTIFICATE", der), config)
}

/// ztunnel `admin::rfc3339`: `to_rfc3339_opts(SecondsFormat::Secs, true)`,
/// e.g. `2026-01-02T03:04:05Z`. A certificate's times are whole seconds,
/// so the agent's formatter writes them the same way.
fn rfc3339_secs(unix: i64) -> String {
    let at = u64::try_from(unix).map_or(std::time::UNIX_EPOCH, |secs| {
        std::time::UNIX_EPOCH + std::time::Duration::from_secs(secs)
    });
    dataplane_core::timestamp::rfc3339(at)
}

#[cfg(test)]
#[path = "ztunnel_dump_tests.rs"]
mod tests;
