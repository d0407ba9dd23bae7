//! The agent's configuration: one plain, serializable [`AgentConfig`]
//! composed of each component's `Config`, built once from the flags
//! (`cli::RunArgs::into_config`, where every flag check is) before anything
//! starts, logged at start-up and shown in `config_dump` as `agentConfig`.
//! Nothing here knows of clap; files the flags name (istiod's roots, the CA)
//! are read when the agent starts, not here.

use std::{
    net::{IpAddr, SocketAddr},
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use rustls::RootCertStore;
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;
use serde::Serialize;

use crate::{
    dns::DnsConfig,
    hbone::{pool::PoolSpread, wire::H2Settings},
    istiod::IstiodEndpoint,
    kube::optin::{EnablementSelector, EnrollmentRule},
    logging::LogFormat,
    proxy::{
        keepalive::Keepalive,
        original_source::{OriginalSource, SourceRouting},
    },
    redirect::ExitMode,
    workers::Threading,
    xds::{NodeIdentity, XdsConfig},
    zds::ZdsConfig,
};

/// Largest root bundle file read.
const MAX_ROOT_FILE: usize = 1024 * 1024;

/// Priority of the in-pod original-source rules: before the main table's
/// (32766).
pub const ORIGINAL_SOURCE_RULE_PRIORITY: u32 = 32764;

/// Everything the agent runs with. Built before anything starts; the
/// agent reads no flag and no environment variable after.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct AgentConfig {
    /// The local config file (workloads, services, policies); `None`: the
    /// embedded default.
    pub workloads_file: Option<PathBuf>,
    /// Where the instance keeps its kernel and enrollment state.
    pub state: StateConfig,
    /// This node's name.
    pub node: Option<String>,
    /// How pod traffic reaches the in-pod listeners.
    pub capture: Capture,
    /// The kernel programs' settings.
    pub redirect: RedirectConfig,
    /// Whether apps see their clients' own addresses.
    pub original_source: OriginalSourceConfig,
    /// DNS capture.
    pub dns: DnsConfig,
    /// What serves enrolled pods.
    pub engine: EngineConfig,
    /// Where the HTTP endpoints listen.
    pub endpoints: EndpointsConfig,
    /// Whether the agent's listeners use IPv6 (`--ipv6-enabled`, ztunnel's
    /// `IPV6_ENABLED`): in-pod ones dual-stack `[::]` and `[::1]`, else
    /// IPv4 alone, for kernels booted with `ipv6.disable=1`.
    pub ipv6_enabled: bool,
    /// The network of this node (`--network`, ztunnel's `NETWORK`; shown
    /// where ztunnel's config dump shows `network`): a client whose
    /// workload the mesh does not know is on it when endpoints are chosen.
    pub network: String,
    /// Settings every pod's engine shares (HBONE, certificates, drain).
    pub mesh: MeshConfig,
    /// The connection worker threads.
    pub workers: WorkersConfig,
    /// Log output format.
    pub log_format: LogFormat,
    /// The share of clean-close access records written (0 to 1).
    pub access_log_sample: f64,
    /// Where workload certificates come from.
    pub certs: CertsConfig,
    /// istiod, when anything asks it (xDS, or its CA unless
    /// [`CertsConfig::Istio`] names another server).
    pub istiod: Option<IstiodConfig>,
    /// Who the agent is to istiod, with `--xds` (workloads from istiod).
    pub xds: Option<NodeIdentity>,
    /// Enrollment from the Kubernetes API, with `--kube`.
    pub kube: Option<KubeConfig>,
    /// Whether to take a running agent's pods over.
    pub takeover: bool,
    /// What to do once handed over and drained.
    pub after_handover: AfterHandover,
}

/// Where an agent instance keeps its state.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct StateConfig {
    /// The instance name (pins under `<bpffs>/dataplane/<instance>/`).
    pub instance: String,
    /// The bpffs directory.
    pub bpffs: PathBuf,
    /// Directory of the control socket and enrollment state.
    pub state_dir: PathBuf,
}

