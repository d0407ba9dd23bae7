//! A known mesh as istiod would push it (a workload with a waypoint and
//! a locality, a service with two endpoints and a load balancer, a policy
//! with principal, namespace and port matches), and the readers the dump
//! tests need (`tests/ztunnel_dump.rs`, `tests/ztunnel_dump_interop.rs`):
//! what ztunnel's `/config_dump` prints for it is checked against ours.

use std::net::IpAddr;

use anyhow::{Context as _, Result, ensure};
use dataplane_user::istio_api::{
    ADDRESS_TYPE, AUTHORIZATION_TYPE,
    discovery::Resource,
    security::{self, Authorization, Clause, Rule, StringMatch, string_match::MatchType},
    workload::{
        self, Address, GatewayAddress, LoadBalancing, Locality, NamespacedHostname, NetworkAddress,
        Port, PortList, TunnelProtocol, address, gateway_address, load_balancing,
    },
};
use serde_json::Value;

use crate::{
    Agent,
    istio_resources::resource,
    istiod::{TestIstiod, TestPki, xds_flags},
    mesh::{NAMESPACE, TwoNodes},
    traffic::{http, wait_until},
};

/// The service's key (`namespace/hostname`).
pub const SERVICE_KEY: &str = "test/echo.test.svc.cluster.local";
/// The client workload (the pod the tests enroll).
pub const CLIENT_UID: &str = "Kubernetes//Pod/test/client";
/// The healthy HBONE endpoint.
pub const SERVER_A: &str = "Kubernetes//Pod/test/server-a";
/// The unhealthy plain-TCP endpoint.
pub const SERVER_B: &str = "Kubernetes//Pod/test/server-b";

fn bytes(ip: IpAddr) -> Vec<u8> {
    match ip {
        IpAddr::V4(v4) => v4.octets().to_vec(),
        IpAddr::V6(v6) => v6.octets().to_vec(),
    }
}

fn exact(v: &str) -> StringMatch {
    StringMatch {
        match_type: Some(MatchType::Exact(v.into())),
    }
}

