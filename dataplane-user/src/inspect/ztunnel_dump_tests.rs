//! The conversions to ztunnel's dump forms, each expected value taken
//! from the ztunnel function named beside it (commit 62d82653).

#![expect(clippy::unwrap_used, reason = "tests fail loudly on unexpected errors")]

use std::{sync::Arc, time::Duration};

use serde_json::{Value, json};

use super::*;
use super::{
    certs::{der_to_pem, rfc3339_secs},
    policies::string_match,
};
use dataplane_identity::test_util::TestCa;

const MESH: &str = r#"
workloads:
  - uid: cluster1//v1/Pod/shop/web-0
    name: web-0
    namespace: shop
    serviceAccount: web
    workloadIps: [10.1.0.5]
    node: node-a
    canonicalName: web
    workloadName: web
    clusterId: cluster1
    services:
      shop/web.shop.svc.cluster.local: {80: 8080}
    waypoint: {address: 10.1.0.9, hbonePort: 15008}
    locality: {region: r1, zone: z1}
    authorizationPolicies: [shop/allow-front]
  - uid: cluster1//v1/Pod/shop/web-1
    name: web-1
    namespace: shop
    serviceAccount: web
    workloadIps: [10.1.0.6]
    protocol: TCP
    status: Unhealthy
    applicationTunnel: {protocol: PROXY}
    services:
      shop/web.shop.svc.cluster.local: {80: 9090}
services:
  - name: web
    namespace: shop
    hostname: web.shop.svc.cluster.local
    vips: [/10.96.0.10]
    ports: {80: 8080}
    healthPolicy: allowAll
    routing: {mode: failover, preferences: [zone, region]}
    waypoint: {hostname: shop/waypoint.shop.svc.cluster.local, hbonePort: 15008}
policies:
  - name: allow-front
    namespace: shop
    scope: WorkloadSelector
    action: Allow
    rules:
      - - - namespaces: [front]
            principals: [cluster.local/ns/front/sa/ui, "*-admin", "spiffe://x*", "*"]
            destinationPorts: [8080]
          - serviceAccounts: [front/ui, bare]
            notSourceIps: [10.0.0.0/8]
"#;

fn sections() -> Value {
    let config = LocalConfig::parse(MESH, "test").unwrap();
    serde_json::to_value(ZtunnelSections::build(&config, &[], &[], &[])).unwrap()
}

#[test]
fn workloads_take_ztunnels_names_defaults_and_order() {
    let dump = sections();
    // `impl Serialize for ProxyState` sorts by uid; `Workload`'s
    // `is_default` fields are left out when empty; `cluster_id` defaults
    // to `Kubernetes` and `capacity` to 1 (`TryFrom<XdsWorkload>`).
    assert_eq!(
        dump["workloads"],
        json!([
            {
                "workloadIps": ["10.1.0.5"],
                "waypoint": {"destination": "/10.1.0.9", "hboneMtlsPort": 15008},
                "protocol": "HBONE",
                "networkMode": "Standard",
                "uid": "cluster1//v1/Pod/shop/web-0",
                "name": "web-0",
                "namespace": "shop",
                "trustDomain": "cluster.local",
                "serviceAccount": "web",
                "workloadName": "web",
                "canonicalName": "web",
                "node": "node-a",
                "authorizationPolicies": ["shop/allow-front"],
                "status": "Healthy",
                "clusterId": "cluster1",
                "locality": {"region": "r1", "zone": "z1", "subzone": ""},
                "services": ["shop/web.shop.svc.cluster.local"],
                "capacity": 1
            },
            {
                "workloadIps": ["10.1.0.6"],
                "protocol": "TCP",
                "networkMode": "Standard",
                "uid": "cluster1//v1/Pod/shop/web-1",
                "name": "web-1",
                "namespace": "shop",
                "trustDomain": "cluster.local",
                "serviceAccount": "web",
                "status": "Unhealthy",
                "applicationTunnel": {"protocol": "PROXY", "port": null},
                "clusterId": "Kubernetes",
                "services": ["shop/web.shop.svc.cluster.local"],
                "capacity": 1
            }
        ])
    );
}