/// How pod traffic is steered into the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Capture {
    /// Our kernel programs.
    Ebpf,
    /// iptables rules someone else installs (the benchmarks' baseline).
    Iptables,
}

impl Capture {
    /// Its name, as `--capture` spells it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Ebpf => "ebpf",
            Self::Iptables => "iptables",
        }
    }
}

/// The kernel programs' settings.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RedirectConfig {
    /// The cgroup to attach to; `None`: the cgroup v2 mount.
    pub cgroup: Option<PathBuf>,
    /// What happens to kernel state when the agent stops.
    pub on_exit: ExitMode,
    /// Whether pods' traffic passes uncaptured while no agent serves them.
    pub fail_open: bool,
    /// Kubelet probe source addresses, never captured inbound.
    pub probe_sources: Vec<IpAddr>,
    /// The node's own network namespace; `None`: the agent's.
    pub node_netns: Option<PathBuf>,
    /// Socket mark of the agent's own sockets.
    pub proxy_mark: u32,
    /// Whether the same-node fast path is on by default.
    pub fast_path: bool,
}

/// When the engine connects to apps from the client's address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum OriginalSourceMode {
    /// Wherever the kernel and the pod's routing allow.
    Auto,
    /// Always; refused where it cannot work.
    On,
    /// Never.
    Off,
}

/// The original-source feature's settings (see `proxy::original_source`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct OriginalSourceConfig {
    /// When it applies.
    pub mode: OriginalSourceMode,
    /// Mark of the engine's connections from a client's address; checked
    /// non-zero and unlike the proxy mark unless the mode is off.
    pub mark: u32,
    /// In-pod routing table of the replies' routes.
    pub table: u32,
}

/// `--original-source on` where it cannot work.
#[derive(Debug, thiserror::Error)]
#[error("--original-source on: {reason}; use --original-source auto or off")]
pub struct OriginalSourceError {
    /// Why it cannot work here.
    pub reason: &'static str,
}

impl OriginalSourceConfig {
    /// The mark the kernel programs exempt: 0 when the feature is off.
    pub fn kernel_mark(&self) -> u32 {
        match self.mode {
            OriginalSourceMode::Off => 0,
            OriginalSourceMode::Auto | OriginalSourceMode::On => self.mark,
        }
    }

    /// What the engine does, given whether this agent can do it at all
    /// (`Err` names why not: iptables capture, an old kernel).
    pub fn decide(
        &self,
        possible: Result<(), &'static str>,
    ) -> Result<Option<OriginalSource>, OriginalSourceError> {
        let required = match self.mode {
            OriginalSourceMode::Off => return Ok(None),
            OriginalSourceMode::Auto => false,
            OriginalSourceMode::On => true,
        };
        match possible {
            Ok(()) => Ok(Some(OriginalSource {
                routing: SourceRouting {
                    mark: self.mark,
                    table: self.table,
                    priority: ORIGINAL_SOURCE_RULE_PRIORITY,
                },
                required,
            })),
            Err(reason) if required => Err(OriginalSourceError { reason }),
            Err(reason) => {
                tracing::info!(
                    reason,
                    "original source off: apps see the pod's own address as their clients'"
                );
                Ok(None)
            }
        }
    }
}

/// What serves enrolled pods.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase", tag = "mode")]
pub enum EngineConfig {
    /// This agent's engine.
    Builtin,
    /// A stock ztunnel on the node, fed over ZDS.
    Ztunnel {
        /// The ZDS server's settings.
        zds: ZdsConfig,
    },
}

/// Where the HTTP endpoints listen (port 0: any free port).
#[derive(Debug, Clone, Copy, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct EndpointsConfig {
    /// `GET /healthz/ready`.
    pub readiness: SocketAddr,
    /// `GET /metrics`.
    pub metrics: SocketAddr,
    /// `/config_dump`, `/logging`, `/quitquitquit` (loopback only).
    pub admin: SocketAddr,
}

