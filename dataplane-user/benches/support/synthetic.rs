//! The synthetic meshes of issue 31 as istiod's resources, shared by the
//! benches that measure the xDS path (`xds_update`, `mesh_memory`).

#![allow(dead_code)]

use std::collections::HashMap;

use dataplane_user::{
    istio_api::{
        ADDRESS_TYPE, AUTHORIZATION_TYPE,
        discovery::{DeltaDiscoveryResponse, Resource},
        security::{self, Authorization, Clause, Rule, StringMatch, string_match},
        workload::{self, Address, NetworkAddress, Port, PortList, TunnelProtocol, address},
    },
    xds::{Response, XdsResources},
};
use prost::Message;

/// The i-th workload's IPv4 address bytes (10.x.y.z).
pub fn workload_ip(i: usize) -> Vec<u8> {
    let [_, a, b, c] = u32::try_from(i).unwrap_or(u32::MAX).to_be_bytes();
    vec![10, a, b, c]
}

pub fn resource(name: String, version: &str, type_url: &str, body: &impl Message) -> Resource {
    Resource {
        name,
        version: version.to_owned(),
        resource: Some(prost_types::Any {
            type_url: type_url.to_owned(),
            value: body.encode_to_vec(),
        }),
        ..Resource::default()
    }
}

pub fn response(type_url: &str, resources: Vec<Resource>) -> Response {
    let message = DeltaDiscoveryResponse {
        type_url: type_url.to_owned(),
        resources,
        nonce: "n".to_owned(),
        ..DeltaDiscoveryResponse::default()
    };
    // A message prost encoded always reads back: an empty response
    // (applies nothing) is unreachable.
    Response::from_message(&message).unwrap_or_default()
}

/// Workload `i` at `version`, an endpoint of service `i % services`.
pub fn workload(i: usize, services: usize, namespaces: usize, version: &str) -> Resource {
    let s = i % services;
    let ns = format!("ns{}", s % namespaces);
    let body = Address {
        r#type: Some(address::Type::Workload(workload::Workload {
            uid: format!("Kubernetes//Pod/{ns}/w{i}"),
            name: format!("w{i}"),
            namespace: ns.clone(),
            addresses: vec![workload_ip(i)],
            tunnel_protocol: TunnelProtocol::Hbone.into(),
            trust_domain: "cluster.local".to_owned(),
            service_account: format!("sa{}", i % 500),
            node: format!("node{}", i % 100),
            canonical_name: format!("app{s}"),
            canonical_revision: version.to_owned(),
            workload_name: format!("app{s}"),
            cluster_id: "Kubernetes".to_owned(),
            services: HashMap::from([(
                format!("{ns}/svc{s}.{ns}.svc.cluster.local"),
                PortList {
                    ports: vec![Port {
                        service_port: 80,
                        target_port: 8080,
                    }],
                },
            )]),
            ..workload::Workload::default()
        })),
    };
    resource(
        format!("Kubernetes//Pod/{ns}/w{i}"),
        version,
        ADDRESS_TYPE,
        &body,
    )
}

/// What istiod holds for a mesh of `n` workloads, `services` services
/// and `policies` namespace policies, as the client holds it after the
/// first push (issue 31's meshes: `n / 10` services, `n / 100` policies,
/// as many namespaces as policies).
pub fn held(n: usize, services: usize, policies: usize) -> XdsResources {
    let namespaces = (n / 100).max(1);
    let mut addresses: Vec<Resource> = (0..n)
        .map(|i| workload(i, services, namespaces, "v1"))
        .collect();
    addresses.extend((0..services).map(|s| {
        let ns = format!("ns{}", s % namespaces);
        let hostname = format!("svc{s}.{ns}.svc.cluster.local");
        let body = Address {
            r#type: Some(address::Type::Service(workload::Service {
                name: format!("svc{s}"),
                namespace: ns.clone(),
                hostname: hostname.clone(),
                addresses: vec![NetworkAddress {
                    network: String::new(),
                    address: vec![172, 16, (s >> 8) as u8, s as u8],
                    length: None,
                }],
                ports: vec![Port {
                    service_port: 80,
                    target_port: 8080,
                }],
                ..workload::Service::default()
            })),
        };
        resource(format!("{ns}/{hostname}"), "v1", ADDRESS_TYPE, &body)
    }));
    let policies = (0..policies)
        .map(|p| {
            let ns = format!("ns{}", p % namespaces);
            let body = Authorization {
                name: format!("p{p}"),
                namespace: ns.clone(),
                scope: security::Scope::Namespace.into(),
                action: security::Action::Allow.into(),
                rules: vec![Rule {
                    clauses: vec![Clause {
                        matches: vec![security::Match {
                            namespaces: vec![StringMatch {
                                match_type: Some(string_match::MatchType::Exact(format!(
                                    "ns{}",
                                    (p + 1) % namespaces
                                ))),
                            }],
                            ..security::Match::default()
                        }],
                    }],
                }],
                dry_run: false,
            };
            resource(format!("{ns}/p{p}"), "v1", AUTHORIZATION_TYPE, &body)
        })
        .collect();
    let mut resources = XdsResources::default();
    resources.apply(&response(ADDRESS_TYPE, addresses));
    resources.apply(&response(AUTHORIZATION_TYPE, policies));
    resources
}
