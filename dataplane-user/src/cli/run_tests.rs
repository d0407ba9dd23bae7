//! `RunArgs::into_config`: each flag check, from argv and an explicit
//! environment (never the process's `ISTIO_META_*`).

use std::path::PathBuf;

use clap::Parser as _;

use super::FlagError;
use crate::agent::config::{AgentConfig, CaConfig, Capture, CertsConfig, EngineConfig};
use crate::cli::{Cli, Command, RunArgs};

/// `dataplane run <flags>`, parsed.
fn run_args(flags: &[&str]) -> RunArgs {
    let argv = [&["dataplane", "run"], flags].concat();
    match Cli::try_parse_from(&argv) {
        Ok(Cli {
            command: Command::Run(args),
        }) => *args,
        Ok(_) => panic!("`{}` parsed as another command", argv.join(" ")),
        Err(e) => panic!("`{}` does not parse: {e}", argv.join(" ")),
    }
}

/// The configuration `flags` make, with an empty environment.
fn config(flags: &[&str]) -> Result<AgentConfig, FlagError> {
    run_args(flags).into_config_with([])
}

/// The message of the error `flags` make.
fn refused(flags: &[&str]) -> String {
    match config(flags) {
        Ok(config) => panic!("{flags:?} was accepted: {config:#?}"),
        Err(err) => err.to_string(),
    }
}

#[test]
fn defaults_make_a_builtin_ebpf_agent_with_its_own_ca() {
    let config = config(&["--state-dir", "/tmp/dp"]).expect("the defaults are accepted");
    assert_eq!(config.capture, Capture::Ebpf);
    assert!(matches!(config.engine, EngineConfig::Builtin));
    match &config.certs {
        CertsConfig::Builtin {
            ca: CaConfig::Dir(dir),
        } => assert_eq!(dir, &PathBuf::from("/tmp/dp/ca")),
        other => panic!("expected the built-in CA under the state dir, got {other:?}"),
    }
    assert!(config.istiod.is_none() && config.xds.is_none() && config.kube.is_none());
    assert_eq!(
        config.original_source.kernel_mark(),
        dataplane_common::DEFAULT_TRANSPARENT_MARK
    );
    assert_eq!(config.mesh.pool_spread.max_connections, 4);
    assert!(config.mesh.keepalive.is_some());
}

#[test]
fn ztunnel_refuses_iptables_takeover_and_a_zero_mark() {
    for (flags, named) in [
        (&["--capture", "iptables"][..], "--capture iptables"),
        (&["--takeover"][..], "--takeover"),
        (&["--proxy-mark", "0"][..], "--proxy-mark 0"),
    ] {
        let message = refused(&[&["--engine", "ztunnel"], flags].concat());
        assert!(
            message.contains(named) && message.contains("--engine ztunnel"),
            "{message}"
        );
    }
    let config = config(&["--engine", "ztunnel", "--zds-socket", "/run/zds.sock"])
        .expect("ztunnel with its defaults is accepted");
    match config.engine {
        EngineConfig::Ztunnel { zds } => {
            assert_eq!(zds.socket, PathBuf::from("/run/zds.sock"));
            assert_eq!(zds.request_timeout, std::time::Duration::from_secs(5));
        }
        EngineConfig::Builtin => panic!("--engine ztunnel made a builtin engine"),
    }
}

#[test]
fn istio_flags_need_their_companions() {
    let message = refused(&["--cert-source", "istio"]);
    assert!(message.contains("needs --istiod-address"), "{message}");
    let message = refused(&["--cert-source", "istio", "--istiod-address", ":15012"]);
    assert!(message.contains("--istiod-address `:15012`"), "{message}");
    let message = refused(&["--cert-source", "files"]);
    assert!(message.contains("needs --cert-dir"), "{message}");
    let message = refused(&["--xds", "--istiod-address", "istiod:15012"]);
    assert!(message.contains("--xds needs --instance-ip"), "{message}");
    let message = refused(&[
        "--xds",
        "--istiod-address",
        "istiod:15012",
        "--instance-ip",
        "10.0.0.7",
        "--pod-name",
        "dp-0",
    ]);
    assert!(message.contains("--xds needs --node"), "{message}");
}

