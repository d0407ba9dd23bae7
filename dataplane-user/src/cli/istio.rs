//! Flags that make the agent a member of an Istio mesh: where istiod is,
//! how to trust and authenticate to it, who the agent is to it, and which
//! of its services to use (workloads over xDS, certificates from its CA).
//!
//! The environment names mirror the downward-API variables Istio's node
//! proxy DaemonSet sets (`POD_NAME`, `POD_NAMESPACE`, `INSTANCE_IP`,
//! `CLUSTER_ID`) under the agent's `DATAPLANE_` prefix.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::PathBuf;

use clap::Args;

use crate::agent::config::IstiodConfig;
use crate::xds::NodeIdentity;

/// Where workload certificates come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum CertSourceKind {
    /// The agent's own CA (`--ca-dir` or `--ca-cert`/`--ca-key`).
    #[default]
    Builtin,
    /// Istio's CA (`CreateCertificate` on `--istiod-address`).
    Istio,
    /// Certificates mounted as files (`--cert-dir`), e.g. by cert-manager.
    Files,
    /// X.509-SVIDs from the SPIFFE Workload API (e.g. the SPIRE agent) at
    /// `--spiffe-endpoint-socket`.
    Spiffe,
}

/// How to reach istiod and what to ask it for.
#[derive(Debug, Clone, Args)]
pub struct IstioArgs {
    /// istiod's address (`host:port`), e.g. `istiod.istio-system.svc:15012`
    /// [default: the proxy config's discoveryAddress]. Needed by `--xds`
    /// and `--cert-source istio`.
    #[arg(long, env = "DATAPLANE_ISTIOD_ADDRESS")]
    pub istiod_address: Option<String>,
    /// The name istiod's certificate must carry [default: the host of
    /// --istiod-address].
    #[arg(long, env = "DATAPLANE_ISTIOD_SERVER_NAME")]
    pub istiod_server_name: Option<String>,
    /// The mesh root(s) istiod's certificate chains to (PEM; the
    /// `istio-ca-root-cert` ConfigMap's `root-cert.pem`), or `SYSTEM` for
    /// the system's roots (ztunnel's `XDS_ROOT_CA=SYSTEM`; `SSL_CERT_FILE`
    /// and `SSL_CERT_DIR` are honoured).
    #[arg(
        long,
        env = "DATAPLANE_ISTIOD_ROOT_CERT",
        default_value = "/var/run/secrets/istio/root-cert.pem"
    )]
    pub istiod_root_cert: PathBuf,
    /// The agent's projected service-account token (audience `istio-ca`),
    /// sent as the bearer credential. `none` sends no token.
    #[arg(
        long,
        env = "DATAPLANE_ISTIOD_TOKEN",
        default_value = "/var/run/secrets/tokens/istio-token"
    )]
    pub istiod_token: PathBuf,
    /// Take workloads, services and authorization policies from istiod
    /// (delta xDS). With --config as well, the file's entries win.
    #[arg(long, env = "DATAPLANE_XDS")]
    pub xds: bool,
    /// Where workload certificates come from.
    #[arg(
        long,
        env = "DATAPLANE_CERT_SOURCE",
        value_enum,
        default_value = "builtin"
    )]
    pub cert_source: CertSourceKind,
    /// With `--cert-source istio`: the CA's address (`host:port`) when it
    /// is not istiod, e.g. cert-manager's istio-csr
    /// (`cert-manager-istio-csr.cert-manager.svc:443`) [default:
    /// --istiod-address]. ztunnel's `CA_ADDRESS` (`src/config.rs`
    /// `construct_config`, default the xDS address).
    #[arg(long, env = "DATAPLANE_CA_ADDRESS")]
    pub ca_address: Option<String>,
    /// The name the CA's certificate must carry [default: the host of
    /// --ca-address, or istiod's name when the CA is istiod]. ztunnel's
    /// `ALT_CA_HOSTNAME`.
    #[arg(long, env = "DATAPLANE_CA_SERVER_NAME")]
    pub ca_server_name: Option<String>,
    /// The root(s) the CA's serving certificate chains to (PEM, or
    /// `SYSTEM`) [default: --istiod-root-cert]. Only the CA's TLS uses it:
    /// the mesh's roots are --mesh-root-cert. ztunnel's `CA_ROOT_CA`.
    #[arg(long, env = "DATAPLANE_CA_SERVER_ROOT_CERT")]
    pub ca_server_root_cert: Option<PathBuf>,
    /// With `--cert-source istio`: the mesh's root(s), which peers'
    /// certificates chain to (PEM; the `istio-ca-root-cert` ConfigMap's
    /// `root-cert.pem`) [default: --istiod-root-cert, which must then be a
    /// file].
    #[arg(long, env = "DATAPLANE_MESH_ROOT_CERT")]
    pub mesh_root_cert: Option<PathBuf>,
    /// With `--cert-source files`: the directory of mounted certificates.
    #[arg(long, env = "DATAPLANE_CERT_DIR")]
    pub cert_dir: Option<PathBuf>,
    /// With `--cert-source spiffe`: the SPIFFE Workload API's socket,
    /// `unix:///path` (e.g. the SPIRE agent's
    /// `unix:///run/spire/sockets/agent.sock`). Read from the standard
    /// `SPIFFE_ENDPOINT_SOCKET`; ignored by the other sources.
    #[arg(long, env = "SPIFFE_ENDPOINT_SOCKET")]
    pub spiffe_endpoint_socket: Option<String>,
    /// This agent's pod name, as istiod knows it.
    #[arg(long, env = "DATAPLANE_POD_NAME")]
    pub pod_name: Option<String>,
    /// This agent's pod namespace.
    #[arg(long, env = "DATAPLANE_POD_NAMESPACE", default_value = "istio-system")]
    pub pod_namespace: String,
    /// This agent's pod IP.
    #[arg(long, env = "DATAPLANE_INSTANCE_IP")]
    pub instance_ip: Option<IpAddr>,
    /// The cluster id istiod knows this cluster by.
    #[arg(long, env = "DATAPLANE_CLUSTER_ID", default_value = "Kubernetes")]
    pub cluster_id: String,
}

