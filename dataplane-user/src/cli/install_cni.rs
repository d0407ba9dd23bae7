//! The flags of `dataplane install-cni`. They convert into the plain
//! [`InstallConfig`] the installer takes, so `cni::install` knows nothing
//! of clap.

use std::{path::PathBuf, time::Duration};

use clap::{Args, ValueEnum};

use crate::cni::{
    install::InstallConfig,
    spec::{DEFAULT_AGENT_SOCKET, UnreachablePolicy},
};

/// `dataplane install-cni` options.
#[derive(Debug, Clone, Args)]
pub struct InstallCniArgs {
    /// The plugin binary to install [default: `dataplane-cni` beside this
    /// executable].
    #[arg(long, env = "DATAPLANE_CNI_PLUGIN_BINARY")]
    pub plugin_binary: Option<PathBuf>,
    /// The host's CNI bin directory, as mounted here.
    #[arg(
        long,
        env = "DATAPLANE_CNI_BIN_DIR",
        default_value = "/host/opt/cni/bin"
    )]
    pub cni_bin_dir: PathBuf,
    /// The host's CNI configuration directory, as mounted here.
    #[arg(
        long,
        env = "DATAPLANE_CNI_CONF_DIR",
        default_value = "/host/etc/cni/net.d"
    )]
    pub cni_conf_dir: PathBuf,
    /// The same directory as the host sees it (paths written into the
    /// configuration are host paths).
    #[arg(
        long,
        env = "DATAPLANE_HOST_CNI_CONF_DIR",
        default_value = "/etc/cni/net.d"
    )]
    pub host_cni_conf_dir: PathBuf,
    /// Insert into this configuration file (a name in the configuration
    /// directory) instead of the first one by name.
    #[arg(long, env = "DATAPLANE_CNI_CONF_FILE")]
    pub conf_file: Option<String>,
    /// The agent's control socket, as the host sees it.
    #[arg(long, env = "DATAPLANE_CNI_AGENT_SOCKET", default_value = DEFAULT_AGENT_SOCKET)]
    pub agent_socket: PathBuf,
    /// What the plugin does when the agent cannot be reached: `fail` (the
    /// pod does not start) or `pass` (it starts uncaptured).
    #[arg(
        long,
        env = "DATAPLANE_CNI_ON_AGENT_UNREACHABLE",
        value_enum,
        default_value = "fail"
    )]
    pub on_agent_unreachable: UnreachablePolicyFlag,
    /// Namespaces whose pods the plugin never enrolls (repeatable, or
    /// comma-separated): at least the agent's own, so it can always start.
    #[arg(
        long = "exclude-namespace",
        env = "DATAPLANE_CNI_EXCLUDE_NAMESPACES",
        value_delimiter = ',',
        default_value = "kube-system"
    )]
    pub exclude_namespaces: Vec<String>,
    /// Which pods the plugin enrolls (Istio's enablement selectors, as the
    /// agent's `--enablement-selectors`) [default: Istio's].
    #[arg(long, env = "DATAPLANE_ENABLEMENT_SELECTORS", value_parser = crate::kube::optin::parse_selectors_arg)]
    pub enablement_selectors: Option<crate::kube::optin::EnablementSelectors>,
    /// SPIFFE trust domain of the pods' identities.
    #[arg(long, env = "DATAPLANE_TRUST_DOMAIN", default_value = "cluster.local")]
    pub trust_domain: String,
    /// Kubernetes API server for the plugin [default: from
    /// KUBERNETES_SERVICE_HOST/PORT]. Without one no kubeconfig is written
    /// and the plugin enrolls every pod.
    #[arg(long, env = "DATAPLANE_KUBE_API_SERVER")]
    pub kube_api_server: Option<String>,
    /// Write no kubeconfig for the plugin (it then enrolls every pod).
    #[arg(
        long,
        env = "DATAPLANE_CNI_NO_KUBECONFIG",
        conflicts_with = "kube_api_server"
    )]
    pub no_kubeconfig: bool,
    /// Service-account token the plugin authenticates with (copied to the
    /// host and refreshed).
    #[arg(
        long,
        env = "DATAPLANE_KUBE_TOKEN_FILE",
        default_value = "/var/run/secrets/kubernetes.io/serviceaccount/token"
    )]
    pub kube_token_file: PathBuf,
    /// CA bundle of the API server.
    #[arg(
        long,
        env = "DATAPLANE_KUBE_CA_FILE",
        default_value = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"
    )]
    pub kube_ca_file: PathBuf,
    /// Install once and exit instead of watching.
    #[arg(long)]
    pub once: bool,
    /// Remove everything installed and exit.
    #[arg(long, conflicts_with = "once")]
    pub uninstall: bool,
    /// On SIGTERM/SIGINT, remove the plugin from the configuration and the
    /// binary from the bin directory.
    #[arg(long, env = "DATAPLANE_CNI_CLEANUP_ON_EXIT")]
    pub cleanup_on_exit: bool,
    /// How often the installation is checked (and the token refreshed)
    /// besides directory change notifications, e.g. `10s`.
    #[arg(long, env = "DATAPLANE_CNI_RESYNC", default_value = "10s", value_parser = dataplane_core::parse::parse_duration)]
    pub resync: Duration,
}

/// The values of `--on-agent-unreachable` (their docs are the flag's
/// help).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum UnreachablePolicyFlag {
    /// Fail the ADD: the pod does not start (the runtime retries).
    Fail,
    /// Let the pod start uncaptured (the agent's reconciler enrolls it
    /// later if it opted in).
    Pass,
}

impl From<UnreachablePolicyFlag> for UnreachablePolicy {
    fn from(flag: UnreachablePolicyFlag) -> Self {
        match flag {
            UnreachablePolicyFlag::Fail => Self::Fail,
            UnreachablePolicyFlag::Pass => Self::Pass,
        }
    }
}

impl From<InstallCniArgs> for InstallConfig {
    fn from(args: InstallCniArgs) -> Self {
        Self {
            plugin_binary: args.plugin_binary,
            cni_bin_dir: args.cni_bin_dir,
            cni_conf_dir: args.cni_conf_dir,
            host_cni_conf_dir: args.host_cni_conf_dir,
            conf_file: args.conf_file,
            agent_socket: args.agent_socket,
            on_agent_unreachable: args.on_agent_unreachable.into(),
            exclude_namespaces: args.exclude_namespaces,
            enablement_selectors: args.enablement_selectors,
            trust_domain: args.trust_domain,
            kube_api_server: args.kube_api_server,
            no_kubeconfig: args.no_kubeconfig,
            kube_token_file: args.kube_token_file,
            kube_ca_file: args.kube_ca_file,
            once: args.once,
            uninstall: args.uninstall,
            cleanup_on_exit: args.cleanup_on_exit,
            resync: args.resync,
        }
    }
}