/// Settings every pod's engine shares.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct MeshConfig {
    /// The trust domain whose clients the HBONE servers accept.
    pub trust_domain: String,
    /// Lifetime of workload certificates.
    pub cert_lifetime: Duration,
    /// How long open connections get to finish on shutdown.
    pub drain_timeout: Duration,
    /// Whether early data rides with the CONNECT request.
    pub hbone_early_data: bool,
    /// How long an inbound HBONE handshake may take.
    pub hbone_handshake_timeout: Duration,
    /// Idle time after which an inbound HBONE connection is closed.
    pub hbone_idle_timeout: Duration,
    /// Whether a PROXY application tunnel is dialled over loopback
    /// (ztunnel's `LOCALHOST_APP_TUNNEL`).
    pub localhost_app_tunnel: bool,
    /// TCP keepalive on proxied sockets; `None`: off.
    pub keepalive: Option<Keepalive>,
    /// How the HBONE pool spreads streams over connections.
    pub pool_spread: PoolSpread,
    /// How long an HBONE pool connection without a stream is kept.
    pub pool_idle_timeout: Duration,
    /// The HTTP/2 windows and frame size of HBONE connections.
    pub h2: H2Settings,
    /// Node-wide pending handshakes; `None`: derived from the descriptor
    /// limit.
    pub max_pending_handshakes: Option<u32>,
    /// Pending handshakes to one pod.
    pub max_pending_handshakes_per_pod: u32,
    /// Pending handshakes from one source address.
    pub max_pending_handshakes_per_source: u32,
    /// What TLS may negotiate (post-quantum key exchange only, TLS 1.2),
    /// process-wide: HBONE both ways and the channel to istiod.
    pub tls: crate::tls::TlsPolicy,
    /// Certificate revocation lists HBONE peers are checked against, re-read
    /// when they change; `None`: no revocation checks.
    pub crl_path: Option<PathBuf>,
    /// What outbound connections to addresses the mesh does not know do.
    pub outbound_traffic_policy: crate::proxy::outbound::OutboundTrafficPolicy,
}

/// The connection worker threads.
#[derive(Debug, Clone, Copy, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct WorkersConfig {
    /// How connections are spread over threads.
    pub threading: Threading,
    /// How many threads; `None`: one per CPU the agent may use.
    pub threads: Option<u16>,
}

/// The built-in CA's root.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum CaConfig {
    /// Loaded from this directory, generated there when missing.
    Dir(PathBuf),
    /// An existing root's certificate and key files.
    Files {
        /// The root certificate (PEM).
        cert: PathBuf,
        /// Its key (PEM).
        key: PathBuf,
    },
}

/// Where workload certificates come from.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase", tag = "source")]
pub enum CertsConfig {
    /// The agent's own CA.
    Builtin {
        /// Its root.
        ca: CaConfig,
    },
    /// Istio's CA (istiod's, or another server speaking its API, e.g.
    /// istio-csr).
    Istio {
        /// Where the CA is and how its certificate is checked.
        ca: IstiodConfig,
        /// The mesh's roots, which the trust bundle starts with
        /// (`--istiod-root-cert`).
        mesh_roots: PathBuf,
    },
    /// Certificates mounted as files.
    Files {
        /// Their directory.
        dir: PathBuf,
    },
    /// X.509-SVIDs from the SPIFFE Workload API.
    Spiffe {
        /// Its socket, `unix:///path`.
        endpoint: String,
    },
}

/// How to reach istiod.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct IstiodConfig {
    /// `host:port`.
    pub address: String,
    /// The name istiod's certificate must carry.
    pub server_name: String,
    /// The PEM file of the roots istiod's certificate chains to.
    pub root_cert: PathBuf,
    /// The projected service-account token sent to istiod; `None`: none.
    pub token_file: Option<PathBuf>,
    /// Extra gRPC metadata sent with every request, checked by the flags
    /// (the dump shows the names only: a value may be a credential).
    #[serde(serialize_with = "header_names")]
    pub headers: Vec<(String, String)>,
}

