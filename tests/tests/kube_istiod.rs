//! The agent with `--kube` and `--xds` against a stand-in API server and a
//! test istiod fed by that same server: istiod derives each pod's workload
//! from the pod objects as istiod does (`tests/src/istiod_kube.rs`, after
//! `podWorkloadBuilder` and `setTunnelProtocol`), so a pod gets
//! `TunnelProtocol: HBONE` only once the agent has written its
//! `ambient.istio.io/redirection: enabled` annotation.
//!
//! Two pods the agent enrolls from the API talk in plaintext while the
//! API refuses the agent's `pods/status` patch (the chart's RBAC without
//! it: istiod sees no annotation and serves both workloads as TCP), and
//! over HBONE, with mutual TLS and both identities, once the patch is
//! allowed and istiod pushes the workloads it derives again.
//!
//! A Service object's VIP reaches the pod it selects, at the container
//! port its named `targetPort` resolves to in that pod, and waypoint
//! labels on the namespace and the pod reach the agent as istiod attaches
//! them (`services.go`, `waypoints.go`): the server's connections then go
//! through a waypoint stand-in, the endpoint of the Service the Gateway's
//! hostname names, until the pod's own `none` label opts it out.
//!
//! A Service without a selector reaches what its EndpointSlices list
//! (`workloads.go` `matchingServicesWithoutSelectors`,
//! `endpointSlicesBuilder`): a pod its endpoint targets, over HBONE, and a
//! bare address outside the mesh, in plain TCP.
//!
//! State is read from the agent's status, config dump and `/metrics`, and
//! from the API server's objects, never from logs.

use std::net::SocketAddr;
use std::path::Path;

use anyhow::{Context as _, Result, ensure};
use dataplane_tests::{
    Agent, Cgroup, ChildGuard, TempDir,
    cni_kubeapi::{FakeApi, fixture, fixture_namespaces, pod_uid},
    istiod::{TestIstiod, TestPki, loopback_istiod, xds_flags},
    istiod_kube::{Cluster, KubeAddresses, REDIRECTION_ANNOTATION, USE_WAYPOINT},
    kube_rbac::Grants,
    observe::{scrape, sum_matching},
    spawn_in,
    topology::{Node, Pod},
    traffic::{echo, echo_server, http, wait_until},
    waypoint::WaypointStandIn,
};
use dataplane_user::control::Request;
use dataplane_user::identity::Identity;
use dataplane_user::istio_api::AUTHORIZATION_TYPE;
use serde_json::{Value, json};

const NODE: &str = "node-a";
const NAMESPACE: &str = "shop";

/// istiod on loopback deriving its addresses from `api` (live), which
/// lists `pods` and the fixture's namespaces; it serves no policies.
fn kube_fed_istiod(
    api: &FakeApi,
    pods: [&ApiPod; 2],
) -> Result<(tokio::runtime::Runtime, TestPki, TestIstiod, KubeAddresses)> {
    api.push_list(
        "/api/v1/pods",
        json!({"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": "1210"},
               "items": pods.map(ApiPod::item)}),
    );
    api.push_list("/api/v1/namespaces", fixture_namespaces()?);
    let (rt, pki, istiod) = loopback_istiod()?;
    let addresses = KubeAddresses::start(rt.handle(), api, &istiod, Cluster::default());
    rt.block_on(istiod.publish(AUTHORIZATION_TYPE, Vec::new(), &[]))?;
    Ok((rt, pki, istiod, addresses))
}

/// One pod of the test: its namespace and cgroup, the sandbox process that
/// makes the agent find it, and its object in the API.
struct ApiPod {
    name: String,
    uid: String,
    path: String,
    object: Value,
    _sandbox: ChildGuard,
    _sandbox_cgroup: Cgroup,
}

