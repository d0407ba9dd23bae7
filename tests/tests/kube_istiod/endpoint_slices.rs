//! A Service without a selector reaches what its EndpointSlices list.

use super::*;

#[test]
fn a_selectorless_services_endpoint_slices_reach_its_pod_and_an_address_outside_the_mesh()
-> Result<()> {
    let mut node = Node::new("kubeeps", 1)?;
    let client_pod = node.add_pod("kubeeps")?;
    let server_pod = node.add_pod("kubeeps")?;
    // Outside the mesh: in no API object, reached only as a slice address.
    let outside_pod = node.add_pod("kubeeps")?;
    let client = ApiPod::new(&node, &client_pod, "client")?;
    let server = ApiPod::new(&node, &server_pod, "server")?;
    // Two Services without a selector, whose EndpointSlices their owners
    // write (`endpointSlicesBuilder`, `matchingServicesWithoutSelectors`):
    // `server`'s names the server pod as its endpoint's target; `outside`'s
    // is a bare address.
    let selectorless = |name: &str, vip: &str| {
        json!({
            "kind": "Service", "apiVersion": "v1",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"type": "ClusterIP", "clusterIP": vip, "clusterIPs": [vip],
                     "ipFamilies": ["IPv4"],
                     "ports": [{"name": "http", "port": 80, "targetPort": 9000, "protocol": "TCP"}]}
        })
    };
    let slice = |service: &str, endpoint: Value| {
        json!({
            "kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1",
            "metadata": {"name": format!("{service}-1"), "namespace": NAMESPACE,
                         "labels": {"kubernetes.io/service-name": service}},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": 9000, "protocol": "TCP"}],
            "endpoints": [endpoint]
        })
    };
    let (server_vip, outside_vip) = ("10.96.78.10", "10.96.78.11");
    let api = FakeApi::start()?;
    api.enforce(Grants::from_chart()?);
    for pod in [&client, &server] {
        api.set_object(&pod.path, pod.object.clone());
    }
    let objects = [
        (
            "api/v1",
            "services",
            "server",
            selectorless("server", server_vip),
        ),
        (
            "api/v1",
            "services",
            "outside",
            selectorless("outside", outside_vip),
        ),
        (
            "apis/discovery.k8s.io/v1",
            "endpointslices",
            "server-1",
            slice(
                "server",
                json!({"addresses": [server_pod.ip4.to_string()], "conditions": {"ready": true},
                       "targetRef": {"kind": "Pod", "namespace": NAMESPACE,
                                     "name": server.name, "uid": server.uid}}),
            ),
        ),
        (
            "apis/discovery.k8s.io/v1",
            "endpointslices",
            "outside-1",
            slice(
                "outside",
                json!({"addresses": [outside_pod.ip4.to_string()], "conditions": {"ready": true}}),
            ),
        ),
    ];
    for (prefix, kind, name, object) in objects {
        api.set_object(
            &format!("/{prefix}/namespaces/{NAMESPACE}/{kind}/{name}"),
            object,
        );
    }
    let (_rt, pki, istiod, _addresses) = kube_fed_istiod(&api, [&client, &server])?;
    let dir = TempDir::new("kubeeps")?;
    let agent = start_agent(&dir, &api, &istiod, &pki, &node)?;
    let _server_echo = echo_server(&server_pod, 9000)?;
    let _outside_echo = echo_server(&outside_pod, 9000)?;

    // The server's workload is in `server` (the Service's own target port);
    // `outside` has the slice's address as a workload of its own.
    let (server_host, outside_host) = (
        format!("server.{NAMESPACE}.svc.cluster.local"),
        format!("outside.{NAMESPACE}.svc.cluster.local"),
    );
    let outside_uid = format!(
        "Kubernetes/discovery.k8s.io/EndpointSlice/{NAMESPACE}/outside-1/{}",
        outside_pod.ip4
    );
    wait_until(
        "both Services' endpoints and the HBONE pods to be held",
        || {
            let dump = admin_dump(&agent)?;
            let server_svc = entry(&dump, "services", "hostname", &server_host);
            let outside_svc = entry(&dump, "services", "hostname", &outside_host);
            Ok(
                server_svc["endpoints"][server_uid(&server)]["port"] == json!({"80": 9000})
                    && outside_svc["endpoints"][&outside_uid]["port"] == json!({"80": 9000})
                    && protocol(&agent, &client.name)?.as_deref() == Some("HBONE")
                    && protocol(&agent, &server.name)?.as_deref() == Some("HBONE"),
            )
        },
    )?;

    // The server's VIP reaches it over HBONE, as the Service's.
    echo(
        &client_pod,
        SocketAddr::new(server_vip.parse()?, 80),
        4096,
        1,
    )?;
    let opened_to = |host: &str, reporter: &str, security: &str| -> Result<f64> {
        Ok(sum_matching(
            &scrape(&agent)?,
            "istio_tcp_connections_opened_total",
            &[
                ("reporter", reporter),
                ("connection_security_policy", security),
                ("destination_service", host),
            ],
        ))
    };
    wait_until(
        "the connection through the server's VIP to be counted",
        || Ok(opened_to(&server_host, "destination", "mutual_tls")? >= 1.0),
    )?;

    // The outside VIP (no route but the agent's) reaches the address the
    // slice lists, in plain TCP: the slice's workload has no tunnel.
    echo(
        &client_pod,
        SocketAddr::new(outside_vip.parse()?, 80),
        4096,
        2,
    )?;
    wait_until(
        "the connection through the outside VIP to be counted",
        || Ok(opened_to(&outside_host, "source", "none")? >= 1.0),
    )?;
    ensure!(
        opened_to(&outside_host, "source", "mutual_tls")? == 0.0,
        "mutual TLS to an address outside the mesh"
    );
    Ok(())
}
