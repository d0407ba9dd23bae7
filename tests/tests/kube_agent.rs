//! The agent with `--kube` against the stand-in API server: a pod that
//! already runs on the node when the agent starts (no CNI call ever made
//! for it) is found through `/proc` (its processes' cgroup names its uid;
//! its namespace is the runtime's pinned file under /var/run/netns),
//! enrolled, and captured, and its `ambient.istio.io/redirection`
//! annotation tells istiod so (under the chart's RBAC, enforced by the
//! stand-in); deleting it from the API unenrolls it and takes the
//! annotation away.

use std::{net::SocketAddr, process::Command, time::Duration};

use dataplane_tests::{
    Agent, Cgroup, TempDir,
    cni_kubeapi::{FakeApi, fixture, fixture_namespaces, pod_list, pod_uid},
    kube_rbac::Grants,
    spawn_in,
    topology::Node,
    traffic::{echo_server, stream, wait_until},
};
use dataplane_user::control::Request;
use serde_json::json;

#[test]
fn pods_running_before_the_agent_are_enrolled_and_unenrolled_from_the_api() -> anyhow::Result<()> {
    let mut node = Node::new("kubeagent", 1)?;
    let client = node.add_pod("kubeagent")?;
    let server = node.add_pod("kubeagent")?;
    let uid = pod_uid();
    // The pod's sandbox: a long-lived process in its namespace, in a cgroup
    // named after the pod uid as the kubelet names it.
    let sandbox_cgroup = Cgroup::child(node.cgroup(), &format!("pod{uid}"))?;
    let mut pause = Command::new("sleep");
    pause.arg("120");
    let _pause = spawn_in(
        pause,
        Some(client.netns.path()),
        Some(sandbox_cgroup.path()),
    )?;

    let mut pod = fixture(
        "pod_web.json",
        &[
            ("NODE", "node-a"),
            ("UID_WEB", uid.as_str()),
            ("NS_UID_SHOP", "a3c1b5e2-7f00-4b1e-9d55-0e6f7a8b9c01"),
        ],
    )?;
    pod["status"]["podIP"] = client.ip4.to_string().into();
    pod["status"]["podIPs"] =
        json!([{"ip": client.ip4.to_string()}, {"ip": client.ip6.to_string()}]);
    let api = FakeApi::start()?;
    // The chart's permissions, as Kubernetes would enforce them, but for
    // the annotation's patch at first.
    api.enforce(Grants::from_chart()?.without("pods/status", "patch"));
    let pod_path = "/api/v1/namespaces/shop/pods/web-7d9c8b6f5-x2x4q";
    api.set_object(pod_path, pod.clone());
    api.push_list("/api/v1/pods", pod_list(&[&pod]));
    api.push_list("/api/v1/namespaces", fixture_namespaces()?);
    let dir = TempDir::new("kubeagent")?;
    let kubeconfig = api.write_kubeconfig(dir.path())?;
    let kubeconfig = kubeconfig.display().to_string();
    let agent = Agent::start(
        "kubeagent",
        &node,
        &["--kube", "--node", "node-a", "--kubeconfig", &kubeconfig],
    )?;

    wait_until("the running pod to be enrolled", || {
        Ok(agent
            .call(&Request::List)?
            .pods
            .iter()
            .any(|p| p.spec.uid == uid))
    })?;
    let listed = agent.call(&Request::List)?.pods;
    let spec = &listed[0].spec;
    assert_eq!(spec.netns, client.netns.path(), "the runtime's pinned path");
    assert_eq!(spec.service_account, "web");
    assert_eq!(spec.namespace, "shop");
    let request = api.wait_for_request("the pod list", Duration::from_secs(5), |r| {
        r.path == "/api/v1/pods" && !r.is_watch()
    })?;
    assert_eq!(
        request.query.get("fieldSelector").map(String::as_str),
        Some("spec.nodeName=node-a")
    );

    let _echo = echo_server(&server, 9900)?;
    let dst = SocketAddr::new(server.ip4.into(), 9900).to_string();
    assert_eq!(stream(&client, &["echo", &dst, "4096", "1"])?, "ok 4096");
    assert_eq!(agent.counter("redirected_outbound")?, 1);

    // istiod learns of the capture from the pod's
    // ambient.istio.io/redirection annotation. Refused the patch, the agent
    // says so and keeps capturing; granted it, it writes the annotation as
    // istio-cni does (a merge patch on pods/status).
    let redirection = || {
        api.object(pod_path).and_then(|p| {
            p["metadata"]["annotations"]["ambient.istio.io/redirection"]
                .as_str()
                .map(str::to_owned)
        })
    };
    wait_until("the refused patch to show in status", || {
        let annotations = agent.status()?.redirection_annotations;
        Ok(annotations.is_some_and(|a| {
            a.pending == 1 && a.last_error.is_some_and(|e| e.contains("forbidden"))
        }))
    })?;
    assert_eq!(redirection(), None);
    assert_eq!(stream(&client, &["echo", &dst, "4096", "3"])?, "ok 4096");
    assert_eq!(agent.counter("redirected_outbound")?, 2);
    api.enforce(Grants::from_chart()?);
    wait_until("the annotation to be written", || {
        Ok(redirection().as_deref() == Some("enabled"))
    })?;
    let patch = api.wait_for_request("the patch", Duration::from_secs(5), |r| {
        r.method == "PATCH" && r.path == format!("{pod_path}/status")
    })?;
    assert_eq!(
        patch.content_type.as_deref(),
        Some("application/merge-patch+json")
    );
    wait_until("status to say it is written", || {
        Ok(agent
            .status()?
            .redirection_annotations
            .is_some_and(|a| a.pending == 0 && a.written == 1 && a.last_error.is_none()))
    })?;

    // Deleted from the API (the watch delivers it): unenrolled.
    let mut deleted = pod.clone();
    deleted["metadata"]["resourceVersion"] = "1220".into();
    api.wait_for_request("the pod watch", Duration::from_secs(5), |r| {
        r.path == "/api/v1/pods" && r.is_watch()
    })?;
    api.send_event(
        "/api/v1/pods",
        json!({"type": "DELETED", "object": deleted}),
    );
    wait_until("the deleted pod to be unenrolled", || {
        Ok(agent.call(&Request::List)?.pods.is_empty())
    })?;
    stream(&client, &["echo", &dst, "4096", "2"])?;
    assert_eq!(agent.counter("redirected_outbound")?, 2, "direct again");
    // Unenrolled: the annotation goes (the stand-in still has the object).
    wait_until("the annotation to be removed", || {
        Ok(redirection().is_none())
    })?;
    Ok(())
}
