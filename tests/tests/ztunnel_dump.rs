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

use anyhow::{Context as _, Result, ensure};
use dataplane_tests::known_mesh::{
    CLIENT_UID, KnownMesh, SERVER_A, SERVER_B, SERVICE_KEY, base64_decode, hex_serial_to_decimal,
};
use serde_json::{Value, json};

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
    // `Service` (src/state/service.rs): `vips` as `network/ip`,
    // `cidrVips` as `NetworkCidr` (`{network, cidr}`, src/state/workload.rs), `ports`
    // and each endpoint's `port` a u16 map (JSON string keys), `endpoints`
    // keyed by workload uid (`EndpointSet`) with the workload's own port
    // list and health, `subjectAltNames`/`canonical`/`visibility` always
    // written, `ipFamilies` by variant name and left out for `Automatic`
    // (`Option<IpFamily>`); `LoadBalancer` enums
    // by variant name (`LoadBalancerScopes`, `LoadBalancerMode`,
    // `LoadBalancerHealthPolicy`).
    json!([{
        "name": "echo",
        "namespace": "test",
        "hostname": "echo.test.svc.cluster.local",
        "vips": ["/10.96.0.10"],
        "cidrVips": [{"network": "east", "cidr": "10.97.0.5/16"}],
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
        "ipFamilies": "Dual",
        "canonical": true,
        "visibility": "Namespace"
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

#[test]
fn the_admin_dump_carries_ztunnels_sections_as_ztunnel_writes_them() -> Result<()> {
    let world = KnownMesh::start("zdmp")?;
    let agent = world.agent("zd", &[])?;
    let dump = world.full_dump(&agent)?;
    let w = &world.w;

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
