//! The chained CNI plugin with the real reference plugins (Debian's
//! containernetworking-plugins: bridge + host-local, and loopback), run
//! exactly as a container runtime runs them (environment + stdin per the
//! CNI spec, `prevResult` chained), inside a simulated node's namespace:
//! the pod's very first connection is captured; DEL cleans up and is
//! idempotent, also once the namespace is gone; CHECK reports drift; an
//! unreachable agent fails or passes the pod per `onAgentUnreachable`;
//! malformed stdin gives a spec error; with a kubeconfig, only pods that
//! opted in are enrolled (and the others start even with the agent down).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener};

use dataplane_tests::{
    Agent, Cgroup, Netns, Responder, TempDir,
    cni::{Attachment, CniNetwork},
    cni_kubeapi::{FakeApi, fixture, pod_uid},
    topology::{Node, Pod},
    traffic::stream,
};
use dataplane_user::control::Request;
use serde_json::{Value, json};

/// The agent's control socket as the plugin configuration names it.
fn socket_of(agent: &Agent) -> String {
    dataplane_user::control::socket_path(agent.state_dir(), agent.instance())
        .display()
        .to_string()
}

/// An echo server on the node side of the CNI bridge (all addresses of the
/// node namespace, port `port`).
fn node_echo(node: &Node, port: u16) -> anyhow::Result<Responder> {
    let listener = node
        .netns()
        .run(move || TcpListener::bind(SocketAddr::from(([0u16; 8], port))))??;
    Responder::start(listener, |req| req.body.clone())
}

/// The pod's IPv4 and IPv6 addresses from a CNI result.
fn addresses(result: &Value) -> anyhow::Result<(Ipv4Addr, Ipv6Addr)> {
    let mut v4 = None;
    let mut v6 = None;
    for ip in result["ips"].as_array().cloned().unwrap_or_default() {
        let addr: IpAddr = ip["address"]
            .as_str()
            .and_then(|a| a.split('/').next())
            .unwrap_or_default()
            .parse()?;
        match addr {
            IpAddr::V4(a) => v4 = Some(a),
            IpAddr::V6(a) => v6 = Some(a),
        }
    }
    Ok((
        v4.ok_or_else(|| anyhow::anyhow!("no IPv4 in {result}"))?,
        v6.ok_or_else(|| anyhow::anyhow!("no IPv6 in {result}"))?,
    ))
}

fn code(err: &Value) -> u64 {
    err["code"].as_u64().unwrap_or(0)
}

#[test]
fn the_pods_very_first_connection_is_captured_and_del_cleans_up() -> anyhow::Result<()> {
    let node = Node::new("cnifirst", 1)?;
    let agent = Agent::start("cnifirst", &node, &[])?;
    let net = CniNetwork::bridge_with_dataplane(
        "cnifirst",
        node.netns(),
        json!({"agentSocket": socket_of(&agent)}),
    )?;
    let _echo = node_echo(&node, 9800)?;
    let netns = Netns::new("cnifirstpod")?;
    let cgroup = Cgroup::child(node.cgroup(), "cnifirstpod")?;
    let uid = pod_uid();
    let att = Attachment::pod(&netns, "shop", "web-0", &uid);

    assert_eq!(net.loopback(&att)?.code, Some(0));
    let result = match net.add(&att)? {
        Ok(result) => result,
        Err(err) => anyhow::bail!("ADD failed in {}: {} {}", err.plugin, err.error, err.stderr),
    };
    // The chain's result is the bridge's, passed through unchanged.
    assert_eq!(result["cniVersion"], "1.0.0");
    let (ip4, ip6) = addresses(&result)?;
    let listed = agent.call(&Request::List)?.pods;
    assert_eq!(listed.len(), 1, "{listed:?}");
    let spec = &listed[0].spec;
    assert_eq!(spec.uid, uid);
    assert_eq!(
        (spec.name.as_str(), spec.namespace.as_str()),
        ("web-0", "shop")
    );
    assert_eq!(spec.netns, netns.path());
    assert_eq!(spec.ips, vec![IpAddr::V4(ip4), IpAddr::V6(ip6)]);
    assert_eq!(spec.node_addr, Some(IpAddr::from([10, 88, 0, 1])));

    // The pod's first process, first connection.
    let pod = Pod {
        netns,
        cgroup,
        ip4,
        ip6,
        node_side: IpAddr::from([10, 88, 0, 1]),
    };
    assert_eq!(agent.counter("redirected_outbound")?, 0);
    assert_eq!(
        stream(&pod, &["echo", "10.88.0.1:9800", "65536", "1"])?,
        "ok 65536"
    );
    assert_eq!(
        agent.counter("redirected_outbound")?,
        1,
        "the very first connection went through the engine"
    );

    // CHECK agrees with ADD.
    if let Err(err) = net.check(&att, &result)? {
        anyhow::bail!("CHECK failed in {}: {}", err.plugin, err.error);
    }

    // DEL: unenrolled, address released, veth gone; again: still fine.
    let ipam = net.ipam_dir();
    assert!(
        ipam.join(ip4.to_string()).exists(),
        "host-local holds the address"
    );
    if let Err(err) = net.del(&att, Some(&result))? {
        anyhow::bail!("DEL failed in {}: {}", err.plugin, err.error);
    }
    assert!(agent.call(&Request::List)?.pods.is_empty());
    assert!(!ipam.join(ip4.to_string()).exists(), "address released");
    let links = node.netns().ip(&["-o", "link", "show", "master", "cni0"])?;
    assert!(links.trim().is_empty(), "host-side veth removed: {links}");
    assert!(net.del(&att, Some(&result))?.is_ok(), "DEL is idempotent");

    // DEL once the namespace itself is gone.
    let Pod { netns, .. } = pod;
    drop(netns);
    assert!(
        net.del(&att, Some(&result))?.is_ok(),
        "DEL without a namespace"
    );
    Ok(())
}