/// Flags that do not fit together.
#[derive(Debug, thiserror::Error)]
pub enum IstioArgsError {
    /// A flag another one needs is missing.
    #[error("{what} needs {needed}")]
    Missing {
        /// The flag or mode that needs it.
        what: &'static str,
        /// What to set.
        needed: &'static str,
    },
    /// The address has no host.
    #[error("--istiod-address `{0}` is not host:port; give e.g. istiod.istio-system.svc:15012")]
    Address(String),
    /// The CA's address has no host.
    #[error(
        "--ca-address `{0}` is not host:port; give e.g. cert-manager-istio-csr.cert-manager.svc:443"
    )]
    CaAddress(String),
    /// An `XDS_HEADER_*` or `CA_HEADER_*` variable that is no gRPC
    /// metadata.
    #[error(
        "environment variable {variable}: {reason}; the name after the prefix must be a lowercase-able ASCII header name (not ending in -bin) and the value printable ASCII"
    )]
    Header {
        /// The variable.
        variable: String,
        /// What is wrong.
        reason: &'static str,
    },
    /// A CA flag without `--cert-source istio`, which alone uses it.
    #[error("{0} applies only to --cert-source istio; set that, or drop {0}")]
    CaFlagUnused(&'static str),
}

impl IstioArgs {
    /// Whether anything asks istiod: xDS, or Istio's CA unless
    /// `--ca-address` names another server.
    pub fn uses_istiod(&self) -> bool {
        self.xds || (self.cert_source == CertSourceKind::Istio && self.ca_address.is_none())
    }

    /// How to reach istiod, when anything asks it. Its root file is read
    /// when the agent starts ([`IstiodConfig::endpoint`]).
    pub fn istiod_config(&self) -> Result<Option<IstiodConfig>, IstioArgsError> {
        if !self.uses_istiod() {
            return Ok(None);
        }
        let address = self.istiod_address.clone().ok_or(IstioArgsError::Missing {
            what: "--xds or --cert-source istio",
            needed: "--istiod-address or the mesh config's discoveryAddress (or, for the CA alone, --ca-address)",
        })?;
        let server_name = match &self.istiod_server_name {
            Some(name) => name.clone(),
            None => host_of(&address)
                .ok_or_else(|| IstioArgsError::Address(address.clone()))?
                .to_owned(),
        };
        Ok(Some(IstiodConfig {
            address,
            server_name,
            root_cert: self.istiod_root_cert.clone(),
            token_file: self.token_file(),
            headers: Vec::new(),
        }))
    }

    /// The mesh's roots with `--cert-source istio`: `--mesh-root-cert`,
    /// else istiod's root file. The system's roots are no mesh's: with
    /// `--istiod-root-cert SYSTEM` the mesh's must be given.
    pub fn mesh_roots(&self) -> Result<PathBuf, IstioArgsError> {
        match &self.mesh_root_cert {
            Some(path) => Ok(path.clone()),
            None if crate::agent::config::is_system_roots(&self.istiod_root_cert) => {
                Err(IstioArgsError::Missing {
                    what: "--cert-source istio with --istiod-root-cert SYSTEM",
                    needed: "--mesh-root-cert (the mesh's root: the istio-ca-root-cert ConfigMap's root-cert.pem)",
                })
            }
            None => Ok(self.istiod_root_cert.clone()),
        }
    }

