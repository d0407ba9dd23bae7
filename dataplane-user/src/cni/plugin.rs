//! The plugin's operations. [`run`] takes the runtime's environment and
//! stdin and returns what to print and whether it succeeded, so the binary
//! (`src/bin/dataplane-cni.rs`) is a thin shell and the logic is testable
//! without a runtime.
//!
//! - **ADD**: a chained plugin: reads the pod's IPs from `prevResult`, asks
//!   the agent to enroll the pod (`CNI_NETNS`, `K8S_POD_*` from
//!   `CNI_ARGS`), and prints `prevResult` unchanged once the agent answers
//!   (it answers only when capture is in place). With a kubeconfig, pods
//!   that did not opt in are passed through without contacting the agent.
//! - **DEL**: unenrolls by network namespace path; succeeds when the pod was
//!   not enrolled, when the namespace is gone, and when the agent is down
//!   (a restarted agent drops pods whose namespace vanished).
//! - **CHECK**: the pod is enrolled with this namespace and the IPs of
//!   `prevResult`, else error 103 (drift).
//! - **STATUS** (1.1): the agent answers, else error 50 (unless the policy
//!   is `pass`). **GC** (1.1): nothing to collect here (the agent unenrolls
//!   pods whose namespace vanished). **VERSION**: the supported versions.

use std::{collections::BTreeSet, net::IpAddr, path::Path, time::Duration};

use serde_json::value::RawValue;

use super::{
    lookup::{self, PodFacts},
    spec::{
        CniEnv, CniError, Command, ErrorCode, LATEST_VERSION, PluginConf, ResultView,
        SUPPORTED_VERSIONS, UnreachablePolicy,
    },
};
use crate::{
    control::{self, ControlError, Request},
    enroll::PodSpec,
    kube::optin::OptIn,
};

/// How long the Kubernetes API look-up may take.
const LOOKUP_TIMEOUT: Duration = Duration::from_secs(10);

/// What the plugin prints on stdout, and whether it succeeded (exit 0).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    /// stdout (a result, a version report, an error, or nothing).
    pub stdout: String,
    /// Exit status 0.
    pub success: bool,
}

/// Runs one CNI operation. Diagnostics go to stderr.
pub fn run(env: &CniEnv, stdin: &[u8]) -> Outcome {
    let version = declared_version(stdin);
    match dispatch(env, stdin) {
        Ok(stdout) => Outcome {
            stdout: stdout.unwrap_or_default(),
            success: true,
        },
        Err(err) => {
            log(&format!("error: {err}"));
            Outcome {
                stdout: err.to_json(&version),
                success: false,
            }
        }
    }
}

/// The config's `cniVersion` when readable and supported, for the error
/// and version reports.
fn declared_version(stdin: &[u8]) -> String {
    #[derive(serde::Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Versioned {
        cni_version: String,
    }
    serde_json::from_slice::<Versioned>(stdin)
        .ok()
        .map(|v| v.cni_version)
        .filter(|v| SUPPORTED_VERSIONS.contains(&v.as_str()))
        .unwrap_or_else(|| LATEST_VERSION.to_owned())
}

fn dispatch(env: &CniEnv, stdin: &[u8]) -> Result<Option<String>, CniError> {
    let raw = env.command.as_deref().ok_or_else(|| {
        CniError::new(
            ErrorCode::InvalidEnvironment,
            "CNI_COMMAND is not set",
            "this binary is a CNI plugin run by the container runtime; see the CNI specification",
        )
    })?;
    let command: Command = raw.parse().map_err(|()| {
        CniError::new(
            ErrorCode::InvalidEnvironment,
            format!("unknown CNI_COMMAND `{raw}`"),
            "expected ADD, DEL, CHECK, STATUS, GC or VERSION",
        )
    })?;
    if command == Command::Version {
        return Ok(Some(version_report(stdin)));
    }
    let conf = read_conf(stdin)?;
    match command {
        Command::Add => add(env, &conf).map(Some),
        Command::Del => del(env, &conf).map(|()| None),
        Command::Check => check(env, &conf).map(|()| None),
        Command::Status => status(&conf).map(|()| None),
        Command::Gc | Command::Version => Ok(None),
    }
}