/// Serializes headers as their names.
fn header_names<S: serde::Serializer>(
    headers: &[(String, String)],
    serializer: S,
) -> Result<S::Ok, S::Error> {
    serializer.collect_seq(headers.iter().map(|(name, _)| name))
}

/// A root certificate file that cannot be used.
#[derive(Debug, thiserror::Error)]
#[error("cannot use istiod's root certificate file {path}: {reason}")]
pub struct RootsError {
    /// The file.
    pub path: PathBuf,
    /// Why.
    pub reason: String,
}

impl IstiodConfig {
    /// istiod's endpoint; its root file is read now.
    pub fn endpoint(&self) -> Result<IstiodEndpoint, RootsError> {
        Ok(IstiodEndpoint {
            address: self.address.clone(),
            server_name: self.server_name.clone(),
            roots: Arc::new(read_roots(&self.root_cert)?),
            token_file: self.token_file.clone(),
            // Checked by the flags (`cli::istio::grpc_headers`): none is
            // dropped here.
            headers: self
                .headers
                .iter()
                .filter_map(|(key, value)| Some((key.parse().ok()?, value.parse().ok()?)))
                .collect(),
        })
    }
}

impl AgentConfig {
    /// The xDS client's configuration, with `--xds`; istiod's root file is
    /// read now.
    pub fn xds_config(&self) -> Result<Option<XdsConfig>, RootsError> {
        match (&self.xds, &self.istiod) {
            (Some(node), Some(istiod)) => Ok(Some(XdsConfig {
                istiod: istiod.endpoint()?,
                node: node.clone(),
            })),
            _ => Ok(None),
        }
    }
}

/// Enrollment from the Kubernetes API.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct KubeConfig {
    /// This node's name: its pods are watched.
    pub node: String,
    /// The kubeconfig; `None`: in-cluster, else the usual places.
    pub kubeconfig: Option<PathBuf>,
    /// The enablement selectors given; `None`: Istio's.
    pub enablement_selectors: Option<Vec<EnablementSelector>>,
    /// Namespaces never enrolled.
    pub exclude_namespaces: Vec<String>,
    /// The rule compiled from the two above.
    #[serde(skip)]
    pub rule: EnrollmentRule,
}

/// What an agent does once it has handed its pods over.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum AfterHandover {
    /// Exit 0.
    Exit,
    /// Stay up idle until SIGTERM or SIGINT.
    Wait,
}

/// The root file name that means the system's roots (ztunnel's
/// `XDS_ROOT_CA`/`CA_ROOT_CA` value `SYSTEM`, `src/config.rs`), unless a
/// file of that name exists (as ztunnel checks first).
pub const SYSTEM_ROOTS: &str = "SYSTEM";

/// Whether `path` names the system's roots ([`SYSTEM_ROOTS`]).
pub fn is_system_roots(path: &Path) -> bool {
    path == Path::new(SYSTEM_ROOTS) && !path.exists()
}

/// Every certificate of a PEM bundle as a root store; a file with none, or
/// with one that is not a usable root, is refused. [`SYSTEM_ROOTS`]: the
/// system's (`SSL_CERT_FILE`/`SSL_CERT_DIR` when set, else the
/// distribution's store), as ztunnel's `RootCert::Default`.
pub fn read_roots(path: &Path) -> Result<RootCertStore, RootsError> {
    if is_system_roots(path) {
        return system_roots(path);
    }
    let mut roots = RootCertStore::empty();
    for cert in read_root_certs(path)? {
        roots.add(cert).map_err(|e| RootsError {
            path: path.to_path_buf(),
            reason: format!("a certificate is not a usable root: {e}"),
        })?;
    }
    Ok(roots)
}

