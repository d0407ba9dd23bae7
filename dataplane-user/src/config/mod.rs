//! The local configuration file: workloads, services and authorization
//! policies in the shape Istio's node proxy accepts for local config.
//!
//! Parsing is strict: an unknown field, a bad IP, CIDR or port is an error
//! that names the file, the line and the column; so is a duplicate workload
//! IP or service VIP, or a reference to a service or policy that does not
//! exist. Nothing is silently ignored.

mod schema;
mod validate;

pub use schema::{Action, LoadBalancing, Match, Policy, Scope, Service};

use std::{
    net::IpAddr,
    path::{Path, PathBuf},
};

use serde::Deserialize;

/// The configuration compiled into the agent (see `config/default.yaml`).
pub const EMBEDDED_DEFAULT: &str = include_str!("default.yaml");

/// Errors reading a configuration.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config file {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The YAML is malformed or does not match the schema.
    #[error("invalid config {origin}")]
    Parse {
        /// The file path, or `<embedded default>`.
        origin: String,
        /// The parser's error, which carries line and column.
        #[source]
        source: serde_yaml_ng::Error,
    },
    /// The file parses but contradicts itself.
    #[error("invalid config {origin}:{line}:{column}: {field}: {reason}")]
    Invalid {
        /// The file path, or `<embedded default>`.
        origin: String,
        /// 1-based line of the offending value (best effort: its first
        /// occurrence after the entry's start).
        line: usize,
        /// 1-based column.
        column: usize,
        /// The field, e.g. `workloads[2].workloadIps`.
        field: String,
        /// What is wrong and how to fix it.
        reason: String,
    },
}

/// Whether a workload speaks HBONE or plain TCP.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Protocol {
    /// Mutual-TLS HTTP/2 CONNECT tunnels on port 15008.
    #[default]
    Hbone,
    /// Plain TCP (not in the mesh).
    Tcp,
}

/// One workload (pod).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Workload {
    /// Unique id, e.g. `cluster1//v1/Pod/default/web-0`.
    pub uid: String,
    /// Pod name.
    pub name: String,
    /// Kubernetes namespace.
    pub namespace: String,
    /// Service account (the identity's last component).
    #[serde(default = "default_service_account")]
    pub service_account: String,
    /// SPIFFE trust domain.
    #[serde(default = "default_trust_domain")]
    pub trust_domain: String,
    /// Pod IPs.
    #[serde(default)]
    pub workload_ips: Vec<IpAddr>,
    /// Protocol the workload accepts.
    #[serde(default)]
    pub protocol: Protocol,
    /// Node the workload runs on.
    #[serde(default)]
    pub node: String,
    /// Network namespace path, for workloads this agent enrolls at start
    /// (standalone mode).
    #[serde(default)]
    pub netns: Option<PathBuf>,
    /// Services this workload is an endpoint of: `namespace/hostname` ->
    /// service port -> target port.
    #[serde(default)]
    pub services: std::collections::BTreeMap<String, std::collections::BTreeMap<u16, u16>>,
    /// `namespace/name` of WorkloadSelector-scoped policies that apply.
    #[serde(default)]
    pub authorization_policies: Vec<String>,
}

fn default_service_account() -> String {
    "default".into()
}

fn default_trust_domain() -> String {
    "cluster.local".into()
}

/// A parsed configuration.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LocalConfig {
    /// Where it came from (a path, or `<embedded default>`).
    pub origin: String,
    /// Workloads.
    pub workloads: Vec<Workload>,
    /// Services.
    pub services: Vec<Service>,
    /// Authorization policies.
    pub policies: Vec<Policy>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    #[serde(default)]
    workloads: Vec<Workload>,
    #[serde(default)]
    services: Vec<Service>,
    #[serde(default)]
    policies: Vec<Policy>,
}

impl LocalConfig {
    /// The embedded default.
    pub fn embedded() -> Result<Self, ConfigError> {
        Self::parse(EMBEDDED_DEFAULT, "<embedded default>")
    }

    /// Reads and parses `path`.
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Self::parse(&text, &path.display().to_string())
    }

    /// Parses YAML text; `origin` names it in errors.
    pub fn parse(text: &str, origin: &str) -> Result<Self, ConfigError> {
        let raw: RawConfig =
            serde_yaml_ng::from_str(text).map_err(|source| ConfigError::Parse {
                origin: origin.to_owned(),
                source,
            })?;
        let config = Self {
            origin: origin.to_owned(),
            workloads: raw.workloads,
            services: raw.services,
            policies: raw.policies,
        };
        validate::check(&config, text)?;
        Ok(config)
    }
}

#[cfg(test)]
#[expect(
    clippy::unwrap_used,
    reason = "a bad fixture should fail the test loudly"
)]
mod tests {
    use super::*;

    #[test]
    fn embedded_default_parses() {
        let config = LocalConfig::embedded().expect("embedded default must parse");
        assert!(config.workloads.is_empty());
    }

    #[test]
    fn workload_defaults_and_fields() {
        let config = LocalConfig::parse(
            "workloads:\n- uid: u1\n  name: web\n  namespace: shop\n  workloadIps: [10.0.0.5]\n",
            "t",
        )
        .expect("valid config");
        let w = &config.workloads[0];
        assert_eq!(w.trust_domain, "cluster.local");
        assert_eq!(w.service_account, "default");
        assert_eq!(w.protocol, Protocol::Hbone);
        assert_eq!(w.workload_ips, vec!["10.0.0.5".parse::<IpAddr>().unwrap()]);
    }

    #[test]
    fn unknown_field_is_rejected_with_position() {
        let err = LocalConfig::parse(
            "workloads:\n- uid: u1\n  name: web\n  namespace: shop\n  colour: red\n",
            "cfg.yaml",
        )
        .unwrap_err();
        let err = crate::logging::Chain(&err).to_string();
        assert!(err.contains("cfg.yaml"), "{err}");
        assert!(err.contains("colour"), "{err}");
        assert!(err.contains("line 5"), "{err}");
    }

    #[test]
    fn bad_ip_is_rejected() {
        let err = LocalConfig::parse(
            "workloads:\n- uid: u1\n  name: web\n  namespace: shop\n  workloadIps: [10.0.0.300]\n",
            "cfg.yaml",
        )
        .unwrap_err();
        let err = crate::logging::Chain(&err).to_string();
        assert!(err.contains("invalid"), "{err}");
    }
}