fn version_report(stdin: &[u8]) -> String {
    serde_json::json!({
        "cniVersion": declared_version(stdin),
        "supportedVersions": SUPPORTED_VERSIONS,
    })
    .to_string()
}

/// Reads the network configuration on stdin (any version the plugin
/// supports); the first thing every command but VERSION does with it.
pub fn read_conf(stdin: &[u8]) -> Result<PluginConf, CniError> {
    let conf: PluginConf = serde_json::from_slice(stdin).map_err(|e| {
        let code = if e.is_data() {
            ErrorCode::InvalidConfig
        } else {
            ErrorCode::Decode
        };
        CniError::new(
            code,
            "cannot read the network configuration on stdin",
            e.to_string(),
        )
    })?;
    if !SUPPORTED_VERSIONS.contains(&conf.cni_version.as_str()) {
        return Err(CniError::new(
            ErrorCode::IncompatibleVersion,
            format!("CNI version {} is not supported", conf.cni_version),
            format!("supported versions: {}", SUPPORTED_VERSIONS.join(", ")),
        ));
    }
    Ok(conf)
}

fn require<'a, T: ?Sized>(
    value: Option<&'a T>,
    name: &str,
    command: &str,
) -> Result<&'a T, CniError> {
    value.ok_or_else(|| {
        CniError::new(
            ErrorCode::InvalidEnvironment,
            format!("{name} is required for {command}"),
            "the container runtime must set it (CNI specification, Parameters)",
        )
    })
}

fn prev_result<'a>(conf: &'a PluginConf, command: &str) -> Result<&'a RawValue, CniError> {
    conf.prev_result.as_deref().ok_or_else(|| {
        CniError::new(
            ErrorCode::InvalidConfig,
            format!("no prevResult for {command}"),
            "dataplane-cni is a chained plugin: list it after the primary network plugin in a .conflist",
        )
    })
}

fn add(env: &CniEnv, conf: &PluginConf) -> Result<String, CniError> {
    let prev = prev_result(conf, "ADD")?;
    let pass_through = Ok(prev.get().to_owned());
    let netns = require(env.netns.as_deref(), "CNI_NETNS", "ADD")?;
    let container_id = require(env.container_id.as_deref(), "CNI_CONTAINERID", "ADD")?;
    require(env.ifname.as_deref(), "CNI_IFNAME", "ADD")?;
    let Some(pod) = env.pod() else {
        log("no K8S_POD_NAME/K8S_POD_NAMESPACE in CNI_ARGS: not a Kubernetes pod; passing through");
        return pass_through;
    };
    if conf.exclude_namespaces.contains(&pod.namespace) {
        log(&format!(
            "{}/{}: namespace excluded; passing through",
            pod.namespace, pod.name
        ));
        return pass_through;
    }
    let facts = match facts_for(conf, &pod)? {
        Lookup::Found(facts) => Some(facts),
        Lookup::NotConfigured => None,
        Lookup::Unavailable => return pass_through,
    };
    if let Some(PodFacts {
        opt_in: OptIn::Skip(reason),
        ..
    }) = &facts
    {
        log(&format!(
            "{}/{}: not enrolled: {reason}",
            pod.namespace, pod.name
        ));
        return pass_through;
    }
    let result = read_result(prev)?;
    let ips = result
        .addresses()
        .map_err(|e| CniError::new(ErrorCode::InvalidConfig, "invalid prevResult", e))?;
    if ips.is_empty() {
        return Err(CniError::new(
            ErrorCode::InvalidConfig,
            "prevResult assigns no IP address",
            "the primary plugin (and its IPAM) must run before dataplane-cni",
        ));
    }
    let uid = facts
        .as_ref()
        .map(|f| f.uid.clone())
        .or_else(|| pod.uid.clone())
        .unwrap_or_else(|| format!("cni-{container_id}"));
    let (dns_capture, fast_path) = facts
        .as_ref()
        .map_or((None, None), |f| (f.dns_capture, f.fast_path));
    let exclusions = facts
        .as_ref()
        .map(|f| f.exclusions.clone())
        .unwrap_or_default();
    for ignored in facts.iter().flat_map(|f| &f.ignored) {
        log(&format!(
            "{}/{}: {ignored}; the pod is captured as if it were not set",
            pod.namespace, pod.name
        ));
    }
    let spec = PodSpec {
        uid,
        name: pod.name.clone(),
        namespace: pod.namespace.clone(),
        service_account: facts
            .map(|f| f.service_account)
            .unwrap_or_else(|| "default".into()),
        trust_domain: conf.trust_domain.clone(),
        netns: netns.to_path_buf(),
        ips,
        node_addr: result.node_side(),
        exclusions,
        dns_capture,
        fast_path,
    };
    let request = Request::Add {
        pod: Box::new(spec),
    };
    match control::call(&conf.agent_socket, &request, agent_timeout(conf)) {
        Ok(_) => {
            log(&format!("{}/{}: enrolled", pod.namespace, pod.name));
            pass_through
        }
        Err(ControlError::Refused(reason)) => Err(CniError::new(
            ErrorCode::AgentRefused,
            format!("the agent cannot enroll pod {}/{}", pod.namespace, pod.name),
            reason,
        )),
        Err(err) => {
            unreachable_agent(conf, &err, "ADD")?;
            pass_through
        }
    }
}

