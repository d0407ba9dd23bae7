//! istiod's resources in the agent's own mesh model: each `Workload`,
//! `Service` and `Authorization` becomes the [`crate::config`] entry the
//! local file would write for it, so both sources share one validated
//! model and one meaning.
//!
//! Each resource was checked on its own when it arrived (and NACKed if
//! unusable, see [`super::resources`]). What remains are conflicts between
//! resources, resolved by [`super::XdsModel`].

use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;

use super::resources::{XdsResources, ip_from_bytes};
use crate::config::{
    self, Action, AppTunnelProtocol, ApplicationTunnel, HealthPolicy, LocalConfig, Locality, Match,
    Policy, Protocol, Routing, RoutingMode, RoutingScope, Scope, SharedStr, Waypoint,
    WorkloadStatus, interned::Strings,
};
use crate::identity::Identity;
use crate::istio_api::{
    security::{self, Authorization, StringMatch, string_match::MatchType},
    workload::{
        self, Address, GatewayAddress, IpFamilies, TunnelProtocol, address, gateway_address,
        load_balancing::{HealthPolicy as XdsHealthPolicy, Mode, Scope as XdsScope},
        service::Visibility as XdsVisibility,
    },
};

/// The mesh model of what istiod sent, and what had to be left out.
#[derive(Debug, Clone, Default)]
pub struct Translated {
    /// Workloads, services and policies.
    pub config: LocalConfig,
    /// One line per conflict resolved by leaving something out.
    pub dropped: Vec<String>,
}

/// A resource type istiod sends, as the mesh model holds it: what the
/// held resources keep in place of istiod's encoding (translated once,
/// when it arrives; the model's entries share it).
pub trait IntoModel: prost::Message + Default {
    /// The resource in the mesh model (cheap to clone: shared).
    type Model: Clone + std::fmt::Debug + Send + Sync;

    /// Translates `self`, held under `name`, sharing repeated strings
    /// through `strings` (and `name` itself where the model repeats it: a
    /// workload's uid).
    fn to_model(&self, name: &Arc<str>, strings: &mut Strings) -> Self::Model;
}

/// One address resource in the mesh model, before the conflicts between
/// resources are resolved, with what translating it left out.
#[derive(Debug, Clone)]
pub struct AddressModel {
    /// What it is.
    pub entry: AddressEntry,
    /// What was left out, one line each (usually none).
    pub notes: Box<[String]>,
}

/// What an address resource is in the mesh model.
#[derive(Debug, Clone)]
pub enum AddressEntry {
    /// A workload (`None`: unusable, see the notes).
    Workload(Option<Arc<config::Workload>>),
    /// A service.
    Service(Arc<config::Service>),
    /// Neither (an empty address).
    Neither,
}

impl IntoModel for Address {
    type Model = AddressModel;

    fn to_model(&self, name: &Arc<str>, strings: &mut Strings) -> AddressModel {
        let mut notes = Vec::new();
        let entry = match &self.r#type {
            Some(address::Type::Workload(w)) => {
                AddressEntry::Workload(workload_of(w, name, strings, &mut notes).map(Arc::new))
            }
            Some(address::Type::Service(s)) => {
                AddressEntry::Service(Arc::new(service_of(s, &mut notes)))
            }
            None => AddressEntry::Neither,
        };
        AddressModel {
            entry,
            notes: notes.into(),
        }
    }
}

impl IntoModel for Authorization {
    type Model = Arc<Policy>;

    fn to_model(&self, _: &Arc<str>, _: &mut Strings) -> Arc<Policy> {
        Arc::new(policy_of(self))
    }
}

/// Translates everything held from istiod; `origin` names the source
/// (e.g. `xds://istiod.istio-system.svc:15012`). The agent keeps an
/// [`super::XdsModel`] instead, which translates only what changed.
pub fn translate(resources: &XdsResources, origin: &str) -> Translated {
    super::XdsModel::default()
        .update(resources)
        .translated(origin)
}

