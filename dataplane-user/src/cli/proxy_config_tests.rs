//! The mesh config and `PROXY_CONFIG` as ztunnel's `config_from_proxyconfig`
//! test (`src/config.rs`) checks them: file only, variable only, both, and
//! the agent's flags over all; from files this test writes and an
//! explicit environment, never the process's.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use clap::Parser as _;

use super::*;
use crate::agent::config::AgentConfig;
use crate::cli::{Cli, Command, RunArgs, run::FlagError};

/// A mesh config like ztunnel's `test_helpers/mesh_config.yaml`, with
/// fields the agent ignores around the ones it reads.
const MESH_CONFIG: &str = "\
accessLogFile: /dev/stdout
defaultConfig:
  discoveryAddress: istiod.istio-system.svc:15012
  proxyAdminPort: 15099
  statsPort: 15888
  concurrency: 3
  tracing:
    zipkin:
      address: zipkin.istio-system:9411
  proxyMetadata:
    ISTIO_META_FOO: foo
    FOOBAR: foobar
enableTracing: true
";

/// ztunnel's `PROXY_CONFIG` of the same test, as JSON.
const PROXY_CONFIG: &str = r#"{
    "discoveryAddress": "istiod-rev0.istio-system-2:15012",
    "proxyAdminPort": 15999,
    "proxyMetadata": {
        "ISTIO_META_BAR": "bar",
        "ISTIO_META_FOOBAR": "foobar-overwritten",
        "NO_PREFIX": "no-prefix"
    }
}"#;

/// A directory of mesh config files, removed when dropped.
struct Files(PathBuf);