#[test]
fn xds_takes_who_the_agent_is_from_flags_and_the_given_environment() {
    let flags = [
        "--xds",
        "--istiod-address",
        "istiod.istio-system.svc:15012",
        "--instance-ip",
        "10.0.0.7",
        "--pod-name",
        "dp-0",
        "--node",
        "node-a",
        "--istiod-token",
        "none",
    ];
    let env = [
        ("ISTIO_META_CLUSTER".to_owned(), "east".to_owned()),
        ("PATH".to_owned(), "/bin".to_owned()),
    ];
    let config = run_args(&flags)
        .into_config_with(env)
        .expect("complete xDS flags are accepted");
    let node = config.xds.expect("--xds gives a node identity");
    assert_eq!(node.node_name, "node-a");
    assert_eq!(
        node.extra.into_iter().collect::<Vec<_>>(),
        [
            ("CLUSTER".to_owned(), "east".to_owned()),
            ("DNS_CAPTURE".to_owned(), "true".to_owned()),
            ("DNS_PROXY_ADDR".to_owned(), "localhost:15053".to_owned()),
        ]
    );
    let istiod = config.istiod.expect("--xds asks istiod");
    assert_eq!(istiod.server_name, "istiod.istio-system.svc");
    assert_eq!(istiod.token_file, None);
}

#[test]
fn the_transparent_mark_must_differ_from_the_proxy_mark() {
    let message = refused(&["--proxy-mark", "0x600", "--transparent-mark", "0x600"]);
    assert!(
        message.contains("--transparent-mark 0x600") && message.contains("--proxy-mark 0x600"),
        "{message}"
    );
    let config = config(&["--original-source", "off", "--transparent-mark", "0"])
        .expect("off ignores the mark");
    assert_eq!(config.original_source.kernel_mark(), 0);
}

#[test]
fn kube_needs_the_node_and_valid_selectors() {
    let message = refused(&["--kube"]);
    assert!(
        message.contains("--kube needs") && message.contains("--node"),
        "{message}"
    );
    let config = config(&["--kube", "--node", "node-a"]).expect("--kube --node is accepted");
    let kube = config
        .kube
        .expect("--kube gives a Kubernetes configuration");
    assert_eq!(kube.node, "node-a");
    assert_eq!(kube.exclude_namespaces, ["kube-system"]);
    // clap checks the selectors it parses; a rule that does not compile is
    // refused here as well.
    let mut args = run_args(&["--kube", "--node", "node-a"]);
    let bad = crate::kube::optin::parse_selectors(
        r#"[{"podSelector": {"matchExpressions": [{"key": "k", "operator": "Near"}]}}]"#,
    )
    .expect("the selector list parses");
    args.enablement_selectors = Some(crate::kube::optin::EnablementSelectors(bad));
    let message = match args.into_config_with([]) {
        Ok(_) => panic!("an invalid selector was accepted"),
        Err(err) => err.to_string(),
    };
    assert!(message.starts_with("--enablement-selectors: "), "{message}");
}

#[test]
fn the_config_serializes_for_the_dump() {
    let config = config(&["--instance", "n1", "--fail-open"]).expect("accepted");
    let json = serde_json::to_value(&config).expect("the config serializes");
    assert_eq!(json["state"]["instance"], "n1");
    assert_eq!(json["redirect"]["failOpen"], true);
    assert_eq!(json["redirect"]["onExit"], "keep");
    assert_eq!(json["capture"], "ebpf");
    assert_eq!(json["engine"]["mode"], "builtin");
    assert_eq!(json["certs"]["source"], "builtin");
}

