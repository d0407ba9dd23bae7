//! `dataplane run`'s flags into the agent's [`AgentConfig`]: every check of
//! flags against each other is here, so a bad combination is refused (exit
//! 2) before anything starts, and parsing is tested from a list of strings
//! and a map of environment variables, never the process's.

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};

use super::{AfterHandover as AfterHandoverFlag, CaptureMode, RunArgs};
use crate::{
    agent::config::{
        AfterHandover, AgentConfig, CaConfig, Capture, CertsConfig, EndpointsConfig, IstiodConfig,
        KubeConfig, MeshConfig, RedirectConfig, StateConfig, WorkersConfig,
    },
    cli::{
        dns::{DNS_CAPTURE_METADATA, DNS_PROXY_ADDR_METADATA},
        engine::EngineArgsError,
        istio::{
            CA_HEADER_PREFIX, CertSourceKind, IstioArgsError, XDS_HEADER_PREFIX, grpc_headers,
        },
        original_source::OriginalSourceArgsError,
        proxy_config::ProxyConfigError,
        tls::TlsArgsError,
    },
    dns::DnsConfig,
    hbone::{pool::PoolSpread, wire::H2Settings},
    kube::optin::{EnrollmentRule, RuleError, istio_default_selectors},
    proxy::{bind_wildcard, keepalive::Keepalive},
};

/// The readiness endpoint's port, as ztunnel's `DEFAULT_READINESS_PORT`.
const READINESS_PORT: u16 = 15021;
/// The metrics endpoint's port, as ztunnel's `DEFAULT_STATS_PORT`.
const METRICS_PORT: u16 = 15020;
/// The admin endpoint's port, as ztunnel's `DEFAULT_ADMIN_PORT`.
const ADMIN_PORT: u16 = 15000;

/// Flags that do not fit together: the message names the flag and what to
/// do.
#[derive(Debug, thiserror::Error)]
pub enum FlagError {
    /// The engine choice conflicts with another flag.
    #[error(transparent)]
    Engine(#[from] EngineArgsError),
    /// An Istio flag needs another one, or is malformed.
    #[error(transparent)]
    Istio(#[from] IstioArgsError),
    /// The original-source marks conflict.
    #[error(transparent)]
    OriginalSource(#[from] OriginalSourceArgsError),
    /// A TLS compliance flag is not one this build can honour.
    #[error(transparent)]
    Tls(#[from] TlsArgsError),
    /// The mesh config file or `PROXY_CONFIG` cannot be used.
    #[error(transparent)]
    ProxyConfig(#[from] ProxyConfigError),
    /// `--kube` without `--node`.
    #[error(
        "--kube needs this node's name: pass --node (DaemonSet: DATAPLANE_NODE from spec.nodeName)"
    )]
    KubeNeedsNode,
    /// The HTTP/2 connection window is smaller than the stream window.
    #[error(
        "--http2-connection-window-size {connection} is below --http2-stream-window-size {stream}: \
         one stream could take the whole connection's window and stall the others; \
         raise the connection window (ztunnel's default is 4 times the stream window)"
    )]
    Http2Windows {
        /// `--http2-connection-window-size`.
        connection: u32,
        /// `--http2-stream-window-size`.
        stream: u32,
    },
    /// An enablement selector is not a valid label selector.
    #[error("--enablement-selectors: {0}; fix it, or leave the flag unset for Istio's selectors")]
    EnablementSelectors(#[source] RuleError),
    /// The proxy metadata moves the DNS proxy (ztunnel's
    /// `DNS_PROXY_ADDR`), which this agent's resolver cannot follow: see
    /// [`check_dns_proxy_addr`].
    #[error(
        "DNS_PROXY_ADDR={0:?} (ISTIO_META_DNS_PROXY_ADDR or PROXY_CONFIG proxyMetadata): \
         this agent's DNS proxy listens on localhost:{port} only, where its kernel programs \
         steer pods' DNS; remove the setting or set it to localhost:{port}",
        port = dataplane_common::DNS_PROXY_PORT
    )]
    DnsProxyAddr(String),
}

impl From<CaptureMode> for Capture {
    fn from(mode: CaptureMode) -> Self {
        match mode {
            CaptureMode::Ebpf => Self::Ebpf,
            CaptureMode::Iptables => Self::Iptables,
        }
    }
}

impl From<AfterHandoverFlag> for AfterHandover {
    fn from(flag: AfterHandoverFlag) -> Self {
        match flag {
            AfterHandoverFlag::Exit => Self::Exit,
            AfterHandoverFlag::Wait => Self::Wait,
        }
    }
}

impl RunArgs {
    /// The agent's configuration, every flag checked against the others;
    /// `ISTIO_META_*` node metadata comes from the process environment.
    pub fn into_config(self) -> Result<AgentConfig, FlagError> {
        self.into_config_with(std::env::vars())
    }

