//! Istio's proxy config, read as ztunnel reads it: the `defaultConfig` of
//! the mesh config file merged with the `PROXY_CONFIG` environment
//! variable, the variable winning field by field (ztunnel `src/config.rs`
//! `parse_proxy_config`, `construct_proxy_config`, `ProxyConfig::merge`).
//!
//! Its fields are defaults only: the agent's own flags and `DATAPLANE_*`
//! variables override them, as ztunnel's explicit environment overrides
//! them in `construct_config`. `discoveryAddress` gives istiod's address,
//! `proxyAdminPort` and `statsPort` the admin and metrics ports,
//! `concurrency` the worker threads and `proxyMetadata` (with every
//! `ISTIO_META_*` variable over it) the xDS node metadata.
//!
//! Of the MeshConfig itself, `outboundTrafficPolicy.mode` is read (ztunnel
//! reads none of it): `REGISTRY_ONLY` refuses outbound connections to
//! addresses the mesh does not know, as sidecars do; the
//! `--outbound-traffic-policy` flag overrides it.
//!
//! ```text
//! # /etc/istio/config/mesh (the `istio` ConfigMap's `mesh` key)
//! defaultConfig:
//!   discoveryAddress: istiod.istio-system.svc:15012
//!   statsPort: 15020
//! outboundTrafficPolicy:
//!   mode: REGISTRY_ONLY
//! ```

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use clap::Args;

use crate::proxy::outbound::OutboundTrafficPolicy;
use crate::xds::{NodeIdentity, node::META_PREFIX};

/// The mesh config's path (ztunnel reads `./etc/istio/config/mesh` from
/// its working directory, `/`).
pub const DEFAULT_MESH_CONFIG: &str = "/etc/istio/config/mesh";

/// The most of a mesh config file that is read: Istio's are a few
/// kilobytes, and a file that keeps growing must not exhaust memory.
const MAX_MESH_CONFIG: usize = 1 << 20;

/// The mesh config file and `PROXY_CONFIG`.
#[derive(Debug, Clone, Args)]
pub struct ProxyConfigArgs {
    /// Istio's mesh config file (a MeshConfig YAML) whose `defaultConfig`
    /// gives defaults for istiod's address, the admin and metrics ports,
    /// the worker threads and the xDS node metadata; the agent's own
    /// flags override it. A file named here must exist; the default is
    /// skipped when absent. [default: /etc/istio/config/mesh]
    #[arg(long, env = "DATAPLANE_MESH_CONFIG")]
    pub mesh_config: Option<PathBuf>,
    /// A ProxyConfig (YAML or JSON) over the mesh config's
    /// `defaultConfig`, field by field, under ztunnel's variable name
    /// (`PROXY_CONFIG`, set by Istio's chart). Empty: none.
    #[arg(long, env = "PROXY_CONFIG")]
    pub proxy_config: Option<String>,
    /// What an outbound connection to an address the mesh does not know
    /// (no workload, service or ServiceEntry has it) does: `allow-any`
    /// connects it straight from the pod, `registry-only` refuses it with
    /// a reset (access record and metrics: `REGISTRY_ONLY`). Overrides the
    /// mesh config's `outboundTrafficPolicy.mode`. [default: the mesh
    /// config's, else allow-any]
    #[arg(long, env = "DATAPLANE_OUTBOUND_TRAFFIC_POLICY", value_enum)]
    pub outbound_traffic_policy: Option<OutboundTrafficPolicyArg>,
}

/// `--outbound-traffic-policy`'s values, Istio's modes in flag spelling.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OutboundTrafficPolicyArg {
    /// `ALLOW_ANY`.
    AllowAny,
    /// `REGISTRY_ONLY`.
    RegistryOnly,
}

impl From<OutboundTrafficPolicyArg> for OutboundTrafficPolicy {
    fn from(arg: OutboundTrafficPolicyArg) -> Self {
        match arg {
            OutboundTrafficPolicyArg::AllowAny => Self::AllowAny,
            OutboundTrafficPolicyArg::RegistryOnly => Self::RegistryOnly,
        }
    }
}

