//! `istioctl ztunnel-config workloads|services|policies|certificates|all`
//! reads the node proxy's admin `/config_dump` and decodes ztunnel's
//! sections (istio `istioctl/pkg/writer/ztunnel/configdump/api.go`). The
//! test istiod pushes a known state over xDS (a workload with a waypoint
//! and a locality, a service with two endpoints and a load balancer, a
//! policy with principal, namespace and port matches), a pod is enrolled
//! (so a certificate is issued), and the agent's `/config_dump` must carry
//! ztunnel's sections field by field with the values ztunnel (commit
//! 62d82653) prints for that input; each expectation names the ztunnel
//! function that makes it.
//!
//! Where our model does not keep a field, the expectation says what we
//! write instead (`NOT_CARRIED` in `dataplane-user/src/inspect/ztunnel_dump.rs`).

use std::net::IpAddr;
use std::path::PathBuf;

use anyhow::{Context as _, Result, ensure};
use dataplane_tests::{
    Agent,
    istio_resources::resource,
    istiod::{SERVER_NAME, TestIstiod, TestPki},
    mesh::{NAMESPACE, TwoNodes},
    traffic::{http, wait_until},
};
use dataplane_user::istio_api::{
    ADDRESS_TYPE, AUTHORIZATION_TYPE,
    discovery::Resource,
    security::{self, Authorization, Clause, Rule, StringMatch, string_match::MatchType},
    workload::{
        self, Address, GatewayAddress, LoadBalancing, Locality, NamespacedHostname, NetworkAddress,
        Port, PortList, TunnelProtocol, address, gateway_address, load_balancing,
    },
};
use serde_json::{Value, json};

const SERVICE_KEY: &str = "test/echo.test.svc.cluster.local";
const CLIENT_UID: &str = "Kubernetes//Pod/test/client";
const SERVER_A: &str = "Kubernetes//Pod/test/server-a";
const SERVER_B: &str = "Kubernetes//Pod/test/server-b";

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

