//! istiod's services and workloads from a ServiceEntry: what the test
//! istiod serves for a `networking.istio.io/v1` ServiceEntry object (JSON,
//! as the API server holds it), with istiod's own rules.
//!
//! The rules are istio/istio 86c9f01f,
//! `pilot/pkg/serviceregistry/ambient/services.go`
//! `constructServiceEntries` (one Service per host: the entry's name and
//! namespace, the host as hostname, `spec.addresses`, else the addresses
//! auto-allocated for the host in `status.addresses` unless resolution is
//! NONE or the host a wildcard; ports with `targetPort` defaulting to the
//! number; PASSTHROUGH load balancing for resolution NONE) and
//! `workloads.go` `serviceEntryWorkloadBuilder` (one workload per
//! `spec.endpoints` entry, or, for resolution DNS without endpoints and
//! without a workload selector, one per host with the host as its
//! `hostname`: uid `generateServiceEntryUID`, the entry's name as name
//! and workload name, its service account, a hostname for an address that
//! is not an IP, `constructServicesFromWorkloadEntry`'s port mapping by
//! port name, the canonical service from the entry's labels, the tunnel
//! protocol from `setTunnelProtocol`). Left out: waypoints, policies,
//! networks and gateways, locality, traffic distribution, DYNAMIC_DNS (not
//! sent to data planes without an egress waypoint).

use std::net::IpAddr;

use dataplane_user::istio_api::{
    ADDRESS_TYPE,
    discovery::Resource,
    workload::{
        self, Address, LoadBalancing, NetworkAddress, Port, PortList, WorkloadStatus, WorkloadType,
        address, load_balancing,
    },
};
use serde_json::Value;

use crate::istio_resources::resource;
use crate::istiod_kube::{Cluster, canonical_service, set_tunnel_protocol, strings};

fn ip_bytes(ip: IpAddr) -> Vec<u8> {
    match ip {
        IpAddr::V4(v4) => v4.octets().to_vec(),
        IpAddr::V6(v6) => v6.octets().to_vec(),
    }
}

fn network_address(ip: IpAddr) -> NetworkAddress {
    NetworkAddress {
        network: String::new(),
        address: ip_bytes(ip),
        length: None,
    }
}