/// The system's roots; refused when none is usable. Certificates the
/// store holds but that cannot be roots are skipped and logged.
fn system_roots(path: &Path) -> Result<RootCertStore, RootsError> {
    let found = rustls_native_certs::load_native_certs();
    for error in &found.errors {
        tracing::warn!(%error, "part of the system's root store cannot be read");
    }
    let mut roots = RootCertStore::empty();
    let (added, skipped) = roots.add_parsable_certificates(found.certs);
    if skipped > 0 {
        tracing::warn!(
            skipped,
            "system roots that are not usable roots are left out"
        );
    }
    if added == 0 {
        return Err(RootsError {
            path: path.to_path_buf(),
            reason: "the system's root store holds no usable root (set SSL_CERT_FILE, or give a PEM file)".into(),
        });
    }
    tracing::info!(
        roots = added,
        "istiod's or the CA's certificate is checked against the system's roots"
    );
    Ok(roots)
}

/// Every certificate of a PEM bundle, DER; a file with none is refused.
pub fn read_root_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, RootsError> {
    let error = |reason: String| RootsError {
        path: path.to_path_buf(),
        reason,
    };
    let (bytes, more) =
        dataplane_core::fs::read_at_most(path, MAX_ROOT_FILE).map_err(|e| error(e.to_string()))?;
    if more {
        return Err(error(format!("larger than {MAX_ROOT_FILE} bytes")));
    }
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<_, _>>()
        .map_err(|e| error(format!("not PEM certificates: {e}")))?;
    if certs.is_empty() {
        return Err(error("no certificate in it".into()));
    }
    Ok(certs)
}

#[cfg(test)]
#[expect(
    clippy::unwrap_used,
    reason = "a bad fixture should fail the test loudly"
)]
mod tests {
    use super::*;

    fn original_source(mode: OriginalSourceMode) -> OriginalSourceConfig {
        OriginalSourceConfig {
            mode,
            mark: 0x53a,
            table: 0x53a,
        }
    }

    #[test]
    fn off_exempts_no_second_mark() {
        assert_eq!(original_source(OriginalSourceMode::Off).kernel_mark(), 0);
        assert_eq!(
            original_source(OriginalSourceMode::Auto).kernel_mark(),
            0x53a
        );
    }

    #[test]
    fn on_refuses_where_auto_turns_itself_off() {
        let old_kernel = Err("kernel before 5.17");
        assert!(
            original_source(OriginalSourceMode::On)
                .decide(old_kernel)
                .is_err()
        );
        assert_eq!(
            original_source(OriginalSourceMode::Auto)
                .decide(old_kernel)
                .ok(),
            Some(None)
        );
        assert_eq!(
            original_source(OriginalSourceMode::Off).decide(Ok(())).ok(),
            Some(None)
        );
        let on = original_source(OriginalSourceMode::On)
            .decide(Ok(()))
            .ok()
            .flatten();
        assert_eq!(
            on.map(|o| (o.routing.mark, o.required)),
            Some((0x53a, true))
        );
    }

    #[test]
    fn unusable_root_files_are_refused_with_the_reason() {
        let dir = std::env::temp_dir().join(format!("dp-roots-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("empty.pem"), "").unwrap();
        std::fs::write(
            dir.join("junk.pem"),
            "-----BEGIN CERTIFICATE-----\n!!\n-----END CERTIFICATE-----\n",
        )
        .unwrap();
        let errors: Vec<String> = ["empty.pem", "junk.pem", "missing.pem"]
            .map(|f| read_roots(&dir.join(f)).unwrap_err().to_string())
            .to_vec();
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(errors[0].contains("no certificate"), "{}", errors[0]);
        assert!(errors[1].contains("not PEM"), "{}", errors[1]);
        assert!(errors[2].contains("missing.pem"), "{}", errors[2]);
    }
}
