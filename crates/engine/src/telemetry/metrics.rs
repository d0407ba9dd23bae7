//! The Prometheus registry: Istio's `istio_tcp_*` families, the agent's
//! own connection, configuration and build metrics, and collectors that
//! read kernel and agent state on each scrape.

use std::{
    fmt,
    sync::{
        Arc, Mutex, PoisonError, RwLock,
        atomic::{AtomicI64, Ordering},
    },
};

use foldhash::HashMap;
use prometheus_client::{
    collector::Collector,
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family, gauge::Gauge},
    registry::Registry,
};

use super::{
    flow::{Direction, Peer, ServiceRef},
    process::ProcessCollector,
};

/// The labels Istio puts on its TCP metrics (design: Metrics). Unknown
/// values are `unknown`, as Istio writes them.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TcpLabels {
    /// `source` (the client's node reported) or `destination`.
    pub reporter: &'static str,
    /// The client's workload (its owner's name when known, else the pod).
    pub source_workload: String,
    /// The client's canonical service.
    pub source_canonical_service: String,
    /// The client's canonical revision.
    pub source_canonical_revision: String,
    /// The client's namespace.
    pub source_workload_namespace: String,
    /// The client's SPIFFE identity.
    pub source_principal: String,
    /// The client's app (its canonical service).
    pub source_app: String,
    /// The client's version (its canonical revision).
    pub source_version: String,
    /// The client's cluster.
    pub source_cluster: String,
    /// The service's hostname.
    pub destination_service: String,
    /// The service's namespace.
    pub destination_service_namespace: String,
    /// The service's name.
    pub destination_service_name: String,
    /// The server's workload.
    pub destination_workload: String,
    /// The server's canonical service.
    pub destination_canonical_service: String,
    /// The server's canonical revision.
    pub destination_canonical_revision: String,
    /// The server's namespace.
    pub destination_workload_namespace: String,
    /// The server's SPIFFE identity.
    pub destination_principal: String,
    /// The server's app.
    pub destination_app: String,
    /// The server's version.
    pub destination_version: String,
    /// The server's cluster.
    pub destination_cluster: String,
    /// Always `tcp`: the engine does not parse application protocols.
    pub request_protocol: &'static str,
    /// `-` for a connection that was set up and ended cleanly; Istio's flag
    /// ([`super::ResponseFlags`]: `DENY`, `CONNECT`, `NETWORK_POLICY`, ...)
    /// for one that was not, or that failed or was closed by the agent.
    pub response_flags: &'static str,
    /// `mutual_tls` for HBONE, `none` for plaintext.
    pub connection_security_policy: &'static str,
    /// The client's region.
    pub source_region: String,
    /// The client's zone.
    pub source_zone: String,
    /// The server's region.
    pub destination_region: String,
    /// The server's zone.
    pub destination_zone: String,
}