fn del(env: &CniEnv, conf: &PluginConf) -> Result<(), CniError> {
    let Some(netns) = env.netns.as_deref() else {
        log(
            "DEL without CNI_NETNS: nothing to do (the agent unenrolls pods whose namespace disappears)",
        );
        return Ok(());
    };
    let request = Request::Remove {
        uid: None,
        netns: Some(netns.to_path_buf()),
    };
    match control::call(&conf.agent_socket, &request, agent_timeout(conf)) {
        Ok(_) => Ok(()),
        Err(ControlError::Refused(reason)) => Err(CniError::new(
            ErrorCode::AgentRefused,
            format!(
                "the agent cannot unenroll network namespace {}",
                netns.display()
            ),
            reason,
        )),
        Err(err) => {
            // Nothing to undo that a restarted agent would not undo itself.
            log(&format!(
                "DEL: agent unreachable ({err}); nothing left to clean here"
            ));
            Ok(())
        }
    }
}

fn check(env: &CniEnv, conf: &PluginConf) -> Result<(), CniError> {
    let prev = prev_result(conf, "CHECK")?;
    let netns = require(env.netns.as_deref(), "CNI_NETNS", "CHECK")?;
    let Some(pod) = env
        .pod()
        .filter(|p| !conf.exclude_namespaces.contains(&p.namespace))
    else {
        return Ok(());
    };
    match facts_for(conf, &pod)? {
        Lookup::Found(PodFacts {
            opt_in: OptIn::Skip(_),
            ..
        })
        | Lookup::Unavailable => return Ok(()),
        Lookup::Found(_) | Lookup::NotConfigured => {}
    }
    let expected: BTreeSet<IpAddr> = read_result(prev)?
        .addresses()
        .map_err(|e| CniError::new(ErrorCode::InvalidConfig, "invalid prevResult", e))?
        .into_iter()
        .collect();
    let listed = match control::call(&conf.agent_socket, &Request::List, agent_timeout(conf)) {
        Ok(listed) => listed,
        Err(ControlError::Refused(reason)) => {
            return Err(CniError::new(
                ErrorCode::AgentRefused,
                "the agent refused to list pods",
                reason,
            ));
        }
        Err(err) => return unreachable_agent(conf, &err, "CHECK"),
    };
    let who = format!("{}/{}", pod.namespace, pod.name);
    let Some(enrolled) = listed.pods.iter().find(|p| p.spec.netns == netns) else {
        return Err(CniError::new(
            ErrorCode::Drift,
            format!("pod {who} is not enrolled"),
            format!(
                "the agent has no pod in network namespace {}: its traffic is not captured; delete the pod to have it enrolled again",
                netns.display()
            ),
        ));
    };
    let actual: BTreeSet<IpAddr> = enrolled.spec.ips.iter().copied().collect();
    if actual != expected {
        return Err(CniError::new(
            ErrorCode::Drift,
            format!("pod {who} is enrolled with other addresses"),
            format!("the agent captures {actual:?}, the network assigned {expected:?}"),
        ));
    }
    Ok(())
}