/// What the mesh config file and `PROXY_CONFIG` decide, with the flags
/// that override them applied.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Loaded {
    /// The merged proxy config.
    pub proxy: ProxyConfig,
    /// `--outbound-traffic-policy`, else the mesh config's
    /// `outboundTrafficPolicy.mode`, else `ALLOW_ANY`.
    pub outbound_traffic_policy: OutboundTrafficPolicy,
}

/// The fields of Istio's ProxyConfig ztunnel uses; the others are ignored
/// (ztunnel `src/config.rs` `ProxyConfig`).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ProxyConfig {
    /// istiod's address, `host:port` (an `https://` prefix is dropped).
    pub discovery_address: Option<String>,
    /// The admin endpoint's port.
    pub proxy_admin_port: Option<u16>,
    /// The metrics endpoint's port.
    pub stats_port: Option<u16>,
    /// Worker threads; 0: one per CPU.
    pub concurrency: Option<u16>,
    /// xDS node metadata (an `ISTIO_META_` key prefix is dropped).
    /// ztunnel makes this field required; here it may be left out.
    #[serde(default)]
    pub proxy_metadata: BTreeMap<String, String>,
}

/// The part of a MeshConfig the agent reads.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct MeshConfig {
    /// The proxy config every proxy starts from.
    default_config: Option<ProxyConfig>,
    /// What proxies do with traffic to destinations outside the registry.
    outbound_traffic_policy: Option<OutboundTrafficPolicyField>,
}

/// MeshConfig's `outboundTrafficPolicy` (its `tls`, for
/// `ALLOW_ANY_DYNAMIC_DNS` only, is ignored).
#[derive(Debug, Default, serde::Deserialize)]
struct OutboundTrafficPolicyField {
    /// The mode's name, or its number as protobuf's JSON mapping also
    /// accepts; checked in [`MeshFile::from_config`].
    mode: Option<serde_yaml_ng::Value>,
}

/// What the agent takes from a mesh config file.
#[derive(Debug, Default)]
struct MeshFile {
    /// `defaultConfig`, checked.
    default_config: Option<ProxyConfig>,
    /// `outboundTrafficPolicy.mode`, when set.
    outbound_traffic_policy: Option<OutboundTrafficPolicy>,
}

impl MeshFile {
    /// The checked fields of `mesh`, read from `origin`.
    fn from_config(mesh: MeshConfig, origin: String) -> Result<Self, ProxyConfigError> {
        let mode = mesh.outbound_traffic_policy.and_then(|policy| policy.mode);
        let outbound_traffic_policy = mode
            .map(|mode| outbound_mode(&mode, &origin))
            .transpose()?
            .flatten();
        Ok(Self {
            default_config: mesh
                .default_config
                .map(|config| config.normalized(origin))
                .transpose()?,
            outbound_traffic_policy,
        })
    }
}

/// The policy an `outboundTrafficPolicy.mode` names (istio/api
/// `mesh/v1alpha1/config.proto`, `OutboundTrafficPolicy.Mode`: by name,
/// or by number as protobuf's JSON mapping allows); `None` for a null
/// mode, which leaves Istio's default (`ALLOW_ANY`, istio
/// `pkg/config/mesh/mesh.go` `DefaultMeshConfig`) in place, as Istio's
/// merge over its defaults does. `ALLOW_ANY_DYNAMIC_DNS` lets unknown
/// destinations through as `ALLOW_ANY` does: a node proxy connects to the
/// address the application dialled, which needs no DNS.
fn outbound_mode(
    mode: &serde_yaml_ng::Value,
    origin: &str,
) -> Result<Option<OutboundTrafficPolicy>, ProxyConfigError> {
    use serde_yaml_ng::Value;
    let policy = match mode {
        Value::Null => return Ok(None),
        Value::String(name) => match name.as_str() {
            "ALLOW_ANY" | "ALLOW_ANY_DYNAMIC_DNS" => Some(OutboundTrafficPolicy::AllowAny),
            "REGISTRY_ONLY" => Some(OutboundTrafficPolicy::RegistryOnly),
            _ => None,
        },
        Value::Number(number) => match number.as_u64() {
            Some(1 | 3) => Some(OutboundTrafficPolicy::AllowAny),
            Some(0) => Some(OutboundTrafficPolicy::RegistryOnly),
            _ => None,
        },
        _ => None,
    };
    policy.map(Some).ok_or_else(|| ProxyConfigError::Field {
        origin: origin.to_owned(),
        field: "outboundTrafficPolicy.mode",
        value: match mode {
            Value::String(name) => name.clone(),
            other => serde_yaml_ng::to_string(other)
                .unwrap_or_default()
                .trim()
                .to_owned(),
        },
        reason: "not a mode Istio defines; give ALLOW_ANY or REGISTRY_ONLY",
    })
}