impl ApiPod {
    /// `pod` as the Deployment `app`'s pod (service account `app`), with a
    /// sandbox process in a cgroup named after its uid, as the kubelet
    /// names it (how the agent finds its network namespace).
    fn new(node: &Node, pod: &Pod, app: &str) -> Result<Self> {
        let uid = pod_uid();
        let sandbox_cgroup = Cgroup::child(node.cgroup(), &format!("pod{uid}"))?;
        let mut pause = std::process::Command::new("sleep");
        pause.arg("300");
        let sandbox = spawn_in(pause, Some(pod.netns.path()), Some(sandbox_cgroup.path()))?;
        let mut object = fixture(
            "pod_web.json",
            &[
                ("NODE", NODE),
                ("UID_WEB", uid.as_str()),
                ("NS_UID_SHOP", "a3c1b5e2-7f00-4b1e-9d55-0e6f7a8b9c01"),
            ],
        )?;
        let name = format!("{app}-7d9c8b6f5-x2x4q");
        object["metadata"]["name"] = name.clone().into();
        object["metadata"]["generateName"] = format!("{app}-7d9c8b6f5-").into();
        object["metadata"]["labels"]["app"] = app.into();
        object["metadata"]["ownerReferences"][0]["name"] = format!("{app}-7d9c8b6f5").into();
        object["spec"]["serviceAccountName"] = app.into();
        object["spec"]["serviceAccount"] = app.into();
        object["status"]["podIP"] = pod.ip4.to_string().into();
        object["status"]["podIPs"] =
            json!([{"ip": pod.ip4.to_string()}, {"ip": pod.ip6.to_string()}]);
        Ok(Self {
            path: format!("/api/v1/namespaces/{NAMESPACE}/pods/{name}"),
            name,
            uid,
            object,
            _sandbox: sandbox,
            _sandbox_cgroup: sandbox_cgroup,
        })
    }

    /// Its object as a list item (lists carry no kind).
    fn item(&self) -> Value {
        let mut item = self.object.clone();
        if let Some(obj) = item.as_object_mut() {
            obj.remove("kind");
            obj.remove("apiVersion");
        }
        item
    }

    /// Its `ambient.istio.io/redirection` annotation in the API now.
    fn redirection(&self, api: &FakeApi) -> Option<String> {
        api.object(&self.path).and_then(|p| {
            p["metadata"]["annotations"][REDIRECTION_ANNOTATION]
                .as_str()
                .map(str::to_owned)
        })
    }
}

/// The protocol of the workload named `name` in the agent's config dump
/// (`HBONE` or `TCP`), once istiod's entry for it is there.
fn protocol(agent: &Agent, name: &str) -> Result<Option<String>> {
    let response = agent.call(&Request::ConfigDump)?;
    ensure!(response.ok, "config dump refused: {:?}", response.error);
    let dump = response.report.context("config dump without a report")?;
    Ok(dump["config"]["workloads"].as_array().and_then(|list| {
        list.iter()
            .find(|w| w["name"] == name && w["source"] == "xds")
            .and_then(|w| w["protocol"].as_str().map(str::to_owned))
    }))
}

/// Connections the agent counted opened with `security` between the two
/// pods' identities, as the server's side reports them.
fn opened(agent: &Agent, security: &str, principals: Option<(&str, &str)>) -> Result<f64> {
    let mut want = vec![
        ("reporter", "destination"),
        ("connection_security_policy", security),
    ];
    if let Some((source, destination)) = principals {
        want.push(("source_principal", source));
        want.push(("destination_principal", destination));
    }
    Ok(sum_matching(
        &scrape(agent)?,
        "istio_tcp_connections_opened_total",
        &want,
    ))
}