    /// Where Istio's CA is, with `--cert-source istio`: `--ca-address`
    /// and its name and root when given, istiod's otherwise (as ztunnel's
    /// `CA_ADDRESS`, `ALT_CA_HOSTNAME` and `CA_ROOT_CA` default to the
    /// xDS server's). The token is istiod's.
    pub fn ca_server_config(&self) -> Result<Option<IstiodConfig>, IstioArgsError> {
        if self.cert_source != CertSourceKind::Istio {
            for (flag, set) in [
                ("--ca-address", self.ca_address.is_some()),
                ("--ca-server-name", self.ca_server_name.is_some()),
                ("--ca-server-root-cert", self.ca_server_root_cert.is_some()),
                ("--mesh-root-cert", self.mesh_root_cert.is_some()),
            ] {
                if set {
                    return Err(IstioArgsError::CaFlagUnused(flag));
                }
            }
            return Ok(None);
        }
        let mut server = match &self.ca_address {
            Some(address) => {
                let host =
                    host_of(address).ok_or_else(|| IstioArgsError::CaAddress(address.clone()))?;
                IstiodConfig {
                    address: address.clone(),
                    server_name: host.to_owned(),
                    root_cert: self.istiod_root_cert.clone(),
                    token_file: self.token_file(),
                    headers: Vec::new(),
                }
            }
            None => match self.istiod_config()? {
                Some(istiod) => istiod,
                None => {
                    return Err(IstioArgsError::Missing {
                        what: "--cert-source istio",
                        needed: "--istiod-address or --ca-address",
                    });
                }
            },
        };
        if let Some(name) = &self.ca_server_name {
            server.server_name = name.clone();
        }
        if let Some(root) = &self.ca_server_root_cert {
            server.root_cert = root.clone();
        }
        Ok(Some(server))
    }

    /// The bearer token file; `None` with `--istiod-token none`.
    fn token_file(&self) -> Option<PathBuf> {
        (self.istiod_token.as_os_str() != "none").then(|| self.istiod_token.clone())
    }

    /// The directory of mounted certificates, with `--cert-source files`.
    pub fn cert_dir(&self) -> Result<Option<PathBuf>, IstioArgsError> {
        match (self.cert_source, &self.cert_dir) {
            (CertSourceKind::Files, Some(dir)) => Ok(Some(dir.clone())),
            (CertSourceKind::Files, None) => Err(IstioArgsError::Missing {
                what: "--cert-source files",
                needed: "--cert-dir (the directory of mounted certificates)",
            }),
            _ => Ok(None),
        }
    }

    /// The Workload API's socket with `--cert-source spiffe` (required
    /// then), `None` otherwise.
    pub fn spiffe_endpoint(&self) -> Result<Option<String>, IstioArgsError> {
        match (self.cert_source, &self.spiffe_endpoint_socket) {
            (CertSourceKind::Spiffe, Some(endpoint)) => Ok(Some(endpoint.clone())),
            (CertSourceKind::Spiffe, None) => Err(IstioArgsError::Missing {
                what: "--cert-source spiffe",
                needed: "--spiffe-endpoint-socket or SPIFFE_ENDPOINT_SOCKET (e.g. unix:///run/spire/sockets/agent.sock)",
            }),
            _ => Ok(None),
        }
    }

    /// Who the agent is to istiod (`node_name`: this node); `metadata` is
    /// its extra node metadata (the proxy config's `proxyMetadata` with
    /// the `ISTIO_META_*` variables over it, prefixes removed).
    pub fn node_identity(
        &self,
        node_name: Option<&str>,
        metadata: BTreeMap<String, String>,
    ) -> Result<NodeIdentity, IstioArgsError> {
        let missing = |needed| IstioArgsError::Missing {
            what: "--xds",
            needed,
        };
        Ok(NodeIdentity {
            ip: self.instance_ip.ok_or(missing("--instance-ip"))?,
            pod: self.pod_name.clone().ok_or(missing("--pod-name"))?,
            namespace: self.pod_namespace.clone(),
            node_name: node_name.ok_or(missing("--node"))?.to_owned(),
            cluster_id: Some(self.cluster_id.clone()),
            extra: metadata,
        })
    }

    /// Who the agent is to istiod, when `--xds` is on.
    pub fn xds_node(
        &self,
        node_name: Option<&str>,
        metadata: BTreeMap<String, String>,
    ) -> Result<Option<NodeIdentity>, IstioArgsError> {
        if !self.xds {
            return Ok(None);
        }
        self.node_identity(node_name, metadata).map(Some)
    }
}

/// Environment prefix of extra gRPC metadata for xDS requests (ztunnel's
/// `ISTIO_XDS_HEADER_PREFIX`, `src/config.rs`).
pub const XDS_HEADER_PREFIX: &str = "XDS_HEADER_";
/// Environment prefix of extra gRPC metadata for CA requests (ztunnel's
/// `ISTIO_CA_HEADER_PREFIX`).
pub const CA_HEADER_PREFIX: &str = "CA_HEADER_";

