//! `dataplane install-cni` against temporary directories holding
//! real-world configurations of common CNIs (`cni_fixtures/`: containerd's
//! bridge, Calico, Flannel and Cilium lists, a lone bridge `.conf` beside a
//! loopback one): the plugin lands once at the end of the primary list with
//! every other byte kept, a `.conf` becomes a `.conflist`, a second run
//! changes nothing, the watcher re-inserts after another component
//! overwrites the file and refreshes the token, and removal (SIGTERM with
//! --cleanup-on-exit, or --uninstall) restores the original exactly.

use std::{
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Duration,
};

use dataplane_tests::{ChildGuard, TempDir, agent_binary, cni::plugin_binary, traffic::wait_until};
use serde_json::Value;

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/cni_fixtures")
}

/// A node's directories: `bin/`, `net.d/`, and the pod's service account.
struct Host {
    dir: TempDir,
}

impl Host {
    fn new(tag: &str, configs: &[&str]) -> anyhow::Result<Self> {
        let dir = TempDir::new(tag)?;
        std::fs::create_dir_all(dir.path().join("bin"))?;
        std::fs::create_dir_all(dir.path().join("net.d"))?;
        std::fs::create_dir_all(dir.path().join("sa"))?;
        for name in configs {
            std::fs::copy(
                fixture_dir().join(name),
                dir.path().join("net.d").join(name),
            )?;
        }
        std::fs::write(dir.path().join("sa/token"), "token-1")?;
        std::fs::write(
            dir.path().join("sa/ca.crt"),
            "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n",
        )?;
        Ok(Self { dir })
    }

    fn conf_dir(&self) -> PathBuf {
        self.dir.path().join("net.d")
    }

    fn read(&self, name: &str) -> anyhow::Result<String> {
        Ok(std::fs::read_to_string(self.conf_dir().join(name))?)
    }

    fn command(&self, extra: &[&str]) -> anyhow::Result<Command> {
        let mut cmd = Command::new(agent_binary()?);
        cmd.arg("install-cni")
            .arg("--plugin-binary")
            .arg(plugin_binary()?)
            .arg("--cni-bin-dir")
            .arg(self.dir.path().join("bin"))
            .arg("--cni-conf-dir")
            .arg(self.conf_dir())
            .args(["--host-cni-conf-dir", "/etc/cni/net.d"])
            .args(["--agent-socket", "/run/dataplane/default/agent.sock"])
            .args(["--kube-api-server", "https://10.96.0.1:443"])
            .arg("--kube-token-file")
            .arg(self.dir.path().join("sa/token"))
            .arg("--kube-ca-file")
            .arg(self.dir.path().join("sa/ca.crt"))
            .args(extra)
            .env_remove("KUBERNETES_SERVICE_HOST")
            .env("RUST_LOG", "info");
        Ok(cmd)
    }

    fn run(&self, extra: &[&str]) -> anyhow::Result<String> {
        let out = self.command(extra)?.output()?;
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        anyhow::ensure!(
            out.status.success(),
            "install-cni {extra:?} failed: {stderr}"
        );
        Ok(stderr)
    }

    /// Names in `net.d`, sorted.
    fn names(&self) -> anyhow::Result<Vec<String>> {
        let mut names: Vec<String> = std::fs::read_dir(self.conf_dir())?
            .flatten()
            .filter_map(|e| e.file_name().into_string().ok())
            .collect();
        names.sort();
        Ok(names)
    }
}

fn json(text: &str) -> anyhow::Result<Value> {
    Ok(serde_json::from_str(text)?)
}