/// A mesh config file or `PROXY_CONFIG` the agent cannot use: the message
/// names the file or variable, the field and the fix.
#[derive(Debug, thiserror::Error)]
pub enum ProxyConfigError {
    /// The file could not be read (or, named explicitly, is missing).
    #[error(
        "mesh config {path}: {source}; fix the file, or point --mesh-config (DATAPLANE_MESH_CONFIG) at a readable one"
    )]
    Read {
        /// The file.
        path: PathBuf,
        /// Why it could not be read.
        #[source]
        source: std::io::Error,
    },
    /// The file is larger than any mesh config.
    #[error("mesh config {path}: larger than {limit} bytes; is it the mesh config?")]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// The most that is read.
        limit: usize,
    },
    /// The file or variable is no MeshConfig or ProxyConfig YAML/JSON.
    #[error("{origin}: {source}; fix the YAML (field names are camelCase, ports are numbers)")]
    Parse {
        /// `mesh config <path>` or `PROXY_CONFIG`.
        origin: String,
        /// What the parser refused, with the field's path.
        #[source]
        source: serde_yaml_ng::Error,
    },
    /// A field parsed but its value cannot be used.
    #[error("{origin}: {field} {value:?}: {reason}")]
    Field {
        /// `mesh config <path>` or `PROXY_CONFIG`.
        origin: String,
        /// The field, as spelt in the YAML.
        field: &'static str,
        /// Its value.
        value: String,
        /// What is wrong and what to give instead.
        reason: &'static str,
    },
}

impl ProxyConfigArgs {
    /// The mesh config file's `defaultConfig` with `PROXY_CONFIG` over it,
    /// then the `ISTIO_META_*` variables of `env` over its metadata
    /// (ztunnel `construct_proxy_config`); and the outbound traffic
    /// policy, the flag's over the file's.
    pub fn load(&self, env: &[(String, String)]) -> Result<Loaded, ProxyConfigError> {
        let (path, explicit) = match &self.mesh_config {
            Some(path) => (path.as_path(), true),
            None => (Path::new(DEFAULT_MESH_CONFIG), false),
        };
        let mesh = read_mesh_config(path, explicit)?.unwrap_or_default();
        let file = mesh.default_config;
        let variable = match self.proxy_config.as_deref().map(str::trim) {
            None | Some("") => None,
            Some(text) => Some(ProxyConfig::parse(text, "PROXY_CONFIG".to_owned())?),
        };
        let mut merged = [file, variable]
            .into_iter()
            .flatten()
            .fold(ProxyConfig::default(), ProxyConfig::merge);
        merged
            .proxy_metadata
            .extend(NodeIdentity::extra_from(env.iter().cloned()));
        Ok(Loaded {
            proxy: merged,
            outbound_traffic_policy: self
                .outbound_traffic_policy
                .map(OutboundTrafficPolicy::from)
                .or(mesh.outbound_traffic_policy)
                .unwrap_or_default(),
        })
    }
}