fn workload_of(
    w: &workload::Workload,
    resource_name: &Arc<str>,
    strings: &mut Strings,
    dropped: &mut Vec<String>,
) -> Option<config::Workload> {
    let locality = w.locality.as_ref().and_then(|l| {
        let locality = Locality {
            region: strings.get(&l.region),
            zone: strings.get(&l.zone),
            subzone: strings.get(&l.subzone),
        };
        strings.locality(locality)
    });
    // Each of a service's endpoints holds its key: one copy for all.
    let services = w
        .services
        .iter()
        .map(|(key, ports)| {
            let ports: config::Ports = ports
                .ports
                .iter()
                .filter_map(|p| Some((port(p.service_port)?, port(p.target_port)?)))
                .collect();
            (strings.name(key), ports)
        })
        .collect();
    // The gateways' networks are the workloads' (istiod sends a pod's
    // network gateway on the pod's network): held once, as those are.
    let mut name = |value: &str| strings.name(value);
    let waypoint = w.waypoint.as_ref().and_then(|g| waypoint_of(g, &mut name));
    let network_gateway = w
        .network_gateway
        .as_ref()
        .and_then(|g| waypoint_of(g, &mut name));
    let mut or = |value: &str, default: &str| match value {
        "" => strings.name(default),
        v => strings.name(v),
    };
    let workload = config::Workload {
        // istiod names a workload's resource by its uid: one copy for both.
        uid: if **resource_name == *w.uid {
            Arc::clone(resource_name)
        } else {
            w.uid.as_str().into()
        },
        name: w.name.clone(),
        namespace: or(&w.namespace, ""),
        service_account: or(&w.service_account, "default"),
        trust_domain: or(&w.trust_domain, "cluster.local"),
        workload_ips: w
            .addresses
            .iter()
            .filter_map(|a| ip_from_bytes(a).ok())
            .map(|ip| ip.to_canonical())
            .collect(),
        hostname: or(&w.hostname, ""),
        host_network: w.network_mode == workload::NetworkMode::HostNetwork as i32,
        capacity: w.capacity,
        protocol: match TunnelProtocol::try_from(w.tunnel_protocol) {
            Ok(TunnelProtocol::Hbone) => Protocol::Hbone,
            _ => Protocol::Tcp,
        },
        node: or(&w.node, ""),
        netns: None,
        services,
        authorization_policies: w.authorization_policies.clone().into(),
        status: match workload::WorkloadStatus::try_from(w.status) {
            Ok(workload::WorkloadStatus::Unhealthy) => WorkloadStatus::Unhealthy,
            _ => WorkloadStatus::Healthy,
        },
        waypoint: waypoint.map(Box::new),
        application_tunnel: w.application_tunnel.as_ref().map(application_tunnel_of),
        network: or(&w.network, ""),
        network_gateway: network_gateway.map(Box::new),
        canonical_name: or(&w.canonical_name, ""),
        canonical_revision: or(&w.canonical_revision, ""),
        workload_name: or(&w.workload_name, ""),
        cluster_id: or(&w.cluster_id, ""),
        locality,
        // Istio carries DNS capture in the pod's annotation, not in xDS.
        dns_capture: None,
        fast_path: None,
    };
    // The check on arrival refuses these; an identity is what every
    // certificate and policy hangs on, so never carry one that is not.
    if let Err(err) = Identity::new(
        &*workload.trust_domain,
        &*workload.namespace,
        &*workload.service_account,
    ) {
        dropped.push(format!("workload {}: {err}", workload.uid));
        return None;
    }
    Some(workload)
}

/// The range a service address covers when it is a CIDR (a prefix length
/// shorter than the whole address), on the address's network, as ztunnel
/// reads it (`src/state/service.rs`, `Service::try_from`:
/// `network_cidr(network, cidr)`); host bits are cleared.
fn cidr_of(address: &workload::NetworkAddress) -> Option<config::VipRange> {
    let ip = ip_from_bytes(&address.address).ok()?.to_canonical();
    let max = if ip.is_ipv4() { 32 } else { 128 };
    let length = address.length.filter(|l| *l != max)?;
    let net = IpNet::new(ip, u8::try_from(length).ok()?).ok()?;
    Some(config::VipRange::new(address.network.as_str(), net))
}

