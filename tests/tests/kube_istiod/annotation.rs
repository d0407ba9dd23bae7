//! Pods the agent enrolls from the API get HBONE from istiod only once the
//! agent has annotated them.

use super::*;

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
