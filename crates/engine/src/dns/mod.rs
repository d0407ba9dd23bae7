//! DNS capture: the kernel programs steer an enrolled pod's DNS (UDP and
//! TCP to port 53) to a resolver the agent runs inside the pod on
//! `127.0.0.1`/`[::1]` port [`DNS_PROXY_PORT`], as Istio's node proxy does.
//! The resolver answers mesh service hostnames with their VIPs and forwards
//! everything else to the node's upstream servers.
//!
//! Modules by concern: `names` (which service a queried name means: search
//! domains and Kubernetes short forms), `answer` (mesh answers, NODATA,
//! what is forwarded), `upstream` (forwarding, TCP fallback, the cache),
//! `resolve` (names the proxy resolves for itself: endpoints known by DNS
//! name),
//! `server` (the in-pod UDP and TCP listeners and their bounds), `metrics`.
//!
//! Opt-in and opt-out follow Istio ambient: a mesh-wide default
//! (`--dns-capture`, Istio's `cni.ambient.dnsCapture`), overridden per pod
//! by the `ambient.istio.io/dns-capture` annotation (`"true"`/`"false"`), a
//! workload's `dnsCapture` in the config file, or `dnsCapture` in a
//! `dataplane pod add` request.

mod answer;
mod metrics;
mod names;
mod resolve;
mod server;
mod upstream;

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    path::Path,
    sync::Arc,
    time::Duration,
};

use dataplane_common::DNS_PROXY_PORT;
use socket2::{Protocol, Type};
use tokio::task::JoinSet;
use tracing::{info, warn};

pub use metrics::{AnswerKind, DnsMetrics};
pub use resolve::{choose, lookup_ip};
pub use server::{PodResolver, Transport};
pub use upstream::Forwarder;

use crate::{mesh::MeshContext, proxy::PodNetns};

/// The pod annotation Istio's CNI agent reads to turn DNS capture on or
/// off for one pod.
pub const DNS_CAPTURE_ANNOTATION: &str = "ambient.istio.io/dns-capture";

/// Where upstream servers come from when `--dns-upstream` is not given.
pub const NODE_RESOLV_CONF: &str = "/etc/resolv.conf";

/// Agent-wide DNS capture configuration (from `--dns-*`, see
/// `cli::dns`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DnsConfig {
    /// Whether pods capture DNS unless their annotation, workload or
    /// enrollment request says otherwise.
    pub default_capture: bool,
    /// Upstream servers for names the mesh does not know, each `IP` or
    /// `IP:PORT` as given (checked by [`DnsSettings::new`]); empty means
    /// the nameservers of [`NODE_RESOLV_CONF`].
    pub upstream: Vec<String>,
    /// The cluster's DNS domain, as given (a trailing dot and case do not
    /// matter).
    pub domain: String,
}

