//! Command-line interface of the `dataplane` binary.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

use crate::logging::LogFormat;
use crate::redirect::ExitMode;

pub mod dns;
pub mod engine;
pub mod install_cni;
pub mod istio;
pub mod original_source;
mod pod;
pub mod proxy_config;
pub mod run;
pub mod tls;
pub mod workers;
pub mod ztunnel_env;

pub use pod::{PodAddArgs, PodCommand};

/// eBPF-accelerated transparent redirection data plane for a service mesh.
///
/// Kernel programs steer every enrolled pod's TCP traffic into in-pod
/// listeners of this agent, which carries it in HBONE tunnels (HTTP/2
/// CONNECT over mutual TLS, wire-compatible with Istio ambient). No iptables.
#[derive(Debug, Parser)]
#[command(name = "dataplane", version, propagate_version = true)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the node agent: load and attach the kernel programs, serve
    /// enrolled pods, stop on SIGINT/SIGTERM.
    Run(Box<RunArgs>),
    /// Print the agent's version, its key dependencies, and every embedded
    /// kernel program with its type and attach point.
    Version {
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Inspect the kernel redirection state of an agent instance.
    #[command(subcommand)]
    Redirect(RedirectCommand),
    /// Enroll, unenroll and list pods of a running agent (through its
    /// control socket).
    #[command(subcommand)]
    Pod(PodCommand),
    /// One screen about a running agent: readiness, kernel programs, pods
    /// and whether each is captured (and why not), open connections,
    /// warnings of the last minute. Exit code 0 when all is well, 5 when
    /// something needs attention, 4 when the agent cannot be reached.
    Status {
        /// Which agent instance.
        #[command(flatten)]
        state: StateArgs,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Print a running agent's configuration dump (JSON): configuration in
    /// force, pods, certificates (no keys), kernel programs, pinned maps,
    /// and ztunnel's sections (`workloads`, `services`, `policies`,
    /// `certificates`, `workloadState`) as `istioctl ztunnel-config` reads them.
    ConfigDump {
        /// Which agent instance.
        #[command(flatten)]
        state: StateArgs,
        /// Accepted for symmetry: the dump is always JSON.
        #[arg(long)]
        json: bool,
    },
    /// List a running agent's workload certificates: identity, expiry,
    /// issuer, serial.
    Certs {
        /// Which agent instance.
        #[command(flatten)]
        state: StateArgs,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Readiness probe of the agent's container: exit 0 when the agent
    /// answering on the control socket is ready and, with `--same-cgroup`,
    /// runs in this process's cgroup (a kubelet `exec` probe runs in its
    /// container's), so in a surge rollout the new pod is ready once its
    /// agent has taken over; 1 (saying why) when not, 4 when none answers.
    Ready {
        /// Which agent instance.
        #[command(flatten)]
        state: StateArgs,
        /// Ready only if the answering agent runs in this process's cgroup
        /// (the probe's container).
        #[arg(long)]
        same_cgroup: bool,
    },
    /// Install the CNI plugin on this node (from the DaemonSet): copy the
    /// binary, write its kubeconfig, insert it into the primary CNI
    /// configuration, and keep it there.
    InstallCni(Box<install_cni::InstallCniArgs>),
}

/// `dataplane redirect ...`
#[derive(Debug, Subcommand)]
pub enum RedirectCommand {
    /// Print the kernel programs' decision counters (summed over CPUs).
    Stats {
        /// Which agent instance.
        #[command(flatten)]
        state: StateArgs,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
}

/// Where an agent instance keeps its kernel state.
#[derive(Debug, Clone, Args)]
pub struct StateArgs {
    /// Agent instance name: pins live under <bpffs>/dataplane/<instance>/, so
    /// several agents (simulated nodes) can share one kernel.
    #[arg(long, env = "DATAPLANE_INSTANCE", default_value = "default")]
    pub instance: String,
    /// bpffs directory that holds pinned maps and links.
    #[arg(long, env = "DATAPLANE_BPFFS", default_value = "/sys/fs/bpf")]
    pub bpffs: PathBuf,
    /// Directory for the control socket and enrollment state
    /// (<state-dir>/<instance>/{agent.sock,pods.json}).
    #[arg(long, env = "DATAPLANE_STATE_DIR", default_value = "/run/dataplane")]
    pub state_dir: PathBuf,
}

/// What an agent does once it has handed its pods over (`--after-handover`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum AfterHandover {
    /// Exit 0 (on a host the upgrade is done when the old process is gone).
    Exit,
    /// Stay up idle until SIGTERM or SIGINT (in a pod: its deletion).
    Wait,
}

/// `dataplane run` options.
#[derive(Debug, Clone, Args)]
pub struct RunArgs {
    /// Local config file (workloads, services, policies). Without it the
    /// embedded default is used.
    #[arg(long, env = "DATAPLANE_CONFIG")]
    pub config: Option<PathBuf>,
    /// Kernel state location.
    #[command(flatten)]
    pub state: StateArgs,
    /// cgroup v2 directory to attach the socket programs to [default: the
    /// cgroup v2 mount, detected from /proc/self/mountinfo].
    #[arg(long, env = "DATAPLANE_CGROUP")]
    pub cgroup: Option<PathBuf>,
    /// What to do with kernel state on SIGINT/SIGTERM: `keep` leaves programs
    /// attached and maps pinned for the next agent to re-adopt (pods stay
    /// captured; fail-closed while no agent runs); `detach` removes them
    /// (pods fall back to direct traffic).
    #[arg(long, env = "DATAPLANE_ON_EXIT", default_value = "keep", value_parser = exit_mode_parser())]
    pub on_exit: ExitMode,
    /// While no agent serves an enrolled pod (stopped with `--on-exit keep`,
    /// or crashed), let its traffic through uncaptured instead of refusing
    /// it. Default: fail-closed.
    #[arg(long, env = "DATAPLANE_FAIL_OPEN")]
    pub fail_open: bool,
    /// Same-node fast path: once policy allows a connection between two
    /// pods this agent serves on this node, later connections of the pair
    /// go socket to socket in the kernel, with no proxy and no mutual TLS
    /// on that node-local hop (both identities are checked by this agent;
    /// the bytes never leave the node's kernel). `off` sends every byte
    /// through the HBONE tunnel. A pod's `dataplane/fast-path` annotation,
    /// else its workload's `fastPath` setting, overrides it for that pod.
    #[arg(long, env = "DATAPLANE_FAST_PATH", value_enum, default_value = "on")]
    pub fast_path: Toggle,
    /// Send what a client has already sent when its HBONE tunnel opens (up
    /// to 16 KiB) with the CONNECT request, before the 200, saving a round
    /// trip between the nodes. HTTP/2 allows it and ztunnel and Envoy
    /// accept it by default; `off` for a peer that rejects such data (an
    /// Envoy waypoint whose router sets `reject_connect_request_early_data`).
    #[arg(
        long,
        env = "DATAPLANE_HBONE_EARLY_DATA",
        value_enum,
        default_value = "on"
    )]
    pub hbone_early_data: Toggle,
    /// Source addresses of kubelet health probes, never captured inbound
    /// (repeatable). The node-side address of each pod is always exempt.
    #[arg(
        long = "probe-source",
        env = "DATAPLANE_PROBE_SOURCES",
        value_delimiter = ',',
        default_value = "169.254.7.127"
    )]
    pub probe_sources: Vec<std::net::IpAddr>,
    /// The node's own network namespace: connections its sockets make to
    /// enrolled pods (kubelet's health probes) are never captured, whatever
    /// source address they carry, while traffic merely forwarded through
    /// the node is [default: the agent's own, right for a host-network
    /// DaemonSet].
    #[arg(long, env = "DATAPLANE_NODE_NETNS")]
    pub node_netns: Option<PathBuf>,
    /// DNS capture.
    #[command(flatten)]
    pub dns: dns::DnsArgs,
    /// This node's name: at start, configured workloads with a `netns` are
    /// enrolled when their `node` matches (all of them when unset).
    #[arg(long, env = "DATAPLANE_NODE")]
    pub node: Option<String>,
    /// SPIFFE trust domain whose clients the HBONE servers accept.
    #[arg(long, env = "DATAPLANE_TRUST_DOMAIN", default_value = "cluster.local")]
    pub trust_domain: String,
    /// Directory of the built-in CA's root (root-cert.pem, root-key.pem):
    /// loaded when present, generated (key mode 0600) when not. Agents of one
    /// mesh must share the root. [default: <state-dir>/ca]
    #[arg(long, env = "DATAPLANE_CA_DIR", conflicts_with_all = ["ca_cert", "ca_key"])]
    pub ca_dir: Option<PathBuf>,
    /// Root certificate of the CA (PEM), with --ca-key: use an existing root.
    #[arg(long, env = "DATAPLANE_CA_CERT", requires = "ca_key")]
    pub ca_cert: Option<PathBuf>,
    /// Root key of the CA (PEM), with --ca-cert.
    #[arg(long, env = "DATAPLANE_CA_KEY", requires = "ca_cert")]
    pub ca_key: Option<PathBuf>,
    /// Lifetime of workload certificates (rotated at half-life), e.g. `24h`,
    /// `30m`, `90s`.
    #[arg(long, env = "DATAPLANE_CERT_LIFETIME", default_value = "24h", value_parser = parse_duration)]
    pub cert_lifetime: std::time::Duration,
    /// Whether the agent's listeners use IPv6 (ztunnel's `IPV6_ENABLED`):
    /// `true`, the pods' listeners are dual-stack (`[::]:15006`,
    /// `[::]:15008`, `[::1]:15001` and the DNS resolver on `[::1]`); `false`,
    /// IPv4 alone (`0.0.0.0`, `127.0.0.1`), for nodes whose kernel was
    /// booted with `ipv6.disable=1`, where IPv6 sockets fail with
    /// EAFNOSUPPORT. A pod's IPv6 connections are then refused outbound and
    /// dropped inbound (with --fail-open, inbound ones reach the app
    /// uncaptured). Also sets the default address of readiness and metrics.
    #[arg(
        long,
        env = "DATAPLANE_IPV6_ENABLED",
        default_value_t = true,
        num_args = 0..=1,
        default_missing_value = "true",
        action = clap::ArgAction::Set
    )]
    pub ipv6_enabled: bool,
    /// The network this node's pods are on (ztunnel's `NETWORK`, read
    /// under that name as Istio's chart sets it). A service endpoint on
    /// another network is reached through its network gateway (double
    /// HBONE), or not at all without one. Pods the mesh knows go by their
    /// workload's own network; this one is for the others.
    /// [default: empty, the default network]
    #[arg(long, env = "NETWORK", default_value = "")]
    pub network: String,
    /// Where the readiness endpoint (`GET /healthz/ready`) listens. Port 0
    /// picks a free port (logged). [default: [::]:15021, or 0.0.0.0:15021
    /// with --ipv6-enabled false]
    #[arg(long, env = "DATAPLANE_READINESS_ADDR")]
    pub readiness_addr: Option<std::net::SocketAddr>,
    /// Where Prometheus metrics (`GET /metrics`) are served. Port 0 picks a
    /// free port (logged). [default: [::]:15020, or 0.0.0.0:15020 with
    /// --ipv6-enabled false; the proxy config's statsPort over 15020]
    #[arg(long, env = "DATAPLANE_METRICS_ADDR")]
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// Where the admin endpoint (`/config_dump`, `/logging`,
    /// `/quitquitquit`) listens: a loopback address only, so that nothing
    /// but this host's root can reach it. Port 0 picks a free port (logged).
    /// [default: 127.0.0.1:15000, or the proxy config's proxyAdminPort]
    #[arg(long, env = "DATAPLANE_ADMIN_ADDR", value_parser = parse_loopback)]
    pub admin_addr: Option<std::net::SocketAddr>,
    /// On SIGTERM (or `/quitquitquit`): how long open connections get to
    /// finish after the listeners close and HBONE peers get GOAWAY; what is
    /// still open then is closed. Keep it below the pod's
    /// terminationGracePeriodSeconds. A re-enrolled pod's previous engine
    /// gets as long to finish the connections it had accepted.
    #[arg(long, env = "DATAPLANE_DRAIN_TIMEOUT", default_value = "20s", value_parser = parse_duration)]
    pub drain_timeout: std::time::Duration,
    /// How long an inbound HBONE client may take to finish its handshake:
    /// TLS, then the HTTP/2 connection preface and its first SETTINGS
    /// frame. A connection that takes longer is reset.
    #[arg(long, env = "DATAPLANE_HBONE_HANDSHAKE_TIMEOUT", default_value = "10s", value_parser = parse_positive_duration)]
    pub hbone_handshake_timeout: std::time::Duration,
    /// An inbound HBONE connection with no open stream for this long is
    /// closed (GOAWAY). Keep it above the clients' pool idle timeout (60 s
    /// for this agent's pool) so that clients close first.
    #[arg(long, env = "DATAPLANE_HBONE_IDLE_TIMEOUT", default_value = "3m", value_parser = parse_positive_duration)]
    pub hbone_idle_timeout: std::time::Duration,
    /// How a pod whose workload takes its tunnels as PROXY (a sandwiched
    /// waypoint's `applicationTunnel`) gets them: `true`, from and to
    /// loopback inside the pod (the app listens on localhost, so nothing
    /// reaches it around the node proxy); `false`, at the pod's own
    /// address, from the client's as any inbound connection (ztunnel's
    /// `LOCALHOST_APP_TUNNEL`, read under that name too).
    #[arg(
        long,
        env = "DATAPLANE_LOCALHOST_APP_TUNNEL",
        default_value_t = true,
        num_args = 0..=1,
        default_missing_value = "true",
        action = clap::ArgAction::Set
    )]
    pub localhost_app_tunnel: bool,
    /// TCP keepalive on every proxied socket: those the in-pod listeners
    /// accept and those the agent dials (ztunnel's `KEEPALIVE_ENABLED`).
    /// Without it an idle connection whose path forgets it (a NAT, a load
    /// balancer) is never noticed.
    #[arg(long, env = "DATAPLANE_KEEPALIVE", value_enum, default_value = "on")]
    pub keepalive: Toggle,
    /// Idle time before the first keepalive probe (ztunnel's
    /// `KEEPALIVE_TIME`).
    #[arg(long, env = "DATAPLANE_KEEPALIVE_TIME", default_value = "180s", value_parser = parse_positive_duration)]
    pub keepalive_time: std::time::Duration,
    /// Time between unanswered keepalive probes (ztunnel's
    /// `KEEPALIVE_INTERVAL`).
    #[arg(long, env = "DATAPLANE_KEEPALIVE_INTERVAL", default_value = "180s", value_parser = parse_positive_duration)]
    pub keepalive_interval: std::time::Duration,
    /// Unanswered probes after which the connection is reset (ztunnel's
    /// `KEEPALIVE_RETRIES`).
    #[arg(long, env = "DATAPLANE_KEEPALIVE_RETRIES", default_value_t = 9, value_parser = clap::value_parser!(u32).range(1..=127))]
    pub keepalive_retries: u32,
    /// Pooled HBONE connections to one destination (from one source
    /// identity) that the pool opens to spread concurrent streams: one
    /// connection's bytes are encrypted by one task on one core. A new
    /// stream dials another connection when every connection carries
    /// `--hbone-pool-busy-streams`; at this bound it joins the
    /// least-loaded one (connections are added past it only when all
    /// carry 100 streams).
    #[arg(long, env = "DATAPLANE_HBONE_POOL_MAX_CONNECTIONS", default_value_t = 4, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub hbone_pool_max_connections: u16,
    /// Open streams that make a pooled HBONE connection busy (see
    /// `--hbone-pool-max-connections`). 1 gives every concurrent stream
    /// its own connection up to the bound, at the cost of a handshake
    /// whenever a tunnel still closing overlaps the next one.
    #[arg(long, env = "DATAPLANE_HBONE_POOL_BUSY_STREAMS", default_value_t = 2, value_parser = clap::value_parser!(u16).range(1..=100))]
    pub hbone_pool_busy_streams: u16,
    /// Streams one pooled HBONE connection carries at most; a stream
    /// finding every connection to its destination this full dials
    /// another, past `--hbone-pool-max-connections` (ztunnel's
    /// `POOL_MAX_STREAMS_PER_CONNECTION`). Our HBONE server accepts 100
    /// concurrent streams: above that, extra streams wait on the peer.
    #[arg(long, env = "DATAPLANE_HBONE_POOL_MAX_STREAMS_PER_CONNECTION", default_value_t = 100, value_parser = clap::value_parser!(u16).range(1..))]
    pub hbone_pool_max_streams_per_connection: u16,
    /// How long a pooled HBONE connection without an open stream is kept
    /// before it is closed (ztunnel's `POOL_UNUSED_RELEASE_TIMEOUT`, whose
    /// default is 5 min; ours stays below our servers' 3 min
    /// `--hbone-idle-timeout`, so that the client, not the server, closes
    /// an idle connection and no stream races the server's GOAWAY).
    #[arg(long, env = "DATAPLANE_HBONE_POOL_IDLE_TIMEOUT", default_value = "60s", value_parser = parse_positive_duration)]
    pub hbone_pool_idle_timeout: std::time::Duration,
    /// HTTP/2 receive window of one HBONE stream, in bytes, announced by
    /// both ends (ztunnel's `HTTP2_STREAM_WINDOW_SIZE`).
    #[arg(long, env = "DATAPLANE_HTTP2_STREAM_WINDOW_SIZE", default_value_t = crate::hbone::wire::STREAM_WINDOW, value_parser = clap::value_parser!(u32).range(1..=i64::from(crate::hbone::wire::MAX_WINDOW_LIMIT)))]
    pub http2_stream_window_size: u32,
    /// HTTP/2 receive window of one HBONE connection (all its streams), in
    /// bytes; at least the stream window (ztunnel's
    /// `HTTP2_CONNECTION_WINDOW_SIZE`).
    #[arg(long, env = "DATAPLANE_HTTP2_CONNECTION_WINDOW_SIZE", default_value_t = crate::hbone::wire::CONNECTION_WINDOW, value_parser = clap::value_parser!(u32).range(1..=i64::from(crate::hbone::wire::MAX_WINDOW_LIMIT)))]
    pub http2_connection_window_size: u32,
    /// Largest HTTP/2 frame an HBONE end accepts, in bytes, 16384 to
    /// 16777215 (ztunnel's `HTTP2_FRAME_SIZE`).
    #[arg(long, env = "DATAPLANE_HTTP2_FRAME_SIZE", default_value_t = crate::hbone::wire::MAX_FRAME, value_parser = clap::value_parser!(u32).range(i64::from(crate::hbone::wire::MIN_FRAME_LIMIT)..=i64::from(crate::hbone::wire::MAX_FRAME_LIMIT)))]
    pub http2_frame_size: u32,
    /// Inbound HBONE connections that may be in their handshake at once on
    /// the whole node; over it the oldest handshake of the busiest source is
    /// reset [default: a quarter of the file descriptor limit, between 16
    /// and 16384].
    #[arg(long, env = "DATAPLANE_MAX_PENDING_HANDSHAKES", value_parser = clap::value_parser!(u32).range(1..))]
    pub max_pending_handshakes: Option<u32>,
    /// Inbound HBONE connections that may be in their handshake at once to
    /// one pod; over it the oldest handshake of the pod's busiest source is
    /// reset.
    #[arg(long, env = "DATAPLANE_MAX_PENDING_HANDSHAKES_PER_POD", default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_pending_handshakes_per_pod: u32,
    /// Inbound HBONE connections that may be in their handshake at once
    /// from one source address; over it that source's oldest is reset.
    #[arg(long, env = "DATAPLANE_MAX_PENDING_HANDSHAKES_PER_SOURCE", default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_pending_handshakes_per_source: u32,
    /// Threads serving connections [default: the proxy config's
    /// concurrency, else one per CPU the agent may use]. Under `--threading shared`, `1` runs everything on one thread.
    #[arg(long, env = "DATAPLANE_WORKER_THREADS", value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub worker_threads: Option<u16>,
    /// How connections are spread over the worker threads: `pinned` puts
    /// each pod on one single-threaded worker (its connections never
    /// change threads; pods spread over the workers), `shared` runs all on
    /// one work-stealing pool (one pod may use every thread).
    #[arg(
        long,
        env = "DATAPLANE_THREADING",
        value_enum,
        default_value = "pinned"
    )]
    pub threading: workers::ThreadingFlag,
    /// Socket mark of the agent's own sockets, which capture never touches.
    #[arg(long, env = "DATAPLANE_PROXY_MARK", default_value_t = dataplane_common::DEFAULT_PROXY_MARK, value_parser = parse_u32)]
    pub proxy_mark: u32,
    /// Log output format.
    #[arg(long, env = "DATAPLANE_LOG_FORMAT", default_value = "text", value_parser = log_format_parser())]
    pub log_format: LogFormat,
    /// The share of access records of connections that ended well to
    /// write, from 0 (none) to 1 (all), each drawn per connection; records
    /// of failed, refused or agent-closed connections are always written
    /// (at `warn`: `RUST_LOG=info,access=warn` writes those alone).
    #[arg(long, env = "DATAPLANE_ACCESS_LOG_SAMPLE", default_value_t = 1.0, value_parser = parse_fraction)]
    pub access_log_sample: f64,
    /// How pod traffic reaches the in-pod listeners: `ebpf` (our kernel
    /// programs) or `iptables` (Istio-style REDIRECT rules that someone else
    /// installs in each pod; no kernel program is loaded or attached and
    /// original destinations come from `SO_ORIGINAL_DST`). `iptables` exists
    /// as the benchmarks' baseline.
    #[arg(long, env = "DATAPLANE_CAPTURE", value_enum, default_value = "ebpf")]
    pub capture: CaptureMode,
    /// Enroll this node's pods that opted in (`istio.io/dataplane-mode=ambient`)
    /// and unenroll those gone, from a watch of the Kubernetes API. Needs
    /// --node.
    #[arg(long, env = "DATAPLANE_KUBE")]
    pub kube: bool,
    /// Kubeconfig for --kube [default: the in-cluster service account, else
    /// $KUBECONFIG or ~/.kube/config].
    #[arg(long, env = "DATAPLANE_KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// Which pods --kube enrolls: Istio's enablement selectors (the
    /// istio-cni chart's `ambient.enablementSelectors`), a YAML or JSON
    /// list of `{podSelector, namespaceSelector}` label selectors; a pod
    /// is enrolled when any entry matches it and its namespace [default:
    /// Istio's: pods labelled `istio.io/dataplane-mode=ambient`, and pods
    /// not labelled `none` in namespaces labelled `ambient`].
    #[arg(long, env = "DATAPLANE_ENABLEMENT_SELECTORS", value_parser = crate::kube::optin::parse_selectors_arg)]
    pub enablement_selectors: Option<crate::kube::optin::EnablementSelectors>,
    /// Namespaces whose pods --kube never enrolls, and unenrolls if
    /// enrolled (istio-cni's `excludeNamespaces`; repeatable or
    /// comma-separated).
    #[arg(
        long = "exclude-namespace",
        env = "DATAPLANE_EXCLUDE_NAMESPACES",
        value_delimiter = ',',
        default_value = crate::kube::optin::DEFAULT_EXCLUDED_NAMESPACE
    )]
    pub exclude_namespaces: Vec<String>,
    /// If an agent of this instance is running, take its pods over: it
    /// passes its lock and its in-pod listening sockets to this agent,
    /// which serves them before the old one stops accepting, so an
    /// upgrade refuses no connection; the old one then drains and exits.
    /// Without a running agent this starts as usual.
    #[arg(long, env = "DATAPLANE_TAKEOVER")]
    pub takeover: bool,
    /// Once handed over and drained: `exit` 0, or `wait` for SIGTERM/SIGINT
    /// holding nothing (lock, socket, ports, kernel state), then exit 0. A
    /// pod's container must not exit before the pod is deleted: restarted,
    /// it would take the pods back.
    #[arg(
        long,
        env = "DATAPLANE_AFTER_HANDOVER",
        value_enum,
        default_value = "exit"
    )]
    pub after_handover: AfterHandover,
    /// Istio mesh membership: istiod, xDS, certificate source.
    #[command(flatten)]
    pub istio: istio::IstioArgs,
    /// Whether apps see their clients' own addresses.
    #[command(flatten)]
    pub original_source: original_source::OriginalSourceArgs,
    /// What serves enrolled pods: this agent or a stock ztunnel.
    #[command(flatten)]
    pub engine: engine::EngineArgs,
    /// TLS compliance: post-quantum key exchange only, TLS 1.2.
    #[command(flatten)]
    pub tls: tls::TlsArgs,
    /// Istio's mesh config and `PROXY_CONFIG`: defaults under the flags.
    #[command(flatten)]
    pub proxy_config: proxy_config::ProxyConfigArgs,
}

