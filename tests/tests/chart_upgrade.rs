//! An upgrade through the chart refuses no connection: the DaemonSet's
//! surge rollout, run as the kubelet and the DaemonSet controller run it
//! on one node, with the chart's own container ([`dataplane_tests::chart`]
//! says how its paths, host network and API access are stood in for).
//!
//! One rollout: the old pod's agent serves the node; the new pod's agent
//! starts beside it with exactly the chart's command and environment; the
//! controller waits until the new pod is ready by the chart's own
//! readiness probe, then deletes the old pod (its kubelet sends SIGTERM).
//! Meanwhile a full-rate connection loop through the node (HBONE between
//! two enrolled pods, and plaintext inbound from a pod outside the mesh)
//! must see nothing refused, nothing reset and every echo intact; the old
//! agent must stay up until SIGTERM (a container that exits is restarted
//! and would take the pods back) and then exit 0 without taking them back.
//!
//! Pods are enrolled as on a cluster: the stand-in API server lists them on
//! the node (under the chart's RBAC), and each agent's reconciler
//! (`DATAPLANE_KUBE=true` in the chart) finds their network namespaces
//! through their sandbox processes' cgroups.

use std::time::Duration;

use dataplane_tests::{
    BpffsDir, Cgroup, ChildGuard, TempDir,
    chart::{ChartContainer, HostPaths, Kubelet, RunningContainer},
    cni_kubeapi::{FakeApi, fixture, fixture_namespaces, pod_uid},
    kube_rbac::Grants,
    mesh::addr,
    spawn_in,
    topology::{Node, Pod},
    traffic::{echo_server, wait_until},
    upgrade::{Loop, assert_clean, engine_listeners, lock_pid, sockets_held},
};
use dataplane_user::{
    control::{self, Request},
    inspect::StatusReport,
};
use serde_json::json;

/// Rollouts per run (old -> new, then new -> newer).
const ROLLOUTS: usize = 2;

/// Good exchanges each loop must make between two steps of a rollout, so
/// every step happens with both loops running.
const PROGRESS_STEP: u64 = 40;

/// The node's name in the API (`spec.nodeName`).
const NODE_NAME: &str = "node-a";

/// Hang guard for an agent's exit after SIGTERM (its drain is bounded by
/// the chart's `--drain-timeout`, below the grace period).
const EXIT_LIMIT: Duration = Duration::from_secs(60);

/// A pod as the API lists it, with its sandbox: a process in the pod's
/// namespace, in a cgroup named after the pod's uid as the kubelet names
/// it, which is how the reconciler finds the namespace.
struct ApiPod {
    uid: String,
    _sandbox: ChildGuard,
    _cgroup: Cgroup,
}

fn api_pod(api: &FakeApi, node: &Node, pod: &Pod, name: &str) -> anyhow::Result<ApiPod> {
    let uid = pod_uid();
    let cgroup = Cgroup::child(node.cgroup(), &format!("pod{uid}"))?;
    let mut pause = std::process::Command::new("sleep");
    pause.arg("600");
    let sandbox = spawn_in(pause, Some(pod.netns.path()), Some(cgroup.path()))?;
    let mut object = fixture(
        "pod_web.json",
        &[
            ("NODE", NODE_NAME),
            ("UID_WEB", uid.as_str()),
            ("NS_UID_SHOP", "a3c1b5e2-7f00-4b1e-9d55-0e6f7a8b9c01"),
        ],
    )?;
    object["metadata"]["name"] = name.into();
    object["status"]["podIP"] = pod.ip4.to_string().into();
    object["status"]["podIPs"] = json!([{"ip": pod.ip4.to_string()}, {"ip": pod.ip6.to_string()}]);
    api.set_object(&format!("/api/v1/namespaces/shop/pods/{name}"), object);
    Ok(ApiPod {
        uid,
        _sandbox: sandbox,
        _cgroup: cgroup,
    })
}

/// The status of the agent answering on the chart's control socket.
fn status(state: &std::path::Path) -> anyhow::Result<StatusReport> {
    let socket = control::socket_path(state, "default");
    let response = control::call(&socket, &Request::Status, Duration::from_secs(30))?;
    anyhow::ensure!(response.ok, "status refused: {:?}", response.error);
    Ok(serde_json::from_value(response.report.unwrap_or_default())?)
}

fn both_logs(old: &RunningContainer, new: &RunningContainer) -> String {
    format!("old:\n{}\nnew:\n{}", old.log_text(), new.log_text())
}

/// Waits until the chart's readiness probe passes for `container`,
/// failing at once if its agent exits.
fn wait_ready(kubelet: &Kubelet<'_>, container: &mut RunningContainer) -> anyhow::Result<()> {
    let mut last = String::new();
    let ready = wait_until("the pod to be ready by the chart's readiness probe", || {
        anyhow::ensure!(
            container.is_running(),
            "the agent exited before it was ready (last probe: {last}):\n{}",
            container.log_text()
        );
        let probe = kubelet.probe(container)?;
        last = probe.output;
        Ok(probe.passed)
    });
    ready.map_err(|e| anyhow::anyhow!("{e} (last probe: {last}):\n{}", container.log_text()))
}