/// The gRPC metadata `env` names under `prefix`: `XDS_HEADER_X_TENANT=a`
/// sends `x_tenant: a`, as ztunnel's `parse_headers` (`src/config.rs`)
/// does; sorted by name so the order does not follow the environment's.
pub fn grpc_headers(
    env: &[(String, String)],
    prefix: &str,
) -> Result<Vec<(String, String)>, IstioArgsError> {
    use tonic::metadata::{AsciiMetadataKey, AsciiMetadataValue};
    let mut headers = Vec::new();
    for (variable, value) in env {
        let Some(name) = variable.strip_prefix(prefix) else {
            continue;
        };
        let bad = |reason| IstioArgsError::Header {
            variable: variable.clone(),
            reason,
        };
        let key: AsciiMetadataKey = name.parse().map_err(|_| bad("not a header name"))?;
        let _: AsciiMetadataValue = value.parse().map_err(|_| bad("not a header value"))?;
        headers.push((key.as_str().to_owned(), value.clone()));
    }
    headers.sort();
    Ok(headers)
}

/// The host of `host:port` or `[v6]:port`.
fn host_of(address: &str) -> Option<&str> {
    let (host, _port) = address.rsplit_once(':')?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    (!host.is_empty()).then_some(host)
}

#[cfg(test)]
#[expect(
    clippy::unwrap_used,
    reason = "a bad fixture should fail the test loudly"
)]
mod tests {
    use super::*;

    #[test]
    fn files_need_a_cert_dir() {
        use clap::Parser as _;
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            istio: IstioArgs,
        }
        let parse = |args: &[&str]| Cli::try_parse_from([&["t"], args].concat()).unwrap().istio;
        let error = parse(&["--cert-source", "files"]).cert_dir().unwrap_err();
        assert!(error.to_string().contains("--cert-dir"), "{error}");
        let dir = parse(&["--cert-source", "files", "--cert-dir", "/certs"]).cert_dir();
        assert_eq!(dir.unwrap(), Some(PathBuf::from("/certs")));
        assert_eq!(parse(&["--cert-dir", "/certs"]).cert_dir().unwrap(), None);
    }

    #[test]
    fn what_istiod_needs_is_asked_for_by_name() {
        use clap::Parser as _;
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            istio: IstioArgs,
        }
        let parse = |args: &[&str]| Cli::try_parse_from([&["t"], args].concat());
        // --xds or the istio source without an address (which the mesh
        // config may give) is refused when read.
        for flags in [&["--xds"][..], &["--cert-source", "istio"]] {
            let istio = parse(flags).unwrap().istio;
            let error = istio.istiod_config().unwrap_err().to_string();
            assert!(error.contains("needs --istiod-address"), "{error}");
        }
        let bare = parse(&["--xds", "--istiod-address", "istiod:15012"])
            .unwrap()
            .istio;
        let error = bare
            .xds_node(Some("node-a"), BTreeMap::new())
            .unwrap_err()
            .to_string();
        assert!(error.contains("--xds needs"), "{error}");
        // Who the agent is, once it is all given.
        let full = parse(&[
            "--xds",
            "--istiod-address",
            "istiod.istio-system.svc:15012",
            "--istiod-root-cert",
            "/nonexistent/root-cert.pem",
            "--pod-name",
            "dataplane-abc",
            "--instance-ip",
            "10.0.0.7",
        ])
        .unwrap()
        .istio;
        // The root file is read when the agent starts, not when the flags are.
        let istiod = full.istiod_config().unwrap().unwrap();
        let error = istiod.endpoint().unwrap_err().to_string();
        assert!(error.contains("/nonexistent/root-cert.pem"), "{error}");
        let node = full
            .node_identity(Some("node-a"), BTreeMap::from([("A".into(), "b".into())]))
            .unwrap();
        assert_eq!(node.extra.get("A").map(String::as_str), Some("b"));
        assert_eq!(
            node.id(),
            "ztunnel~10.0.0.7~dataplane-abc.istio-system~istio-system.svc.cluster.local"
        );
        assert!(
            full.node_identity(None, BTreeMap::new())
                .unwrap_err()
                .to_string()
                .contains("--node")
        );
    }

    #[test]
    fn hosts_are_taken_from_addresses() {
        assert_eq!(
            host_of("istiod.istio-system.svc:15012"),
            Some("istiod.istio-system.svc")
        );
        assert_eq!(host_of("[fd00::1]:15012"), Some("fd00::1"));
        assert_eq!(host_of(":15012"), None);
        assert_eq!(host_of("istiod"), None);
    }
}