/// Clients that connect to the control socket and say nothing (a flood,
/// or hung tools) never lock kubelet's runtime out: beyond the agent's
/// slots the oldest silent one is closed for each newcomer, so a CNI ADD
/// made while 200 of them hold the socket still enrolls its pod.
#[test]
fn an_add_enrolls_its_pod_while_200_silent_clients_hold_the_control_socket() -> anyhow::Result<()> {
    use std::io::Read as _;
    let node = Node::new("cnisilent", 1)?;
    let agent = Agent::start("cnisilent", &node, &[])?;
    let net = CniNetwork::bridge_with_dataplane(
        "cnisilent",
        node.netns(),
        json!({"agentSocket": socket_of(&agent)}),
    )?;
    let netns = Netns::new("cnisilentpod")?;
    let att = Attachment::pod(&netns, "shop", "web-0", &pod_uid());
    let socket = dataplane_user::control::socket_path(agent.state_dir(), agent.instance());
    let silent: Vec<std::os::unix::net::UnixStream> = (0..200)
        .map(|_| std::os::unix::net::UnixStream::connect(&socket))
        .collect::<Result<_, _>>()?;
    assert_eq!(net.loopback(&att)?.code, Some(0));
    if let Err(err) = net.add(&att)? {
        anyhow::bail!("ADD failed in {}: {} {}", err.plugin, err.error, err.stderr);
    }
    let listed = agent.call(&Request::List)?.pods;
    assert_eq!(listed.len(), 1, "{listed:?}");
    // The oldest were shed as the newer came, each told why (the newer
    // ones close at their own request timeout).
    let mut oldest = &silent[0];
    oldest.set_read_timeout(Some(std::time::Duration::from_secs(20)))?;
    let mut told = String::new();
    oldest.read_to_string(&mut told)?;
    assert!(told.contains("had sent nothing"), "{told}");
    let samples = dataplane_tests::observe::scrape(&agent)?;
    let shed = dataplane_tests::observe::sum(&samples, "dataplane_control_clients_shed_total");
    assert!(shed >= 72.0, "200 silent clients on 128 slots: {shed} shed");
    if let Err(err) = net.del(&att, None)? {
        anyhow::bail!("DEL failed in {}: {}", err.plugin, err.error);
    }
    Ok(())
}