fn str_list(value: &Value) -> Vec<&str> {
    value
        .as_array()
        .map(|list| list.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default()
}

/// The Services and workloads istiod builds for `entry`, as resources at
/// `version`.
pub fn service_entry_resources(entry: &Value, cluster: &Cluster, version: &str) -> Vec<Resource> {
    let (services, workloads) = service_entry_addresses(entry, cluster);
    let service = services.into_iter().map(|s| {
        let name = format!("{}/{}", s.namespace, s.hostname);
        let body = Address {
            r#type: Some(address::Type::Service(s)),
        };
        resource(ADDRESS_TYPE, &name, version, &body)
    });
    let workload = workloads.into_iter().map(|w| {
        let uid = w.uid.clone();
        let body = Address {
            r#type: Some(address::Type::Workload(w)),
        };
        resource(ADDRESS_TYPE, &uid, version, &body)
    });
    service.chain(workload).collect()
}

/// The Services and workloads istiod builds for `entry`.
pub fn service_entry_addresses(
    entry: &Value,
    cluster: &Cluster,
) -> (Vec<workload::Service>, Vec<workload::Workload>) {
    let (meta, spec) = (&entry["metadata"], &entry["spec"]);
    let name = meta["name"].as_str().unwrap_or_default();
    let namespace = meta["namespace"].as_str().unwrap_or_default();
    let resolution = spec["resolution"].as_str().unwrap_or("NONE");
    let hosts = str_list(&spec["hosts"]);
    // `constructServiceEntries`.
    let addresses: Vec<IpAddr> = str_list(&spec["addresses"])
        .iter()
        .filter_map(|a| a.split('/').next()?.parse().ok())
        .collect();
    let auto: Vec<(&str, IpAddr)> = spec_status_addresses(&entry["status"]);
    let ports: Vec<(u32, u32, &str)> = spec["ports"]
        .as_array()
        .map(|list| {
            list.iter()
                .filter_map(|p| {
                    let number = u32::try_from(p["number"].as_u64()?).ok()?;
                    let target = p["targetPort"]
                        .as_u64()
                        .and_then(|t| u32::try_from(t).ok())
                        .filter(|t| *t != 0)
                        .unwrap_or(number);
                    Some((number, target, p["name"].as_str().unwrap_or_default()))
                })
                .collect()
        })
        .unwrap_or_default();
    let services: Vec<workload::Service> = hosts
        .iter()
        .map(|host| {
            let mut vips = addresses.clone();
            if vips.is_empty() && resolution != "NONE" && !host.starts_with("*.") {
                vips = auto
                    .iter()
                    .filter(|(h, _)| h == host)
                    .map(|(_, ip)| *ip)
                    .collect();
            }
            workload::Service {
                name: name.to_owned(),
                namespace: namespace.to_owned(),
                hostname: (*host).to_owned(),
                addresses: vips.into_iter().map(network_address).collect(),
                ports: ports
                    .iter()
                    .map(|(number, target, _)| Port {
                        service_port: *number,
                        target_port: *target,
                    })
                    .collect(),
                subject_alt_names: str_list(&spec["subjectAltNames"])
                    .into_iter()
                    .map(str::to_owned)
                    .collect(),
                load_balancing: (resolution == "NONE").then(|| LoadBalancing {
                    mode: load_balancing::Mode::Passthrough as i32,
                    health_policy: load_balancing::HealthPolicy::AllowAll as i32,
                    ..Default::default()
                }),
                ..Default::default()
            }
        })
        .collect();
    // `serviceEntryWorkloadBuilder`.
    let endpoints: Vec<&Value> = spec["endpoints"]
        .as_array()
        .map(|list| list.iter().collect())
        .unwrap_or_default();
    let implicit = endpoints.is_empty()
        && matches!(resolution, "DNS" | "DNS_ROUND_ROBIN" | "DYNAMIC_DNS")
        && spec["workloadSelector"].is_null();
    let labels = strings(&meta["labels"]);
    let annotations = strings(&meta["annotations"]);
    let workload = |address: &str, endpoint: Option<&Value>, of: &[&workload::Service]| {
        let mut w = workload::Workload {
            uid: format!(
                "{}/networking.istio.io/ServiceEntry/{namespace}/{name}/{address}",
                cluster.id
            ),
            name: name.to_owned(),
            namespace: namespace.to_owned(),
            cluster_id: cluster.id.clone(),
            service_account: endpoint
                .and_then(|e| e["serviceAccount"].as_str())
                .unwrap_or_default()
                .to_owned(),
            services: of
                .iter()
                .map(|s| {
                    let key = format!("{}/{}", s.namespace, s.hostname);
                    (key, endpoint_ports(endpoint, &ports))
                })
                .collect(),
            status: WorkloadStatus::Healthy as i32,
            // `pickTrustDomain`: the default trust domain is sent as "".
            trust_domain: match cluster.trust_domain.as_str() {
                "cluster.local" => String::new(),
                other => other.to_owned(),
            },
            workload_name: name.to_owned(),
            workload_type: WorkloadType::Pod as i32,
            ..Default::default()
        };
        match address.parse::<IpAddr>() {
            Ok(ip) => w.addresses = vec![ip_bytes(ip)],
            Err(_) => w.hostname = address.to_owned(),
        }
        let (canonical_name, canonical_revision) = canonical_service(&labels, name);
        w.canonical_name = canonical_name;
        w.canonical_revision = canonical_revision;
        set_tunnel_protocol(&labels, &annotations, &mut w);
        w
    };
    let workloads = if implicit {
        // Each host's endpoint is the host itself, in that host's service.
        services
            .iter()
            .map(|s| workload(&s.hostname, None, &[s]))
            .collect()
    } else {
        let all: Vec<&workload::Service> = services.iter().collect();
        endpoints
            .iter()
            .filter_map(|e| Some(workload(e["address"].as_str()?, Some(e), &all)))
            .collect()
    };
    (services, workloads)
}

/// `status.addresses` (`GetHostAddressesFromServiceEntry`): the addresses
/// auto-allocated per host.
fn spec_status_addresses(status: &Value) -> Vec<(&str, IpAddr)> {
    status["addresses"]
        .as_array()
        .map(|list| {
            list.iter()
                .filter_map(|a| Some((a["host"].as_str()?, a["value"].as_str()?.parse().ok()?)))
                .collect()
        })
        .unwrap_or_default()
}

/// `constructServicesFromWorkloadEntry` for a ServiceEntry's service: a
/// port whose name the endpoint maps goes to that port, else to the
/// service's target port.
fn endpoint_ports(endpoint: Option<&Value>, ports: &[(u32, u32, &str)]) -> PortList {
    let mapped = |port_name: &str| {
        endpoint
            .and_then(|e| e["ports"][port_name].as_u64())
            .and_then(|p| u32::try_from(p).ok())
    };
    PortList {
        ports: ports
            .iter()
            .map(|(number, target, port_name)| Port {
                service_port: *number,
                target_port: mapped(port_name).unwrap_or(*target),
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dns_entry_without_endpoints_is_one_workload_per_host_known_by_name() {
        let entry = serde_json::json!({
            "metadata": {"name": "ext", "namespace": "shop", "labels": {"app": "ext"}},
            "spec": {
                "hosts": ["api.example.com", "*.example.org"],
                "ports": [{"number": 443, "name": "tls", "protocol": "TLS"},
                          {"number": 80, "name": "http", "targetPort": 8080}],
                "resolution": "DNS",
            },
            "status": {"addresses": [{"host": "api.example.com", "value": "240.240.0.1"}]},
        });
        let (services, workloads) = service_entry_addresses(&entry, &Cluster::default());
        assert_eq!(services.len(), 2);
        assert_eq!(services[0].addresses[0].address, vec![240, 240, 0, 1]);
        // No auto-allocated address for a wildcard host.
        assert!(services[1].addresses.is_empty());
        assert_eq!(
            services[0]
                .ports
                .iter()
                .map(|p| (p.service_port, p.target_port))
                .collect::<Vec<_>>(),
            [(443, 443), (80, 8080)]
        );
        assert_eq!(workloads.len(), 2);
        let api = &workloads[0];
        assert_eq!(
            api.uid,
            "Kubernetes/networking.istio.io/ServiceEntry/shop/ext/api.example.com"
        );
        assert_eq!(api.hostname, "api.example.com");
        assert!(api.addresses.is_empty());
        assert_eq!(api.canonical_name, "ext");
        assert_eq!(api.tunnel_protocol, 0, "NONE: plain TCP");
        assert_eq!(
            api.services.keys().collect::<Vec<_>>(),
            ["shop/api.example.com"]
        );
    }

    #[test]
    fn listed_endpoints_are_the_workloads_by_ip_or_by_name() {
        let entry = serde_json::json!({
            "metadata": {"name": "db", "namespace": "shop"},
            "spec": {
                "hosts": ["db.example.com"],
                "ports": [{"number": 5432, "name": "pg"}],
                "resolution": "DNS",
                "endpoints": [{"address": "10.9.0.1"},
                              {"address": "db2.example.com", "ports": {"pg": 6432}}],
            },
        });
        let (_, workloads) = service_entry_addresses(&entry, &Cluster::default());
        assert_eq!(workloads[0].addresses, [vec![10, 9, 0, 1]]);
        assert!(workloads[0].hostname.is_empty());
        assert_eq!(workloads[1].hostname, "db2.example.com");
        let ports = &workloads[1].services["shop/db.example.com"].ports;
        assert_eq!((ports[0].service_port, ports[0].target_port), (5432, 6432));
    }
}