#[test]
fn http2_and_pool_knobs_default_to_ztunnels_and_are_checked() {
    use crate::hbone::wire::H2Settings;
    let defaults = config(&[]).expect("the defaults are accepted");
    assert_eq!(defaults.mesh.h2, H2Settings::default());
    assert_eq!(defaults.mesh.h2.stream_window, 4 * 1024 * 1024);
    assert_eq!(defaults.mesh.h2.connection_window, 16 * 1024 * 1024);
    assert_eq!(defaults.mesh.h2.max_frame, 1024 * 1024);
    assert_eq!(defaults.mesh.pool_spread.max_streams, 100);
    assert_eq!(
        defaults.mesh.pool_idle_timeout,
        std::time::Duration::from_secs(60)
    );
    let tuned = config(&[
        "--http2-stream-window-size",
        "1048576",
        "--http2-connection-window-size",
        "2097152",
        "--http2-frame-size",
        "16384",
        "--hbone-pool-max-streams-per-connection",
        "7",
        "--hbone-pool-idle-timeout",
        "5m",
    ])
    .expect("tuned values are accepted");
    assert_eq!(
        tuned.mesh.h2,
        H2Settings {
            stream_window: 1 << 20,
            connection_window: 2 << 20,
            max_frame: 16384,
        }
    );
    assert_eq!(tuned.mesh.pool_spread.max_streams, 7);
    assert_eq!(
        tuned.mesh.pool_idle_timeout,
        std::time::Duration::from_secs(300)
    );
    // The dump carries them.
    let dump = serde_json::to_value(&tuned.mesh).expect("the mesh config serializes");
    assert_eq!(dump["h2"]["maxFrame"], 16384);
    assert_eq!(dump["poolSpread"]["maxStreams"], 7);
    // A connection window below the stream window is refused by name.
    let message = refused(&[
        "--http2-stream-window-size",
        "1048576",
        "--http2-connection-window-size",
        "65535",
    ]);
    assert!(
        message.contains("--http2-connection-window-size")
            && message.contains("--http2-stream-window-size"),
        "{message}"
    );
    // Values HTTP/2 does not allow never reach the config (clap, exit 2).
    for (flag, value) in [
        ("--http2-frame-size", "16383"),
        ("--http2-frame-size", "16777216"),
        ("--http2-stream-window-size", "2147483648"),
        ("--http2-connection-window-size", "0"),
        ("--hbone-pool-max-streams-per-connection", "0"),
        ("--hbone-pool-idle-timeout", "0s"),
    ] {
        let parsed = Cli::try_parse_from(["dataplane", "run", flag, value]);
        match parsed {
            Ok(_) => panic!("{flag} {value} was accepted"),
            Err(e) => {
                assert_eq!(e.exit_code(), 2, "{flag} {value}");
                assert!(e.to_string().contains(flag), "{flag} {value}: {e}");
            }
        }
    }
}

#[test]
fn the_ca_may_be_another_server_than_istiod() {
    let ca_of = |flags: &[&str]| match config(flags) {
        Ok(AgentConfig {
            certs: CertsConfig::Istio { ca, mesh_roots },
            istiod,
            ..
        }) => (ca, mesh_roots, istiod),
        other => panic!("{flags:?}: expected Istio's CA, got {other:?}"),
    };
    let istiod = "istiod.istio-system.svc:15012";
    let mesh_root = PathBuf::from("/var/run/secrets/istio/root-cert.pem");
    // By default the CA is istiod, as ztunnel's CA_ADDRESS defaults.
    let (ca, roots, xds) = ca_of(&["--cert-source", "istio", "--istiod-address", istiod]);
    assert_eq!(ca.address, istiod);
    assert_eq!(ca.server_name, "istiod.istio-system.svc");
    assert_eq!((&ca.root_cert, &roots), (&mesh_root, &mesh_root));
    assert!(xds.is_some());
    // istio-csr alone: no istiod address is needed.
    let csr = "cert-manager-istio-csr.cert-manager.svc:443";
    let (ca, roots, xds) = ca_of(&["--cert-source", "istio", "--ca-address", csr]);
    assert_eq!(ca.address, csr);
    assert_eq!(ca.server_name, "cert-manager-istio-csr.cert-manager.svc");
    assert_eq!(roots, mesh_root);
    assert!(xds.is_none(), "nothing asks istiod");
    // xDS from istiod, certificates from the CA, each with its own name
    // and root; the mesh's roots stay istiod's file.
    let (ca, roots, xds) = ca_of(&[
        "--xds",
        "--pod-name",
        "dataplane-abc",
        "--instance-ip",
        "10.0.0.7",
        "--node",
        "node-a",
        "--cert-source",
        "istio",
        "--istiod-address",
        istiod,
        "--ca-address",
        csr,
        "--ca-server-name",
        "istio-csr.example",
        "--ca-server-root-cert",
        "/etc/csr/ca.pem",
    ]);
    assert_eq!(ca.address, csr);
    assert_eq!(ca.server_name, "istio-csr.example");
    assert_eq!(ca.root_cert, PathBuf::from("/etc/csr/ca.pem"));
    assert_eq!(roots, mesh_root);
    assert_eq!(xds.map(|x| x.address).as_deref(), Some(istiod));
    // Refusals name the flag.
    for (flags, named) in [
        (&["--ca-address", csr][..], "--ca-address"),
        (&["--ca-server-name", "x"][..], "--ca-server-name"),
        (
            &["--ca-server-root-cert", "/x.pem"][..],
            "--ca-server-root-cert",
        ),
        (
            &["--cert-source", "istio", "--ca-address", "csr"][..],
            "--ca-address `csr`",
        ),
        (&["--cert-source", "istio"][..], "--ca-address"),
        (&["--mesh-root-cert", "/x.pem"][..], "--mesh-root-cert"),
    ] {
        let message = refused(flags);
        assert!(message.contains(named), "{flags:?}: {message}");
    }
    // The system's roots for istiod's TLS (ztunnel's XDS_ROOT_CA=SYSTEM):
    // the CA's TLS follows them, the mesh's roots must be given.
    let system = ["--cert-source", "istio", "--istiod-address", istiod];
    let system = [&system[..], &["--istiod-root-cert", "SYSTEM"]].concat();
    let message = refused(&system);
    assert!(
        message.contains("--mesh-root-cert") && message.contains("SYSTEM"),
        "{message}"
    );
    let (ca, roots, xds) =
        ca_of(&[&system[..], &["--mesh-root-cert", "/etc/mesh/root.pem"]].concat());
    assert_eq!(ca.root_cert, PathBuf::from("SYSTEM"));
    assert_eq!(roots, PathBuf::from("/etc/mesh/root.pem"));
    assert_eq!(xds.map(|x| x.root_cert), Some(PathBuf::from("SYSTEM")));
}