#[test]
fn services_key_endpoints_by_uid_and_write_vips_as_network_slash_ip() {
    let dump = sections();
    // `Service` (src/state/service.rs): `ports` a u16 map (string keys),
    // `endpoints` keyed by workload uid with the workload's own port list,
    // unhealthy ones included with their status; `subjectAltNames`,
    // `canonical`, `visibility` always written; `LoadBalancer` enums by
    // variant name.
    assert_eq!(
        dump["services"],
        json!([{
            "name": "web",
            "namespace": "shop",
            "hostname": "web.shop.svc.cluster.local",
            "vips": ["/10.96.0.10"],
            "ports": {"80": 8080},
            "endpoints": {
                "cluster1//v1/Pod/shop/web-0": {
                    "workloadUid": "cluster1//v1/Pod/shop/web-0",
                    "port": {"80": 8080},
                    "status": "Healthy"
                },
                "cluster1//v1/Pod/shop/web-1": {
                    "workloadUid": "cluster1//v1/Pod/shop/web-1",
                    "port": {"80": 9090},
                    "status": "Unhealthy"
                }
            },
            "subjectAltNames": [],
            "waypoint": {
                "destination": "shop/waypoint.shop.svc.cluster.local",
                "hboneMtlsPort": 15008
            },
            "loadBalancer": {
                "routingPreferences": ["Zone", "Region"],
                "mode": "Failover",
                "healthPolicy": "AllowAll"
            },
            "canonical": false,
            "visibility": "Public"
        }])
    );
}

#[test]
fn a_default_service_has_no_load_balancer() {
    let yaml = "services:\n  - {name: a, namespace: n, hostname: a.n, vips: [/10.96.0.1]}\n";
    let config = LocalConfig::parse(yaml, "test").unwrap();
    let dump = serde_json::to_value(ZtunnelSections::build(&config, &[], &[], &[])).unwrap();
    assert_eq!(dump["services"][0].get("loadBalancer"), None);
    assert_eq!(dump["services"][0]["endpoints"], json!({}));
}

/// `Service.cidr_vips` (`src/state/service.rs`: left out when empty) is
/// a list of `NetworkCidr` (`src/state/workload.rs`: derived, so
/// `{network, cidr}`, the cidr as `IpNet` writes itself), each on the
/// network its range was sent with.
#[test]
fn vip_ranges_are_written_as_network_cidrs() {
    let yaml = "services:\n  - {name: a, namespace: n, hostname: a.n, cidrVips: [east/192.0.2.0/24, 'fd00::/112']}\n";
    let config = LocalConfig::parse(yaml, "test").unwrap();
    let dump = serde_json::to_value(ZtunnelSections::build(&config, &[], &[], &[])).unwrap();
    assert_eq!(
        dump["services"][0]["cidrVips"],
        json!([
            {"network": "east", "cidr": "192.0.2.0/24"},
            {"network": "", "cidr": "fd00::/112"}
        ])
    );
    assert_eq!(dump["services"][0]["vips"], json!([]));
    assert_eq!(sections()["services"][0].get("cidrVips"), None);
}

#[test]
fn policies_nest_rules_and_tag_string_matches() {
    let dump = sections();
    // `rbac::Authorization`, `RbacMatch` (empty lists left out),
    // `StringMatch` externally tagged, `Presence()` as an empty array,
    // `ServiceAccountMatch` split into namespace and name, `IpNet` as text.
    assert_eq!(
        dump["policies"],
        json!([{
            "name": "allow-front",
            "namespace": "shop",
            "scope": "WorkloadSelector",
            "action": "Allow",
            "rules": [[[
                {
                    "namespaces": [{"Exact": "front"}],
                    "principals": [
                        {"Exact": "cluster.local/ns/front/sa/ui"},
                        {"Suffix": "-admin"},
                        {"Prefix": "spiffe://x"},
                        {"Presence": []}
                    ],
                    "destinationPorts": [8080]
                },
                {
                    "serviceAccounts": [
                        {"namespace": "front", "serviceAccount": "ui"},
                        {"namespace": "", "serviceAccount": "bare"}
                    ],
                    "notSourceIps": ["10.0.0.0/8"]
                }
            ]]],
            "dryRun": false
        }])
    );
}