#[test]
fn check_reports_drift() -> anyhow::Result<()> {
    let node = Node::new("cnidrift", 1)?;
    let agent = Agent::start("cnidrift", &node, &[])?;
    let net = CniNetwork::bridge_with_dataplane(
        "cnidrift",
        node.netns(),
        json!({"agentSocket": socket_of(&agent)}),
    )?;
    let netns = Netns::new("cnidriftpod")?;
    let uid = pod_uid();
    let att = Attachment::pod(&netns, "shop", "web-1", &uid);
    let result = net
        .add(&att)?
        .map_err(|e| anyhow::anyhow!("ADD: {}", e.error))?;
    assert!(net.check(&att, &result)?.is_ok());

    // Someone unenrolls the pod behind the runtime's back.
    agent.call(&Request::Remove {
        uid: Some(uid),
        netns: None,
    })?;
    let err = net
        .check(&att, &result)?
        .err()
        .ok_or_else(|| anyhow::anyhow!("CHECK passed on a pod that is not captured"))?;
    assert_eq!(err.plugin, "dataplane-cni");
    assert_eq!(code(&err.error), 103, "{}", err.error);
    assert!(
        err.error["msg"]
            .as_str()
            .unwrap_or("")
            .contains("not enrolled")
    );

    // Addresses that differ are drift too.
    let mut other = result.clone();
    other["ips"][0]["address"] = "10.88.200.200/16".into();
    let again = net.exec(1, "ADD", &att, Some(&result))?;
    assert_eq!(again.code, Some(0), "re-enroll: {}", again.stdout);
    let run = net.exec(1, "CHECK", &att, Some(&other))?;
    assert_eq!(run.code, Some(1));
    assert_eq!(code(&run.json()?), 103);
    assert!(
        run.json()?["msg"]
            .as_str()
            .unwrap_or("")
            .contains("other addresses")
    );
    let _ = net.del(&att, Some(&result))?;
    Ok(())
}

#[test]
fn unreachable_agent_fails_or_passes_per_setting() -> anyhow::Result<()> {
    let node = Node::new("cnidown", 1)?;
    let dir = TempDir::new("cnidown")?;
    let dead = dir.path().join("agent.sock").display().to_string();

    // Default policy: fail. The runtime then tears the attachment down.
    let net =
        CniNetwork::bridge_with_dataplane("cnidownf", node.netns(), json!({"agentSocket": dead}))?;
    let netns = Netns::new("cnidownpod")?;
    let att = Attachment::pod(&netns, "shop", "web-2", &pod_uid());
    let err = net
        .add(&att)?
        .err()
        .ok_or_else(|| anyhow::anyhow!("ADD passed with the agent down under `fail`"))?;
    assert_eq!(err.plugin, "dataplane-cni");
    assert_eq!(code(&err.error), 100, "{}", err.error);
    assert!(
        err.error["details"]
            .as_str()
            .unwrap_or("")
            .contains("onAgentUnreachable")
    );
    assert!(
        net.del(&att, None)?.is_ok(),
        "the runtime's cleanup DEL succeeds"
    );

    // `pass`: the pod starts, uncaptured, with the primary plugin's result.
    let net = CniNetwork::bridge_with_dataplane(
        "cnidownp",
        node.netns(),
        json!({"agentSocket": dead, "onAgentUnreachable": "pass"}),
    )?;
    let bridge_only = net.exec(0, "ADD", &att, None)?;
    assert_eq!(bridge_only.code, Some(0), "{}", bridge_only.stderr);
    let prev = bridge_only.json()?;
    let ours = net.exec(1, "ADD", &att, Some(&prev))?;
    assert_eq!(ours.code, Some(0), "{}", ours.stderr);
    assert_eq!(ours.json()?, prev, "prevResult passed through unchanged");
    assert!(
        ours.stderr.contains("passing uncaptured"),
        "{}",
        ours.stderr
    );
    assert!(net.del(&att, Some(&prev))?.is_ok());
    Ok(())
}