fn service_of(s: &workload::Service, dropped: &mut Vec<String>) -> config::Service {
    let subject_alt_names = s
        .subject_alt_names
        .iter()
        .filter(|san| {
            let uri = if san.starts_with("spiffe://") {
                (*san).clone()
            } else {
                format!("spiffe://{san}")
            };
            let ok = Identity::parse(&uri).is_ok();
            if !ok {
                dropped.push(format!(
                    "service {}/{}: subject alt name `{san}` is not a SPIFFE identity",
                    s.namespace, s.hostname
                ));
            }
            ok
        })
        .cloned()
        .collect();
    let lb = s.load_balancing.as_ref();
    config::Service {
        name: s.name.clone(),
        namespace: s.namespace.clone(),
        hostname: s.hostname.clone(),
        vips: s
            .addresses
            .iter()
            .filter(|a| cidr_of(a).is_none())
            .filter_map(|a| {
                // Its network kept: two networks' services may share a
                // VIP (ztunnel `Service` `vips: Vec<NetworkAddress>`).
                let ip = ip_from_bytes(&a.address).ok()?;
                Some(config::Vip::new(a.network.as_str(), ip))
            })
            .collect(),
        cidr_vips: s.addresses.iter().filter_map(cidr_of).collect(),
        ports: s
            .ports
            .iter()
            .filter_map(|p| Some((port(p.service_port)?, port(p.target_port)?)))
            .collect(),
        subject_alt_names,
        load_balancing: config::LoadBalancing::default(),
        health_policy: match lb.map(|lb| XdsHealthPolicy::try_from(lb.health_policy)) {
            Some(Ok(XdsHealthPolicy::AllowAll)) => HealthPolicy::AllowAll,
            _ => HealthPolicy::OnlyHealthy,
        },
        routing: lb
            .map(|lb| Routing {
                mode: match Mode::try_from(lb.mode) {
                    Ok(Mode::Strict) => RoutingMode::Strict,
                    Ok(Mode::Failover) => RoutingMode::Failover,
                    Ok(Mode::Passthrough) => RoutingMode::Passthrough,
                    _ => RoutingMode::Standard,
                },
                preferences: lb
                    .routing_preference
                    .iter()
                    .filter_map(|scope| match XdsScope::try_from(*scope) {
                        Ok(XdsScope::Region) => Some(RoutingScope::Region),
                        Ok(XdsScope::Zone) => Some(RoutingScope::Zone),
                        Ok(XdsScope::Subzone) => Some(RoutingScope::Subzone),
                        Ok(XdsScope::Node) => Some(RoutingScope::Node),
                        Ok(XdsScope::Cluster) => Some(RoutingScope::Cluster),
                        Ok(XdsScope::Network) => Some(RoutingScope::Network),
                        _ => None,
                    })
                    .collect(),
            })
            .unwrap_or_default(),
        waypoint: s
            .waypoint
            .as_ref()
            .and_then(|g| waypoint_of(g, &mut |n: &str| SharedStr::from(n))),
        weighted_waypoints: s
            .weighted_waypoints
            .iter()
            .filter_map(|w| {
                Some(config::WeightedWaypoint {
                    waypoint: waypoint_of(w.destination.as_ref()?, &mut |n: &str| {
                        SharedStr::from(n)
                    })?,
                    weight: w.weight,
                })
            })
            .collect(),
        canonical: s.canonical,
        // An unknown value is PUBLIC, as ztunnel reads it (fail open
        // rather than drop the service: `src/state/service.rs`).
        visibility: match XdsVisibility::try_from(s.visibility) {
            Ok(XdsVisibility::Namespace) => config::Visibility::Namespace,
            _ => config::Visibility::Public,
        },
        ip_families: ip_families_of(s, dropped),
    }
}

/// A service's address families (ztunnel `src/state/service.rs`:
/// `AUTOMATIC` is none). ztunnel refuses a service whose value it does not
/// know; here the service is kept, reached as if `AUTOMATIC`, and the
/// value noted.
fn ip_families_of(s: &workload::Service, dropped: &mut Vec<String>) -> Option<config::IpFamily> {
    match IpFamilies::try_from(s.ip_families) {
        Ok(IpFamilies::Automatic) => None,
        Ok(IpFamilies::Ipv4Only) => Some(config::IpFamily::IPv4),
        Ok(IpFamilies::Ipv6Only) => Some(config::IpFamily::IPv6),
        Ok(IpFamilies::Dual) => Some(config::IpFamily::Dual),
        Err(_) => {
            dropped.push(format!(
                "service {}/{}: ip_families {} is not one this agent knows; any family is used",
                s.namespace, s.hostname, s.ip_families
            ));
            None
        }
    }
}