/// Errors of DNS capture.
#[derive(Debug, thiserror::Error)]
pub enum DnsError {
    /// An upstream address does not parse.
    #[error(
        "--dns-upstream {value:?} is not an IP or IP:PORT; give e.g. 10.96.0.10 or [fd00::a]:53"
    )]
    BadUpstream {
        /// The value given.
        value: String,
    },
    /// The node's resolv.conf cannot be read.
    #[error("cannot read upstream DNS servers from {path}; pass --dns-upstream")]
    ResolvConf {
        /// The file.
        path: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// No upstream server is known.
    #[error("no upstream DNS server configured; pass --dns-upstream or fix the node's resolv.conf")]
    NoUpstream,
    /// Too many upstream queries in flight.
    #[error("{limit} upstream DNS queries already in flight")]
    Busy {
        /// The bound.
        limit: usize,
    },
    /// An upstream server could not be asked.
    #[error("upstream DNS server {server} failed")]
    Upstream {
        /// The server.
        server: SocketAddr,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// An upstream server did not answer in time.
    #[error("upstream DNS server {server} did not answer within {limit:?}")]
    UpstreamTimeout {
        /// The server.
        server: SocketAddr,
        /// The time it had.
        limit: Duration,
    },
    /// An upstream reply is not an answer to the query.
    #[error("upstream DNS server {server} sent a bad reply: {reason}")]
    BadReply {
        /// The server.
        server: SocketAddr,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A name to resolve is not a DNS name.
    #[error("`{name}` is not a DNS name: {reason}")]
    BadName {
        /// The name.
        name: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The upstream servers answered a name with an error.
    #[error("DNS lookup of `{name}` failed: the upstream server answered {code}")]
    BadAnswer {
        /// The name.
        name: String,
        /// The response code (or what was wrong with the reply).
        code: String,
    },
    /// Nothing resolves names for the proxy.
    #[error(
        "no DNS resolver for `{name}`: endpoints known by DNS name are resolved through the \
         upstream servers of DNS capture, which runs with the agent's kernel programs only"
    )]
    NoResolver {
        /// The name.
        name: String,
    },
    /// A name resolved to no address.
    #[error("`{name}` has no A or AAAA record")]
    NoAddresses {
        /// The name.
        name: String,
    },
    /// The resolver's sockets could not be made in the pod.
    #[error("cannot bind the DNS resolver on {addr} in the pod's network namespace")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

/// Agent-wide DNS settings, shared by every pod's resolver.
#[derive(Debug)]
pub struct DnsSettings {
    /// Whether pods capture DNS unless they say otherwise.
    pub default_capture: bool,
    /// The cluster domain.
    pub domain: String,
    /// The upstream forwarder (and its cache), shared by all pods and by
    /// the proxy's own lookups ([`lookup_ip`]).
    pub forwarder: Arc<Forwarder>,
    /// Mesh state (service hostnames and VIPs).
    pub mesh: Arc<MeshContext>,
    /// Metrics.
    pub metrics: DnsMetrics,
    /// Whether pods' resolvers also listen on `[::1]`; off with
    /// `--ipv6-enabled false`, as ztunnel's DNS proxy binds IPv4 alone
    /// without `IPV6_ENABLED` (`src/config.rs`, `Address::Localhost`).
    pub ipv6: bool,
}

impl DnsSettings {
    /// Settings from `config`; upstream sockets carry `proxy_mark`.
    pub fn new(
        config: &DnsConfig,
        mesh: Arc<MeshContext>,
        proxy_mark: u32,
    ) -> Result<Self, DnsError> {
        let servers = if config.upstream.is_empty() {
            // A node without a readable resolv.conf must not keep the agent
            // from starting: forwarded names then get SERVFAIL.
            match std::fs::read_to_string(Path::new(NODE_RESOLV_CONF)) {
                Ok(text) => resolv_conf_servers(&text),
                Err(source) => {
                    let err = DnsError::ResolvConf {
                        path: NODE_RESOLV_CONF.into(),
                        source,
                    };
                    warn!(error = %crate::logging::Chain(&err), "no upstream DNS servers");
                    Vec::new()
                }
            }
        } else {
            config
                .upstream
                .iter()
                .map(|v| parse_upstream(v))
                .collect::<Result<_, _>>()?
        };
        if servers.is_empty() {
            warn!("no upstream DNS server: names outside the mesh will get SERVFAIL");
        }
        let metrics = DnsMetrics::register(&mesh.metrics);
        info!(upstream = ?servers, domain = %config.domain, default_capture = config.default_capture, "DNS capture settings");
        Ok(Self {
            default_capture: config.default_capture,
            domain: config.domain.trim_end_matches('.').to_ascii_lowercase(),
            forwarder: Arc::new(Forwarder::new(
                servers,
                proxy_mark,
                Arc::new(metrics.clone()),
            )),
            mesh,
            metrics,
            ipv6: true,
        })
    }

    /// Whether a pod captures DNS, given its own setting.
    pub fn captures(&self, pod_setting: Option<bool>) -> bool {
        pod_setting.unwrap_or(self.default_capture)
    }
}

/// One pod's running resolver; dropping it stops it.
#[derive(Debug)]
pub struct PodDns {
    tasks: JoinSet<()>,
    addrs: Vec<SocketAddr>,
}

impl PodDns {
    /// The resolver of a pod being enrolled, when its DNS is captured
    /// (`settings` mesh-wide, `pod_setting` its own choice). A resolver
    /// that cannot start leaves the pod its own DNS rather than losing its
    /// mesh capture over it.
    pub fn for_pod(
        settings: Option<&Arc<DnsSettings>>,
        pod_setting: Option<bool>,
        netns: &PodNetns,
        (name, namespace): (&str, &str),
    ) -> Option<Self> {
        let settings = settings.filter(|s| s.captures(pod_setting))?;
        match Self::start(netns, (name, namespace), Arc::clone(settings)) {
            Ok(resolver) => Some(resolver),
            Err(err) => {
                tracing::warn!(pod = %name, %namespace, error = %crate::logging::Chain(&err), "DNS capture left off for this pod");
                None
            }
        }
    }

    /// Binds the resolver in the pod's namespace (UDP and TCP on
    /// `127.0.0.1` and, when IPv6 is on and the pod has it, `[::1]`) and
    /// starts serving.
    /// Must run within the agent's tokio runtime.
    pub fn start(
        netns: &PodNetns,
        (name, namespace): (&str, &str),
        settings: Arc<DnsSettings>,
    ) -> Result<Self, DnsError> {
        let resolver = Arc::new(PodResolver {
            pod: name.to_owned(),
            namespace: namespace.to_owned(),
            settings,
        });
        let mut tasks = JoinSet::new();
        let mut addrs = Vec::new();
        let loopbacks = [
            IpAddr::V4(Ipv4Addr::LOCALHOST),
            IpAddr::V6(Ipv6Addr::LOCALHOST),
        ];
        let ipv6 = resolver.settings.ipv6;
        for ip in loopbacks.into_iter().filter(|ip| ipv6 || ip.is_ipv4()) {
            let addr = SocketAddr::new(ip, DNS_PROXY_PORT);
            let bind_err = |source| DnsError::Bind { addr, source };
            let udp = match netns.bind_reusable(addr, Type::DGRAM, Protocol::UDP) {
                Ok(socket) => socket,
                // A pod without IPv6 has no [::1]: IPv4 alone then.
                Err(err) if ip.is_ipv6() && err.raw_os_error() == Some(libc::EADDRNOTAVAIL) => {
                    continue;
                }
                Err(err) => return Err(bind_err(err)),
            };
            let tcp = netns
                .bind_reusable(addr, Type::STREAM, Protocol::TCP)
                .and_then(|socket| {
                    socket.listen(128)?;
                    Ok(socket)
                })
                .map_err(bind_err)?;
            let udp = tokio::net::UdpSocket::from_std(udp.into()).map_err(bind_err)?;
            let tcp = tokio::net::TcpListener::from_std(tcp.into()).map_err(bind_err)?;
            tasks.spawn(Arc::clone(&resolver).serve_udp(udp));
            tasks.spawn(Arc::clone(&resolver).serve_tcp(tcp));
            addrs.push(addr);
        }
        Ok(Self { tasks, addrs })
    }

    /// The addresses it serves on.
    pub fn addrs(&self) -> &[SocketAddr] {
        &self.addrs
    }

    /// Stops serving (dropping does the same).
    pub fn stop(mut self) {
        self.tasks.abort_all();
    }
}

/// A pod's [`DNS_CAPTURE_ANNOTATION`] (see
/// [`annotation_flag`](dataplane_core::parse::annotation_flag)).
pub fn annotation_setting(
    annotations: &std::collections::BTreeMap<String, String>,
) -> Option<bool> {
    dataplane_core::parse::annotation_flag(annotations, DNS_CAPTURE_ANNOTATION)
}

/// `IP` or `IP:PORT` (`[v6]:PORT`); port 53 when none is given.
pub fn parse_upstream(value: &str) -> Result<SocketAddr, DnsError> {
    let value = value.trim();
    if let Ok(ip) = value.parse::<IpAddr>() {
        return Ok(SocketAddr::new(ip, 53));
    }
    value.parse().map_err(|_| DnsError::BadUpstream {
        value: value.to_owned(),
    })
}

/// The `nameserver` entries of a resolv.conf, port 53 (at most three, as
/// stub resolvers read).
pub fn resolv_conf_servers(text: &str) -> Vec<SocketAddr> {
    text.lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            if words.next()? != "nameserver" {
                return None;
            }
            // A scoped IPv6 address (`fe80::1%eth0`) is left out.
            let ip: IpAddr = words.next()?.parse().ok()?;
            Some(SocketAddr::new(ip, 53))
        })
        .take(3)
        .collect()
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test inputs are fixed")]
mod tests {
    use super::*;

    #[test]
    fn upstreams_parse_with_and_without_port() {
        assert_eq!(
            parse_upstream("10.0.0.1").unwrap(),
            "10.0.0.1:53".parse().unwrap()
        );
        assert_eq!(
            parse_upstream("[fd00::1]:5353").unwrap(),
            "[fd00::1]:5353".parse().unwrap()
        );
        assert_eq!(
            parse_upstream("fd00::1").unwrap(),
            "[fd00::1]:53".parse().unwrap()
        );
        assert!(matches!(
            parse_upstream("dns.example"),
            Err(DnsError::BadUpstream { .. })
        ));
    }

    #[test]
    fn the_istio_annotation_is_read_as_a_boolean() {
        let with = |v: &str| {
            std::collections::BTreeMap::from([(DNS_CAPTURE_ANNOTATION.to_owned(), v.to_owned())])
        };
        assert_eq!(annotation_setting(&with("true")), Some(true));
        assert_eq!(annotation_setting(&with("False")), Some(false));
        assert_eq!(annotation_setting(&with("maybe")), None);
        assert_eq!(annotation_setting(&Default::default()), None);
    }

    #[test]
    fn resolv_conf_gives_its_nameservers() {
        let text = "# c\nsearch a.svc.cluster.local\nnameserver 10.96.0.10\nnameserver fd00::a\n\
                    nameserver fe80::1%eth0\noptions ndots:5\n";
        assert_eq!(
            resolv_conf_servers(text),
            [
                "10.96.0.10:53".parse::<SocketAddr>().unwrap(),
                "[fd00::a]:53".parse().unwrap()
            ]
        );
    }
}