#[test]
fn malformed_input_gives_spec_errors_and_version_is_reported() -> anyhow::Result<()> {
    let node = Netns::new("cnimalformed")?;
    let net = CniNetwork::bridge_with_dataplane("cnimalformed", &node, json!({}))?;
    let pod = Netns::new("cnimalformedpod")?;
    let att = Attachment::pod(&pod, "shop", "web-3", &pod_uid());

    let garbage = net.exec_raw("dataplane-cni", "ADD", Some(&att), b"{\"cniVersion\": ")?;
    assert_eq!(garbage.code, Some(1));
    let err = garbage.json()?;
    assert_eq!(code(&err), 6, "{err}");
    assert!(
        err["msg"].is_string() && err["details"].is_string(),
        "{err}"
    );

    let wrong_type = net.exec_raw(
        "dataplane-cni",
        "ADD",
        Some(&att),
        br#"{"cniVersion":"1.0.0","name":"n","type":"dataplane-cni","agentTimeoutSeconds":"soon"}"#,
    )?;
    assert_eq!(code(&wrong_type.json()?), 7);

    let unchained = net.exec_raw(
        "dataplane-cni",
        "ADD",
        Some(&att),
        br#"{"cniVersion":"1.0.0","name":"n","type":"dataplane-cni"}"#,
    )?;
    assert_eq!(code(&unchained.json()?), 7);

    let mut no_env = att.clone();
    no_env.netns = std::path::PathBuf::new();
    let missing = net.exec(
        1,
        "ADD",
        &no_env,
        Some(&json!({"cniVersion":"1.0.0","ips":[]})),
    )?;
    // An empty CNI_NETNS is unset.
    assert_eq!(code(&missing.json()?), 4, "{}", missing.stdout);

    let version = net.exec_raw(
        "dataplane-cni",
        "VERSION",
        None,
        br#"{"cniVersion":"1.1.0"}"#,
    )?;
    assert_eq!(version.code, Some(0));
    let v = version.json()?;
    assert_eq!(v["cniVersion"], "1.1.0");
    for supported in ["0.3.1", "0.4.0", "1.0.0", "1.1.0"] {
        assert!(
            v["supportedVersions"]
                .as_array()
                .is_some_and(|a| a.iter().any(|s| s == supported)),
            "{v}"
        );
    }
    Ok(())
}

#[test]
fn status_and_gc_follow_cni_1_1() -> anyhow::Result<()> {
    let node = Node::new("cnistatus", 1)?;
    let mut agent = Agent::start("cnistatus", &node, &[])?;
    let net = CniNetwork::bridge_with_dataplane("cnistatus", node.netns(), json!({}))?;
    let conf = |socket: &str| {
        json!({"cniVersion":"1.1.0","name":"dpt-net","type":"dataplane-cni","agentSocket":socket})
            .to_string()
    };
    let up = net.exec_raw(
        "dataplane-cni",
        "STATUS",
        None,
        conf(&socket_of(&agent)).as_bytes(),
    )?;
    assert_eq!(up.code, Some(0), "{}", up.stdout);
    let gc = json!({"cniVersion":"1.1.0","name":"dpt-net","type":"dataplane-cni",
                    "cni.dev/valid-attachments":[{"containerID":"abc","ifname":"eth0"}]});
    assert_eq!(
        net.exec_raw("dataplane-cni", "GC", None, gc.to_string().as_bytes())?
            .code,
        Some(0)
    );

    let socket = socket_of(&agent);
    agent.stop()?;
    let down = net.exec_raw("dataplane-cni", "STATUS", None, conf(&socket).as_bytes())?;
    assert_eq!(down.code, Some(1));
    assert_eq!(code(&down.json()?), 50, "{}", down.stdout);
    Ok(())
}