#[test]
fn api_enrolled_pods_get_hbone_from_istiod_only_once_the_agent_annotates_them() -> Result<()> {
    let mut node = Node::new("kubeistiod", 1)?;
    let client_pod = node.add_pod("kubeistiod")?;
    let server_pod = node.add_pod("kubeistiod")?;
    let client = ApiPod::new(&node, &client_pod, "client")?;
    let server = ApiPod::new(&node, &server_pod, "server")?;

    // The API: both pods, their namespace (labelled ambient), and the
    // chart's RBAC without the annotation's patch for now.
    let api = FakeApi::start()?;
    api.enforce(Grants::from_chart()?.without("pods/status", "patch"));
    for pod in [&client, &server] {
        api.set_object(&pod.path, pod.object.clone());
    }
    // istiod: workloads from the API's pods, no policies.
    let (_rt, pki, istiod, _workloads) = kube_fed_istiod(&api, [&client, &server])?;

    let dir = TempDir::new("kubeistiod")?;
    let agent = start_agent(&dir, &api, &istiod, &pki, &node)?;
    wait_until("both pods to be enrolled from the API", || {
        let pods = agent.call(&Request::List)?.pods;
        Ok([&client, &server]
            .iter()
            .all(|p| pods.iter().any(|e| e.spec.uid == p.uid)))
    })?;
    let _echo = echo_server(&server_pod, 9000)?;
    let dst = SocketAddr::new(server_pod.ip4.into(), 9000);

    // Refused the patch, the agent captures both pods but cannot say so:
    // istiod, seeing no annotation, serves both workloads as TCP, and the
    // client's connection goes to the server in plaintext (captured on
    // both sides, no identity on it).
    wait_until("the refused patches to show in status", || {
        Ok(agent.status()?.redirection_annotations.is_some_and(|a| {
            a.pending == 2 && a.last_error.is_some_and(|e| e.contains("forbidden"))
        }))
    })?;
    wait_until("istiod's workloads for both pods to be held", || {
        Ok(protocol(&agent, &client.name)?.is_some() && protocol(&agent, &server.name)?.is_some())
    })?;
    for pod in [&client, &server] {
        ensure!(pod.redirection(&api).is_none(), "{} annotated", pod.name);
        ensure!(
            protocol(&agent, &pod.name)?.as_deref() == Some("TCP"),
            "istiod served {} as {:?} without the annotation",
            pod.name,
            protocol(&agent, &pod.name)?
        );
    }
    echo(&client_pod, dst, 4096, 1)?;
    wait_until("the plaintext connection to be counted", || {
        Ok(opened(&agent, "none", None)? >= 1.0)
    })?;
    ensure!(
        opened(&agent, "mutual_tls", None)? == 0.0,
        "mutual TLS with no pod annotated"
    );

    // Allowed the patch, the agent writes `enabled` on both pods; istiod
    // derives HBONE from it and pushes both workloads again; the same
    // connection now goes over HBONE with both identities.
    api.enforce(Grants::from_chart()?);
    wait_until("both annotations to be written", || {
        Ok(client.redirection(&api).as_deref() == Some("enabled")
            && server.redirection(&api).as_deref() == Some("enabled"))
    })?;
    wait_until("istiod to push both workloads as HBONE", || {
        Ok(protocol(&agent, &client.name)?.as_deref() == Some("HBONE")
            && protocol(&agent, &server.name)?.as_deref() == Some("HBONE"))
    })?;
    echo(&client_pod, dst, 4096, 2)?;
    let (source, destination) = (
        format!("spiffe://cluster.local/ns/{NAMESPACE}/sa/client"),
        format!("spiffe://cluster.local/ns/{NAMESPACE}/sa/server"),
    );
    wait_until("the mutual-TLS connection to be counted", || {
        Ok(opened(&agent, "mutual_tls", Some((&source, &destination)))? >= 1.0)
    })?;
    ensure!(
        opened(&agent, "none", None)? == 1.0,
        "only the first connection was plaintext"
    );
    Ok(())
}

/// ztunnel's `/config_dump` sections from the agent's admin endpoint.
fn admin_dump(agent: &Agent) -> Result<Value> {
    let (status, body) = http(agent.admin_addr()?, "GET", "/config_dump")?;
    ensure!(status == 200, "config dump: {status}: {body}");
    Ok(serde_json::from_str(&body)?)
}

/// The entry of `section` (`workloads`, `services`) whose `key` is `value`.
fn entry(dump: &Value, section: &str, key: &str, value: &str) -> Value {
    dump[section]
        .as_array()
        .and_then(|list| list.iter().find(|e| e[key] == value).cloned())
        .unwrap_or(Value::Null)
}

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

/// The workload uid istiod gives `pod` (`generatePodUID`).
fn server_uid(pod: &ApiPod) -> String {
    format!("Kubernetes//Pod/{NAMESPACE}/{}", pod.name)
}

/// The node's agent: pods from the API (`--kube`), mesh from istiod
/// (`--xds`), certificates from the built-in CA. The same-node fast path
/// is off: every connection between the two pods crosses the proxy, so
/// each one shows how istiod's protocol sends it.
fn start_agent(
    dir: &TempDir,
    api: &FakeApi,
    istiod: &TestIstiod,
    pki: &TestPki,
    node: &Node,
) -> Result<Agent> {
    let write = |name: &str, text: &str| -> Result<std::path::PathBuf> {
        let path = dir.path().join(name);
        std::fs::write(&path, text)?;
        Ok(path)
    };
    let root = write("root-cert.pem", &pki.root_pem)?;
    let token = write("istio-token", "kube-istiod-token\n")?;
    let empty = write("empty.yaml", "workloads: []\n")?;
    let kubeconfig = api.write_kubeconfig(dir.path())?;
    let ca = Path::new(dir.path()).join("ca");
    let mut flags: Vec<String> = [
        "--kube",
        "--node",
        NODE,
        "--kubeconfig",
        &kubeconfig.display().to_string(),
        "--config",
        &empty.display().to_string(),
        "--ca-dir",
        &ca.display().to_string(),
        "--fast-path",
        "off",
    ]
    .map(str::to_owned)
    .to_vec();
    flags.extend(xds_flags(istiod.addr, &root, &token, "dataplane-node-a"));
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    Agent::start("kubeistiod", node, &flags)
}
