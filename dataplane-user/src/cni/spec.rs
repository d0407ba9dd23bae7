//! The CNI protocol as the plugin sees it (spec 0.3.0 to 1.1.0): the
//! runtime's environment, the network configuration on stdin, error codes,
//! and the pieces of `prevResult` the plugin reads.

use std::{collections::BTreeMap, net::IpAddr, path::PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

/// The `type` of this plugin in a network configuration, and the name of
/// its binary in the CNI bin directory.
pub const PLUGIN_TYPE: &str = "dataplane-cni";

/// CNI versions this plugin speaks (chained plugins need `prevResult`,
/// which appeared in 0.3.0).
pub const SUPPORTED_VERSIONS: &[&str] = &["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"];

/// The newest supported version.
pub const LATEST_VERSION: &str = "1.1.0";

/// Default path of the agent's control socket (state dir `/run/dataplane`,
/// instance `default`).
pub const DEFAULT_AGENT_SOCKET: &str = "/run/dataplane/default/agent.sock";

/// CNI well-known error codes (spec "Error" section) and ours (>= 100).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum ErrorCode {
    /// Incompatible CNI version.
    IncompatibleVersion = 1,
    /// Unsupported field in network configuration.
    UnsupportedField = 2,
    /// Container unknown or does not exist.
    UnknownContainer = 3,
    /// Invalid necessary environment variables.
    InvalidEnvironment = 4,
    /// I/O failure.
    Io = 5,
    /// Failed to decode content.
    Decode = 6,
    /// Invalid network config.
    InvalidConfig = 7,
    /// Try again later.
    TryAgainLater = 11,
    /// The plugin is not available (STATUS).
    NotAvailable = 50,
    /// The node agent could not be reached.
    AgentUnreachable = 100,
    /// The node agent refused the request.
    AgentRefused = 101,
    /// The Kubernetes API lookup of the pod failed.
    KubernetesLookup = 102,
    /// CHECK found the pod's capture not as it should be.
    Drift = 103,
}

/// A spec-shaped error: printed as JSON on stdout, exit status 1.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{msg}: {details}")]
pub struct CniError {
    /// The error code.
    pub code: ErrorCode,
    /// Short message.
    pub msg: String,
    /// Longer explanation (what to do about it).
    pub details: String,
}

impl CniError {
    /// A new error.
    pub fn new(code: ErrorCode, msg: impl Into<String>, details: impl Into<String>) -> Self {
        Self {
            code,
            msg: msg.into(),
            details: details.into(),
        }
    }

    /// The JSON the runtime reads.
    pub fn to_json(&self, cni_version: &str) -> String {
        serde_json::json!({
            "cniVersion": cni_version,
            "code": self.code as u32,
            "msg": self.msg,
            "details": self.details,
        })
        .to_string()
    }
}

/// The CNI operation (`CNI_COMMAND`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    /// Attach the container to the network.
    Add,
    /// Detach it (idempotent).
    Del,
    /// Verify the attachment.
    Check,
    /// Report supported versions.
    Version,
    /// Whether the plugin can serve ADD now (1.1).
    Status,
    /// Remove stale resources (1.1).
    Gc,
}

impl std::str::FromStr for Command {
    type Err = ();

    fn from_str(s: &str) -> Result<Self, ()> {
        Ok(match s {
            "ADD" => Self::Add,
            "DEL" => Self::Del,
            "CHECK" => Self::Check,
            "VERSION" => Self::Version,
            "STATUS" => Self::Status,
            "GC" => Self::Gc,
            _ => return Err(()),
        })
    }
}

/// The runtime's environment variables.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CniEnv {
    /// `CNI_COMMAND`.
    pub command: Option<String>,
    /// `CNI_CONTAINERID`.
    pub container_id: Option<String>,
    /// `CNI_NETNS`.
    pub netns: Option<PathBuf>,
    /// `CNI_IFNAME`.
    pub ifname: Option<String>,
    /// `CNI_ARGS`, split (`K=V;K=V`).
    pub args: BTreeMap<String, String>,
}

impl CniEnv {
    /// Reads the process environment.
    pub fn from_process() -> Self {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// Reads variables through `get`.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Self {
        let non_empty = |name: &str| get(name).filter(|v| !v.is_empty());
        Self {
            command: non_empty("CNI_COMMAND"),
            container_id: non_empty("CNI_CONTAINERID"),
            netns: non_empty("CNI_NETNS").map(PathBuf::from),
            ifname: non_empty("CNI_IFNAME"),
            args: non_empty("CNI_ARGS")
                .map(|a| parse_args(&a))
                .unwrap_or_default(),
        }
    }

    /// `K8S_POD_NAMESPACE`, `K8S_POD_NAME` and `K8S_POD_UID` (if given)
    /// from `CNI_ARGS`; `None` when the container is not a Kubernetes pod.
    pub fn pod(&self) -> Option<PodRef> {
        Some(PodRef {
            namespace: self.args.get("K8S_POD_NAMESPACE")?.clone(),
            name: self.args.get("K8S_POD_NAME")?.clone(),
            uid: self.args.get("K8S_POD_UID").cloned(),
        })
    }
}

/// Which pod a CNI call is for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodRef {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// Uid (containerd and CRI-O pass it).
    pub uid: Option<String>,
}

fn parse_args(args: &str) -> BTreeMap<String, String> {
    args.split(';')
        .filter_map(|pair| pair.split_once('='))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .collect()
}

