//! `deploy/` validated: the Helm chart rendered by Helm's own engine, linted,
//! its values schema exercised, every rendered object and the plain manifest
//! validated strictly against the official Kubernetes JSON schemas of
//! several Kubernetes versions (`deploy/tools/check_chart.py`); the plain
//! manifest read back as typed Kubernetes objects and checked against the
//! binaries it runs (every argument and `DATAPLANE_*` variable exists in the
//! CLI); the container build producing both binaries.

use std::{
    collections::BTreeSet,
    path::{Path, PathBuf},
    process::Command,
};

use clap::CommandFactory as _;
use dataplane_tests::cni_deploy;
use dataplane_user::cli::Cli;
use k8s_openapi::api::{
    apps::v1::DaemonSet,
    core::v1::{Container, ServiceAccount},
    rbac::v1::{ClusterRole, ClusterRoleBinding},
};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use k8s_openapi::serde::Deserialize as _;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default()
}

#[test]
fn chart_renders_lints_and_validates_against_kubernetes_schemas() -> anyhow::Result<()> {
    let python = cni_deploy::python()?;
    let out = Command::new(python)
        .arg(repo().join("deploy/tools/check_chart.py"))
        .output()?;
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "deploy checks failed:\n{report}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_str(&report)?;
    assert_eq!(report["problems"], serde_json::json!([]));
    assert_eq!(report["helm"], "v4.2.3");
    Ok(())
}

/// The plain manifest's objects, by kind.
struct Manifest {
    daemonset: DaemonSet,
    role: ClusterRole,
    binding: ClusterRoleBinding,
    account: ServiceAccount,
}

fn manifest() -> anyhow::Result<Manifest> {
    let text = std::fs::read_to_string(repo().join("deploy/kubernetes/dataplane.yaml"))?;
    let mut daemonset = None;
    let mut role = None;
    let mut binding = None;
    let mut account = None;
    for doc in serde_yaml_ng::Deserializer::from_str(&text) {
        let value = serde_yaml_ng::Value::deserialize(doc)?;
        let kind = value["kind"].as_str().unwrap_or_default().to_owned();
        match kind.as_str() {
            "DaemonSet" => daemonset = Some(serde_yaml_ng::from_value(value)?),
            "ClusterRole" => role = Some(serde_yaml_ng::from_value(value)?),
            "ClusterRoleBinding" => binding = Some(serde_yaml_ng::from_value(value)?),
            "ServiceAccount" => account = Some(serde_yaml_ng::from_value(value)?),
            "Namespace" => {}
            other => anyhow::bail!("unexpected kind {other}"),
        }
    }
    Ok(Manifest {
        daemonset: daemonset.ok_or_else(|| anyhow::anyhow!("no DaemonSet"))?,
        role: role.ok_or_else(|| anyhow::anyhow!("no ClusterRole"))?,
        binding: binding.ok_or_else(|| anyhow::anyhow!("no ClusterRoleBinding"))?,
        account: account.ok_or_else(|| anyhow::anyhow!("no ServiceAccount"))?,
    })
}

fn container<'a>(ds: &'a DaemonSet, name: &str) -> anyhow::Result<&'a Container> {
    ds.spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .and_then(|p| p.containers.iter().find(|c| c.name == name))
        .ok_or_else(|| anyhow::anyhow!("no container {name}"))
}