#[test]
fn a_surge_rollout_of_the_chart_refuses_and_resets_no_connection() -> anyhow::Result<()> {
    let mut node = Node::new("chartup", 1)?;
    let client = node.add_pod("chartup")?;
    let server = node.add_pod("chartup")?;
    let outsider = node.add_pod("chartup")?;
    let dir = TempDir::new("chartup")?;
    let state = TempDir::new("chartup-state")?;
    let bpffs = BpffsDir::new("chartup")?;

    // The API server, in the node's network (the agents' host network),
    // under the chart's RBAC, listing the two meshed pods on the node.
    let api = FakeApi::start_in(node.netns())?;
    api.enforce(Grants::from_chart()?);
    let pods = [
        api_pod(&api, &node, &client, "client")?,
        api_pod(&api, &node, &server, "server")?,
    ];
    let items: Vec<_> = ["client", "server"]
        .iter()
        .filter_map(|name| api.object(&format!("/api/v1/namespaces/shop/pods/{name}")))
        .map(|mut pod| {
            if let Some(obj) = pod.as_object_mut() {
                obj.remove("kind");
                obj.remove("apiVersion");
            }
            pod
        })
        .collect();
    api.push_list(
        "/api/v1/pods",
        json!({"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": "1210"}, "items": items}),
    );
    api.push_list("/api/v1/namespaces", fixture_namespaces()?);

    let container = ChartContainer::agent_from_manifest()?;
    eprintln!("the chart's agent container: {:?}", container.argv());
    let kubelet = Kubelet::new(
        container,
        &node,
        HostPaths {
            bpffs: bpffs.path().to_path_buf(),
            state: state.path().to_path_buf(),
            kubeconfig: api.write_kubeconfig(dir.path())?,
            node_name: NODE_NAME.to_owned(),
        },
    )?;

    // The DaemonSet's first pod: with no agent running, `--takeover`
    // starts as usual.
    let mut old = kubelet.start("agent-0", dir.path())?;
    wait_ready(&kubelet, &mut old)?;
    wait_until("the reconciler to enroll and capture both pods", || {
        let status = status(state.path())?;
        let enrolled: Vec<_> = status
            .pods
            .iter()
            .filter(|p| p.captured && pods.iter().any(|a| a.uid == p.uid))
            .collect();
        Ok(enrolled.len() == 2)
    })?;
    let sockets = engine_listeners([&client, &server])?;

    let _echo = echo_server(&server, 9000)?;
    let dst = addr(&server, 9000);
    let mut meshed = Loop::start("client (HBONE)", &client, dst)?;
    let mut plain = Loop::start("outsider (plaintext inbound)", &outsider, dst)?;
    meshed.advance(PROGRESS_STEP)?;
    plain.advance(PROGRESS_STEP)?;

    for round in 1..=ROLLOUTS {
        // The surge pod: started while the old one runs.
        let mut new = kubelet.start(&format!("agent-{round}"), dir.path())?;
        wait_ready(&kubelet, &mut new)?;
        // Ready means taken over: the new agent answers, holds the lock
        // and serves on the very sockets the first agent listened on.
        assert_eq!(
            status(state.path())?.pid,
            new.pid(),
            "{}",
            both_logs(&old, &new)
        );
        assert_eq!(
            lock_pid(state.path(), "default")?,
            new.pid(),
            "{}",
            both_logs(&old, &new)
        );
        assert_eq!(engine_listeners([&client, &server])?, sockets);
        let held = sockets_held(new.pid())?;
        assert!(
            sockets.is_subset(&held),
            "round {round}: the new agent holds every listening socket: {sockets:?} vs {held:?}"
        );
        // The old pod is no longer ready, and once its agent has drained
        // (or exited, which is the failure) its container is still up:
        // the kubelet would restart one that exited.
        let old_probe = kubelet.probe(&old)?;
        assert!(!old_probe.passed, "the old pod stays ready: {old_probe:?}");
        wait_until("the old agent to drain after the hand-over", || {
            Ok(!old.is_running() || old.log_text().contains("idle until SIGTERM"))
        })?;
        let running = old.is_running();
        assert!(
            running,
            "round {round}: the old agent exited after the hand-over:\n{}",
            both_logs(&old, &new)
        );
        meshed.advance(PROGRESS_STEP)?;
        plain.advance(PROGRESS_STEP)?;

        // The controller deletes the old pod: SIGTERM. It exits 0 and
        // takes nothing back.
        let old_log = old.log_text();
        let code = old.terminate(EXIT_LIMIT)?;
        assert_eq!(
            code,
            Some(0),
            "round {round}: the old agent's exit:\n{old_log}"
        );
        let status = status(state.path())?;
        assert_eq!(status.pid, new.pid(), "{}", new.log_text());
        assert_eq!(lock_pid(state.path(), "default")?, new.pid());
        assert!(
            status.ready && status.pods.iter().all(|p| p.captured),
            "{status:?}"
        );
        assert_eq!(engine_listeners([&client, &server])?, sockets);
        assert!(kubelet.probe(&new)?.passed);
        meshed.advance(PROGRESS_STEP)?;
        plain.advance(PROGRESS_STEP)?;
        old = new;
    }

    let log = old.log_text();
    for (name, counts) in [("meshed", meshed.finish()?), ("plaintext", plain.finish()?)] {
        eprintln!("{name} loop across {ROLLOUTS} chart rollouts: {counts}");
        assert_clean(
            name,
            &counts,
            PROGRESS_STEP * (2 * ROLLOUTS as u64 + 1),
            &log,
        );
    }
    // The last pod deleted too (no hand-over): an orderly stop.
    assert_eq!(old.terminate(EXIT_LIMIT)?, Some(0));
    Ok(())
}