/// What the agent reads of the mesh config at `path`; a missing file is
/// none unless it was named explicitly.
fn read_mesh_config(path: &Path, explicit: bool) -> Result<Option<MeshFile>, ProxyConfigError> {
    let (bytes, more) = match dataplane_core::fs::read_at_most(path, MAX_MESH_CONFIG) {
        Ok(read) => read,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && !explicit => return Ok(None),
        Err(source) => {
            return Err(ProxyConfigError::Read {
                path: path.to_owned(),
                source,
            });
        }
    };
    if more {
        return Err(ProxyConfigError::TooLarge {
            path: path.to_owned(),
            limit: MAX_MESH_CONFIG,
        });
    }
    let origin = || format!("mesh config {}", path.display());
    // An empty file is an empty MeshConfig, as ztunnel's YAML parser
    // takes it.
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(None);
    }
    let mesh: MeshConfig =
        serde_yaml_ng::from_slice(&bytes).map_err(|source| ProxyConfigError::Parse {
            origin: origin(),
            source,
        })?;
    MeshFile::from_config(mesh, origin()).map(Some)
}

impl ProxyConfig {
    /// A ProxyConfig in YAML or JSON from `origin`, checked.
    fn parse(text: &str, origin: String) -> Result<Self, ProxyConfigError> {
        let config: Option<Self> =
            serde_yaml_ng::from_str(text).map_err(|source| ProxyConfigError::Parse {
                origin: origin.clone(),
                source,
            })?;
        config.unwrap_or_default().normalized(origin)
    }

    /// `other`'s fields over these, metadata key by key (ztunnel
    /// `ProxyConfig::merge`).
    fn merge(mut self, other: Self) -> Self {
        self.discovery_address = other.discovery_address.or(self.discovery_address);
        self.proxy_admin_port = other.proxy_admin_port.or(self.proxy_admin_port);
        self.stats_port = other.stats_port.or(self.stats_port);
        self.concurrency = other.concurrency.or(self.concurrency);
        self.proxy_metadata.extend(other.proxy_metadata);
        self
    }

    /// Checked before merging, so an error names where the value came
    /// from: the address as `host:port`, the metadata keys without
    /// `ISTIO_META_`.
    fn normalized(mut self, origin: String) -> Result<Self, ProxyConfigError> {
        let field = |field, value: &str, reason| ProxyConfigError::Field {
            origin: origin.clone(),
            field,
            value: value.to_owned(),
            reason,
        };
        // ztunnel treats an empty address as unset (`empty_to_none`) and
        // prefixes `https://` to one without a scheme (`validate_uri`);
        // the agent's --istiod-address is the `host:port` alone.
        self.discovery_address = match self.discovery_address.as_deref().map(str::trim) {
            None | Some("") => None,
            Some(address) => {
                let bare = address.strip_prefix("https://").unwrap_or(address);
                let port = bare.rsplit_once(':').map(|(host, port)| {
                    (
                        host.trim_matches(['[', ']']).is_empty(),
                        port.parse::<u16>(),
                    )
                });
                if bare.contains('/') || !matches!(port, Some((false, Ok(_)))) {
                    return Err(field(
                        "discoveryAddress",
                        address,
                        "not host:port (or https://host:port); give e.g. istiod.istio-system.svc:15012",
                    ));
                }
                Some(bare.to_owned())
            }
        };
        if let Some(threads) = self.concurrency
            && threads > MAX_WORKER_THREADS
        {
            return Err(field(
                "concurrency",
                &threads.to_string(),
                "at most 1024 worker threads; give 0 for one per CPU",
            ));
        }
        self.proxy_metadata = std::mem::take(&mut self.proxy_metadata)
            .into_iter()
            .filter_map(|(key, value)| {
                let key = key.strip_prefix(META_PREFIX).unwrap_or(&key).to_owned();
                (!key.is_empty()).then_some((key, value))
            })
            .collect();
        Ok(self)
    }

    /// The worker threads `concurrency` asks for: `None` (one per CPU)
    /// when unset or 0, as ztunnel's `construct_config` uses all cores for
    /// 0.
    pub fn worker_threads(&self) -> Option<u16> {
        self.concurrency.filter(|&threads| threads > 0)
    }
}

/// The most worker threads `--worker-threads` allows.
const MAX_WORKER_THREADS: u16 = 1024;

#[cfg(test)]
#[expect(
    clippy::unwrap_used,
    reason = "a bad fixture should fail the test loudly"
)]
#[path = "proxy_config_tests.rs"]
mod tests;