fn address_of(kind: address::Type, name: &str) -> Resource {
    resource(ADDRESS_TYPE, name, "v1", &Address { r#type: Some(kind) })
}

/// A server workload in the service, its service port 80 sent to `target`.
fn server(uid: &str, name: &str, ip: [u8; 4], target: u32) -> workload::Workload {
    workload::Workload {
        uid: uid.into(),
        name: name.into(),
        namespace: NAMESPACE.into(),
        addresses: vec![ip.to_vec()],
        service_account: "echo".into(),
        node: "node2".into(),
        services: [(
            SERVICE_KEY.to_owned(),
            PortList {
                ports: vec![Port {
                    service_port: 80,
                    target_port: target,
                }],
            },
        )]
        .into(),
        ..Default::default()
    }
}

/// The state istiod pushes (addresses, then authorizations): `client` (the enrolled pod, with a waypoint by
/// address and a locality), two servers behind `echo` (one unhealthy and
/// plain TCP), and one policy.
pub fn resources(client: &crate::topology::Pod) -> Vec<Vec<Resource>> {
    let client = workload::Workload {
        uid: CLIENT_UID.into(),
        name: "client".into(),
        namespace: NAMESPACE.into(),
        addresses: vec![bytes(client.ip4.into()), bytes(client.ip6.into())],
        service_account: "default".into(),
        tunnel_protocol: TunnelProtocol::Hbone as i32,
        node: "node1".into(),
        canonical_name: "client".into(),
        canonical_revision: "v1".into(),
        workload_name: "client".into(),
        waypoint: Some(GatewayAddress {
            hbone_mtls_port: 15008,
            destination: Some(gateway_address::Destination::Address(NetworkAddress {
                network: String::new(),
                address: vec![10, 9, 0, 1],
                length: None,
            })),
        }),
        locality: Some(Locality {
            region: "eu".into(),
            zone: "eu-1".into(),
            subzone: String::new(),
        }),
        ..Default::default()
    };
    let mut a = server(SERVER_A, "server-a", [10, 77, 0, 1], 9000);
    a.tunnel_protocol = TunnelProtocol::Hbone as i32;
    a.cluster_id = "cluster1".into();
    a.authorization_policies = vec!["test/allow-front".into()];
    let mut b = server(SERVER_B, "server-b", [10, 77, 0, 2], 9001);
    b.status = workload::WorkloadStatus::Unhealthy as i32;
    let service = workload::Service {
        name: "echo".into(),
        namespace: NAMESPACE.into(),
        hostname: "echo.test.svc.cluster.local".into(),
        addresses: vec![
            NetworkAddress {
                network: String::new(),
                address: vec![10, 96, 0, 10],
                length: None,
            },
            // A range on a network of its own (a ServiceEntry's CIDR
            // address): the dumps write it with that network.
            NetworkAddress {
                network: "east".into(),
                // Host bits set: both dumps keep them as sent.
                address: vec![10, 97, 0, 5],
                length: Some(16),
            },
        ],
        ports: vec![Port {
            service_port: 80,
            target_port: 9000,
        }],
        waypoint: Some(GatewayAddress {
            hbone_mtls_port: 15008,
            destination: Some(gateway_address::Destination::Hostname(NamespacedHostname {
                namespace: NAMESPACE.into(),
                hostname: "waypoint.test.svc.cluster.local".into(),
            })),
        }),
        load_balancing: Some(LoadBalancing {
            routing_preference: vec![
                load_balancing::Scope::Zone as i32,
                load_balancing::Scope::Region as i32,
            ],
            mode: load_balancing::Mode::Failover as i32,
            health_policy: load_balancing::HealthPolicy::AllowAll as i32,
        }),
        ip_families: workload::IpFamilies::Dual as i32,
        canonical: true,
        visibility: workload::service::Visibility::Namespace as i32,
        ..Default::default()
    };
    let policy = Authorization {
        name: "allow-front".into(),
        namespace: NAMESPACE.into(),
        scope: security::Scope::WorkloadSelector as i32,
        action: security::Action::Allow as i32,
        rules: vec![Rule {
            clauses: vec![Clause {
                matches: vec![security::Match {
                    namespaces: vec![exact("front")],
                    principals: vec![
                        exact("cluster.local/ns/front/sa/ui"),
                        StringMatch {
                            match_type: Some(MatchType::Suffix("/sa/admin".into())),
                        },
                    ],
                    not_principals: vec![StringMatch {
                        match_type: Some(MatchType::Prefix("cluster.local/ns/ops/".into())),
                    }],
                    destination_ports: vec![9000],
                    not_destination_ports: vec![9001],
                    ..Default::default()
                }],
            }],
        }],
        dry_run: false,
    };
    vec![
        vec![
            address_of(address::Type::Workload(client), CLIENT_UID),
            address_of(address::Type::Workload(a), SERVER_A),
            address_of(address::Type::Workload(b), SERVER_B),
            address_of(address::Type::Service(service), SERVICE_KEY),
        ],
        vec![resource(
            AUTHORIZATION_TYPE,
            "test/allow-front",
            "v1",
            &policy,
        )],
    ]
}

/// Two nodes, the test istiod serving [`resources`] for node1's client pod,
/// and the files an agent on istiod reads.
pub struct KnownMesh {
    /// The nodes and pods.
    pub w: TwoNodes,
    /// The runtime driving istiod.
    pub rt: tokio::runtime::Runtime,
    /// istiod's CA.
    pub pki: TestPki,
    /// The test istiod.
    pub istiod: TestIstiod,
    flags: Vec<String>,
    empty: std::path::PathBuf,
}

impl KnownMesh {
    /// Starts the nodes and istiod and publishes the known state.
    pub fn start(tag: &str) -> Result<Self> {
        let w = TwoNodes::new(tag)?;
        let (rt, pki, istiod) = crate::istiod::loopback_istiod()?;
        let dir = w.dir.path();
        let (root, token, empty) = (
            dir.join("root-cert.pem"),
            dir.join("istio-token"),
            dir.join("empty.yaml"),
        );
        std::fs::write(&root, &pki.root_pem)?;
        std::fs::write(&token, "known-mesh-token\n")?;
        std::fs::write(&empty, "workloads: []\n")?;
        let [addresses, policies] = <[_; 2]>::try_from(resources(&w.client))
            .map_err(|_| anyhow::anyhow!("two resource types"))?;
        rt.block_on(istiod.publish(ADDRESS_TYPE, addresses, &[]))?;
        rt.block_on(istiod.publish(AUTHORIZATION_TYPE, policies, &[]))?;
        let flags = xds_flags(istiod.addr, &root, &token, "dataplane-node1");
        Ok(Self {
            w,
            rt,
            pki,
            istiod,
            flags,
            empty,
        })
    }

    /// node1's agent on istiod (with `extra` flags), the client pod
    /// enrolled (so it holds the client's certificate).
    pub fn agent(&self, tag: &str, extra: &[&str]) -> Result<Agent> {
        let mut flags: Vec<&str> = self.flags.iter().map(String::as_str).collect();
        flags.extend_from_slice(extra);
        let agent = self.w.agent(tag, 1, &self.empty, &flags)?;
        let response = agent.enroll(Agent::spec_for(&self.w.client, "client"))?;
        ensure!(response.ok, "enrolling client: {:?}", response.error);
        Ok(agent)
    }

    /// `agent`'s admin `/config_dump` (where istioctl reads it) once it
    /// holds the whole known state and a certificate.
    pub fn full_dump(&self, agent: &Agent) -> Result<Value> {
        let admin = agent.admin_addr()?;
        let mut dump = Value::Null;
        wait_until("the dump to hold istiod's state and a certificate", || {
            let (status, body) = http(admin, "GET", "/config_dump")?;
            ensure!(status == 200, "{status}: {body}");
            dump = serde_json::from_str(&body)?;
            Ok(holds_known_state(&dump))
        })?;
        Ok(dump)
    }
}

/// Whether a dump (ours or ztunnel's) lists the whole known state and an
/// available certificate.
pub fn holds_known_state(dump: &Value) -> bool {
    let len = |key: &str| dump[key].as_array().map_or(0, Vec::len);
    len("workloads") == 3
        && len("services") == 1
        && len("policies") == 1
        && dump["certificates"]
            .as_array()
            .is_some_and(|l| l.iter().any(|c| c["state"] == "Available"))
}

/// `aa:bb:...` (our serial form) in decimal, as `BigUint::to_string`
/// writes ztunnel's `serialNumber`.
pub fn hex_serial_to_decimal(hex: &str) -> Result<String> {
    // Base 10^9 limbs, least significant first.
    let mut limbs: Vec<u64> = vec![0];
    for byte in hex.split(':') {
        let mut carry = u64::from(u8::from_str_radix(byte, 16)?);
        for limb in &mut limbs {
            let v = *limb * 256 + carry;
            *limb = v % 1_000_000_000;
            carry = v / 1_000_000_000;
        }
        while carry > 0 {
            limbs.push(carry % 1_000_000_000);
            carry /= 1_000_000_000;
        }
    }
    let mut out = String::new();
    for (i, limb) in limbs.iter().rev().enumerate() {
        if i == 0 {
            out.push_str(&limb.to_string());
        } else {
            out.push_str(&format!("{limb:09}"));
        }
    }
    Ok(out)
}

/// Standard base64 (with padding) to bytes: ztunnel's `base64_encode`
/// undone without a dependency the tests do not otherwise need.
pub fn base64_decode(text: &str) -> Result<Vec<u8>> {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = Vec::new();
    let (mut acc, mut bits) = (0u32, 0u32);
    for c in text.bytes().filter(|c| *c != b'=') {
        let v = ALPHABET
            .iter()
            .position(|a| *a == c)
            .with_context(|| format!("not base64: {c}"))?;
        acc = ((acc << 6) | u32::try_from(v)?) & 0xffff;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push(u8::try_from((acc >> bits) & 0xff)?);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serials_in_decimal() -> Result<()> {
        assert_eq!(hex_serial_to_decimal("01:00")?, "256");
        assert_eq!(
            hex_serial_to_decimal("ff:ff:ff:ff:ff:ff:ff:ff:ff")?,
            "4722366482869645213695"
        );
        assert_eq!(base64_decode("aGVsbG8=")?, b"hello");
        Ok(())
    }
}