#[test]
fn with_a_kubeconfig_only_opted_in_pods_are_enrolled() -> anyhow::Result<()> {
    let node = Node::new("cnikube", 1)?;
    let agent = Agent::start("cnikube", &node, &[])?;
    // The API the plugin asks lives on the node namespace's loopback,
    // where the plugins run.
    let api = FakeApi::start_in(node.netns())?;
    let dir = TempDir::new("cnikube")?;
    let kubeconfig = api.write_kubeconfig(dir.path())?;
    let web_uid = pod_uid();
    let plain_uid = pod_uid();
    let vars = [
        ("NODE", "node-a"),
        ("UID_WEB", web_uid.as_str()),
        ("UID_PLAIN", plain_uid.as_str()),
        ("NS_UID_SHOP", "a3c1b5e2-7f00-4b1e-9d55-0e6f7a8b9c01"),
        ("NS_UID_LEGACY", "a3c1b5e2-7f00-4b1e-9d55-0e6f7a8b9c02"),
    ];
    // Istio's sidecar-mode exclusions, one of them invalid (Istio's CIDR
    // lists take no spaces): that one is ignored, the other applies.
    let mut web_pod = fixture("pod_web.json", &vars)?;
    web_pod["metadata"]["annotations"] = json!({
        "traffic.sidecar.istio.io/excludeOutboundPorts": "5432, 6379",
        "traffic.sidecar.istio.io/excludeOutboundIPRanges": "10.0.0.0/8, 192.168.0.0/16",
    });
    api.set_object("/api/v1/namespaces/shop/pods/web-7d9c8b6f5-x2x4q", web_pod);
    api.set_object(
        "/api/v1/namespaces/shop",
        fixture("namespace_shop.json", &vars)?,
    );
    api.set_object(
        "/api/v1/namespaces/legacy/pods/plain-1",
        fixture("pod_plain.json", &vars)?,
    );
    api.set_object(
        "/api/v1/namespaces/legacy",
        fixture("namespace_legacy.json", &vars)?,
    );

    let net = CniNetwork::bridge_with_dataplane(
        "cnikube",
        node.netns(),
        json!({"agentSocket": socket_of(&agent), "kubeconfig": kubeconfig, "trustDomain": "example.org"}),
    )?;
    // Opted in through its namespace: enrolled with the API's uid and
    // service account (the runtime passes no K8S_POD_UID here).
    let web_ns = Netns::new("cnikubeweb")?;
    let mut web = Attachment::pod(&web_ns, "shop", "web-7d9c8b6f5-x2x4q", "ignored");
    web.args.remove("K8S_POD_UID");
    let web_result = net
        .add(&web)?
        .map_err(|e| anyhow::anyhow!("ADD web: {} {}", e.error, e.stderr))?;
    let listed = agent.call(&Request::List)?.pods;
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].spec.uid, web_uid);
    assert_eq!(listed[0].spec.service_account, "web");
    assert_eq!(listed[0].spec.trust_domain, "example.org");
    assert_eq!(listed[0].spec.exclusions.outbound_ports, [5432, 6379]);
    assert!(listed[0].spec.exclusions.outbound_cidrs.is_empty());

    // Not opted in: passed through, not enrolled.
    let plain_ns = Netns::new("cnikubeplain")?;
    let plain = Attachment::pod(&plain_ns, "legacy", "plain-1", &plain_uid);
    let plain_result = net
        .add(&plain)?
        .map_err(|e| anyhow::anyhow!("ADD plain: {}", e.error))?;
    assert_eq!(agent.call(&Request::List)?.pods.len(), 1);

    // ... and it would start even with the agent down under `fail`.
    let dead = CniNetwork::bridge_with_dataplane(
        "cnikubedead",
        node.netns(),
        json!({"agentSocket": dir.path().join("none.sock"), "kubeconfig": kubeconfig}),
    )?;
    let ours = dead.exec(1, "ADD", &plain, Some(&plain_result))?;
    assert_eq!(ours.code, Some(0), "{}", ours.stdout);
    assert!(ours.stderr.contains("not enrolled"), "{}", ours.stderr);

    // The plugin asked for exactly the pod and its namespace.
    let asked: Vec<String> = api.requests().into_iter().map(|r| r.path).collect();
    assert!(
        asked.contains(&"/api/v1/namespaces/shop/pods/web-7d9c8b6f5-x2x4q".to_owned()),
        "{asked:?}"
    );
    assert!(
        asked.contains(&"/api/v1/namespaces/legacy".to_owned()),
        "{asked:?}"
    );

    // The plugin's own enablement selectors (install-cni writes the
    // chart's) replace Istio's: selecting the namespace by name enrolls
    // the pod the default left out. (Web goes first: the second network's
    // IPAM hands out its address again.)
    let _ = net.del(&web, Some(&web_result))?;
    let by_name = CniNetwork::bridge_with_dataplane(
        "cnikubesel",
        node.netns(),
        json!({"agentSocket": socket_of(&agent), "kubeconfig": kubeconfig,
               "enablementSelectors": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "legacy"}}}]}),
    )?;
    let selected_ns = Netns::new("cnikubesel")?;
    let selected = Attachment::pod(&selected_ns, "legacy", "plain-1", &plain_uid);
    let selected_result = by_name
        .add(&selected)?
        .map_err(|e| anyhow::anyhow!("ADD selected: {} {}", e.error, e.stderr))?;
    let listed = agent.call(&Request::List)?.pods;
    assert!(listed.iter().any(|p| p.spec.uid == plain_uid), "{listed:?}");

    let _ = by_name.del(&selected, Some(&selected_result))?;
    let _ = net.del(&plain, Some(&plain_result))?;
    Ok(())
}
