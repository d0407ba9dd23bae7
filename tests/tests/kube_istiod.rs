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

#[path = "kube_istiod/annotation.rs"]
mod annotation;

#[path = "kube_istiod/services.rs"]
mod services;

#[path = "kube_istiod/endpoint_slices.rs"]
mod endpoint_slices;

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
