//! A Service object's VIP and the waypoint labels istiod attaches.

use super::*;

#[test]
fn a_service_object_reaches_its_pod_and_waypoint_labels_attach_as_istiod_attaches_them()
-> Result<()> {
    let mut node = Node::new("kubesvc", 1)?;
    let client_pod = node.add_pod("kubesvc")?;
    let server_pod = node.add_pod("kubesvc")?;
    let waypoint_pod = node.add_pod("kubesvc")?;
    let client = ApiPod::new(&node, &client_pod, "client")?;
    let mut server = ApiPod::new(&node, &server_pod, "server")?;
    // The waypoint's pod and Service as istio's gateway controller makes
    // them: its pod labelled with the Gateway's name (not enrolled: the
    // agent's pod list leaves it out), its Service managed by the mesh
    // controller (so it gets no waypoint of its own) and selecting it.
    let mut waypoint = ApiPod::new(&node, &waypoint_pod, "waypoint")?;
    waypoint.object["metadata"]["labels"]["gateway.networking.k8s.io/gateway-name"] =
        "waypoint".into();
    let waypoint_service = json!({
        "kind": "Service", "apiVersion": "v1",
        "metadata": {"name": "waypoint", "namespace": NAMESPACE,
                     "labels": {"gateway.istio.io/managed": "istio.io-mesh-controller"}},
        "spec": {"type": "ClusterIP", "clusterIP": "10.96.77.15", "clusterIPs": ["10.96.77.15"],
                 "selector": {"gateway.networking.k8s.io/gateway-name": "waypoint"},
                 "ports": [{"name": "mesh", "port": 15008, "targetPort": 15008, "protocol": "TCP"}]}
    });
    // The server names its port; the Service targets it by that name.
    server.object["spec"]["containers"][0]["ports"] =
        json!([{"name": "web", "containerPort": 9000, "protocol": "TCP"}]);
    let vip = "10.96.77.10";
    let service = json!({
        "kind": "Service", "apiVersion": "v1",
        "metadata": {"name": "server", "namespace": NAMESPACE},
        "spec": {"type": "ClusterIP", "clusterIP": vip, "clusterIPs": [vip],
                 "ipFamilies": ["IPv4"], "selector": {"app": "server"},
                 "ports": [{"name": "http", "port": 80, "targetPort": "web", "protocol": "TCP"}]}
    });
    let mut namespace = fixture_namespaces()?["items"][0].clone();

    let api = FakeApi::start()?;
    api.enforce(Grants::from_chart()?);
    for pod in [&client, &server, &waypoint] {
        api.set_object(&pod.path, pod.object.clone());
    }
    api.set_object(
        &format!("/api/v1/namespaces/{NAMESPACE}/services/waypoint"),
        waypoint_service,
    );
    let ns_path = format!("/api/v1/namespaces/{NAMESPACE}");
    api.set_object(&ns_path, namespace.clone());
    api.set_object(
        &format!("/api/v1/namespaces/{NAMESPACE}/services/server"),
        service,
    );
    let (_rt, pki, istiod, _addresses) = kube_fed_istiod(&api, [&client, &server])?;
    let dir = TempDir::new("kubesvc")?;
    let agent = start_agent(&dir, &api, &istiod, &pki, &node)?;
    let _echo = echo_server(&server_pod, 9000)?;

    // istiod serves the Service with its VIP, and the server's workload
    // in it at 9000, the port named `web` (the Service says 0: named).
    let hostname = format!("server.{NAMESPACE}.svc.cluster.local");
    wait_until("the Service and both HBONE workloads to be held", || {
        let dump = admin_dump(&agent)?;
        let svc = entry(&dump, "services", "hostname", &hostname);
        Ok(
            svc["endpoints"][server_uid(&server)]["port"] == json!({"80": 9000})
                && protocol(&agent, &client.name)?.as_deref() == Some("HBONE")
                && protocol(&agent, &server.name)?.as_deref() == Some("HBONE"),
        )
    })?;
    let dump = admin_dump(&agent)?;
    let svc = entry(&dump, "services", "hostname", &hostname);
    ensure!(svc["vips"] == json!([format!("/{vip}")]), "{svc:#}");
    ensure!(svc["ports"] == json!({"80": 0}), "{svc:#}");

    // The client's connection to the VIP arrives at the server, over
    // HBONE, as the Service's.
    echo(&client_pod, SocketAddr::new(vip.parse()?, 80), 4096, 1)?;
    let to_service = |agent: &Agent| -> Result<f64> {
        Ok(sum_matching(
            &scrape(agent)?,
            "istio_tcp_connections_opened_total",
            &[
                ("reporter", "destination"),
                ("connection_security_policy", "mutual_tls"),
                ("destination_service", hostname.as_str()),
            ],
        ))
    };
    wait_until("the connection through the VIP to be counted", || {
        Ok(to_service(&agent)? >= 1.0)
    })?;

    // A running waypoint (a Gateway with an address, for all traffic) and
    // the namespace's label: the Service and the server's workload use
    // it, at its hostname's port 15008.
    api.set_object(
        &format!("/apis/gateway.networking.k8s.io/v1/namespaces/{NAMESPACE}/gateways/waypoint"),
        json!({
            "kind": "Gateway", "apiVersion": "gateway.networking.k8s.io/v1",
            "metadata": {"name": "waypoint", "namespace": NAMESPACE,
                         "labels": {"istio.io/waypoint-for": "all"}},
            "spec": {"gatewayClassName": "istio-waypoint",
                     "listeners": [{"name": "mesh", "port": 15008, "protocol": "HBONE"}]},
            "status": {"addresses": [
                {"type": "Hostname", "value": format!("waypoint.{NAMESPACE}.svc.cluster.local")}
            ]}
        }),
    );
    namespace["metadata"]["labels"][USE_WAYPOINT] = "waypoint".into();
    api.set_object(&ns_path, namespace);
    let waypoint = json!({
        "destination": format!("{NAMESPACE}/waypoint.{NAMESPACE}.svc.cluster.local"),
        "hboneMtlsPort": 15008
    });
    wait_until("the waypoint on the Service and the server", || {
        let dump = admin_dump(&agent)?;
        Ok(
            entry(&dump, "services", "hostname", &hostname)["waypoint"] == waypoint
                && entry(&dump, "workloads", "name", &server.name)["waypoint"] == waypoint,
        )
    })?;

    // The client's connection to the server's pod now goes through the
    // waypoint (an HBONE stand-in for it in its pod, found as the
    // endpoint of the Service its hostname names).
    let standin = WaypointStandIn::start(
        &waypoint_pod,
        &dir.path().join("ca"),
        NAMESPACE,
        "waypoint",
        &[(
            server_pod.ip4.into(),
            Identity::new("cluster.local", NAMESPACE, "server")?,
        )],
    )?;
    echo(
        &client_pod,
        SocketAddr::new(server_pod.ip4.into(), 9000),
        4096,
        2,
    )?;
    wait_until("the waypoint to have carried the connection", || {
        Ok(standin.forwarded() >= 1)
    })?;

    // The pod's own `none` wins over its namespace's label: the workload
    // goes without, the Service keeps it.
    let mut live = api.object(&server.path).context("the server's object")?;
    live["metadata"]["labels"][USE_WAYPOINT] = "none".into();
    api.set_object(&server.path, live);
    wait_until("the server's workload to drop its waypoint", || {
        let dump = admin_dump(&agent)?;
        Ok(entry(&dump, "workloads", "name", &server.name)["waypoint"].is_null())
    })?;
    let dump = admin_dump(&agent)?;
    ensure!(
        entry(&dump, "services", "hostname", &hostname)["waypoint"] == waypoint,
        "the Service lost its namespace's waypoint"
    );
    Ok(())
}