fn plugin_types(conf: &Value) -> Vec<String> {
    conf["plugins"]
        .as_array()
        .map(|ps| {
            ps.iter()
                .map(|p| p["type"].as_str().unwrap_or_default().to_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// Checks a list after installation against the original list.
fn assert_inserted_into_list(original: &str, installed: &str) -> anyhow::Result<()> {
    let before = json(original)?;
    let after = json(installed)?;
    let mut expected_types = plugin_types(&before);
    expected_types.push("dataplane-cni".into());
    assert_eq!(plugin_types(&after), expected_types);
    // Every top-level field and every other plugin, unchanged in meaning.
    for (key, value) in before.as_object().into_iter().flatten() {
        if key != "plugins" {
            assert_eq!(&after[key], value, "top-level {key}");
        }
    }
    for (i, plugin) in before["plugins"]
        .as_array()
        .into_iter()
        .flatten()
        .enumerate()
    {
        assert_eq!(&after["plugins"][i], plugin, "plugin {i}");
    }
    // ... and unchanged byte for byte: the original text up to the end of
    // its last plugin is a prefix of the new one.
    let last_plugin_end = original
        .rfind('}')
        .and_then(|end| original[..end].rfind('}'));
    if let Some(end) = last_plugin_end {
        assert_eq!(&installed[..=end], &original[..=end]);
    }
    let ours = &after["plugins"][expected_types.len() - 1];
    assert_eq!(ours["agentSocket"], "/run/dataplane/default/agent.sock");
    assert_eq!(ours["onAgentUnreachable"], "fail");
    assert_eq!(
        ours["excludeNamespaces"],
        serde_json::json!(["kube-system"])
    );
    assert_eq!(
        ours["kubeconfig"],
        "/etc/cni/net.d/ZZZ-dataplane-cni-kubeconfig"
    );
    Ok(())
}

#[test]
fn lists_of_common_cnis_get_the_plugin_once_and_lose_it_cleanly() -> anyhow::Result<()> {
    for name in [
        "10-containerd-net.conflist",
        "10-calico.conflist",
        "10-flannel.conflist",
        "05-cilium.conflist",
    ] {
        let mut files = vec![name];
        if name == "10-calico.conflist" {
            files.push("calico-kubeconfig");
        }
        let host = Host::new("cniinst", &files)?;
        let original = host.read(name)?;
        host.run(&["--once"])?;
        let installed = host.read(name)?;
        assert_inserted_into_list(&original, &installed)
            .map_err(|e| anyhow::anyhow!("{name}: {e}\n{installed}"))?;

        // The binary, atomically in place and executable; the kubeconfig
        // and token for the plugin, private.
        let bin = host.dir.path().join("bin/dataplane-cni");
        assert_eq!(std::fs::read(&bin)?, std::fs::read(plugin_binary()?)?);
        assert_eq!(std::fs::metadata(&bin)?.permissions().mode() & 0o777, 0o755);
        let kubeconfig = host.read("ZZZ-dataplane-cni-kubeconfig")?;
        assert!(
            kubeconfig.contains("server: https://10.96.0.1:443"),
            "{kubeconfig}"
        );
        assert!(kubeconfig.contains("tokenFile: /etc/cni/net.d/ZZZ-dataplane-cni-token"));
        assert!(kubeconfig.contains("certificate-authority-data: "));
        assert_eq!(host.read("ZZZ-dataplane-cni-token")?, "token-1");
        let mode = std::fs::metadata(host.conf_dir().join("ZZZ-dataplane-cni-token"))?
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        assert!(
            !host.names()?.iter().any(|n| n.starts_with('.')),
            "no temporary file left: {:?}",
            host.names()?
        );

        // Idempotent: a second run leaves the bytes alone.
        host.run(&["--once"])?;
        assert_eq!(
            host.read(name)?,
            installed,
            "{name}: second run changed the file"
        );

        // Uninstall: the original, byte for byte, and nothing of ours.
        host.run(&["--uninstall"])?;
        assert_eq!(host.read(name)?, original, "{name}: removal is not clean");
        let mut expected: Vec<String> = files.iter().map(|s| (*s).to_owned()).collect();
        expected.sort();
        assert_eq!(host.names()?, expected);
        assert!(!bin.exists());
    }
    Ok(())
}

#[test]
fn a_lone_conf_becomes_a_list_and_only_the_first_file_is_touched() -> anyhow::Result<()> {
    let host = Host::new("cniconf", &["10-bridge.conf", "99-loopback.conf"])?;
    let original = host.read("10-bridge.conf")?;
    let loopback = host.read("99-loopback.conf")?;
    host.run(&["--once"])?;
    assert_eq!(
        host.names()?,
        [
            "10-bridge.conflist",
            "99-loopback.conf",
            "ZZZ-dataplane-cni-kubeconfig",
            "ZZZ-dataplane-cni-token"
        ]
    );
    let list = json(&host.read("10-bridge.conflist")?)?;
    assert_eq!(list["cniVersion"], "0.4.0");
    assert_eq!(list["name"], "bridge");
    assert_eq!(list["plugins"][0], json(&original)?);
    assert_eq!(list["plugins"][1]["type"], "dataplane-cni");
    assert_eq!(list["plugins"][1]["convertedFrom"], "10-bridge.conf");
    assert_eq!(host.read("99-loopback.conf")?, loopback, "not the primary");

    let installed = host.read("10-bridge.conflist")?;
    host.run(&["--once"])?;
    assert_eq!(host.read("10-bridge.conflist")?, installed);

    host.run(&["--uninstall"])?;
    assert_eq!(host.names()?, ["10-bridge.conf", "99-loopback.conf"]);
    assert_eq!(host.read("10-bridge.conf")?, original);
    Ok(())
}

#[test]
fn the_watcher_reinserts_refreshes_the_token_and_cleans_up_on_sigterm() -> anyhow::Result<()> {
    // Starts before any network configuration exists, as on a new node.
    let host = Host::new("cniwatch", &[])?;
    let mut cmd = host.command(&["--cleanup-on-exit", "--resync", "1s"])?;
    cmd.stdout(Stdio::null()).stderr(Stdio::piped());
    let installer = ChildGuard::new(cmd.spawn()?);
    let name = "10-calico.conflist";
    let original = std::fs::read_to_string(fixture_dir().join(name))?;
    let inserted = |host: &Host| -> anyhow::Result<bool> {
        Ok(host
            .read(name)
            .ok()
            .and_then(|t| json(&t).ok())
            .is_some_and(|v| plugin_types(&v).last().map(String::as_str) == Some("dataplane-cni")))
    };

    // The primary CNI writes its configuration: the plugin follows.
    std::fs::write(host.conf_dir().join(name), &original)?;
    wait_until("the plugin to be inserted", || inserted(&host))?;
    assert_inserted_into_list(&original, &host.read(name)?)?;

    // The primary CNI's installer rewrites its file (write + rename, as
    // calico-node does): the plugin comes back, once.
    let tmp = host.conf_dir().join(".calico.tmp");
    std::fs::write(&tmp, &original)?;
    std::fs::rename(&tmp, host.conf_dir().join(name))?;
    std::thread::sleep(Duration::from_millis(100));
    wait_until("the plugin to be re-inserted", || inserted(&host))?;
    let after = json(&host.read(name)?)?;
    assert_eq!(
        plugin_types(&after)
            .iter()
            .filter(|t| *t == "dataplane-cni")
            .count(),
        1
    );

    // The kubelet rotates the token: the plugin's copy follows.
    std::fs::write(host.dir.path().join("sa/token"), "token-2")?;
    wait_until("the token copy to be refreshed", || {
        Ok(host.read("ZZZ-dataplane-cni-token")? == "token-2")
    })?;

    // The binary deleted by hand comes back at the next check.
    std::fs::remove_file(host.dir.path().join("bin/dataplane-cni"))?;
    wait_until("the binary to be restored", || {
        Ok(host.dir.path().join("bin/dataplane-cni").exists())
    })?;

    // SIGTERM: clean removal.
    installer.signal(nix::sys::signal::Signal::SIGTERM)?;
    let done = installer.wait(Duration::from_secs(10))?;
    assert_eq!(done.code, Some(0), "{}", done.stderr);
    assert_eq!(host.read(name)?, original);
    assert_eq!(host.names()?, [name]);
    assert!(!host.dir.path().join("bin/dataplane-cni").exists());
    Ok(())
}

#[test]
fn without_an_api_server_no_kubeconfig_is_written() -> anyhow::Result<()> {
    let host = Host::new("cninokube", &["10-flannel.conflist"])?;
    let out = Command::new(agent_binary()?)
        .arg("install-cni")
        .arg("--once")
        .arg("--plugin-binary")
        .arg(plugin_binary()?)
        .arg("--cni-bin-dir")
        .arg(host.dir.path().join("bin"))
        .arg("--cni-conf-dir")
        .arg(host.conf_dir())
        .args(["--on-agent-unreachable", "pass"])
        .env_remove("KUBERNETES_SERVICE_HOST")
        .env_remove("DATAPLANE_KUBE_API_SERVER")
        .output()?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(host.names()?, ["10-flannel.conflist"]);
    let list = json(&host.read("10-flannel.conflist")?)?;
    let ours = &list["plugins"][2];
    assert_eq!(ours["type"], "dataplane-cni");
    assert_eq!(ours["onAgentUnreachable"], "pass");
    assert!(ours.get("kubeconfig").is_none(), "{ours}");
    Ok(())
}
