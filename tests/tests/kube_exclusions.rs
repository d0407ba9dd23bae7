//! Istio's sidecar-mode capture exclusions
//! (`traffic.sidecar.istio.io/excludeOutboundPorts`, `excludeOutboundIPRanges`,
//! `excludeInboundPorts`) on a pod the agent enrolls from the stand-in
//! Kubernetes API: the excluded port and range are reached uncaptured
//! while other destinations stay captured; the excluded inbound port is
//! reached without the proxy; changing the annotation on the running pod
//! (a watch `MODIFIED` event) changes its capture in place; an invalid
//! value leaves the pod enrolled and captured as if it were not set, and
//! is reported (warning and counter).

use std::{net::SocketAddr, process::Command, time::Duration};

use dataplane_tests::{
    Agent, Cgroup, TempDir,
    cni_kubeapi::{FakeApi, fixture, fixture_namespaces, pod_list, pod_uid},
    observe::{scrape, sum, sum_matching},
    spawn_in,
    topology::{Node, Pod},
    traffic::{echo_server, stream, wait_until},
};
use dataplane_user::{control::Request, redirect::Exclusions};
use serde_json::{Value, json};

const EXCLUDE_OUT_PORTS: &str = "traffic.sidecar.istio.io/excludeOutboundPorts";
const EXCLUDE_OUT_RANGES: &str = "traffic.sidecar.istio.io/excludeOutboundIPRanges";
const EXCLUDE_IN_PORTS: &str = "traffic.sidecar.istio.io/excludeInboundPorts";
const POD_PATH: &str = "/api/v1/namespaces/shop/pods/web-7d9c8b6f5-x2x4q";

/// The capture counters this test reads, in one snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Counts {
    out: u64,
    inb: u64,
    port: u64,
    cidr: u64,
}

fn counts(agent: &Agent) -> anyhow::Result<Counts> {
    Ok(Counts {
        out: agent.counter("redirected_outbound")?,
        inb: agent.counter("redirected_inbound")?,
        port: agent.counter("exempt_excluded_port")?,
        cidr: agent.counter("exempt_excluded_cidr")?,
    })
}

/// One echo exchange from `from` to `to:port`, and what it changed.
fn exchange(agent: &Agent, from: &Pod, to: &Pod, port: u16) -> anyhow::Result<Counts> {
    let before = counts(agent)?;
    let dst = SocketAddr::new(to.ip4.into(), port).to_string();
    assert_eq!(
        stream(from, &["echo", &dst, "2048", "1"])?,
        "ok 2048",
        "{dst}"
    );
    let after = counts(agent)?;
    Ok(Counts {
        out: after.out - before.out,
        inb: after.inb - before.inb,
        port: after.port - before.port,
        cidr: after.cidr - before.cidr,
    })
}

const CAPTURED_OUT: Counts = Counts {
    out: 1,
    inb: 0,
    port: 0,
    cidr: 0,
};
const CAPTURED_IN: Counts = Counts {
    out: 0,
    inb: 1,
    port: 0,
    cidr: 0,
};
const PORT_EXEMPT: Counts = Counts {
    out: 0,
    inb: 0,
    port: 1,
    cidr: 0,
};
const CIDR_EXEMPT: Counts = Counts {
    out: 0,
    inb: 0,
    port: 0,
    cidr: 1,
};

/// The exclusions in force for the one enrolled pod, as `pod list` shows
/// them.
fn listed(agent: &Agent, uid: &str) -> anyhow::Result<Option<(Exclusions, u64)>> {
    Ok(agent
        .call(&Request::List)?
        .pods
        .into_iter()
        .find(|p| p.spec.uid == uid)
        .map(|p| (p.spec.exclusions, p.netns_cookie)))
}