#[test]
fn certificates_list_the_leaf_apart_from_the_roots() {
    let ca = TestCa::new().ca;
    let identity = TestCa::identity("shop", "web");
    let issued = Arc::new(ca.issue(&identity, Duration::from_secs(3600)).unwrap());
    let roots = vec![ca.root_der().clone()];
    let sections = ZtunnelSections::build(
        &LocalConfig::default(),
        std::slice::from_ref(&issued),
        &roots,
        &[],
    );
    let dump = serde_json::to_value(sections).unwrap();
    let cert = &dump["certificates"][0];
    assert_eq!(cert["identity"], "spiffe://cluster.local/ns/shop/sa/web");
    assert_eq!(cert["state"], "Available");
    // `cert_and_intermediates`: the root is listed under rootCerts only.
    assert_eq!(cert["certChain"].as_array().unwrap().len(), 1);
    assert_eq!(cert["rootCerts"].as_array().unwrap().len(), 1);
    let leaf = &cert["certChain"][0];
    // `dump_cert`: the PEM text base64-encoded again, whose body is the
    // leaf's DER.
    use base64::Engine as _;
    let pem_text = base64::engine::general_purpose::STANDARD
        .decode(leaf["pem"].as_str().unwrap())
        .unwrap();
    let parsed = pem::parse(&pem_text).unwrap();
    assert_eq!(parsed.tag(), "CERTIFICATE");
    assert_eq!(parsed.contents(), issued.leaf().unwrap().as_ref());
    // Decimal serial (`serial.to_string()`), not our hex form.
    let serial = leaf["serialNumber"].as_str().unwrap();
    assert!(serial.chars().all(|c| c.is_ascii_digit()), "{serial}");
    assert_ne!(serial, issued.serial());
    // The issued times are whole seconds, which RFC 3339 writes without
    // a fraction, as ztunnel's `SecondsFormat::Secs` does.
    let expected = dataplane_core::timestamp::rfc3339;
    assert_eq!(leaf["validFrom"], expected(issued.not_before));
    assert_eq!(leaf["expirationTime"], expected(issued.not_after));
}

#[test]
fn pem_lines_are_sixty_characters_as_ztunnels() {
    // `der_to_pem`: line_length = 60.
    let pem = der_to_pem(&[7u8; 100]);
    let lines: Vec<&str> = pem.lines().collect();
    assert_eq!(lines[0], "-----BEGIN CERTIFICATE-----");
    assert_eq!(lines[1].len(), 60);
    assert_eq!(lines[2].len(), 60);
    assert_eq!(lines[3].len(), 16);
    assert_eq!(lines[4], "-----END CERTIFICATE-----");
    assert!(pem.ends_with("-----\n"));
}

#[test]
fn times_are_whole_seconds_with_z() {
    // `rfc3339`: SecondsFormat::Secs, use_z = true.
    assert_eq!(rfc3339_secs(0), "1970-01-01T00:00:00Z");
    assert_eq!(rfc3339_secs(1_767_323_045), "2026-01-02T03:04:05Z");
}

#[test]
fn string_matches_read_back_from_our_wildcards() {
    assert_eq!(string_match("a"), StringMatch::Exact("a".into()));
    assert_eq!(string_match("a*"), StringMatch::Prefix("a".into()));
    assert_eq!(string_match("*a"), StringMatch::Suffix("a".into()));
    assert_eq!(string_match("*"), StringMatch::Presence());
    assert_eq!(
        serde_json::to_value(StringMatch::Presence()).unwrap(),
        json!({"Presence": []})
    );
}

#[test]
fn certificate_times_are_whole_seconds_in_utc() {
    // ztunnel `admin::rfc3339`: `SecondsFormat::Secs`, `Z` for UTC.
    assert_eq!(rfc3339_secs(1_714_564_800), "2024-05-01T12:00:00Z");
    assert_eq!(rfc3339_secs(0), "1970-01-01T00:00:00Z");
}