/// How pod traffic is steered into the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum CaptureMode {
    /// Our kernel programs (the product).
    Ebpf,
    /// iptables rules installed by someone else (the benchmarks' baseline).
    Iptables,
}

/// A feature switch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Toggle {
    /// Enabled.
    On,
    /// Disabled.
    Off,
}

impl Toggle {
    /// Whether it is `on`.
    pub fn is_on(self) -> bool {
        self == Self::On
    }
}

/// Parses `--on-exit` into [`ExitMode`] and lists the modes in `--help` as
/// a clap enum would; the kernel crate's type knows nothing of clap.
fn exit_mode_parser() -> impl clap::builder::TypedValueParser<Value = ExitMode> {
    use clap::builder::{PossibleValue, PossibleValuesParser, TypedValueParser as _};
    PossibleValuesParser::new([
        PossibleValue::new("keep").help(
            "Leave programs attached and maps pinned, so a restarted agent re-adopts them and \
             enrolled pods stay captured (their connections are refused until the agent's \
             listeners are back: fail-closed)",
        ),
        PossibleValue::new("detach").help(
            "Detach every program and remove every pin: pods fall back to direct, uncaptured \
             traffic (fail-open) and nothing is left in bpffs",
        ),
    ])
    .map(|name| match name.as_str() {
        "detach" => ExitMode::Detach,
        _ => ExitMode::Keep,
    })
}