fn status(conf: &PluginConf) -> Result<(), CniError> {
    match control::call(&conf.agent_socket, &Request::List, agent_timeout(conf)) {
        Ok(_) => Ok(()),
        Err(err) => match conf.on_agent_unreachable {
            UnreachablePolicy::Pass => Ok(()),
            UnreachablePolicy::Fail => Err(CniError::new(
                ErrorCode::NotAvailable,
                "the dataplane agent is not available",
                format!(
                    "{err}; pods in the mesh cannot start until it is (onAgentUnreachable: fail)"
                ),
            )),
        },
    }
}

/// Outcome of the optional API look-up.
enum Lookup {
    /// No kubeconfig configured: every pod is enrolled.
    NotConfigured,
    /// The pod as the API sees it.
    Found(PodFacts),
    /// The API could not be asked and the policy says pass.
    Unavailable,
}

fn facts_for(conf: &PluginConf, pod: &super::spec::PodRef) -> Result<Lookup, CniError> {
    let Some(kubeconfig) = conf.kubeconfig.as_deref() else {
        return Ok(Lookup::NotConfigured);
    };
    let selectors = conf
        .enablement_selectors
        .clone()
        .unwrap_or_else(crate::kube::optin::istio_default_selectors);
    let rule = crate::kube::optin::EnrollmentRule::new(
        &selectors,
        conf.exclude_namespaces.iter().cloned(),
    )
    .map_err(|e| {
        CniError::new(
            ErrorCode::InvalidConfig,
            "invalid enablementSelectors in the plugin configuration",
            e.to_string(),
        )
    })?;
    match lookup::lookup(kubeconfig, pod, &rule, LOOKUP_TIMEOUT) {
        Ok(facts) => Ok(Lookup::Found(facts)),
        Err(reason) => match conf.on_agent_unreachable {
            UnreachablePolicy::Pass => {
                log(&format!(
                    "{}/{}: Kubernetes look-up failed ({reason}); passing (onAgentUnreachable: pass)",
                    pod.namespace, pod.name
                ));
                Ok(Lookup::Unavailable)
            }
            UnreachablePolicy::Fail => Err(CniError::new(
                ErrorCode::KubernetesLookup,
                format!(
                    "cannot look pod {}/{} up in the Kubernetes API",
                    pod.namespace, pod.name
                ),
                format!(
                    "{reason}; check the plugin's kubeconfig {}",
                    kubeconfig_display(kubeconfig)
                ),
            )),
        },
    }
}

fn kubeconfig_display(path: &Path) -> String {
    path.display().to_string()
}

/// Applies the policy for an unreachable agent: `Ok` to pass.
fn unreachable_agent(conf: &PluginConf, err: &ControlError, op: &str) -> Result<(), CniError> {
    let reason = crate::logging::Chain(err).to_string();
    match conf.on_agent_unreachable {
        UnreachablePolicy::Pass => {
            log(&format!(
                "{op}: {reason}; passing uncaptured (onAgentUnreachable: pass)"
            ));
            Ok(())
        }
        UnreachablePolicy::Fail => Err(CniError::new(
            ErrorCode::AgentUnreachable,
            "the dataplane agent is unreachable",
            format!(
                "{reason}; the pod is not started (onAgentUnreachable: fail): start the agent, or set onAgentUnreachable to pass"
            ),
        )),
    }
}

/// Reads the previous plugin's result (`prevResult`).
pub fn read_result(prev: &RawValue) -> Result<ResultView, CniError> {
    serde_json::from_str(prev.get())
        .map_err(|e| CniError::new(ErrorCode::Decode, "cannot read prevResult", e.to_string()))
}

fn agent_timeout(conf: &PluginConf) -> Duration {
    Duration::from_secs(conf.agent_timeout_seconds.max(1))
}