/// The labels of `istio_on_demand_dns_total` (ztunnel
/// `src/proxy/metrics.rs` `OnDemandDnsLabels`): the client, and the name
/// resolved for it.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OnDemandDnsLabels {
    source_workload: String,
    source_canonical_service: String,
    source_canonical_revision: String,
    source_workload_namespace: String,
    source_principal: String,
    source_app: String,
    source_version: String,
    source_cluster: String,
    hostname: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FailedLabels {
    direction: &'static str,
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DirectionLabels {
    direction: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct AcceptLabels {
    listener: &'static str,
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BuildLabels {
    component: &'static str,
    tag: &'static str,
}

/// The counters of one connection, resolved once when it opens so closing
/// it does not hash its labels again.
#[derive(Debug, Clone)]
pub(super) struct TcpCounters {
    pub opened: Counter,
    pub closed: Counter,
    pub received: Counter,
    pub sent: Counter,
}

/// What a connection's Istio label set is made of: the peers and service
/// it was attributed to and the labels fixed by its kind. Equal keys give
/// equal label sets, so the counters of a key are found with one lookup
/// that hashes the peers' facts instead of building 27 label strings and
/// hashing them once per family.
///
/// Hash and equality are the peers' contents (`Arc`'s, with a pointer
/// comparison first): peers rebuilt with the same facts (a configuration
/// reload, an inbound connection's own source peer) share the entry.
#[derive(Debug, Clone, Hash, PartialEq, Eq)]
pub(super) struct FlowKey {
    /// `source` or `destination`.
    pub reporter: &'static str,
    /// `mutual_tls` or `none`.
    pub security: &'static str,
    /// The client.
    pub source: Arc<Peer>,
    /// The server.
    pub destination: Arc<Peer>,
    /// The service the connection is attributed to.
    pub service: Option<Arc<ServiceRef>>,
}

/// The counters of every label set a connection was opened with. It grows
/// like the families themselves (one entry per label set, never removed).
/// Hashed with foldhash rather than SipHash (half the time of a flow's
/// open and close): its keys are facts from the configuration and
/// identities from verified certificates, and its seed is random per
/// process.
type CounterCache = RwLock<HashMap<FlowKey, TcpCounters>>;

/// Every metric the agent exports on `/metrics`.
#[derive(Debug)]
pub struct Metrics {
    registry: Mutex<Registry>,
    opened: Family<TcpLabels, Counter>,
    closed: Family<TcpLabels, Counter>,
    received: Family<TcpLabels, Counter>,
    sent: Family<TcpLabels, Counter>,
    counters: CounterCache,
    failed: Family<FailedLabels, Counter>,
    istio_failed: Family<TcpLabels, Counter>,
    /// The two series of `dataplane_tcp_connections_open`, resolved once.
    open_outbound: Gauge,
    open_inbound: Gauge,
    open_total: AtomicI64,
    reloads: Family<ResultLabels, Counter>,
    config_valid: Gauge,
    handshakes_shed: Family<ReasonLabels, Counter>,
    accept_failures: Family<AcceptLabels, Counter>,
    handshakes_pending: Gauge,
    early_data: Counter,
    on_demand_dns: Family<OnDemandDnsLabels, Counter>,
    proxies_started: Counter,
    proxies_stopped: Counter,
    /// The share of clean-close access records written (not a metric:
    /// held here because every connection's record reaches it).
    access_sample: super::AccessSample,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// A registry with every family registered and no samples yet.
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let opened = Family::<TcpLabels, Counter>::default();
        let closed = Family::<TcpLabels, Counter>::default();
        let received = Family::<TcpLabels, Counter>::default();
        let sent = Family::<TcpLabels, Counter>::default();
        registry.register(
            "istio_tcp_connections_opened",
            "TCP connections opened",
            opened.clone(),
        );
        registry.register(
            "istio_tcp_connections_closed",
            "TCP connections closed",
            closed.clone(),
        );
        registry.register(
            "istio_tcp_received_bytes",
            "Bytes the client sent towards the server, counted as they pass",
            received.clone(),
        );
        registry.register(
            "istio_tcp_sent_bytes",
            "Bytes the server sent back to the client, counted as they pass",
            sent.clone(),
        );
        let failed = Family::<FailedLabels, Counter>::default();
        registry.register(
            "dataplane_tcp_connections_failed",
            "Connections refused or that could not be set up, by direction and reason",
            failed.clone(),
        );
        let istio_failed = Family::<TcpLabels, Counter>::default();
        registry.register(
            "istio_tcp_connections_failed",
            "TCP connections that could not be set up, with Istio's response flags",
            istio_failed.clone(),
        );
        let open = Family::<DirectionLabels, Gauge>::default();
        registry.register(
            "dataplane_tcp_connections_open",
            "Connections open now, by direction",
            open.clone(),
        );
        let reloads = Family::<ResultLabels, Counter>::default();
        registry.register(
            "dataplane_config_reloads",
            "Configuration files read after start-up, by result (applied or rejected)",
            reloads.clone(),
        );
        let config_valid = Gauge::default();
        config_valid.set(1);
        registry.register(
            "dataplane_config_valid",
            "1 when the last configuration file read was applied, 0 when it was rejected \
             (the previous one stays in force)",
            config_valid.clone(),
        );
        let accept_failures = Family::<AcceptLabels, Counter>::default();
        registry.register(
            "dataplane_accept_failures",
            "Failed accepts on the in-pod listeners, by listener and reason \
             (descriptors: out of file descriptors; memory; other)",
            accept_failures.clone(),
        );
        let handshakes_shed = Family::<ReasonLabels, Counter>::default();
        registry.register(
            "dataplane_hbone_handshakes_shed",
            "Inbound HBONE connections reset while still in their TLS or HTTP/2 handshake \
             because a bound on pending handshakes was reached, by the bound \
             (source_limit, pod_limit, node_limit)",
            handshakes_shed.clone(),
        );
        let handshakes_pending = Gauge::default();
        registry.register(
            "dataplane_hbone_handshakes_pending",
            "Inbound HBONE connections in their TLS or HTTP/2 handshake now",
            handshakes_pending.clone(),
        );
        let early_data = Counter::default();
        registry.register(
            "dataplane_hbone_early_data",
            "Outbound HBONE tunnels whose CONNECT request carried the client's first bytes \
             (sent before the response, saving a round trip)",
            early_data.clone(),
        );
        let on_demand_dns = Family::<OnDemandDnsLabels, Counter>::default();
        registry.register(
            "istio_on_demand_dns",
            "Connections to an endpoint known by DNS name, whose name the agent resolved",
            on_demand_dns.clone(),
        );
        // ztunnel's names (`src/inpod/metrics.rs`, under the
        // `workload_manager` prefix of `src/app.rs`): it counts a pod's
        // proxy started once its listeners are up and stopped once its
        // task ends (`src/inpod/statemanager.rs` `add_workload_inner`).
        let proxies_started = Counter::default();
        registry.register(
            "workload_manager_proxies_started",
            "Pod engines started (one per enrollment, and one more for each re-enrollment)",
            proxies_started.clone(),
        );
        let proxies_stopped = Counter::default();
        registry.register(
            "workload_manager_proxies_stopped",
            "Pod engines ended (the pod left, or a re-enrolled pod's previous engine drained)",
            proxies_stopped.clone(),
        );
        let build = Family::<BuildLabels, Gauge>::default();
        build
            .get_or_create(&BuildLabels {
                component: "dataplane",
                tag: env!("CARGO_PKG_VERSION"),
            })
            .set(1);
        registry.register("istio_build", "Build of this agent", build);
        registry.register_collector(Box::new(ProcessCollector));
        let open_outbound = open.get_or_create_owned(&DirectionLabels {
            direction: Direction::Outbound.as_str(),
        });
        let open_inbound = open.get_or_create_owned(&DirectionLabels {
            direction: Direction::Inbound.as_str(),
        });
        Self {
            registry: Mutex::new(registry),
            opened,
            closed,
            received,
            sent,
            counters: RwLock::default(),
            failed,
            istio_failed,
            open_outbound,
            open_inbound,
            open_total: AtomicI64::new(0),
            reloads,
            config_valid,
            handshakes_shed,
            accept_failures,
            handshakes_pending,
            early_data,
            on_demand_dns,
            proxies_started,
            proxies_stopped,
            access_sample: super::AccessSample::default(),
        }
    }

    /// Writes `rate` (0 to 1) of the access records of connections that
    /// ended well from now on (`--access-log-sample`); every other record
    /// is written.
    pub fn set_access_log_sample(&self, rate: f64) {
        self.access_sample.set(rate);
    }

    /// Whether a clean close's access record is written.
    pub(super) fn keep_access_record(&self) -> bool {
        self.access_sample.keep()
    }

    /// The registry itself, for a module below telemetry that registers
    /// its own families (`xds::XdsMetrics::registered`). A scrape waits
    /// while the guard is held.
    pub fn registry(&self) -> std::sync::MutexGuard<'_, Registry> {
        self.registry.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Adds a metric another module owns (it keeps a clone to update).
    pub fn register(
        &self,
        name: &str,
        help: &str,
        unit: Option<prometheus_client::registry::Unit>,
        metric: impl prometheus_client::registry::Metric,
    ) {
        let mut registry = self.registry();
        match unit {
            Some(unit) => registry.register_with_unit(name, help, unit, metric),
            None => registry.register(name, help, metric),
        }
    }

    /// Adds a collector run on every scrape (kernel counters, pods, ...).
    pub fn register_collector(&self, collector: Box<dyn Collector>) {
        self.registry
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .register_collector(collector);
    }

    /// The Prometheus text exposition (format 0.0.4) of every metric.
    pub fn encode(&self) -> Result<String, fmt::Error> {
        let registry = self.registry.lock().unwrap_or_else(PoisonError::into_inner);
        let mut out = String::with_capacity(16 * 1024);
        prometheus_client::encoding::prometheus_text::encode(&mut out, &registry)?;
        Ok(out)
    }

    /// Records the result of reading a changed configuration file.
    pub fn config_reloaded(&self, applied: bool) {
        let result = if applied { "applied" } else { "rejected" };
        self.reloads.get_or_create(&ResultLabels { result }).inc();
        self.config_valid.set(i64::from(applied));
    }

    /// Connections open now, in both directions.
    pub fn open_connections(&self) -> i64 {
        self.open_total.load(Ordering::Acquire)
    }

    /// Counts a connection that could not be set up.
    pub fn failed(&self, direction: &'static str, reason: &'static str) {
        self.failed
            .get_or_create(&FailedLabels { direction, reason })
            .inc();
    }

    /// Counts a connection that could not be set up, in Istio's family.
    pub(super) fn istio_failed(&self, labels: &TcpLabels) {
        self.istio_failed.get_or_create(labels).inc();
    }

    /// Counts a connection as closed under `labels` (a failed one, whose
    /// response flags differ from those it was opened with).
    pub(super) fn closed_with(&self, labels: &TcpLabels) {
        self.closed.get_or_create(labels).inc();
    }

    /// Counts a failed accept on `listener`; `reason` is `descriptors`,
    /// `memory` or `other`.
    pub fn accept_failed(&self, listener: &'static str, reason: &'static str) {
        self.accept_failures
            .get_or_create(&AcceptLabels { listener, reason })
            .inc();
    }

    /// Counts an inbound handshake shed because of the bound `reason`.
    pub fn handshake_shed(&self, reason: &'static str) {
        self.handshakes_shed
            .get_or_create(&ReasonLabels { reason })
            .inc();
    }

    /// Counts a tunnel whose request carried the client's first bytes.
    pub fn early_data_sent(&self) {
        self.early_data.inc();
    }

    /// Counts a pod engine started (its listeners serving).
    pub fn proxy_started(&self) {
        self.proxies_started.inc();
    }

    /// Counts a pod engine ended (every task of it gone).
    pub fn proxy_stopped(&self) {
        self.proxies_stopped.inc();
    }

    /// Counts a connection from `source` whose endpoint's DNS name
    /// `hostname` is resolved for it (ztunnel counts before the lookup,
    /// whatever its outcome: `src/state.rs` `resolve_workload_address`).
    pub fn on_demand_dns(&self, source: &Peer, hostname: &str) {
        let label =
            |value: &Option<dataplane_model::config::SharedStr>| super::flow::label(value.as_ref());
        self.on_demand_dns
            .get_or_create(&OnDemandDnsLabels {
                source_workload: label(&source.workload),
                source_canonical_service: label(&source.canonical_service),
                source_canonical_revision: label(&source.canonical_revision),
                source_workload_namespace: label(&source.namespace),
                source_principal: label(&source.principal),
                source_app: label(&source.canonical_service),
                source_version: label(&source.canonical_revision),
                source_cluster: label(&source.cluster),
                hostname: hostname.to_owned(),
            })
            .inc();
    }

    /// Records how many inbound handshakes are pending.
    pub fn set_pending_handshakes(&self, pending: usize) {
        self.handshakes_pending
            .set(i64::try_from(pending).unwrap_or(i64::MAX));
    }

    /// Counts a connection as opened and open, and returns its counters;
    /// `labels` builds its label set the first time `key` is seen.
    pub(super) fn opened(
        &self,
        direction: Direction,
        key: &FlowKey,
        labels: impl FnOnce() -> TcpLabels,
    ) -> TcpCounters {
        let cached = self
            .counters
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(key)
            .cloned();
        let counters = cached.unwrap_or_else(|| {
            let labels = labels();
            let counters = TcpCounters {
                opened: self.opened.get_or_create_owned(&labels),
                closed: self.closed.get_or_create_owned(&labels),
                received: self.received.get_or_create_owned(&labels),
                sent: self.sent.get_or_create_owned(&labels),
            };
            self.counters
                .write()
                .unwrap_or_else(PoisonError::into_inner)
                .entry(key.clone())
                .or_insert(counters)
                .clone()
        });
        counters.opened.inc();
        self.open_gauge(direction).inc();
        self.open_total.fetch_add(1, Ordering::AcqRel);
        counters
    }

    /// The open-connections gauge of `direction`.
    fn open_gauge(&self, direction: Direction) -> &Gauge {
        match direction {
            Direction::Outbound => &self.open_outbound,
            Direction::Inbound => &self.open_inbound,
        }
    }

    pub(super) fn gone(&self, direction: Direction) {
        self.open_gauge(direction).dec();
        self.open_total.fetch_sub(1, Ordering::AcqRel);
    }
}