/// Parses `--log-format` into [`LogFormat`] and lists the formats in
/// `--help` as a clap enum would; the type itself knows nothing of clap.
fn log_format_parser() -> impl clap::builder::TypedValueParser<Value = LogFormat> {
    use clap::builder::{PossibleValue, PossibleValuesParser, TypedValueParser as _};
    PossibleValuesParser::new([
        PossibleValue::new("text").help("Human-readable lines"),
        PossibleValue::new("json").help("One JSON object per line"),
    ])
    .map(|name| match name.as_str() {
        "json" => LogFormat::Json,
        _ => LogFormat::Text,
    })
}

pub use dataplane_core::parse::parse_duration;

/// A [`parse_duration`] that is not zero (a zero timeout would end every
/// connection at once).
fn parse_positive_duration(s: &str) -> Result<std::time::Duration, String> {
    match parse_duration(s)? {
        d if d.is_zero() => Err(format!("`{s}`: must be longer than zero")),
        d => Ok(d),
    }
}

/// Accepts decimal or `0x` hexadecimal.
fn parse_loopback(text: &str) -> Result<std::net::SocketAddr, String> {
    let addr: std::net::SocketAddr = text
        .parse()
        .map_err(|e| format!("`{text}` is not an ip:port address: {e}"))?;
    if addr.ip().is_loopback() {
        Ok(addr)
    } else {
        Err(format!(
            "{addr} is not a loopback address; the admin endpoint may only listen on 127.0.0.1 or [::1]"
        ))
    }
}

/// A number from 0 to 1.
fn parse_fraction(s: &str) -> Result<f64, String> {
    let value: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a number; give one from 0 to 1"))?;
    if !(0.0..=1.0).contains(&value) {
        return Err(format!("{s} is not between 0 and 1"));
    }
    Ok(value)
}

fn parse_u32(s: &str) -> Result<u32, String> {
    let parsed = match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(hex) => u32::from_str_radix(hex, 16),
        None => s.parse(),
    };
    parsed.map_err(|e| format!("`{s}` is not a 32-bit number (decimal or 0x hex): {e}"))
}

#[cfg(test)]
mod tests;
