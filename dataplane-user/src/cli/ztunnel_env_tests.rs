//! ztunnel's variable names: read as ztunnel reads them, beaten by the
//! agent's flags, refused when the agent cannot honour them; from argv and
//! an explicit environment, never the process's.

use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use super::parse;
use crate::agent::config::{AgentConfig, CertsConfig, OriginalSourceMode};
use crate::cli::{Command, RunArgs, run::FlagError};

fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

/// A state directory of its own, removed on drop (pass or fail).
struct StateDir(PathBuf);

impl StateDir {
    fn new(test: &str) -> Self {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let path = std::env::temp_dir().join(format!(
            "dp-zenv-{test}-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&path).unwrap();
        Self(path)
    }

    fn flag(&self) -> &str {
        self.0.to_str().unwrap()
    }
}

impl Drop for StateDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The file's contents and permission bits.
fn written(path: &Path) -> (String, u32) {
    let mode = std::fs::metadata(path).unwrap().permissions().mode() & 0o777;
    (std::fs::read_to_string(path).unwrap(), mode)
}

/// `dataplane run <flags>` parsed with `env`, or clap's message.
fn run_args(flags: &[&str], env: &[(String, String)]) -> Result<RunArgs, String> {
    let argv = [&["dataplane", "run"], flags].concat();
    match parse(&argv, env) {
        Ok(cli) => match cli.command {
            Command::Run(args) => Ok(*args),
            _ => Err(format!("`{}` parsed as another command", argv.join(" "))),
        },
        Err(e) => Err(e.to_string()),
    }
}

/// The agent's configuration from `flags` and `env`.
fn resolved(flags: &[&str], env: &[(String, String)]) -> Result<AgentConfig, String> {
    run_args(flags, env)?
        .into_config_with(env.to_vec())
        .map_err(|e: FlagError| e.to_string())
}

/// The flags a node proxy of Istio's mesh needs beside its environment.
const MESH: &[&str] = &["--xds", "--cert-source", "istio", "--state-dir", "/tmp/dp"];

/// The environment Istio's ztunnel chart gives (istio/istio
/// `manifests/charts/ztunnel/templates/daemonset.yaml`), IPv6 off.
fn chart_env() -> Vec<(String, String)> {
    env(&[
        ("CA_ADDRESS", "istiod.istio-system.svc:15012"),
        (
            "XDS_ADDRESS",
            "https://istiod-canary.istio-system.svc:15012",
        ),
        ("ISTIO_META_CLUSTER_ID", "cluster-east"),
        ("CLUSTER_ID", "ignored-after-istio-meta"),
        ("TERMINATION_GRACE_PERIOD_SECONDS", "30"),
        ("POD_NAME", "ztunnel-x7k2p"),
        ("POD_NAMESPACE", "istio-system"),
        ("NODE_NAME", "node-a"),
        ("INSTANCE_IP", "10.0.0.7"),
        ("IPV6_ENABLED", "false"),
        ("AUTH_TOKEN", "/"),
    ])
}

#[test]
fn istios_ztunnel_chart_environment_configures_the_agent() {
    let config = resolved(MESH, &chart_env()).unwrap();
    let istiod = config.istiod.as_ref().unwrap();
    // The scheme ztunnel's `validate_uri` adds or keeps is dropped.
    assert_eq!(istiod.address, "istiod-canary.istio-system.svc:15012");
    assert_eq!(istiod.server_name, "istiod-canary.istio-system.svc");
    let CertsConfig::Istio { ca, .. } = &config.certs else {
        panic!("expected Istio's CA, got {:?}", config.certs);
    };
    assert_eq!(ca.address, "istiod.istio-system.svc:15012");
    let node = config.xds.as_ref().unwrap();
    assert_eq!(
        node.id(),
        "ztunnel~10.0.0.7~ztunnel-x7k2p.istio-system~istio-system.svc.cluster.local"
    );
    assert_eq!(node.node_name, "node-a");
    assert_eq!(node.cluster_id.as_deref(), Some("cluster-east"));
    // 30 s of grace: 25 s of drain (ztunnel keeps 5 s to end the rest).
    assert_eq!(config.mesh.drain_timeout, Duration::from_secs(25));
    assert!(!config.ipv6_enabled);
    assert_eq!(config.endpoints.metrics.to_string(), "0.0.0.0:15020");
}

#[test]
fn the_agents_own_flags_win_over_ztunnels_names() {
    let config = resolved(
        &[
            MESH,
            &[
                "--istiod-address",
                "istiod.flag:15012",
                "--ipv6-enabled",
                "--drain-timeout",
                "7s",
                "--cluster-id",
                "from-flag",
            ],
        ]
        .concat(),
        &chart_env(),
    )
    .unwrap();
    assert_eq!(config.istiod.as_ref().unwrap().address, "istiod.flag:15012");
    assert!(config.ipv6_enabled);
    assert_eq!(config.mesh.drain_timeout, Duration::from_secs(7));
    assert_eq!(
        config.xds.as_ref().unwrap().cluster_id.as_deref(),
        Some("from-flag")
    );
}

#[test]
fn knobs_read_as_ztunnel_reads_them() {
    let knobs = env(&[
        ("HTTP2_STREAM_WINDOW_SIZE", "1048576"),
        ("HTTP2_CONNECTION_WINDOW_SIZE", "8388608"),
        ("HTTP2_FRAME_SIZE", "65536"),
        ("POOL_MAX_STREAMS_PER_CONNECTION", "20"),
        ("POOL_UNUSED_RELEASE_TIMEOUT", "5m"),
        ("KEEPALIVE_TIME", "30"),
        ("KEEPALIVE_INTERVAL", "15s"),
        ("KEEPALIVE_RETRIES", "4"),
        ("SECRET_TTL", "12h"),
        ("CONNECTION_TERMINATION_DEADLINE", "9s"),
        ("TERMINATION_GRACE_PERIOD_SECONDS", "30"),
        ("ZTUNNEL_WORKER_THREADS", "50%"),
        ("ZTUNNEL_RESOURCE_CPU_LIMIT", "2500m"),
        ("ENABLE_ORIG_SRC", "false"),
        ("LOCALHOST_APP_TUNNEL", "false"),
        ("PACKET_MARK", "4242"),
        ("CLUSTER_DOMAIN", "corp.example"),
        ("ALT_XDS_HOSTNAME", "istiod.alt"),
        ("XDS_ROOT_CA", "SYSTEM"),
    ]);
    let config = resolved(&["--state-dir", "/tmp/dp"], &knobs).unwrap();
    let mesh = &config.mesh;
    assert_eq!(
        (
            mesh.h2.stream_window,
            mesh.h2.connection_window,
            mesh.h2.max_frame
        ),
        (1 << 20, 8 << 20, 1 << 16)
    );
    assert_eq!(mesh.pool_spread.max_streams, 20);
    assert_eq!(mesh.pool_idle_timeout, Duration::from_secs(300));
    let keepalive = mesh.keepalive.as_ref().unwrap();
    assert_eq!(
        (keepalive.time, keepalive.interval, keepalive.retries),
        (Duration::from_secs(30), Duration::from_secs(15), 4)
    );
    assert_eq!(mesh.cert_lifetime, Duration::from_secs(12 * 3600));
    // The deadline wins over the grace period.
    assert_eq!(mesh.drain_timeout, Duration::from_secs(9));
    // 50 % of 2.5 CPUs rounded up to 3: 2 threads.
    assert_eq!(config.workers.threads, Some(2));
    assert_eq!(config.original_source.mode, OriginalSourceMode::Off);
    assert!(!mesh.localhost_app_tunnel);
    assert_eq!(config.redirect.proxy_mark, 4242);
    assert_eq!(config.dns.domain, "corp.example");

    // KEEPALIVE_ENABLED=false; a short grace period keeps 1 s; 0 worker
    // threads is one per CPU (ZTUNNEL_CPU_LIMIT's).
    let config = resolved(
        &["--state-dir", "/tmp/dp"],
        &env(&[
            ("KEEPALIVE_ENABLED", "false"),
            ("TERMINATION_GRACE_PERIOD_SECONDS", "5"),
            ("ZTUNNEL_WORKER_THREADS", "0"),
            ("ZTUNNEL_CPU_LIMIT", "6"),
        ]),
    )
    .unwrap();
    assert!(config.mesh.keepalive.is_none());
    // Unset, as ztunnel's `parse_default(LOCALHOST_APP_TUNNEL, true)`.
    assert!(config.mesh.localhost_app_tunnel);
    assert_eq!(config.mesh.drain_timeout, Duration::from_secs(4));
    assert_eq!(config.workers.threads, Some(6));
}

#[test]
fn the_istio_cas_names_apply_only_with_istios_ca() {
    // With the built-in CA, ztunnel's CA settings are none of the agent's
    // (as ztunnel ignores them with `FAKE_CA`): no refusal, no CA client.
    let config = resolved(
        &["--state-dir", "/tmp/dp"],
        &env(&[
            ("CA_ADDRESS", "istiod.istio-system.svc:15012"),
            ("CA_ROOT_CA", "/nonexistent/ca-root.pem"),
            ("ALT_CA_HOSTNAME", "ca.alt"),
        ]),
    )
    .unwrap();
    assert!(matches!(config.certs, CertsConfig::Builtin { .. }));
    // A path that exists is the file, as ztunnel's `RootCert::File`.
    let state = StateDir::new("ca-root");
    let csr_root = state.0.join("csr-root.pem");
    std::fs::write(&csr_root, "mounted").unwrap();
    let config = resolved(
        &["--cert-source", "istio", "--state-dir", state.flag()],
        &env(&[
            ("CA_ADDRESS", "https://istio-csr.cert-manager.svc:443/"),
            ("CA_ROOT_CA", csr_root.to_str().unwrap()),
            ("ALT_CA_HOSTNAME", "ca.alt"),
        ]),
    )
    .unwrap();
    let CertsConfig::Istio { ca, .. } = &config.certs else {
        panic!("expected Istio's CA, got {:?}", config.certs);
    };
    assert_eq!(ca.address, "istio-csr.cert-manager.svc:443");
    assert_eq!(ca.server_name, "ca.alt");
    assert_eq!(ca.root_cert, csr_root);
}

#[test]
fn values_ztunnel_refuses_or_the_agent_cannot_honour_are_refused_by_name() {
    for (variable, value, says) in [
        // Rust's `bool::from_str`, as ztunnel's `parse::<bool>`.
        ("IPV6_ENABLED", "True", "lowercase"),
        ("XDS_ADDRESS", "http://istiod:15010", "https://"),
        // Neither a file, SYSTEM nor a PEM certificate (ztunnel fails on
        // it later, loading the roots).
        ("XDS_ROOT_CA", "/nonexistent/root.pem", "not SYSTEM or PEM"),
        (
            "XDS_ROOT_CA",
            "-----BEGIN CERTIFICATE-----",
            "not SYSTEM or PEM",
        ),
        // No file, and no header value (ztunnel fails sending it).
        ("AUTH_TOKEN", "two\nlines", "HTTP header"),
        ("ZTUNNEL_WORKER_THREADS", "150%", "between 0 and 100"),
        ("POOL_UNUSED_RELEASE_TIMEOUT", "soon", "not a duration"),
        ("HTTP2_FRAME_SIZE", "1M", "whole number"),
    ] {
        let error = run_args(&[], &env(&[(variable, value)])).unwrap_err();
        assert!(
            error.contains(variable) && error.contains(says),
            "{variable}={value}: {error}"
        );
    }
}

#[test]
fn dns_capture_follows_the_proxy_metadata_as_ztunnel_does() {
    let flags = |extra: &[&str]| {
        [
            &[
                "--xds",
                "--istiod-address",
                "istiod:15012",
                "--pod-name",
                "p",
                "--instance-ip",
                "10.0.0.7",
                "--node",
                "n",
                "--state-dir",
                "/tmp/dp",
            ][..],
            extra,
        ]
        .concat()
        .iter()
        .map(|s| (*s).to_owned())
        .collect::<Vec<String>>()
    };
    let resolve = |extra: &[&str], env: Vec<(String, String)>| {
        let argv = flags(extra);
        let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
        resolved(&argv, &env).unwrap()
    };
    // ztunnel's `dns_proxy`: the metadata's DNS_CAPTURE, `true` in any
    // case; the metadata sent says what the agent does.
    for (value, on) in [("False", false), ("TRUE", true), ("no", false)] {
        let config = resolve(&[], env(&[("ISTIO_META_DNS_CAPTURE", value)]));
        assert_eq!(config.dns.default_capture, on, "DNS_CAPTURE={value}");
        let sent = &config.xds.as_ref().unwrap().extra;
        assert_eq!(sent["DNS_CAPTURE"], on.to_string());
        assert_eq!(sent["DNS_PROXY_ADDR"], "localhost:15053");
    }
    // The agent's flag wins, and the metadata says so.
    let config = resolve(
        &["--dns-capture"],
        env(&[("ISTIO_META_DNS_CAPTURE", "false")]),
    );
    assert!(config.dns.default_capture);
    assert_eq!(config.xds.as_ref().unwrap().extra["DNS_CAPTURE"], "true");
    // Unset: on.
    assert!(resolve(&[], Vec::new()).dns.default_capture);
}

#[test]
fn every_ztunnel_name_maps_onto_a_flag_of_run() {
    use clap::CommandFactory as _;
    let command = crate::cli::Cli::command();
    let run = command.find_subcommand("run").unwrap();
    for setting in super::SETTINGS {
        let arg = run
            .get_arguments()
            .find(|arg| arg.get_id() == setting.id)
            .unwrap_or_else(|| panic!("{:?}: no argument {}", setting.variables, setting.id));
        assert_eq!(
            arg.get_long().map(|long| format!("--{long}")).as_deref(),
            Some(setting.flag),
            "{:?}",
            setting.variables
        );
    }
}

#[test]
fn inline_pem_roots_become_files_under_the_state_dir() {
    let state = StateDir::new("pem");
    let pem = dataplane_identity::test_util::TestCa::new()
        .ca
        .root_pem()
        .to_owned();
    let config = resolved(
        &[
            "--xds",
            "--cert-source",
            "istio",
            "--state-dir",
            state.flag(),
        ],
        &[
            chart_env(),
            env(&[("XDS_ROOT_CA", &pem), ("CA_ROOT_CA", &pem)]),
        ]
        .concat(),
    )
    .unwrap();
    let dir = state.0.join("ztunnel-env");
    let istiod_root = &config.istiod.as_ref().unwrap().root_cert;
    assert_eq!(istiod_root, &dir.join("xds-root-ca.pem"));
    assert_eq!(written(istiod_root), (pem.clone(), 0o600));
    let CertsConfig::Istio { ca, .. } = &config.certs else {
        panic!("expected Istio's CA, got {:?}", config.certs);
    };
    assert_eq!(ca.root_cert, dir.join("ca-root-ca.pem"));
    assert_eq!(written(&ca.root_cert), (pem, 0o600));
    assert_eq!(
        std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777,
        0o700
    );
    // SYSTEM stays the system roots, written nowhere.
    let state = StateDir::new("system");
    let config = resolved(
        &["--xds", "--state-dir", state.flag()],
        &[chart_env(), env(&[("XDS_ROOT_CA", "SYSTEM")])].concat(),
    )
    .unwrap();
    assert_eq!(
        config.istiod.as_ref().unwrap().root_cert,
        PathBuf::from("SYSTEM")
    );
    assert!(!state.0.join("ztunnel-env").exists());
}

#[test]
fn a_token_naming_no_file_is_the_token_itself_as_in_ztunnel() {
    let state = StateDir::new("token");
    let config = resolved(
        &["--xds", "--state-dir", state.flag()],
        // The last value of a name wins: the chart's `AUTH_TOKEN` is
        // replaced.
        &[
            chart_env(),
            env(&[("AUTH_TOKEN", "eyJhbGciOi.static.token")]),
        ]
        .concat(),
    )
    .unwrap();
    let token = config.istiod.as_ref().unwrap().token_file.clone().unwrap();
    assert_eq!(token, state.0.join("ztunnel-env/auth-token"));
    // Only the agent reads a credential.
    assert_eq!(
        written(&token),
        ("eyJhbGciOi.static.token".to_owned(), 0o600)
    );
    // A path that exists is the token file.
    let file = state.0.join("mounted-token");
    std::fs::write(&file, "t").unwrap();
    let config = resolved(
        &["--xds", "--state-dir", state.flag()],
        &[chart_env(), env(&[("AUTH_TOKEN", file.to_str().unwrap())])].concat(),
    )
    .unwrap();
    assert_eq!(config.istiod.as_ref().unwrap().token_file, Some(file));
}

#[test]
fn durations_take_ztunnels_duration_str_grammar() {
    // ztunnel's `parse_duration` is `duration_str::parse`: compound
    // terms, sums and products, units in any case, seconds by default.
    for (value, want) in [
        ("30s", Duration::from_secs(30)),
        ("500ms", Duration::from_millis(500)),
        ("1h30m", Duration::from_secs(5400)),
        ("1m31", Duration::from_secs(91)),
        ("1m+30s", Duration::from_secs(90)),
        ("1m*3", Duration::from_secs(180)),
        (" 2 min ", Duration::from_secs(120)),
        ("1H", Duration::from_secs(3600)),
        ("1d2h", Duration::from_secs(93_600)),
        ("1500000us", Duration::from_millis(1500)),
        ("45", Duration::from_secs(45)),
    ] {
        let config = resolved(
            &["--state-dir", "/tmp/dp"],
            &env(&[("POOL_UNUSED_RELEASE_TIMEOUT", value)]),
        )
        .unwrap_or_else(|e| panic!("{value:?}: {e}"));
        assert_eq!(config.mesh.pool_idle_timeout, want, "{value:?}");
    }
    for (value, says) in [
        ("1h30x", "not a duration"),
        ("1.5s", "not a duration"),
        ("-5s", "not a duration"),
        ("1m+2*3", "not a duration"),
        ("1h 30 fortnights", "not a duration"),
        // duration_str takes it; the agent's millisecond durations cannot.
        ("1500us", "finer than a millisecond"),
    ] {
        let error = run_args(&[], &env(&[("KEEPALIVE_TIME", value)])).unwrap_err();
        assert!(
            error.contains("KEEPALIVE_TIME") && error.contains(says),
            "{value:?}: {error}"
        );
    }
}

#[test]
fn a_dns_proxy_address_the_agent_cannot_serve_is_refused() {
    // ztunnel's DNS proxy listens where the proxy metadata's
    // DNS_PROXY_ADDR says; this agent's is where its kernel programs
    // steer DNS, so only that address is accepted.
    let flags = ["--xds", "--state-dir", "/tmp/dp"];
    let with = |value: &str| [chart_env(), env(&[("ISTIO_META_DNS_PROXY_ADDR", value)])].concat();
    let ok = resolved(&flags, &with("localhost:15053")).unwrap();
    assert_eq!(
        ok.xds.as_ref().unwrap().extra["DNS_PROXY_ADDR"],
        "localhost:15053"
    );
    for value in ["localhost:5353", "127.0.0.1:15053", "0.0.0.0:53"] {
        let error = resolved(&flags, &with(value)).unwrap_err();
        assert!(
            error.contains("DNS_PROXY_ADDR") && error.contains(value),
            "{value}: {error}"
        );
    }
}