fn log(message: &str) {
    eprintln!("dataplane-cni: {message}");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(command: &str) -> CniEnv {
        CniEnv {
            command: Some(command.into()),
            container_id: Some("c1".into()),
            netns: Some("/var/run/netns/nope".into()),
            ifname: Some("eth0".into()),
            args: [("K8S_POD_NAMESPACE", "ns"), ("K8S_POD_NAME", "p")]
                .into_iter()
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect(),
        }
    }

    fn conf(policy: &str) -> String {
        let conf = format!(
            r#"{{"cniVersion":"1.0.0","name":"n","type":"dataplane-cni","agentSocket":"/nonexistent/agent.sock","onAgentUnreachable":"{policy}",
               "prevResult":{{"cniVersion":"1.0.0","ips":[{{"address":"10.0.0.2/24","gateway":"10.0.0.1"}}],"dns":{{}}}}}}"#
        );
        crate::fuzz_seeds::seed("cni_stdin", &conf);
        conf
    }

    /// The plugin's `run`, recording each stdin the tests try as a seed of
    /// the `cni_stdin` fuzz target.
    fn run(env: &CniEnv, stdin: &[u8]) -> Outcome {
        crate::fuzz_seeds::seed("cni_stdin", stdin);
        super::run(env, stdin)
    }

    #[test]
    fn version_lists_supported_versions() {
        let out = run(&env("VERSION"), br#"{"cniVersion":"1.0.0"}"#);
        assert!(out.success);
        let v: serde_json::Value = serde_json::from_str(&out.stdout).unwrap_or_default();
        assert_eq!(v["cniVersion"], "1.0.0");
        assert_eq!(v["supportedVersions"][4], "1.1.0");
    }

    #[test]
    fn garbage_is_a_decode_error() {
        let out = run(&env("ADD"), b"{not json");
        assert!(!out.success);
        let v: serde_json::Value = serde_json::from_str(&out.stdout).unwrap_or_default();
        assert_eq!(v["code"], 6);
    }

    #[test]
    fn unsupported_version_is_error_1() {
        let out = run(
            &env("ADD"),
            br#"{"cniVersion":"0.2.0","type":"dataplane-cni"}"#,
        );
        let v: serde_json::Value = serde_json::from_str(&out.stdout).unwrap_or_default();
        assert_eq!(v["code"], 1);
    }

    #[test]
    fn add_needs_prev_result() {
        let out = run(
            &env("ADD"),
            br#"{"cniVersion":"1.0.0","type":"dataplane-cni"}"#,
        );
        let v: serde_json::Value = serde_json::from_str(&out.stdout).unwrap_or_default();
        assert_eq!(v["code"], 7);
        assert!(v["details"].as_str().unwrap_or("").contains("chained"));
    }

    #[test]
    fn unreachable_agent_fails_or_passes_per_policy() {
        let failed = run(&env("ADD"), conf("fail").as_bytes());
        assert!(!failed.success);
        let v: serde_json::Value = serde_json::from_str(&failed.stdout).unwrap_or_default();
        assert_eq!(v["code"], 100);

        let passed = run(&env("ADD"), conf("pass").as_bytes());
        assert!(passed.success, "{}", passed.stdout);
        assert_eq!(
            passed.stdout,
            r#"{"cniVersion":"1.0.0","ips":[{"address":"10.0.0.2/24","gateway":"10.0.0.1"}],"dns":{}}"#,
            "prevResult byte for byte"
        );
    }

    #[test]
    fn excluded_namespaces_pass_even_with_the_agent_down() {
        let conf = conf("fail").replace(
            r#""type":"dataplane-cni","#,
            r#""type":"dataplane-cni","excludeNamespaces":["ns"],"#,
        );
        let out = run(&env("ADD"), conf.as_bytes());
        assert!(out.success, "{}", out.stdout);
        assert!(run(&env("CHECK"), conf.as_bytes()).success);
    }

    #[test]
    fn del_succeeds_without_agent() {
        let out = run(&env("DEL"), conf("fail").as_bytes());
        assert!(out.success, "{}", out.stdout);
        assert_eq!(out.stdout, "");
    }

    #[test]
    fn non_kubernetes_containers_pass_through() {
        let mut e = env("ADD");
        e.args.clear();
        let out = run(&e, conf("fail").as_bytes());
        assert!(out.success);
    }

    #[test]
    fn status_reports_unavailable_agent() {
        let out = run(
            &env("STATUS"),
            conf("fail").replace("1.0.0", "1.1.0").as_bytes(),
        );
        let v: serde_json::Value = serde_json::from_str(&out.stdout).unwrap_or_default();
        assert_eq!(v["code"], 50);
        assert!(run(&env("STATUS"), conf("pass").as_bytes()).success);
        assert!(run(&env("GC"), conf("fail").as_bytes()).success);
    }
}