/// Every `DATAPLANE_*` variable the CLI reads, for `subcommand`.
fn cli_env(subcommand: &str) -> BTreeSet<String> {
    let cli = Cli::command();
    cli.get_subcommands()
        .find(|c| c.get_name() == subcommand)
        .map(|c| {
            c.get_arguments()
                .filter_map(|a| a.get_env())
                .filter_map(|e| e.to_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn manifest_matches_the_binaries_it_runs() -> anyhow::Result<()> {
    let m = manifest()?;
    let pod = m
        .daemonset
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .ok_or_else(|| anyhow::anyhow!("no pod spec"))?;
    assert_eq!(pod.host_pid, Some(true));
    assert_eq!(pod.host_network, Some(true));
    assert_eq!(
        pod.service_account_name.as_deref(),
        m.account.metadata.name.as_deref()
    );

    // The agent's arguments parse as `dataplane` arguments; its variables
    // are ones the agent reads.
    let agent = container(&m.daemonset, "agent")?;
    let mut argv = vec!["dataplane".to_owned()];
    argv.extend(agent.args.clone().unwrap_or_default());
    Cli::try_parse_from_checked(&argv)?;
    if let Ok(Cli {
        command: dataplane_user::cli::Command::Run(run),
    }) = <Cli as clap::Parser>::try_parse_from(&argv)
    {
        // Istio's ports (the pod declares none: they would be host ports);
        // unset, the agent takes them (`cli::run` unit tests).
        assert_eq!(run.readiness_addr.map_or(15021, |a| a.port()), 15021);
        assert_eq!(run.metrics_addr.map_or(15020, |a| a.port()), 15020);
        // Unset, the agent takes 127.0.0.1 (and the proxy config's port).
        assert!(run.admin_addr.is_none_or(|a| a.ip().is_loopback()));
        assert!(run.drain_timeout < std::time::Duration::from_secs(30));
    } else {
        anyhow::bail!("the agent's arguments are not `dataplane run`: {argv:?}");
    }
    let known = cli_env("run");
    for var in agent.env.iter().flatten() {
        if var.name.starts_with("DATAPLANE_") {
            assert!(known.contains(&var.name), "the agent reads no {}", var.name);
        }
    }
    // Upgrades surge: the new pod starts beside the old one, which host
    // ports (a hostNetwork pod's `ports`) would forbid; the new agent takes
    // over, the old one waits for its pod's deletion.
    assert_eq!(agent.ports, None, "host ports block the surge pod");
    let rolling = m
        .daemonset
        .spec
        .as_ref()
        .and_then(|s| s.update_strategy.as_ref())
        .and_then(|u| u.rolling_update.as_ref())
        .ok_or_else(|| anyhow::anyhow!("no rolling update"))?;
    assert_eq!(rolling.max_surge, Some(IntOrString::Int(1)));
    assert_eq!(rolling.max_unavailable, Some(IntOrString::Int(0)));
    for flag in ["--takeover", "--after-handover=wait"] {
        assert!(
            argv.iter().any(|a| a == flag),
            "the agent runs without {flag}"
        );
    }
    assert_eq!(
        agent.command.as_deref(),
        Some(&["/usr/local/bin/dataplane".to_owned()][..])
    );
    // Readiness is the agent's own `ready --same-cgroup` (an HTTP probe of
    // 15021 would be answered by the old pod's agent during the surge).
    let probe = agent
        .readiness_probe
        .as_ref()
        .and_then(|p| p.exec.as_ref())
        .and_then(|e| e.command.clone())
        .ok_or_else(|| anyhow::anyhow!("the agent has no exec readiness probe"))?;
    assert_eq!(
        probe[..3],
        ["/usr/local/bin/dataplane", "ready", "--same-cgroup"]
    );
    let mut probe_argv = vec!["dataplane".to_owned()];
    probe_argv.extend(probe[1..].iter().cloned());
    Cli::try_parse_from_checked(&probe_argv)?;

    // install-cni: the command exists, every variable is read, and the
    // plugin binary it copies is where the image puts it.
    let install = container(&m.daemonset, "install-cni")?;
    let command = install.command.clone().unwrap_or_default();
    assert_eq!(command, ["/usr/local/bin/dataplane", "install-cni"]);
    Cli::try_parse_from_checked(&["dataplane".to_owned(), "install-cni".to_owned()])?;
    let known = cli_env("install-cni");
    for var in install.env.iter().flatten() {
        if var.name.starts_with("DATAPLANE_") {
            assert!(
                known.contains(&var.name),
                "install-cni reads no {}",
                var.name
            );
        }
    }
    let plugin = install
        .env
        .iter()
        .flatten()
        .find(|v| v.name == "DATAPLANE_CNI_PLUGIN_BINARY")
        .and_then(|v| v.value.clone());
    assert_eq!(plugin.as_deref(), Some("/usr/local/bin/dataplane-cni"));
    let containerfile = std::fs::read_to_string(repo().join("deploy/Containerfile"))?;
    for binary in ["dataplane", "dataplane-cni"] {
        assert!(
            containerfile.contains(&format!("/out/{binary} /usr/local/bin/{binary}")),
            "the image lacks /usr/local/bin/{binary}"
        );
        assert!(
            containerfile.contains(&format!("--bin {binary}")),
            "the build skips {binary}"
        );
    }
    assert!(containerfile.matches("\nFROM ").count() >= 1 && containerfile.contains(" AS build"));

    // Least privilege, and bound to the agent's account.
    let rules = m.role.rules.unwrap_or_default();
    assert_eq!(rules.len(), 2);
    let read = &rules[0];
    assert_eq!(read.api_groups.as_deref(), Some(&["".to_owned()][..]));
    assert_eq!(
        read.resources.as_deref(),
        Some(&["pods".to_owned(), "namespaces".to_owned()][..])
    );
    assert_eq!(read.verbs, ["get", "list", "watch"]);
    // The redirection annotation istiod reads, written as istio-cni does.
    let write = &rules[1];
    assert_eq!(write.api_groups.as_deref(), Some(&["".to_owned()][..]));
    assert_eq!(
        write.resources.as_deref(),
        Some(&["pods/status".to_owned()][..])
    );
    assert_eq!(write.verbs, ["patch"]);
    assert_eq!(
        m.binding.role_ref.name,
        m.role.metadata.name.unwrap_or_default()
    );
    let subject = &m.binding.subjects.unwrap_or_default()[0];
    assert_eq!(Some(subject.name.clone()), m.account.metadata.name);
    Ok(())
}

/// `try_parse_from` with the error rendered.
trait ParseChecked {
    fn try_parse_from_checked(argv: &[String]) -> anyhow::Result<()>;
}

impl ParseChecked for Cli {
    fn try_parse_from_checked(argv: &[String]) -> anyhow::Result<()> {
        <Cli as clap::Parser>::try_parse_from(argv)
            .map(drop)
            .map_err(|e| anyhow::anyhow!("{argv:?} does not parse: {e}"))
    }
}