/// The state istiod pushes: `client` (the enrolled pod, with a waypoint by
/// address and a locality), two servers behind `echo` (one unhealthy and
/// plain TCP), and one policy.
fn resources(client: &dataplane_tests::topology::Pod) -> Vec<Vec<Resource>> {
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
        addresses: vec![NetworkAddress {
            network: String::new(),
            address: vec![10, 96, 0, 10],
        }],
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

/// What ztunnel prints for [`resources`]; `ips` are the client pod's.
fn expected_workloads(ips: [String; 2]) -> Value {
    // `TryFrom<XdsWorkload> for Workload` (src/state/workload.rs): trust
    // domain `cluster.local` and cluster id `Kubernetes` when empty,
    // capacity 1; `Workload`'s `is_default` fields left out when empty;
    // `Locality` all three keys; `GatewayAddress` destination `network/ip`
    // or `namespace/hostname` (`NetworkAddress`/`NamespacedHostname`
    // `collect_str`); `ProxyState` serialization sorts by uid. ztunnel
    // would also print `"workloadType": "deployment"` (not kept by us).
    json!([
        {
            "workloadIps": ips,
            "waypoint": {"destination": "/10.9.0.1", "hboneMtlsPort": 15008},
            "protocol": "HBONE",
            "networkMode": "Standard",
            "uid": CLIENT_UID,
            "name": "client",
            "namespace": "test",
            "trustDomain": "cluster.local",
            "serviceAccount": "default",
            "workloadName": "client",
            "canonicalName": "client",
            "canonicalRevision": "v1",
            "node": "node1",
            "status": "Healthy",
            "clusterId": "Kubernetes",
            "locality": {"region": "eu", "zone": "eu-1", "subzone": ""},
            "capacity": 1
        },
        {
            "workloadIps": ["10.77.0.1"],
            "protocol": "HBONE",
            "networkMode": "Standard",
            "uid": SERVER_A,
            "name": "server-a",
            "namespace": "test",
            "trustDomain": "cluster.local",
            "serviceAccount": "echo",
            "node": "node2",
            "authorizationPolicies": ["test/allow-front"],
            "status": "Healthy",
            "clusterId": "cluster1",
            "services": [SERVICE_KEY],
            "capacity": 1
        },
        {
            "workloadIps": ["10.77.0.2"],
            "protocol": "TCP",
            "networkMode": "Standard",
            "uid": SERVER_B,
            "name": "server-b",
            "namespace": "test",
            "trustDomain": "cluster.local",
            "serviceAccount": "echo",
            "node": "node2",
            "status": "Unhealthy",
            "clusterId": "Kubernetes",
            "services": [SERVICE_KEY],
            "capacity": 1
        }
    ])
}

fn expected_services() -> Value {
    // `Service` (src/state/service.rs): `vips` as `network/ip`, `ports`
    // and each endpoint's `port` a u16 map (JSON string keys), `endpoints`
    // keyed by workload uid (`EndpointSet`) with the workload's own port
    // list and health, `subjectAltNames`/`canonical`/`visibility` always
    // written, `ipFamilies` left out for `Automatic`; `LoadBalancer` enums
    // by variant name (`LoadBalancerScopes`, `LoadBalancerMode`,
    // `LoadBalancerHealthPolicy`).
    json!([{
        "name": "echo",
        "namespace": "test",
        "hostname": "echo.test.svc.cluster.local",
        "vips": ["/10.96.0.10"],
        "ports": {"80": 9000},
        "endpoints": {
            SERVER_A: {"workloadUid": SERVER_A, "port": {"80": 9000}, "status": "Healthy"},
            SERVER_B: {"workloadUid": SERVER_B, "port": {"80": 9001}, "status": "Unhealthy"}
        },
        "subjectAltNames": [],
        "waypoint": {"destination": "test/waypoint.test.svc.cluster.local", "hboneMtlsPort": 15008},
        "loadBalancer": {
            "routingPreferences": ["Zone", "Region"],
            "mode": "Failover",
            "healthPolicy": "AllowAll"
        },
        "canonical": false,
        "visibility": "Public"
    }])
}

fn expected_policies() -> Value {
    // `rbac::Authorization` and `RbacMatch` (src/rbac.rs): rules nested
    // rule > clause > match, empty match lists left out, `StringMatch`
    // externally tagged (`From<&XdsStringMatch>`), `dryRun` always.
    json!([{
        "name": "allow-front",
        "namespace": "test",
        "scope": "WorkloadSelector",
        "action": "Allow",
        "rules": [[[{
            "namespaces": [{"Exact": "front"}],
            "principals": [{"Exact": "cluster.local/ns/front/sa/ui"}, {"Suffix": "/sa/admin"}],
            "notPrincipals": [{"Prefix": "cluster.local/ns/ops/"}],
            "destinationPorts": [9000],
            "notDestinationPorts": [9001]
        }]]],
        "dryRun": false
    }])
}

/// `aa:bb:...` (our serial form) in decimal, as `BigUint::to_string`
/// writes ztunnel's `serialNumber`.
fn hex_serial_to_decimal(hex: &str) -> Result<String> {
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

#[test]
fn the_admin_dump_carries_ztunnels_sections_as_ztunnel_writes_them() -> Result<()> {
    let w = TwoNodes::new("zdmp")?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let pki = TestPki::generate()?;
    let istiod: TestIstiod = rt.block_on(TestIstiod::start(&pki, "127.0.0.1:0".parse()?))?;
    let dir = w.dir.path();
    let (root, token, empty): (PathBuf, PathBuf, PathBuf) = (
        dir.join("root-cert.pem"),
        dir.join("istio-token"),
        dir.join("empty.yaml"),
    );
    std::fs::write(&root, &pki.root_pem)?;
    std::fs::write(&token, "ztunnel-dump-token\n")?;
    std::fs::write(&empty, "workloads: []\n")?;
    let [addresses, policies] = <[_; 2]>::try_from(resources(&w.client))
        .map_err(|_| anyhow::anyhow!("two resource types"))?;
    rt.block_on(istiod.publish(ADDRESS_TYPE, addresses, &[]))?;
    rt.block_on(istiod.publish(AUTHORIZATION_TYPE, policies, &[]))?;
    let address = istiod.addr.to_string();
    let (root_s, token_s) = (root.display().to_string(), token.display().to_string());
    let flags = [
        "--xds",
        "--istiod-address",
        address.as_str(),
        "--istiod-server-name",
        SERVER_NAME,
        "--istiod-root-cert",
        root_s.as_str(),
        "--istiod-token",
        token_s.as_str(),
        "--pod-name",
        "dataplane-node1",
        "--instance-ip",
        "127.0.0.1",
    ];
    let agent: Agent = w.agent("zd", 1, &empty, &flags)?;
    let response = agent.enroll(Agent::spec_for(&w.client, "client"))?;
    ensure!(response.ok, "enrolling client: {:?}", response.error);

    // The admin endpoint, where istioctl reads it, once the state and the
    // certificate are in.
    let admin = agent.admin_addr()?;
    let mut dump = Value::Null;
    wait_until("the dump to hold istiod's state and a certificate", || {
        let (status, body) = http(admin, "GET", "/config_dump")?;
        ensure!(status == 200, "{status}: {body}");
        dump = serde_json::from_str(&body)?;
        Ok(dump["workloads"].as_array().is_some_and(|l| l.len() == 3)
            && dump["policies"].as_array().is_some_and(|l| l.len() == 1)
            && dump["certificates"]
                .as_array()
                .is_some_and(|l| !l.is_empty()))
    })?;

    let ips = [w.client.ip4.to_string(), w.client.ip6.to_string()];
    assert_eq!(dump["workloads"], expected_workloads(ips), "workloads");
    assert_eq!(dump["services"], expected_services(), "services");
    assert_eq!(dump["policies"], expected_policies(), "policies");

    // `dump_certs` (src/admin.rs): identity URI, `Available`, the leaf
    // (and intermediates) in `certChain`, the roots apart; `dump_cert`:
    // base64 of the PEM text, decimal serial, RFC 3339 whole seconds.
    let certs = dump["certificates"].as_array().context("certificates")?;
    ensure!(certs.len() == 1, "one identity enrolled: {certs:?}");
    let cert = &certs[0];
    assert_eq!(
        cert["identity"],
        "spiffe://cluster.local/ns/test/sa/default"
    );
    assert_eq!(cert["state"], "Available");
    let held = &dump["heldCertificates"][0];
    let leaf = &cert["certChain"][0];
    assert_eq!(
        leaf["serialNumber"].as_str(),
        Some(hex_serial_to_decimal(held["serial"].as_str().context("serial")?)?.as_str()),
        "{leaf} vs {held}"
    );
    assert_eq!(leaf["validFrom"], held["notBefore"]);
    assert_eq!(leaf["expirationTime"], held["notAfter"]);
    let pem = String::from_utf8(base64_decode(leaf["pem"].as_str().context("pem")?)?)?;
    ensure!(
        pem.starts_with("-----BEGIN CERTIFICATE-----\n")
            && pem.ends_with("-----END CERTIFICATE-----\n"),
        "{pem}"
    );
    // `der_to_pem`: 60 characters a line.
    ensure!(pem.lines().nth(1).is_some_and(|l| l.len() == 60), "{pem}");
    let der = pem::parse(&pem)?.into_contents();
    let (_, parsed) = x509_parser::parse_x509_certificate(&der)?;
    assert_eq!(
        leaf["serialNumber"].as_str(),
        Some(parsed.tbs_certificate.serial.to_string().as_str())
    );
    let roots = cert["rootCerts"].as_array().context("rootCerts")?;
    ensure!(!roots.is_empty(), "{cert}");
    for root in roots {
        ensure!(root["pem"] != leaf["pem"], "the leaf is not a root: {cert}");
    }

    // `WorkloadManagerAdminHandler` (src/inpod/admin.rs): by pod uid,
    // `Up`, the pod's name, namespace and service account.
    assert_eq!(
        dump["workloadState"],
        json!({"uid-client": {
            "state": "Up",
            "info": {"name": "client", "namespace": "test", "serviceAccount": "default"}
        }})
    );
    // Our own sections stay beside ztunnel's.
    ensure!(dump["config"]["workloads"].is_array(), "{dump:#}");
    ensure!(
        dump["heldCertificates"][0]["expiresInSecs"].is_i64(),
        "{dump:#}"
    );
    Ok(())
}

/// Standard base64 (with padding) to bytes: ztunnel's `base64_encode`
/// undone without a dependency the tests do not otherwise need.
fn base64_decode(text: &str) -> Result<Vec<u8>> {
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