/// What the plugin does when it cannot make sure a pod is captured (agent
/// unreachable, Kubernetes API unreachable); `install-cni` writes it into
/// the plugin's configuration from `--on-agent-unreachable`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum UnreachablePolicy {
    /// Fail the ADD: the pod does not start (the runtime retries).
    #[default]
    Fail,
    /// Let the pod start uncaptured (the agent's reconciler enrolls it
    /// later if it opted in).
    Pass,
}

/// This plugin's network configuration (stdin).
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PluginConf {
    /// Version of the configuration and of the expected result.
    pub cni_version: String,
    /// Network name.
    #[serde(default)]
    pub name: Option<String>,
    /// Must be [`PLUGIN_TYPE`].
    #[serde(rename = "type")]
    pub plugin_type: String,
    /// The agent's control socket.
    #[serde(default = "default_agent_socket")]
    pub agent_socket: PathBuf,
    /// What to do when the agent or the API cannot be reached.
    #[serde(default)]
    pub on_agent_unreachable: UnreachablePolicy,
    /// How long to wait for the agent, in seconds.
    #[serde(default = "default_agent_timeout")]
    pub agent_timeout_seconds: u64,
    /// Kubeconfig for looking the pod up (opt-in, uid, service account).
    /// Without one every pod is enrolled.
    #[serde(default)]
    pub kubeconfig: Option<PathBuf>,
    /// Trust domain of the pods' SPIFFE identities.
    #[serde(default = "default_trust_domain")]
    pub trust_domain: String,
    /// Namespaces whose pods are never enrolled nor looked up (the agent's
    /// own, so it can always start; `kube-system`).
    #[serde(default)]
    pub exclude_namespaces: Vec<String>,
    /// Which pods the plugin enrolls when it can look them up: Istio's
    /// enablement selectors (as istio-cni writes `enablement_selectors`
    /// into its plugin's configuration) [default: Istio's].
    #[serde(default)]
    pub enablement_selectors: Option<Vec<crate::kube::optin::EnablementSelector>>,
    /// The previous plugin's result (absent for DEL on old runtimes).
    #[serde(default)]
    pub prev_result: Option<Box<RawValue>>,
}

fn default_agent_socket() -> PathBuf {
    PathBuf::from(DEFAULT_AGENT_SOCKET)
}

fn default_agent_timeout() -> u64 {
    30
}

fn default_trust_domain() -> String {
    "cluster.local".into()
}

/// The parts of a CNI result the plugin reads.
#[derive(Debug, Default, Deserialize)]
pub struct ResultView {
    /// Assigned addresses.
    #[serde(default)]
    pub ips: Vec<IpConfig>,
}

/// One assigned address.
#[derive(Debug, Deserialize)]
pub struct IpConfig {
    /// `ip/prefix`.
    pub address: String,
    /// The gateway, if any (the node side of the pod's link).
    #[serde(default)]
    pub gateway: Option<IpAddr>,
}

impl ResultView {
    /// The pod's addresses (prefix lengths dropped).
    pub fn addresses(&self) -> Result<Vec<IpAddr>, String> {
        self.ips
            .iter()
            .map(|ip| {
                let addr = ip.address.split('/').next().unwrap_or_default();
                addr.parse()
                    .map_err(|_| format!("prevResult address `{}` is not ip/prefix", ip.address))
            })
            .collect()
    }

    /// The first gateway, IPv4 preferred: where kubelet probes come from on
    /// bridge-style networks.
    pub fn node_side(&self) -> Option<IpAddr> {
        let gateways = || self.ips.iter().filter_map(|ip| ip.gateway);
        gateways()
            .find(IpAddr::is_ipv4)
            .or_else(|| gateways().next())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cni_args_are_split() {
        let env = CniEnv::from_vars(|name| {
            match name {
            "CNI_COMMAND" => Some("ADD".into()),
            "CNI_ARGS" => Some(
                "IgnoreUnknown=1;K8S_POD_NAMESPACE=shop;K8S_POD_NAME=web-0;K8S_POD_INFRA_CONTAINER_ID=abc;K8S_POD_UID=u-1".into(),
            ),
            "CNI_NETNS" => Some(String::new()),
            _ => None,
        }
        });
        assert_eq!(env.netns, None, "empty counts as unset");
        assert_eq!(
            env.pod(),
            Some(PodRef {
                namespace: "shop".into(),
                name: "web-0".into(),
                uid: Some("u-1".into())
            })
        );
    }

    #[test]
    fn error_json_is_spec_shaped() {
        let err = CniError::new(ErrorCode::Decode, "bad", "why");
        let v: serde_json::Value = serde_json::from_str(&err.to_json("1.0.0")).unwrap_or_default();
        assert_eq!(v["code"], 6);
        assert_eq!(v["msg"], "bad");
        assert_eq!(v["details"], "why");
        assert_eq!(v["cniVersion"], "1.0.0");
    }

    #[test]
    fn prev_result_addresses_and_gateway() {
        let r: ResultView = serde_json::from_str(
            r#"{"cniVersion":"1.0.0","interfaces":[{"name":"eth0","sandbox":"/x"}],
                "ips":[{"address":"fd00::5/64","gateway":"fd00::1","interface":0},
                       {"address":"10.88.0.5/16","gateway":"10.88.0.1","interface":0}]}"#,
        )
        .unwrap_or_default();
        assert_eq!(
            r.addresses(),
            Ok(vec![
                "fd00::5".parse().unwrap_or(IpAddr::from([0; 4])),
                IpAddr::from([10, 88, 0, 5])
            ])
        );
        assert_eq!(r.node_side(), Some(IpAddr::from([10, 88, 0, 1])));
    }
}