#[test]
fn xds_and_ca_headers_come_from_ztunnels_environment_names() {
    let flags = [
        "dataplane",
        "run",
        "--xds",
        "--istiod-address",
        "istiod.istio-system.svc:15012",
        "--pod-name",
        "dataplane-abc",
        "--instance-ip",
        "10.0.0.7",
        "--node",
        "node-a",
        "--cert-source",
        "istio",
        "--ca-address",
        "istio-csr.cert-manager.svc:443",
    ];
    let parse = |env: &[(&str, &str)]| {
        let args = match Cli::try_parse_from(flags) {
            Ok(Cli {
                command: Command::Run(args),
            }) => *args,
            other => panic!("{other:?}"),
        };
        args.into_config_with(env.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())))
    };
    let config = parse(&[
        ("XDS_HEADER_X_TENANT", "blue"),
        ("CA_HEADER_X-Route", "csr"),
        ("CA_HEADER_A", "first"),
        ("PATH", "/bin"),
    ])
    .expect("valid headers are accepted");
    let istiod = config.istiod.expect("--xds asks istiod");
    assert_eq!(istiod.headers, [("x_tenant".to_owned(), "blue".to_owned())]);
    let CertsConfig::Istio { ca, .. } = config.certs else {
        panic!("expected Istio's CA");
    };
    assert_eq!(
        ca.headers,
        [
            ("a".to_owned(), "first".to_owned()),
            ("x-route".to_owned(), "csr".to_owned()),
        ]
    );
    // The dump names them and hides the values.
    let dump = serde_json::to_value(&ca).expect("serializes");
    assert_eq!(dump["headers"], serde_json::json!(["a", "x-route"]));
    // A name or value gRPC cannot carry is refused, naming the variable.
    for (variable, value) in [
        ("XDS_HEADER_bad name", "x"),
        ("CA_HEADER_x-bin", "x"),
        ("CA_HEADER_X", "new\nline"),
    ] {
        let message = match parse(&[(variable, value)]) {
            Ok(_) => panic!("{variable}={value:?} was accepted"),
            Err(err) => err.to_string(),
        };
        assert!(message.contains(variable), "{message}");
    }
}

#[test]
fn tls_compliance_flags_make_the_policy_and_unknown_policies_are_refused() {
    let default = config(&[]).expect("the defaults are accepted");
    assert_eq!(default.mesh.tls, crate::tls::TlsPolicy::default());
    assert_eq!(default.mesh.crl_path, None);
    let set = config(&[
        "--compliance-policy",
        "pqc",
        "--tls12",
        "--crl-path",
        "/etc/crl.pem",
    ])
    .expect("pqc, TLS 1.2 and a CRL");
    assert!(set.mesh.tls.post_quantum_only && set.mesh.tls.tls12);
    assert_eq!(set.mesh.crl_path, Some(PathBuf::from("/etc/crl.pem")));
    let empty = config(&["--compliance-policy", ""]).expect("an empty policy is the default");
    assert_eq!(empty.mesh.tls, crate::tls::TlsPolicy::default());
    for (value, why) in [
        ("fips-140-2", "no FIPS-validated crypto provider"),
        ("fips-140-3", "no FIPS-validated crypto provider"),
        ("quantum", "unknown policy"),
    ] {
        let err = refused(&["--compliance-policy", value]);
        assert!(
            err.contains("--compliance-policy (COMPLIANCE_POLICY)") && err.contains(why),
            "{err}"
        );
    }
}