/// A waypoint or network gateway as istiod names it; a network's name is
/// held as `name` holds it.
fn waypoint_of(
    gateway: &GatewayAddress,
    name: &mut dyn FnMut(&str) -> SharedStr,
) -> Option<Waypoint> {
    let hbone_port = match port(gateway.hbone_mtls_port) {
        Some(0) | None => dataplane_common::HBONE_PORT,
        Some(p) => p,
    };
    // An address is kept with its network (ztunnel `src/state/workload.rs`
    // `GatewayAddress`: `Destination::Address(NetworkAddress)`), which
    // `src/state.rs` `fetch_network_gateway` looks it up on.
    let (address, network, hostname) = match gateway.destination.as_ref()? {
        gateway_address::Destination::Address(a) => (
            Some(ip_from_bytes(&a.address).ok()?),
            Some(name(&a.network)),
            None,
        ),
        gateway_address::Destination::Hostname(h) => {
            (None, None, Some(format!("{}/{}", h.namespace, h.hostname)))
        }
    };
    Some(Waypoint {
        address,
        network,
        hostname,
        hbone_port,
    })
}

fn policy_of(a: &security::Authorization) -> Policy {
    Policy {
        name: a.name.clone(),
        namespace: a.namespace.clone(),
        scope: match security::Scope::try_from(a.scope) {
            Ok(security::Scope::Namespace) => Scope::Namespace,
            Ok(security::Scope::WorkloadSelector) => Scope::WorkloadSelector,
            _ => Scope::Global,
        },
        action: match security::Action::try_from(a.action) {
            Ok(security::Action::Deny) => Action::Deny,
            _ => Action::Allow,
        },
        rules: a
            .rules
            .iter()
            .map(|rule| {
                rule.clauses
                    .iter()
                    .map(|clause| clause.matches.iter().map(match_of).collect())
                    .collect()
            })
            .collect(),
        dry_run: a.dry_run,
    }
}

fn match_of(m: &security::Match) -> Match {
    let strings = |list: &[StringMatch]| list.iter().filter_map(pattern).collect();
    let accounts = |list: &[security::ServiceAccountMatch]| {
        list.iter()
            .map(|sa| match sa.namespace.as_str() {
                "" => sa.service_account.clone(),
                ns => format!("{ns}/{}", sa.service_account),
            })
            .collect()
    };
    let nets = |list: &[security::Address]| {
        list.iter()
            .filter_map(|a| {
                let ip: IpAddr = ip_from_bytes(&a.address).ok()?;
                IpNet::new(ip, u8::try_from(a.length).ok()?).ok()
            })
            .collect()
    };
    let ports = |list: &[u32]| list.iter().filter_map(|p| port(*p)).collect();
    Match {
        namespaces: strings(&m.namespaces),
        not_namespaces: strings(&m.not_namespaces),
        service_accounts: accounts(&m.service_accounts),
        not_service_accounts: accounts(&m.not_service_accounts),
        principals: strings(&m.principals),
        not_principals: strings(&m.not_principals),
        source_ips: nets(&m.source_ips),
        not_source_ips: nets(&m.not_source_ips),
        destination_ips: nets(&m.destination_ips),
        not_destination_ips: nets(&m.not_destination_ips),
        destination_ports: ports(&m.destination_ports),
        not_destination_ports: ports(&m.not_destination_ports),
    }
}

/// Istio's StringMatch in the file's wildcard form (`x`, `x*`, `*x`, `*`).
/// A match without a type is refused on arrival.
fn pattern(m: &StringMatch) -> Option<String> {
    Some(match m.match_type.as_ref()? {
        MatchType::Exact(v) => v.clone(),
        MatchType::Prefix(v) => format!("{v}*"),
        MatchType::Suffix(v) => format!("*{v}"),
        MatchType::Presence(_) => "*".to_owned(),
    })
}

/// ztunnel's reading (`src/state/workload.rs`, `ApplicationTunnel::try_from`):
/// port 0 is unset. The check on arrival refused unknown protocols and
/// ports over 16 bits.
fn application_tunnel_of(tunnel: &workload::ApplicationTunnel) -> ApplicationTunnel {
    ApplicationTunnel {
        protocol: match workload::application_tunnel::Protocol::try_from(tunnel.protocol) {
            Ok(workload::application_tunnel::Protocol::Proxy) => AppTunnelProtocol::Proxy,
            _ => AppTunnelProtocol::None,
        },
        port: port(tunnel.port).filter(|p| *p != 0),
    }
}

fn port(value: u32) -> Option<u16> {
    u16::try_from(value).ok()
}

#[cfg(test)]
#[path = "translate_tests.rs"]
mod tests;