#[test]
fn sidecar_exclusion_annotations_apply_change_in_place_and_invalid_ones_are_ignored()
-> anyhow::Result<()> {
    let mut node = Node::new("kubeexcl", 1)?;
    let client = node.add_pod("kubeexcl")?;
    let server = node.add_pod("kubeexcl")?;
    let far = node.add_pod("kubeexcl")?;
    let uid = pod_uid();
    // The pod's sandbox, found through its cgroup as the kubelet names it.
    let sandbox_cgroup = Cgroup::child(node.cgroup(), &format!("pod{uid}"))?;
    let mut pause = Command::new("sleep");
    pause.arg("120");
    let _pause = spawn_in(
        pause,
        Some(client.netns.path()),
        Some(sandbox_cgroup.path()),
    )?;
    let _servers = [
        echo_server(&server, 9901)?,
        echo_server(&server, 9902)?,
        echo_server(&far, 9901)?,
        echo_server(&far, 9902)?,
        echo_server(&client, 9950)?,
        echo_server(&client, 9951)?,
    ];

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
    pod["metadata"]["annotations"] = json!({
        EXCLUDE_OUT_PORTS: "9901",
        EXCLUDE_OUT_RANGES: format!("{}/32", far.ip4),
        EXCLUDE_IN_PORTS: " 9950 ",
    });
    let api = FakeApi::start()?;
    api.set_object(POD_PATH, pod.clone());
    api.push_list("/api/v1/pods", pod_list(&[&pod]));
    api.push_list("/api/v1/namespaces", fixture_namespaces()?);
    let dir = TempDir::new("kubeexcl")?;
    let kubeconfig = api.write_kubeconfig(dir.path())?;
    let kubeconfig = kubeconfig.display().to_string();
    let agent = Agent::start(
        "kubeexcl",
        &node,
        &["--kube", "--node", "node-a", "--kubeconfig", &kubeconfig],
    )?;

    wait_until("the annotated pod to be enrolled", || {
        Ok(listed(&agent, &uid)?.is_some())
    })?;
    let (exclusions, cookie) =
        listed(&agent, &uid)?.ok_or_else(|| anyhow::anyhow!("the pod left"))?;
    assert_eq!(exclusions.outbound_ports, [9901], "pod list shows them");
    let cidrs: Vec<String> = exclusions
        .outbound_cidrs
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(cidrs, [format!("{}/32", far.ip4)]);
    assert_eq!(exclusions.inbound_ports, [9950]);
    assert_eq!(
        agent.pod_status("web-7d9c8b6f5-x2x4q")?.not_captured,
        Some(format!("in:9950,out:9901,out:{}/32", far.ip4)),
        "status shows them"
    );

    // The excluded port and range go out uncaptured, the rest is captured.
    assert_eq!(exchange(&agent, &client, &server, 9901)?, PORT_EXEMPT);
    assert_eq!(exchange(&agent, &client, &far, 9902)?, CIDR_EXEMPT);
    assert_eq!(exchange(&agent, &client, &server, 9902)?, CAPTURED_OUT);
    // The excluded inbound port is reached without the proxy.
    assert_eq!(exchange(&agent, &server, &client, 9950)?, PORT_EXEMPT);
    assert_eq!(exchange(&agent, &server, &client, 9951)?, CAPTURED_IN);

    // The annotations change on the running pod: another port, no range,
    // no inbound exclusion.
    api.wait_for_request("the pod watch", Duration::from_secs(10), |r| {
        r.path == "/api/v1/pods" && r.is_watch()
    })?;
    let modify = |pod: &mut Value, version: &str, annotations: Value| {
        pod["metadata"]["resourceVersion"] = version.into();
        pod["metadata"]["annotations"] = annotations;
        api.send_event(
            "/api/v1/pods",
            json!({"type": "MODIFIED", "object": pod.clone()}),
        );
    };
    modify(&mut pod, "1220", json!({ EXCLUDE_OUT_PORTS: "9902" }));
    wait_until("the new exclusions to be in force", || {
        Ok(listed(&agent, &uid)?.is_some_and(|(e, _)| e.outbound_ports == [9902]))
    })?;
    let (exclusions, same_cookie) =
        listed(&agent, &uid)?.ok_or_else(|| anyhow::anyhow!("the pod left"))?;
    assert_eq!(same_cookie, cookie);
    assert!(exclusions.outbound_cidrs.is_empty() && exclusions.inbound_ports.is_empty());
    // Changed in place: the one engine started for the pod still serves
    // it (a re-enrollment would have started a second).
    assert_eq!(
        sum(&scrape(&agent)?, "workload_manager_proxies_started_total"),
        1.0,
        "changed in place, not re-enrolled"
    );
    assert_eq!(exchange(&agent, &client, &server, 9901)?, CAPTURED_OUT);
    assert_eq!(exchange(&agent, &client, &server, 9902)?, PORT_EXEMPT);
    assert_eq!(exchange(&agent, &client, &far, 9901)?, CAPTURED_OUT);
    assert_eq!(exchange(&agent, &server, &client, 9950)?, CAPTURED_IN);

    // An invalid value: ignored as a whole, the pod stays enrolled and
    // captured as if the annotation were not set, and it is reported.
    modify(&mut pod, "1230", json!({ EXCLUDE_OUT_PORTS: "9902,http" }));
    // The warning comes as the reconciler reads the annotation, the
    // kernel update right after it.
    let ignored = || -> anyhow::Result<f64> {
        Ok(sum_matching(
            &scrape(&agent)?,
            "dataplane_kube_pod_annotations_ignored_total",
            &[("annotation", EXCLUDE_OUT_PORTS)],
        ))
    };
    wait_until("the invalid annotation to be counted and dropped", || {
        Ok(ignored()? >= 1.0
            && listed(&agent, &uid)?.is_some_and(|(e, _)| e == Exclusions::default()))
    })?;
    assert!(listed(&agent, &uid)?.is_some(), "still enrolled");
    let log = agent.log_text();
    assert!(
        log.contains(EXCLUDE_OUT_PORTS)
            && log.contains("9902,http")
            && log.contains("web-7d9c8b6f5-x2x4q"),
        "the warning names the pod, the annotation and the value"
    );
    assert_eq!(ignored()?, 1.0);
    assert_eq!(exchange(&agent, &client, &server, 9902)?, CAPTURED_OUT);
    assert_eq!(exchange(&agent, &client, &server, 9901)?, CAPTURED_OUT);
    Ok(())
}