#[test]
fn the_access_log_sample_is_a_fraction() {
    let sample = |flags: &[&str]| config(flags).map(|c| c.access_log_sample).ok();
    assert_eq!(sample(&[]), Some(1.0));
    assert_eq!(sample(&["--access-log-sample", "0.25"]), Some(0.25));
    assert_eq!(sample(&["--access-log-sample", "0"]), Some(0.0));
    for bad in ["1.5", "-0.1", "NaN", "half"] {
        let flag = format!("--access-log-sample={bad}");
        let argv = ["dataplane", "run", flag.as_str()];
        let err = Cli::try_parse_from(argv).err().map(|e| e.to_string());
        assert!(
            err.as_deref().is_some_and(|e| e.contains(bad)),
            "{bad} was accepted or the error does not name it: {err:?}"
        );
    }
}

#[test]
fn ipv6_off_binds_ipv4_wildcards_by_default_and_keeps_the_operators_addresses() {
    let endpoints = |flags: &[&str]| {
        let config = config(flags).expect("accepted");
        (
            config.ipv6_enabled,
            config.endpoints.readiness.to_string(),
            config.endpoints.metrics.to_string(),
        )
    };
    // ztunnel's IPV6_ENABLED defaults to true: dual-stack wildcards.
    assert_eq!(
        endpoints(&[]),
        (true, "[::]:15021".into(), "[::]:15020".into())
    );
    assert_eq!(
        endpoints(&["--ipv6-enabled"]),
        (true, "[::]:15021".into(), "[::]:15020".into())
    );
    assert_eq!(
        endpoints(&["--ipv6-enabled", "false"]),
        (false, "0.0.0.0:15021".into(), "0.0.0.0:15020".into())
    );
    // An address the operator gave stays as given, whatever the switch.
    assert_eq!(
        endpoints(&[
            "--ipv6-enabled=false",
            "--readiness-addr",
            "[::1]:9021",
            "--metrics-addr",
            "10.0.0.1:9020",
        ]),
        (false, "[::1]:9021".into(), "10.0.0.1:9020".into())
    );
    assert_eq!(
        endpoints(&["--metrics-addr", "127.0.0.1:9020"]),
        (true, "[::]:15021".into(), "127.0.0.1:9020".into())
    );
}

#[test]
fn ipv6_enabled_takes_true_or_false_and_refuses_anything_else() {
    for bad in ["no", "0", "yes"] {
        let flag = format!("--ipv6-enabled={bad}");
        match Cli::try_parse_from(["dataplane", "run", flag.as_str()]) {
            Ok(_) => panic!("{flag} was accepted"),
            Err(e) => {
                assert_eq!(e.exit_code(), 2, "{flag}");
                let message = e.to_string();
                assert!(
                    message.contains("--ipv6-enabled")
                        && message.contains("[possible values: true, false]"),
                    "{flag}: {message}"
                );
            }
        }
    }
}

#[test]
fn the_spiffe_source_needs_its_socket() {
    let message = refused(&["--cert-source", "spiffe"]);
    assert!(
        message.contains("needs --spiffe-endpoint-socket"),
        "{message}"
    );
    let socket = "unix:///run/spire/sockets/agent.sock";
    let spiffe = config(&[
        "--cert-source",
        "spiffe",
        "--spiffe-endpoint-socket",
        socket,
    ])
    .expect("the spiffe source with its socket is accepted");
    match spiffe.certs {
        CertsConfig::Spiffe { endpoint } => assert_eq!(endpoint, socket),
        other => panic!("expected the SPIFFE source, got {other:?}"),
    }
    // Ignored by the other sources (the variable may be set for others).
    let builtin =
        config(&["--spiffe-endpoint-socket", socket]).expect("accepted with the built-in CA");
    assert!(matches!(builtin.certs, CertsConfig::Builtin { .. }));
}
