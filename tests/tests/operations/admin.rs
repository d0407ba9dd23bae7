//! Operating one agent: the admin endpoint on loopback only, flags that
//! conflict, an in-process start and stop, the runtime log level, and
//! `dataplane status`.

use super::*;

#[test]
fn admin_is_reachable_on_loopback_only() -> anyhow::Result<()> {
    let mut node = Node::new("opadmin", 1)?;
    let pod = node.add_pod("opadmin")?;
    let agent = Agent::start("opadmin", &node, &[])?;
    agent.enroll(Agent::spec_for(&pod, "adm"))?;
    let admin = agent.admin_addr()?;
    assert!(admin.ip().is_loopback(), "{admin}");
    // The enrollment actor answers an enrollment before it publishes the
    // pod list that status and the dump read, so the pod can be missing
    // from a dump taken at once: wait for it (bounded).
    let (mut body, mut dump) = (String::new(), Value::Null);
    wait_until("the dump to list the pod", || {
        let (status, text) = http(admin, "GET", "/config_dump")?;
        anyhow::ensure!(status == 200, "{text}");
        dump = serde_json::from_str(&text)?;
        body = text;
        Ok(entry(&dump, "/pods", "/spec/uid", "uid-adm").is_ok())
    })?;
    let cert = entry(&dump, "/heldCertificates", "/identity", DEFAULT_ID)?;
    assert!(
        cert["expiresInSecs"].as_i64().is_some_and(|s| s > 0),
        "{cert}"
    );
    for key in ["origin", "workloads", "services", "policies"] {
        assert!(dump["config"].get(key).is_some(), "config.{key}: {dump:#}");
    }
    assert_eq!(dump["kernel"]["capture"], "ebpf", "{dump:#}");
    // What the agent runs with: its flags, as one checked configuration.
    let config = &dump["agentConfig"];
    assert_eq!(config["state"]["instance"], agent.instance(), "{config:#}");
    assert_eq!(config["capture"], "ebpf", "{config:#}");
    assert_eq!(config["redirect"]["onExit"], "detach", "{config:#}");
    assert_eq!(
        config["endpoints"]["admin"].as_str(),
        Some("127.0.0.1:0"),
        "{config:#}"
    );
    assert!(
        dump["kernel"]["pinnedLinks"]
            .as_array()
            .is_some_and(|l| !l.is_empty()),
        "{dump:#}"
    );
    // No key material: no PEM key, and not a line of the CA's key.
    assert!(!body.contains("PRIVATE KEY"), "{body}");
    let ca_key = std::fs::read_to_string(agent.state_dir().join("ca/root-key.pem"))?;
    let key_line = ca_key
        .lines()
        .filter(|l| !l.starts_with("-----"))
        .max_by_key(|l| l.len());
    assert!(
        key_line.is_some_and(|l| l.len() > 16 && !body.contains(l)),
        "{body}"
    );

    // From inside the pod: the node's addresses, and loopback.
    let mut targets: Vec<IpAddr> = vec!["127.0.0.1".parse()?, "::1".parse()?];
    let addrs = node.netns().ip(&["-o", "addr", "show"])?;
    for word in addrs.split_whitespace() {
        if let Some((ip, _)) = word.split_once('/')
            && let Ok(ip) = ip.parse::<IpAddr>()
            && !matches!(ip, IpAddr::V6(v6) if v6.segments()[0] == 0xfe80)
        {
            targets.push(ip);
        }
    }
    assert!(targets.contains(&IpAddr::V4(node.bridge_ip4())), "{addrs}");
    let port = admin.port();
    for ip in targets {
        let target = SocketAddr::new(ip, port);
        let reached = pod
            .netns
            .run(move || TcpStream::connect_timeout(&target, Duration::from_secs(2)).is_ok())?;
        assert!(!reached, "the pod reached the admin port at {target}");
    }
    let lo = SocketAddr::from(([127, 0, 0, 1], port));
    let reached = node
        .netns()
        .run(move || TcpStream::connect_timeout(&lo, Duration::from_secs(2)).is_ok())?;
    assert!(!reached, "the node namespace reached the admin port");

    let out = Command::new(agent_binary()?)
        .args(["run", "--admin-addr", "10.0.0.1:15000"])
        .output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("loopback"), "{stderr}");
    Ok(())
}

