//! A test mesh (the agent's own config types, see [`crate::mesh`]) as the
//! resources istiod would serve for it: `istio.workload.Address` and
//! `istio.security.Authorization`, encoded as on the wire. Only what the
//! tests' meshes use is written: workloads (identity, addresses, protocol,
//! node, service ports, policies, status, waypoint, application tunnel),
//! services (VIPs, ports) and policies with port, namespace and principal
//! matches.

use dataplane_user::config::{
    Action, AppTunnelProtocol, IpFamily, LocalConfig, Policy, Protocol, Scope, Service, Waypoint,
    Workload, WorkloadStatus,
};
use dataplane_user::istio_api::{
    ADDRESS_TYPE, AUTHORIZATION_TYPE,
    discovery::Resource,
    security::{self, Authorization, Clause, Rule, StringMatch, string_match::MatchType},
    workload::{
        self, Address, GatewayAddress, NamespacedHostname, NetworkAddress, Port, PortList,
        TunnelProtocol, address, gateway_address,
    },
};
use prost::Message;

fn ip_bytes(ip: &std::net::IpAddr) -> Vec<u8> {
    match ip {
        std::net::IpAddr::V4(v4) => v4.octets().to_vec(),
        std::net::IpAddr::V6(v6) => v6.octets().to_vec(),
    }
}

fn ports(map: impl IntoIterator<Item = (u16, u16)>) -> Vec<Port> {
    map.into_iter()
        .map(|(service, target)| Port {
            service_port: u32::from(service),
            target_port: u32::from(target),
        })
        .collect()
}

/// `body` as a resource named `name` at `version`.
pub fn resource(type_url: &str, name: &str, version: &str, body: &impl Message) -> Resource {
    Resource {
        name: name.to_owned(),
        version: version.to_owned(),
        resource: Some(prost_types::Any {
            type_url: type_url.to_owned(),
            value: body.encode_to_vec(),
        }),
        ..Default::default()
    }
}

/// A waypoint or network gateway as istiod names it (`GatewayAddress`:
/// an address on its own network, else on `network`, or
/// `namespace/hostname`).
fn gateway_address(waypoint: &Waypoint, network: &str) -> Option<GatewayAddress> {
    let destination = match (&waypoint.address, &waypoint.hostname) {
        (Some(ip), _) => gateway_address::Destination::Address(NetworkAddress {
            network: waypoint.network.as_deref().unwrap_or(network).to_owned(),
            address: ip_bytes(ip),
            length: None,
        }),
        (None, Some(key)) => {
            let (namespace, hostname) = key.split_once('/')?;
            gateway_address::Destination::Hostname(NamespacedHostname {
                namespace: namespace.to_owned(),
                hostname: hostname.to_owned(),
            })
        }
        (None, None) => return None,
    };
    Some(GatewayAddress {
        destination: Some(destination),
        hbone_mtls_port: u32::from(waypoint.hbone_port),
    })
}

/// A workload as istiod sends it (resource name: its uid).
pub fn workload_resource(w: &Workload, version: &str) -> Resource {
    let body = Address {
        r#type: Some(address::Type::Workload(workload::Workload {
            uid: w.uid.to_string(),
            name: w.name.clone(),
            namespace: w.namespace.to_string(),
            addresses: w.workload_ips.iter().map(ip_bytes).collect(),
            // A ServiceEntry endpoint with `resolution: DNS` (istio
            // `serviceEntryWorkloadBuilder`): a name and no address.
            hostname: w.hostname.to_string(),
            capacity: w.capacity,
            network_mode: if w.host_network {
                workload::NetworkMode::HostNetwork
            } else {
                workload::NetworkMode::Standard
            } as i32,
            trust_domain: w.trust_domain.to_string(),
            service_account: w.service_account.to_string(),
            tunnel_protocol: match w.protocol {
                Protocol::Hbone => TunnelProtocol::Hbone as i32,
                Protocol::Tcp => TunnelProtocol::None as i32,
            },
            node: w.node.to_string(),
            services: w
                .services
                .iter()
                .map(|(key, map)| {
                    (
                        key.to_owned(),
                        PortList {
                            ports: ports(map.iter()),
                        },
                    )
                })
                .collect(),
            authorization_policies: w.authorization_policies.to_vec(),
            status: match w.status {
                WorkloadStatus::Healthy => workload::WorkloadStatus::Healthy as i32,
                WorkloadStatus::Unhealthy => workload::WorkloadStatus::Unhealthy as i32,
            },
            waypoint: w.waypoint.as_deref().and_then(|g| gateway_address(g, "")),
            // istiod's network gateway of a pod of another network is on
            // that network (istio `pilot/pkg/serviceregistry/ambient/
            // workloads.go` `getNetworkGatewayAddress`).
            network: w.network.to_string(),
            network_gateway: w
                .network_gateway
                .as_deref()
                .and_then(|g| gateway_address(g, &w.network)),
            // istiod sets it on the pods of a waypoint whose Gateway (or
            // GatewayClass) is annotated `ambient.istio.io/waypoint-inbound-binding:
            // PROXY/<port>` (istio `pilot/pkg/serviceregistry/ambient/
            // waypoints.go` `makeInboundBinding`, `workloads.go`
            // `computeWaypoint`); unset port as 0.
            application_tunnel: w.application_tunnel.map(|t| workload::ApplicationTunnel {
                protocol: match t.protocol {
                    AppTunnelProtocol::None => workload::application_tunnel::Protocol::None,
                    AppTunnelProtocol::Proxy => workload::application_tunnel::Protocol::Proxy,
                } as i32,
                port: t.port.map_or(0, u32::from),
            }),
            ..Default::default()
        })),
    };
    resource(ADDRESS_TYPE, &w.uid, version, &body)
}