impl Files {
    fn new(test: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("dp-mesh-{test}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }

    /// The path of a file `name` holding `text`.
    fn file(&self, name: &str, text: &str) -> String {
        let path = self.0.join(name);
        std::fs::write(&path, text).unwrap();
        path.display().to_string()
    }

    fn path(&self, name: &str) -> String {
        self.0.join(name).display().to_string()
    }
}

impl Drop for Files {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The environment ztunnel's test sets.
fn env() -> Vec<(String, String)> {
    [
        ("ISTIO_META_INCLUDE_THIS", "foobar-env"),
        ("NOT_INCLUDE", "not-include"),
        ("ISTIO_META_CLUSTER_ID", "test-cluster"),
    ]
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .to_vec()
}

/// Flags that make the agent ask istiod for xDS, less its address.
const XDS: [&str; 9] = [
    "--xds",
    "--instance-ip",
    "10.0.0.7",
    "--pod-name",
    "dp-0",
    "--node",
    "node-a",
    "--istiod-token",
    "none",
];

/// `dataplane run` with the xDS flags and `flags`, resolved with `env`.
fn resolve(flags: &[&str], env: Vec<(String, String)>) -> Result<AgentConfig, FlagError> {
    let argv = [&["dataplane", "run"], &XDS[..], flags].concat();
    let args: RunArgs = match Cli::try_parse_from(&argv) {
        Ok(Cli {
            command: Command::Run(args),
        }) => *args,
        Ok(_) => panic!("`{}` parsed as another command", argv.join(" ")),
        Err(e) => panic!("`{}` does not parse: {e}", argv.join(" ")),
    };
    args.into_config_with(env)
}

/// What the proxy config decides, as `(istiod, admin, metrics, threads)`.
fn knobs(config: &AgentConfig) -> (String, String, String, Option<u16>) {
    (
        config.istiod.as_ref().unwrap().address.clone(),
        config.endpoints.admin.to_string(),
        config.endpoints.metrics.to_string(),
        config.workers.threads,
    )
}

/// The xDS node metadata the agent sends.
fn metadata(config: &AgentConfig) -> BTreeMap<String, String> {
    config.xds.as_ref().unwrap().extra.clone()
}

fn map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

#[test]
fn the_mesh_config_alone_gives_the_defaults() {
    let files = Files::new("file-only");
    let mesh = files.file("mesh", MESH_CONFIG);
    let config = resolve(&["--mesh-config", &mesh], Vec::new()).unwrap();
    assert_eq!(
        knobs(&config),
        (
            "istiod.istio-system.svc:15012".into(),
            "127.0.0.1:15099".into(),
            "[::]:15888".into(),
            Some(3)
        )
    );
    assert_eq!(
        metadata(&config),
        map(&[
            ("DNS_CAPTURE", "true"),
            ("DNS_PROXY_ADDR", "localhost:15053"),
            ("FOO", "foo"),
            ("FOOBAR", "foobar"),
        ])
    );
    // The readiness port is not in ProxyConfig.
    assert_eq!(config.endpoints.readiness.port(), 15021);
}

#[test]
fn proxy_config_alone_gives_the_defaults_and_istio_meta_variables_join_it() {
    let files = Files::new("env-only");
    let empty = files.file("mesh", "");
    let config = resolve(
        &["--mesh-config", &empty, "--proxy-config", PROXY_CONFIG],
        env(),
    )
    .unwrap();
    assert_eq!(
        knobs(&config),
        (
            "istiod-rev0.istio-system-2:15012".into(),
            "127.0.0.1:15999".into(),
            "[::]:15020".into(),
            None
        )
    );
    assert_eq!(
        metadata(&config),
        map(&[
            ("BAR", "bar"),
            ("CLUSTER_ID", "test-cluster"),
            ("DNS_CAPTURE", "true"),
            ("DNS_PROXY_ADDR", "localhost:15053"),
            ("FOOBAR", "foobar-overwritten"),
            ("INCLUDE_THIS", "foobar-env"),
            ("NO_PREFIX", "no-prefix"),
        ])
    );
}

#[test]
fn proxy_config_wins_over_the_mesh_config_field_by_field() {
    let files = Files::new("both");
    let mesh = files.file("mesh", MESH_CONFIG);
    let env_over = [env(), vec![("ISTIO_META_BAR".into(), "bar-env".into())]].concat();
    let config = resolve(
        &["--mesh-config", &mesh, "--proxy-config", PROXY_CONFIG],
        env_over,
    )
    .unwrap();
    // The variable's address and admin port; the file's stats port and
    // concurrency, which the variable leaves out.
    assert_eq!(
        knobs(&config),
        (
            "istiod-rev0.istio-system-2:15012".into(),
            "127.0.0.1:15999".into(),
            "[::]:15888".into(),
            Some(3)
        )
    );
    // Metadata merges key by key; an `ISTIO_META_*` variable wins last.
    assert_eq!(
        metadata(&config),
        map(&[
            ("BAR", "bar-env"),
            ("CLUSTER_ID", "test-cluster"),
            ("DNS_CAPTURE", "true"),
            ("DNS_PROXY_ADDR", "localhost:15053"),
            ("FOO", "foo"),
            ("FOOBAR", "foobar-overwritten"),
            ("INCLUDE_THIS", "foobar-env"),
            ("NO_PREFIX", "no-prefix"),
        ])
    );
}

#[test]
fn the_agents_flags_win_over_both() {
    let files = Files::new("flags");
    let mesh = files.file("mesh", MESH_CONFIG);
    let config = resolve(
        &[
            "--mesh-config",
            &mesh,
            "--proxy-config",
            "statsPort: 16020\nconcurrency: 5",
            "--istiod-address",
            "istiod.other.svc:15012",
            "--admin-addr",
            "127.0.0.1:9000",
            "--metrics-addr",
            "127.0.0.1:9020",
            "--worker-threads",
            "2",
        ],
        Vec::new(),
    )
    .unwrap();
    assert_eq!(
        knobs(&config),
        (
            "istiod.other.svc:15012".into(),
            "127.0.0.1:9000".into(),
            "127.0.0.1:9020".into(),
            Some(2)
        )
    );
}

#[test]
fn empty_proxy_config_is_none_and_concurrency_0_is_one_thread_per_cpu() {
    let files = Files::new("empty");
    let mesh = files.file(
        "mesh",
        "defaultConfig:\n  discoveryAddress: https://istiod.istio-system.svc:15012\n  concurrency: 0\n",
    );
    for empty in ["", "  "] {
        let config = resolve(
            &["--mesh-config", &mesh, "--proxy-config", empty],
            Vec::new(),
        )
        .unwrap();
        // ztunnel's `validate_uri` adds `https://`; --istiod-address is
        // the host:port alone.
        assert_eq!(
            knobs(&config),
            (
                "istiod.istio-system.svc:15012".into(),
                "127.0.0.1:15000".into(),
                "[::]:15020".into(),
                None
            )
        );
    }
}

#[test]
fn a_missing_file_is_fine_only_at_the_default_path() {
    let files = Files::new("missing");
    let missing = files.path("absent");
    assert!(
        read_mesh_config(Path::new(&missing), false)
            .unwrap()
            .is_none()
    );
    let message = resolve(&["--mesh-config", &missing], Vec::new())
        .unwrap_err()
        .to_string();
    assert!(
        message.contains(&format!("mesh config {missing}")) && message.contains("--mesh-config"),
        "{message}"
    );
    // A directory is unreadable as a file, named or not.
    let message = read_mesh_config(&files.0, false).unwrap_err().to_string();
    assert!(message.contains("mesh config"), "{message}");
}

#[test]
fn malformed_input_names_its_source_and_field() {
    let files = Files::new("malformed");
    let bad_file = files.file("mesh", "defaultConfig:\n  statsPort: lots\n");
    let good_file = files.file("good", MESH_CONFIG);
    for (flags, names) in [
        (
            vec!["--mesh-config", &bad_file],
            vec![format!("mesh config {bad_file}"), "statsPort".into()],
        ),
        (
            vec![
                "--mesh-config",
                &good_file,
                "--proxy-config",
                "proxyAdminPort: 70000",
            ],
            vec!["PROXY_CONFIG".into(), "proxyAdminPort".into()],
        ),
        (
            vec!["--mesh-config", &good_file, "--proxy-config", "{not json"],
            vec!["PROXY_CONFIG".into()],
        ),
        (
            vec![
                "--mesh-config",
                &good_file,
                "--proxy-config",
                "discoveryAddress: http://istiod:15010",
            ],
            vec!["PROXY_CONFIG".into(), "discoveryAddress".into()],
        ),
        (
            vec![
                "--mesh-config",
                &good_file,
                "--proxy-config",
                "concurrency: 5000",
            ],
            vec!["PROXY_CONFIG".into(), "concurrency".into()],
        ),
    ] {
        let message = resolve(&flags, Vec::new()).unwrap_err().to_string();
        for name in names {
            assert!(message.contains(&name), "{flags:?}: {message}");
        }
    }
}

/// The outbound traffic policy `flags` resolve to (istiod's address
/// given, for files without one).
fn outbound(flags: &[&str]) -> OutboundTrafficPolicy {
    let flags = [flags, &["--istiod-address", "istiod.test.svc:15012"]].concat();
    resolve(&flags, Vec::new())
        .unwrap()
        .mesh
        .outbound_traffic_policy
}

#[test]
fn the_outbound_traffic_policy_is_the_flags_else_the_mesh_configs_else_allow_any() {
    use OutboundTrafficPolicy::{AllowAny, RegistryOnly};
    let files = Files::new("outbound");
    // Istio's default (`DefaultMeshConfig`): no policy, an empty one, or
    // a null mode.
    for (name, text) in [
        ("none", MESH_CONFIG),
        ("empty", "outboundTrafficPolicy: {}\n"),
        ("null", "outboundTrafficPolicy:\n  mode: null\n"),
    ] {
        let mesh = files.file(name, text);
        assert_eq!(outbound(&["--mesh-config", &mesh]), AllowAny, "{text}");
    }
    let empty = files.file("blank", "");
    assert_eq!(outbound(&["--mesh-config", &empty]), AllowAny);
    // By name and by protobuf number (REGISTRY_ONLY = 0, ALLOW_ANY = 1,
    // ALLOW_ANY_DYNAMIC_DNS = 3); the last lets unknown destinations through.
    for (mode, expected) in [
        ("REGISTRY_ONLY", RegistryOnly),
        ("ALLOW_ANY", AllowAny),
        ("ALLOW_ANY_DYNAMIC_DNS", AllowAny),
        ("0", RegistryOnly),
        ("1", AllowAny),
        ("3", AllowAny),
    ] {
        let text = format!("{MESH_CONFIG}outboundTrafficPolicy:\n  mode: {mode}\n");
        let mesh = files.file(&format!("mode-{mode}"), &text);
        let config = resolve(&["--mesh-config", &mesh], Vec::new()).unwrap();
        assert_eq!(config.mesh.outbound_traffic_policy, expected, "{mode}");
        // The rest of the file is still read.
        assert_eq!(knobs(&config).0, "istiod.istio-system.svc:15012");
    }
    // The flag wins over the file, either way.
    let registry_only = files.file("ro", "outboundTrafficPolicy:\n  mode: REGISTRY_ONLY\n");
    let allow_any = files.file("aa", "outboundTrafficPolicy:\n  mode: ALLOW_ANY\n");
    for (mesh, flag, expected) in [
        (&registry_only, "allow-any", AllowAny),
        (&allow_any, "registry-only", RegistryOnly),
        (&empty, "registry-only", RegistryOnly),
    ] {
        assert_eq!(
            outbound(&["--mesh-config", mesh, "--outbound-traffic-policy", flag]),
            expected,
            "{mesh} {flag}"
        );
    }
}

#[test]
fn an_unknown_outbound_traffic_mode_names_the_file_and_the_field() {
    let files = Files::new("outbound-bad");
    for mode in ["BLOCK", "registry_only", "2", "[ALLOW_ANY]"] {
        let mesh = files.file("mesh", &format!("outboundTrafficPolicy:\n  mode: {mode}\n"));
        let message = resolve(&["--mesh-config", &mesh], Vec::new())
            .unwrap_err()
            .to_string();
        for name in [
            format!("mesh config {mesh}"),
            "outboundTrafficPolicy.mode".to_owned(),
            "REGISTRY_ONLY".to_owned(),
        ] {
            assert!(message.contains(&name), "{mode}: {message}");
        }
        // The flag overrides the field but does not excuse a bad file.
        assert!(
            resolve(
                &[
                    "--mesh-config",
                    &mesh,
                    "--outbound-traffic-policy",
                    "allow-any"
                ],
                Vec::new()
            )
            .is_err()
        );
    }
    // A mode clap does not know is refused by the parser, naming the flag.
    let argv = [
        &["dataplane", "run"],
        &XDS[..],
        &["--outbound-traffic-policy", "block"],
    ]
    .concat();
    let message = Cli::try_parse_from(&argv).unwrap_err().to_string();
    assert!(message.contains("--outbound-traffic-policy"), "{message}");
}