/// Flags that do not fit together are refused before anything starts:
/// exit 2 and a message naming the flag and what to do. Everything else
/// points at the test's own directories, iptables capture and free ports,
/// so that an agent that wrongly starts touches nothing of the host's and
/// fails (an unusable bpffs) instead of running.
#[test]
fn conflicting_flags_exit_2_naming_the_flag() -> anyhow::Result<()> {
    let dir = TempDir::new("opflags")?;
    let none: &[(&str, &str)] = &[];
    // A mesh config whose outbound traffic mode Istio does not define.
    let bad_mode = dir.path().join("mesh-bad-mode");
    std::fs::write(&bad_mode, "outboundTrafficPolicy:\n  mode: BLOCK\n")?;
    let bad_mode = bad_mode.display().to_string();
    for (flags, env, named) in [
        (
            &["--engine", "ztunnel", "--capture", "iptables"][..],
            none,
            "--engine ztunnel cannot run with --capture iptables",
        ),
        (
            &["--kube"][..],
            none,
            "--kube needs this node's name: pass --node",
        ),
        (
            &["--cert-source", "files"][..],
            none,
            "--cert-source files needs --cert-dir",
        ),
        (
            &["--proxy-mark", "0x700", "--transparent-mark", "0x700"][..],
            none,
            "--transparent-mark 0x700 must be non-zero and differ from --proxy-mark",
        ),
        // Istio's proxy config, under ztunnel's variable name, and a mesh
        // config file named but missing.
        (
            &[][..],
            &[("PROXY_CONFIG", r#"{"proxyAdminPort": 70000}"#)][..],
            "PROXY_CONFIG: proxyAdminPort: invalid value",
        ),
        (
            &["--mesh-config", "/nonexistent/dp-mesh-config"][..],
            none,
            "mesh config /nonexistent/dp-mesh-config",
        ),
        (
            &["--mesh-config", bad_mode.as_str()][..],
            none,
            "outboundTrafficPolicy.mode \"BLOCK\"",
        ),
        // ztunnel's DNS proxy address, which the agent's resolver (where
        // its kernel programs steer DNS) cannot move to.
        (
            &[][..],
            &[("ISTIO_META_DNS_PROXY_ADDR", "localhost:5353")][..],
            "DNS_PROXY_ADDR=\"localhost:5353\"",
        ),
    ] {
        let mut command = Command::new(agent_binary()?);
        command
            .arg("run")
            .args(flags)
            .envs(env.iter().copied())
            .arg("--state-dir")
            .arg(dir.path())
            .arg("--bpffs")
            .arg(dir.path())
            .arg("--zds-socket")
            .arg(dir.path().join("zds.sock"))
            .args(["--instance", "opflags", "--on-exit", "detach"])
            .args(["--readiness-addr", "127.0.0.1:0"])
            .args(["--metrics-addr", "127.0.0.1:0"])
            .args(["--admin-addr", "127.0.0.1:0"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if !flags.contains(&"--capture") {
            command.args(["--capture", "iptables"]);
        }
        let out = ChildGuard::new(command.spawn()?).wait(Duration::from_secs(30))?;
        assert_eq!(out.code, Some(2), "{flags:?} {env:?}: {}", out.stderr);
        assert!(
            out.stderr.contains(named),
            "{flags:?} {env:?}: {}",
            out.stderr
        );
    }
    Ok(())
}

/// An agent started in this process (`agent::start`, no second process)
/// serves its admin endpoint with the configuration its flags made, stops
/// on `Bound::stop` as on `/quitquitquit`, and shuts down leaving no
/// control socket.
#[test]
fn an_agent_starts_in_process_and_stops_cleanly() -> anyhow::Result<()> {
    use dataplane_user::agent::{self, Stop};
    use dataplane_user::cli::{Cli, Command as CliCommand};

    let node = Node::new("opinproc", 1)?;
    let bpffs = BpffsDir::new("opinproc")?;
    let state = TempDir::new("opinproc")?;
    let (bpffs_path, state_path) = (bpffs.path().display(), state.path().display());
    let (bpffs_path, state_path) = (bpffs_path.to_string(), state_path.to_string());
    let cgroup = node.cgroup().path().display().to_string();
    let argv = [
        "dataplane",
        "run",
        "--instance",
        "opinproc-agent",
        "--bpffs",
        &bpffs_path,
        "--state-dir",
        &state_path,
        "--cgroup",
        &cgroup,
        "--on-exit",
        "detach",
        "--threading",
        "shared",
        "--readiness-addr",
        "127.0.0.1:0",
        "--metrics-addr",
        "127.0.0.1:0",
        "--admin-addr",
        "127.0.0.1:0",
    ];
    let CliCommand::Run(args) = <Cli as clap::Parser>::try_parse_from(argv)?.command else {
        anyhow::bail!("`dataplane run` parsed as another command");
    };
    let config = args.into_config_with([])?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let bound = agent::start(config).await?;
        let socket = bound.control_socket().to_path_buf();
        assert!(socket.exists(), "{}", socket.display());
        let admin = bound
            .endpoints()
            .admin
            .ok_or_else(|| anyhow::anyhow!("no admin endpoint: {bound:?}"))?;
        let (status, body) =
            tokio::task::spawn_blocking(move || http(admin, "GET", "/config_dump")).await??;
        assert_eq!(status, 200, "{body}");
        let dump: Value = serde_json::from_str(&body)?;
        let config = &dump["agentConfig"];
        assert_eq!(config["state"]["instance"], "opinproc-agent", "{config:#}");
        assert_eq!(config["workers"]["threading"], "shared", "{config:#}");
        bound.stop();
        let stop = bound.wait(None).await;
        assert_eq!(stop, Stop::Asked);
        bound.shut_down(stop, None).await?;
        assert!(!socket.exists(), "the control socket was left behind");
        anyhow::Ok(())
    })
}

#[test]
fn runtime_log_level_change_takes_effect() -> anyhow::Result<()> {
    let mut node = Node::new("oplog", 1)?;
    let client = node.add_pod("oplog")?;
    let server = node.add_pod("oplog")?;
    let agent = Agent::start("oplog", &node, &[])?;
    agent.enroll(Agent::spec_for(&client, "client"))?;
    let _server = doubling_server(&server, 9000)?;
    let admin = agent.admin_addr()?;
    let debug_lines = || agent.log_text().matches(" DEBUG ").count();
    let closed = || access_records(&agent.log_text(), "connection closed").len();
    let connect = |n: usize| -> anyhow::Result<()> {
        exchange(&client, addr(&server, 9000), 64)?;
        wait_until("the access record", || Ok(closed() >= n))
    };

    connect(1)?;
    assert_eq!(debug_lines(), 0, "{}", agent.log_text());
    assert_eq!(
        http(admin, "GET", "/logging")?,
        (200, "log filter: info\n".into())
    );
    let (status, body) = http(admin, "POST", "/logging?level=debug")?;
    assert_eq!(status, 200, "{body}");
    assert_eq!(http(admin, "GET", "/logging")?.1, "log filter: debug\n");
    connect(2)?;
    wait_until("DEBUG lines", || Ok(debug_lines() > 0))?;
    let log = agent.log_text();
    assert!(
        log.lines()
            .any(|l| l.contains(" DEBUG ") && l.contains("connected")),
        "{log}"
    );

    // A bad filter is refused and the one in force stays.
    let (status, body) = http(admin, "POST", "/logging?level=access=loud")?;
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("invalid log filter"), "{body}");
    assert_eq!(http(admin, "GET", "/logging?level=info")?.0, 405);
    assert_eq!(http(admin, "GET", "/logging")?.1, "log filter: debug\n");

    // And back: no DEBUG line after the change.
    assert_eq!(http(admin, "POST", "/logging?level=info")?.0, 200);
    let before = debug_lines();
    connect(3)?;
    assert_eq!(debug_lines(), before, "{}", agent.log_text());
    Ok(())
}

#[test]
fn status_shows_capture_and_the_reason_after_unenroll() -> anyhow::Result<()> {
    let mut node = Node::new("opstatus", 1)?;
    let pod = node.add_pod("opstatus")?;
    let mut agent = Agent::start("opstatus", &node, &[])?;
    agent.enroll(Agent::spec_for(&pod, "stat"))?;
    let json = |out: &Output| -> anyhow::Result<Value> { Ok(serde_json::from_slice(&out.stdout)?) };

    let out = cli(&agent, &["status", "--json"])?;
    let report = json(&out)?;
    assert_eq!(out.status.code(), Some(0), "{report:#}");
    assert_eq!(report["ready"], true, "{report:#}");
    let programs = report["programs"].as_array().cloned().unwrap_or_default();
    assert!(
        !programs.is_empty() && programs.iter().all(|p| p["attached"] == true),
        "{report:#}"
    );
    assert_eq!(
        entry(&report, "/pods", "/uid", "uid-stat")?["captured"],
        true
    );
    assert_eq!(report["connectionsOpen"], 0, "{report:#}");
    for key in [
        "configOrigin",
        "errorsLastMinute",
        "recentErrors",
        "pending",
        "configError",
    ] {
        assert!(report.get(key).is_some(), "{key} missing: {report:#}");
    }

    let out = cli(&agent, &["certs", "--json"])?;
    assert_eq!(out.status.code(), Some(0));
    let certs = json(&out)?;
    let cert = entry(&certs, "", "/identity", DEFAULT_ID)?;
    assert!(
        cert["expiresInSecs"].as_i64().is_some_and(|s| s > 0),
        "{cert}"
    );
    for key in ["serial", "issuer", "notBefore", "notAfter"] {
        assert!(
            cert[key].as_str().is_some_and(|v| !v.is_empty()),
            "{key}: {cert}"
        );
    }
    // `config-dump` prints what the admin endpoint serves.
    let dump = json(&cli(&agent, &["config-dump"])?)?;
    let (_, body) = http(agent.admin_addr()?, "GET", "/config_dump")?;
    let admin: Value = serde_json::from_str(&body)?;
    for key in [
        "/config",
        "/pods",
        "/kernel/pinnedLinks",
        "/heldCertificates/0/serial",
    ] {
        assert_eq!(dump.pointer(key), admin.pointer(key), "{key}");
        assert!(dump.pointer(key).is_some(), "{key} missing: {dump:#}");
    }

    let out = cli(&agent, &["pod", "remove", "--uid", "uid-stat"])?;
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "removed");
    let out = cli(&agent, &["status", "--json"])?;
    let report = json(&out)?;
    assert_eq!(out.status.code(), Some(5), "{report:#}");
    let pod = entry(&report, "/pods", "/uid", "uid-stat")?;
    let dump = json(&cli(&agent, &["config-dump"])?)?;
    entry(&dump, "/departedPods", "/uid", "uid-stat")?;
    assert_eq!(pod["captured"], false, "{pod}");
    let reason = pod["reason"].as_str().unwrap_or_default();
    assert!(reason.starts_with("unenrolled on request"), "{pod}");
    let out = cli(&agent, &["status"])?;
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(5), "{text}");
    assert!(
        text.contains("test/stat") && text.contains("not captured"),
        "{text}"
    );
    assert!(
        !text.contains('\x1b'),
        "escape codes without a TTY: {text:?}"
    );

    assert_eq!(agent.stop()?, Some(0));
    let out = cli(&agent, &["status"])?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(4), "{stderr}");
    Ok(())
}