/// A service as istiod sends it (resource name: `namespace/hostname`).
pub fn service_resource(s: &Service, version: &str) -> Resource {
    let body = Address {
        r#type: Some(address::Type::Service(workload::Service {
            name: s.name.clone(),
            namespace: s.namespace.clone(),
            hostname: s.hostname.clone(),
            addresses: s
                .vips
                .iter()
                .map(|vip| NetworkAddress {
                    network: vip.network.to_string(),
                    address: ip_bytes(&vip.ip),
                    length: None,
                })
                .collect(),
            ports: ports(s.ports.iter().map(|(p, t)| (*p, *t))),
            subject_alt_names: s.subject_alt_names.clone(),
            ip_families: match s.ip_families {
                None => workload::IpFamilies::Automatic,
                Some(IpFamily::IPv4) => workload::IpFamilies::Ipv4Only,
                Some(IpFamily::IPv6) => workload::IpFamilies::Ipv6Only,
                Some(IpFamily::Dual) => workload::IpFamilies::Dual,
            } as i32,
            ..Default::default()
        })),
    };
    resource(ADDRESS_TYPE, &s.key(), version, &body)
}

/// A policy as istiod sends it (resource name: `namespace/name`).
pub fn policy_resource(p: &Policy, version: &str) -> Resource {
    let exact = |v: &String| StringMatch {
        match_type: Some(MatchType::Exact(v.clone())),
    };
    let body = Authorization {
        name: p.name.clone(),
        namespace: p.namespace.clone(),
        scope: match p.scope {
            Scope::Global => security::Scope::Global,
            Scope::Namespace => security::Scope::Namespace,
            Scope::WorkloadSelector => security::Scope::WorkloadSelector,
        } as i32,
        action: match p.action {
            Action::Allow => security::Action::Allow,
            Action::Deny => security::Action::Deny,
        } as i32,
        rules: p
            .rules
            .iter()
            .map(|clauses| Rule {
                clauses: clauses
                    .iter()
                    .map(|matches| Clause {
                        matches: matches
                            .iter()
                            .map(|m| security::Match {
                                namespaces: m.namespaces.iter().map(exact).collect(),
                                principals: m.principals.iter().map(exact).collect(),
                                destination_ports: m
                                    .destination_ports
                                    .iter()
                                    .map(|p| u32::from(*p))
                                    .collect(),
                                not_destination_ports: m
                                    .not_destination_ports
                                    .iter()
                                    .map(|p| u32::from(*p))
                                    .collect(),
                                ..Default::default()
                            })
                            .collect(),
                    })
                    .collect(),
            })
            .collect(),
        dry_run: p.dry_run,
    };
    resource(AUTHORIZATION_TYPE, &p.key(), version, &body)
}

/// Every workload and service of `config` (`istio.workload.Address`).
pub fn address_resources(config: &LocalConfig, version: &str) -> Vec<Resource> {
    config
        .workloads
        .iter()
        .map(|w| workload_resource(w, version))
        .chain(config.services.iter().map(|s| service_resource(s, version)))
        .collect()
}

/// Every policy of `config` (`istio.security.Authorization`).
pub fn authorization_resources(config: &LocalConfig, version: &str) -> Vec<Resource> {
    config
        .policies
        .iter()
        .map(|p| policy_resource(p, version))
        .collect()
}