    /// [`Self::into_config`] with `env` as the environment (`ISTIO_META_*`
    /// variables become xDS node metadata, `XDS_HEADER_*` and
    /// `CA_HEADER_*` extra metadata of xDS and CA requests). The mesh
    /// config file and `PROXY_CONFIG` are read here, so a bad one stops
    /// the agent before anything starts.
    pub fn into_config_with(
        mut self,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<AgentConfig, FlagError> {
        self.engine
            .check(self.capture, self.takeover, self.proxy_mark)?;
        let env: Vec<(String, String)> = env.into_iter().collect();
        // The proxy config gives defaults the flags override, as ztunnel's
        // explicit environment overrides it (`src/config.rs`
        // `construct_config`: `XDS_ADDRESS` over `discovery_address`).
        let loaded = self.proxy_config.load(&env)?;
        let proxy = loaded.proxy;
        if self.istio.istiod_address.is_none() {
            self.istio.istiod_address = proxy.discovery_address.clone();
        }
        let worker_threads = self.worker_threads.or(proxy.worker_threads());
        check_dns_proxy_addr(&proxy.proxy_metadata)?;
        let dns = self.dns.to_config(&proxy.proxy_metadata);
        let xds = self.istio.xds_node(
            self.node.as_deref(),
            node_metadata(&proxy.proxy_metadata, &dns),
        )?;
        let xds_headers = grpc_headers(&env, XDS_HEADER_PREFIX)?;
        let ca_headers = grpc_headers(&env, CA_HEADER_PREFIX)?;
        let istiod = self.istio.istiod_config()?.map(|istiod| IstiodConfig {
            headers: xds_headers,
            ..istiod
        });
        let ca_server = self.istio.ca_server_config()?.map(|ca| IstiodConfig {
            headers: ca_headers,
            ..ca
        });
        let certs = match self.istio.cert_source {
            CertSourceKind::Builtin => CertsConfig::Builtin {
                ca: match (&self.ca_cert, &self.ca_key) {
                    (Some(cert), Some(key)) => CaConfig::Files {
                        cert: cert.clone(),
                        key: key.clone(),
                    },
                    _ => CaConfig::Dir(
                        self.ca_dir
                            .clone()
                            .unwrap_or_else(|| self.state.state_dir.join("ca")),
                    ),
                },
            },
            CertSourceKind::Istio => CertsConfig::Istio {
                ca: ca_server.ok_or(IstioArgsError::Missing {
                    what: "--cert-source istio",
                    needed: "--istiod-address or --ca-address",
                })?,
                mesh_roots: self.istio.mesh_roots()?,
            },
            CertSourceKind::Files => CertsConfig::Files {
                dir: self.istio.cert_dir()?.unwrap_or_default(),
            },
            CertSourceKind::Spiffe => CertsConfig::Spiffe {
                endpoint: self.istio.spiffe_endpoint()?.unwrap_or_default(),
            },
        };
        // ztunnel (`src/config.rs` `construct_config`) warns in a comment
        // that a connection window no larger than a stream's can deadlock;
        // below it is refused.
        if self.http2_connection_window_size < self.http2_stream_window_size {
            return Err(FlagError::Http2Windows {
                connection: self.http2_connection_window_size,
                stream: self.http2_stream_window_size,
            });
        }
        let original_source = self.original_source.to_config(self.proxy_mark)?;
        let tls = self.tls.to_policy()?;
        let crl_path = self.tls.crl_path.clone();
        let kube = if self.kube {
            let node = self.node.clone().ok_or(FlagError::KubeNeedsNode)?;
            let selectors = self.enablement_selectors.map(|s| s.0);
            let rule = EnrollmentRule::new(
                selectors.as_deref().unwrap_or(&istio_default_selectors()),
                self.exclude_namespaces.iter().cloned(),
            )
            .map_err(FlagError::EnablementSelectors)?;
            Some(KubeConfig {
                node,
                kubeconfig: self.kubeconfig,
                enablement_selectors: selectors,
                exclude_namespaces: self.exclude_namespaces,
                rule,
            })
        } else {
            None
        };
        Ok(AgentConfig {
            workloads_file: self.config,
            state: StateConfig {
                instance: self.state.instance,
                bpffs: self.state.bpffs,
                state_dir: self.state.state_dir,
            },
            node: self.node,
            capture: self.capture.into(),
            redirect: RedirectConfig {
                cgroup: self.cgroup,
                on_exit: self.on_exit,
                fail_open: self.fail_open,
                probe_sources: self.probe_sources,
                node_netns: self.node_netns,
                proxy_mark: self.proxy_mark,
                fast_path: self.fast_path.is_on(),
            },
            original_source,
            dns,
            engine: self.engine.to_config(),
            // ztunnel binds its readiness and stats ports on its
            // `bind_wildcard` and its admin port on localhost, the stats
            // and admin ports from the proxy config (`src/config.rs`
            // `construct_config`); an address the operator gave stays as
            // given.
            endpoints: EndpointsConfig {
                readiness: self.readiness_addr.unwrap_or_else(|| {
                    SocketAddr::new(bind_wildcard(self.ipv6_enabled), READINESS_PORT)
                }),
                metrics: self.metrics_addr.unwrap_or_else(|| {
                    SocketAddr::new(
                        bind_wildcard(self.ipv6_enabled),
                        proxy.stats_port.unwrap_or(METRICS_PORT),
                    )
                }),
                admin: self.admin_addr.unwrap_or_else(|| {
                    SocketAddr::from((
                        Ipv4Addr::LOCALHOST,
                        proxy.proxy_admin_port.unwrap_or(ADMIN_PORT),
                    ))
                }),
            },
            ipv6_enabled: self.ipv6_enabled,
            network: self.network,
            mesh: MeshConfig {
                trust_domain: self.trust_domain,
                cert_lifetime: self.cert_lifetime,
                drain_timeout: self.drain_timeout,
                hbone_early_data: self.hbone_early_data.is_on(),
                hbone_handshake_timeout: self.hbone_handshake_timeout,
                hbone_idle_timeout: self.hbone_idle_timeout,
                localhost_app_tunnel: self.localhost_app_tunnel,
                keepalive: self.keepalive.is_on().then_some(Keepalive {
                    time: self.keepalive_time,
                    interval: self.keepalive_interval,
                    retries: self.keepalive_retries,
                }),
                pool_spread: PoolSpread {
                    busy_streams: self.hbone_pool_busy_streams.into(),
                    max_connections: self.hbone_pool_max_connections.into(),
                    max_streams: self.hbone_pool_max_streams_per_connection.into(),
                },
                pool_idle_timeout: self.hbone_pool_idle_timeout,
                h2: H2Settings {
                    stream_window: self.http2_stream_window_size,
                    connection_window: self.http2_connection_window_size,
                    max_frame: self.http2_frame_size,
                },
                max_pending_handshakes: self.max_pending_handshakes,
                max_pending_handshakes_per_pod: self.max_pending_handshakes_per_pod,
                max_pending_handshakes_per_source: self.max_pending_handshakes_per_source,
                tls,
                crl_path,
                outbound_traffic_policy: loaded.outbound_traffic_policy,
            },
            workers: WorkersConfig {
                threading: self.threading.into(),
                threads: worker_threads,
            },
            log_format: self.log_format,
            access_log_sample: self.access_log_sample,
            certs,
            istiod,
            xds,
            kube,
            takeover: self.takeover,
            after_handover: self.after_handover.into(),
        })
    }
}

/// Refuses a proxy metadata `DNS_PROXY_ADDR` (ztunnel `src/config.rs`:
/// the DNS proxy's address in the pod, `localhost:<port>` or an
/// `IP:port`, `Address::new`) other than where this agent's resolver
/// is. The resolver's port is the one the kernel programs steer captured
/// DNS to (`AGENT_CONFIG.dns_port`, [`dataplane_common::DNS_PROXY_PORT`]),
/// shared by every pod and by the agents on either side of a handover,
/// so one agent's setting cannot move it; reading the value and serving
/// elsewhere would tell istiod an address nobody answers on.
fn check_dns_proxy_addr(proxy_metadata: &BTreeMap<String, String>) -> Result<(), FlagError> {
    match proxy_metadata.get(DNS_PROXY_ADDR_METADATA) {
        Some(addr) if *addr != format!("localhost:{}", dataplane_common::DNS_PROXY_PORT) => {
            Err(FlagError::DnsProxyAddr(addr.clone()))
        }
        _ => Ok(()),
    }
}

/// The xDS node metadata: the proxy metadata, with the DNS proxy's keys
/// ztunnel reads from it (`src/config.rs` `DNS_CAPTURE_METADATA`,
/// `DNS_PROXY_ADDR_METADATA`) set to what this agent does, so istiod sees
/// the same keys from it as from a ztunnel so configured. The resolver's
/// address is fixed (the kernel programs steer DNS to port 15053):
/// `localhost:15053` is ztunnel's form for loopback, IPv6 too when
/// enabled (`Address::new`).
fn node_metadata(
    proxy_metadata: &BTreeMap<String, String>,
    dns: &DnsConfig,
) -> BTreeMap<String, String> {
    let mut metadata = proxy_metadata.clone();
    metadata.insert(
        DNS_CAPTURE_METADATA.to_owned(),
        dns.default_capture.to_string(),
    );
    metadata.insert(
        DNS_PROXY_ADDR_METADATA.to_owned(),
        format!("localhost:{}", dataplane_common::DNS_PROXY_PORT),
    );
    metadata
}

#[cfg(test)]
#[path = "run_tests.rs"]
mod tests;
