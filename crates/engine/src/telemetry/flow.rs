//! One proxied connection as operators see it: the metrics it moves and its
//! access record (target `access`), written when it closes, when it is
//! refused, or when the agent closes it (policy change, drain deadline).
//!
//! Byte counts are from the client's point of view: `bytes_sent` went from
//! the client towards the server (Istio's `received_bytes`, since the
//! proxy received them), `bytes_received` came back. The byte metrics grow
//! while a connection is open (the relays count into them, [`Meter`]); the
//! access record has the totals.

use std::{
    net::SocketAddr,
    sync::Arc,
    time::{Duration, Instant},
};

use tracing::{info, warn};

pub use crate::state::{Peer, ServiceRef};

use super::{
    Meter,
    metrics::{FlowKey, Metrics, TcpCounters, TcpLabels},
    outcome::{FailReason, ResponseFlags},
    trace::{self, TraceId},
};

/// Which side of the mesh reports the connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Captured leaving a local pod (Istio reporter `source`).
    Outbound,
    /// Arriving at a local pod (Istio reporter `destination`).
    Inbound,
}

impl Direction {
    /// `outbound` or `inbound`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Outbound => "outbound",
            Self::Inbound => "inbound",
        }
    }

    fn reporter(self) -> &'static str {
        match self {
            Self::Outbound => "source",
            Self::Inbound => "destination",
        }
    }
}

/// How the connection travels between the nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// Plain TCP (passthrough, or a workload that does not speak HBONE).
    Tcp,
    /// An HTTP/2 CONNECT stream over mutual TLS.
    Hbone,
    /// The same-node kernel fast path: the client's socket talked to the
    /// server's directly, never leaving the node's kernel.
    FastPath,
}

impl Protocol {
    /// `TCP` or `HBONE`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Tcp => "TCP",
            Self::Hbone => "HBONE",
            Self::FastPath => "FAST_PATH",
        }
    }

    fn security(self) -> &'static str {
        match self {
            Self::Tcp => "none",
            Self::Hbone => "mutual_tls",
            // Not "mutual_tls": no TLS ran, and dashboards must not say it
            // did; not "none" either, both ends' identities were checked.
            Self::FastPath => "fast_path",
        }
    }
}

/// A connection the engine is handling.
#[derive(Debug, Clone)]
pub struct Flow {
    /// Outbound or inbound.
    pub direction: Direction,
    /// TCP or HBONE.
    pub protocol: Protocol,
    /// The client's address.
    pub src: SocketAddr,
    /// Where it goes (the endpoint, once chosen), if known.
    pub dst: Option<SocketAddr>,
    /// The client (shared: most connections name a pod whose `Peer` is
    /// built once).
    pub source: Arc<Peer>,
    /// The server.
    pub destination: Arc<Peer>,
    /// The service the connection is attributed to: the one whose VIP the
    /// client dialled (outbound), or the one the client named or whose
    /// port it reached (inbound).
    pub service: Option<Arc<ServiceRef>>,
    /// The W3C trace id its tunnel carries in `traceparent` (sent or
    /// received), which joins the two nodes' records; `None` off HBONE.
    pub trace: Option<TraceId>,
}

/// A label's value: `unknown` when not known, as Istio writes it.
pub(super) fn label<S: AsRef<str>>(value: Option<&S>) -> String {
    value.map_or_else(|| "unknown".to_owned(), |v| v.as_ref().to_owned())
}

fn field<S: AsRef<str>>(value: Option<&S>) -> &str {
    value.map_or("-", AsRef::as_ref)
}

impl Flow {
    fn labels(&self, response_flags: ResponseFlags) -> TcpLabels {
        let (src, dst) = (&*self.source, &*self.destination);
        let service = self.service.as_deref();
        let of_service = |f: fn(&ServiceRef) -> &String| label(service.map(f));
        TcpLabels {
            reporter: self.direction.reporter(),
            source_workload: label(src.workload.as_ref()),
            source_canonical_service: label(src.canonical_service.as_ref()),
            source_canonical_revision: label(src.canonical_revision.as_ref()),
            source_workload_namespace: label(src.namespace.as_ref()),
            source_principal: label(src.principal.as_ref()),
            source_app: label(src.canonical_service.as_ref()),
            source_version: label(src.canonical_revision.as_ref()),
            source_cluster: label(src.cluster.as_ref()),
            destination_service: of_service(|s| &s.hostname),
            destination_service_namespace: of_service(|s| &s.namespace),
            destination_service_name: of_service(|s| &s.name),
            destination_workload: label(dst.workload.as_ref()),
            destination_canonical_service: label(dst.canonical_service.as_ref()),
            destination_canonical_revision: label(dst.canonical_revision.as_ref()),
            destination_workload_namespace: label(dst.namespace.as_ref()),
            destination_principal: label(dst.principal.as_ref()),
            destination_app: label(dst.canonical_service.as_ref()),
            destination_version: label(dst.canonical_revision.as_ref()),
            destination_cluster: label(dst.cluster.as_ref()),
            request_protocol: "tcp",
            response_flags: response_flags.as_str(),
            connection_security_policy: self.protocol.security(),
            source_region: label(src.region.as_ref()),
            source_zone: label(src.zone.as_ref()),
            destination_region: label(dst.region.as_ref()),
            destination_zone: label(dst.zone.as_ref()),
        }
    }

    fn service_field(&self) -> &str {
        self.service.as_deref().map_or("-", |s| s.hostname.as_str())
    }

    fn dst_field(&self) -> String {
        self.dst.map_or_else(|| "-".to_owned(), |d| d.to_string())
    }

    /// The connection is established end to end: counts it as opened and
    /// open until the returned handle is closed or dropped.
    pub fn open(self, metrics: &Arc<Metrics>) -> OpenFlow {
        let key = FlowKey {
            reporter: self.direction.reporter(),
            security: self.protocol.security(),
            source: Arc::clone(&self.source),
            destination: Arc::clone(&self.destination),
            service: self.service.clone(),
        };
        let counters = metrics.opened(self.direction, &key, || self.labels(ResponseFlags::None));
        OpenFlow {
            flow: self,
            started: Instant::now(),
            metrics: Arc::clone(metrics),
            counters,
            closed: false,
        }
    }

    /// A connection that opened and closed without passing through the
    /// agent (the kernel fast path, reported at its close): counts it as
    /// opened and closed with its byte totals, and writes its access
    /// record with the kernel's `duration`.
    pub fn record_closed(
        self,
        metrics: &Arc<Metrics>,
        sent: u64,
        received: u64,
        duration: Duration,
    ) {
        let mut open = self.open(metrics);
        open.counters.received.inc_by(sent);
        open.counters.sent.inc_by(received);
        open.started = Instant::now().checked_sub(duration).unwrap_or(open.started);
        open.record(sent, received, None, ResponseFlags::None);
    }

    /// The connection was refused or could not be set up: counts it (in
    /// Istio's family only when it has a response flag, as ztunnel counts
    /// it) and writes its access record.
    pub fn refuse(&self, metrics: &Metrics, reason: FailReason, detail: &str) {
        metrics.failed(self.direction.as_str(), reason.as_str());
        let flags = reason.response_flags();
        if flags.is_failure() {
            metrics.istio_failed(&self.labels(flags));
        }
        warn!(
            target: "access",
            direction = self.direction.as_str(),
            protocol = self.protocol.as_str(),
            src = %self.src,
            dst = %self.dst_field(),
            src_workload = field(self.source.workload.as_ref()),
            src_namespace = field(self.source.namespace.as_ref()),
            src_identity = field(self.source.principal.as_ref()),
            dst_workload = field(self.destination.workload.as_ref()),
            dst_namespace = field(self.destination.namespace.as_ref()),
            dst_identity = field(self.destination.principal.as_ref()),
            service = self.service_field(),
            reason = reason.as_str(),
            response_flags = flags.as_str(),
            trace_id = %trace::field(self.trace),
            error = detail,
            "connection refused"
        );
    }
}

/// An access record at `warn` when `$failed`, else at `info`: a tracing
/// event's level is part of its static call site, so each is its own call.
macro_rules! access_record {
    ($failed:expr, $($fields:tt)*) => {
        if $failed {
            warn!(target: "access", $($fields)*)
        } else {
            info!(target: "access", $($fields)*)
        }
    };
}

/// An open connection; closing or dropping it writes its access record.
#[derive(Debug)]
pub struct OpenFlow {
    flow: Flow,
    started: Instant,
    metrics: Arc<Metrics>,
    counters: TcpCounters,
    closed: bool,
}

impl OpenFlow {
    /// How long it has been open.
    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    /// Counters for a relay whose first stream is the client's side
    /// (`forward` = client to server): the byte metrics grow while the
    /// connection is open.
    pub fn meter_from_client(&self) -> Meter {
        Meter {
            forward: self.counters.received.clone(),
            backward: self.counters.sent.clone(),
        }
    }

    /// Counters for a relay whose first stream is the server's side (the
    /// app behind an inbound tunnel).
    pub fn meter_from_server(&self) -> Meter {
        Meter {
            forward: self.counters.sent.clone(),
            backward: self.counters.received.clone(),
        }
    }

    /// The connection ended: `sent` bytes went from the client towards the
    /// server and `received` came back (for the access record; the byte
    /// metrics were counted as they passed); `error` says how it failed,
    /// if it did (counts can then be short: bytes of a failed relay are
    /// not known). A failed connection is flagged `CONNECT`, as ztunnel
    /// flags an error it has no better flag for
    /// (`ConnectionResult::extract_failure_reason`).
    pub fn close(mut self, sent: u64, received: u64, error: Option<&str>) {
        let flags = match error {
            Some(_) => ResponseFlags::Connect,
            None => ResponseFlags::None,
        };
        self.record(sent, received, error, flags);
    }

    /// Policy no longer allows the connection and the agent closed it:
    /// flagged `DENY`, as ztunnel flags a connection its policy closes
    /// late (`AuthorizationPolicyLateRejection`).
    pub fn revoke(mut self) {
        self.record(
            0,
            0,
            Some("closed by the agent: policy now denies it"),
            ResponseFlags::Deny,
        );
    }

    fn record(&mut self, sent: u64, received: u64, error: Option<&str>, flags: ResponseFlags) {
        self.closed = true;
        if flags.is_failure() {
            // Istio's closed and failed counts carry the flag (ztunnel
            // `ConnectionResult::record_internal`); bytes and opens keep
            // `-`. Built only for failures: the common close reuses the
            // counters resolved at open.
            let labels = self.flow.labels(flags);
            self.metrics.closed_with(&labels);
            self.metrics.istio_failed(&labels);
        } else {
            self.counters.closed.inc();
        }
        self.metrics.gone(self.flow.direction);
        let flow = &self.flow;
        let duration_ms = self.started.elapsed().as_millis() as u64;
        let failed = error.is_some() || flags.is_failure();
        if !failed && !self.metrics.keep_access_record() {
            return;
        }
        let message = if error.is_some() {
            "connection failed"
        } else {
            "connection closed"
        };
        // Failures at the level of refusals, so `access=warn` keeps every
        // error and nothing else (ztunnel logs a failed connection above
        // a clean one too: `src/proxy/metrics.rs` `access_log!`).
        access_record!(
            failed,
            direction = flow.direction.as_str(),
            protocol = flow.protocol.as_str(),
            src = %flow.src,
            dst = %flow.dst_field(),
            src_workload = field(flow.source.workload.as_ref()),
            src_namespace = field(flow.source.namespace.as_ref()),
            src_identity = field(flow.source.principal.as_ref()),
            dst_workload = field(flow.destination.workload.as_ref()),
            dst_namespace = field(flow.destination.namespace.as_ref()),
            dst_identity = field(flow.destination.principal.as_ref()),
            service = flow.service_field(),
            bytes_sent = sent,
            bytes_received = received,
            duration_ms,
            response_flags = flags.as_str(),
            trace_id = %trace::field(flow.trace),
            error = error.unwrap_or("-"),
            "{message}"
        );
    }
}

impl Drop for OpenFlow {
    fn drop(&mut self) {
        if !self.closed {
            // The task was cancelled: a policy change or the drain deadline
            // closed the connection under it.
            self.record(
                0,
                0,
                Some("closed by the agent (policy change or drain)"),
                ResponseFlags::Connect,
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(name: &str) -> Arc<Peer> {
        Arc::new(Peer {
            workload: Some(name.into()),
            namespace: Some("shop".into()),
            principal: Some(format!("spiffe://cluster.local/ns/shop/sa/{name}").into()),
            ..Peer::default()
        })
    }

    fn flow(direction: Direction, source: Arc<Peer>, destination: Arc<Peer>) -> Flow {
        Flow {
            direction,
            protocol: Protocol::Hbone,
            src: "10.1.0.11:40000".parse().expect("address"),
            dst: Some("10.2.0.12:9000".parse().expect("address")),
            source,
            destination,
            service: None,
            trace: None,
        }
    }

    /// The samples of `family` (without `_total`) whose labels contain
    /// `needle`, as `(labels, value)`.
    fn samples(metrics: &Metrics, family: &str, needle: &str) -> Vec<(String, String)> {
        let text = metrics.encode().expect("encodes");
        text.lines()
            .filter(|l| l.starts_with(&format!("{family}_total{{")) && l.contains(needle))
            .filter_map(|l| l.rsplit_once(' '))
            .map(|(labels, value)| (labels.to_owned(), value.to_owned()))
            .collect()
    }

    /// The counters of a label set are looked up by the peers' contents:
    /// peers rebuilt with the same facts count into the same series, other
    /// facts or another reporter into their own.
    #[test]
    fn equal_peers_share_series_and_others_get_their_own() {
        let metrics = Arc::new(Metrics::new());
        for _ in 0..2 {
            // Fresh allocations each time, as an inbound connection builds
            // its source peer.
            let open = flow(Direction::Outbound, peer("client"), peer("server")).open(&metrics);
            open.close(3, 4, None);
        }
        let other = flow(Direction::Outbound, peer("client"), peer("other")).open(&metrics);
        let inbound = flow(Direction::Inbound, peer("client"), peer("server")).open(&metrics);
        let opened = samples(
            &metrics,
            "istio_tcp_connections_opened",
            "reporter=\"source\"",
        );
        assert_eq!(opened.len(), 2, "{opened:?}");
        let to_server: Vec<_> = opened
            .iter()
            .filter(|(l, _)| l.contains("destination_workload=\"server\""))
            .collect();
        assert_eq!(to_server.len(), 1, "{opened:?}");
        assert_eq!(to_server[0].1, "2");
        let closed = samples(
            &metrics,
            "istio_tcp_connections_closed",
            "reporter=\"source\"",
        );
        let closed_server: Vec<_> = closed
            .iter()
            .filter(|(l, _)| l.contains("destination_workload=\"server\""))
            .collect();
        assert_eq!(closed_server.len(), 1, "{closed:?}");
        assert_eq!(closed_server[0].1, "2");
        let inbound_opened = samples(
            &metrics,
            "istio_tcp_connections_opened",
            "reporter=\"destination\"",
        );
        assert_eq!(inbound_opened.len(), 1, "{inbound_opened:?}");
        assert_eq!(metrics.open_connections(), 2);
        let text = metrics.encode().expect("encodes");
        assert!(
            text.contains("dataplane_tcp_connections_open{direction=\"outbound\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("dataplane_tcp_connections_open{direction=\"inbound\"} 1"),
            "{text}"
        );
        drop((other, inbound));
        assert_eq!(metrics.open_connections(), 0);
    }

    /// Istio's response flags reach the closed and failed families and the
    /// access record: `-` for a clean close, `CONNECT` for a failed one or
    /// one the agent dropped, `DENY` for one policy closed later, and a
    /// refusal counts in Istio's family only when it has a flag.
    #[test]
    fn response_flags_follow_how_a_connection_ended() {
        let metrics = Arc::new(Metrics::new());
        let open = || flow(Direction::Inbound, peer("client"), peer("server")).open(&metrics);
        open().close(1, 2, None);
        open().close(0, 0, Some("reset"));
        drop(open());
        open().revoke();
        let closed = |flags: &str| {
            samples(
                &metrics,
                "istio_tcp_connections_closed",
                &format!("response_flags=\"{flags}\""),
            )
        };
        assert_eq!(closed("-").len(), 1);
        assert_eq!(closed("-")[0].1, "1");
        assert_eq!(closed("CONNECT")[0].1, "2");
        assert_eq!(closed("DENY")[0].1, "1");
        let failed = |flags: &str| {
            samples(
                &metrics,
                "istio_tcp_connections_failed",
                &format!("response_flags=\"{flags}\""),
            )
        };
        assert_eq!(failed("CONNECT")[0].1, "2");
        assert_eq!(failed("DENY")[0].1, "1");
        // Opens and bytes keep `-`, as ztunnel resolves them at open.
        let opened = samples(&metrics, "istio_tcp_connections_opened", "reporter");
        assert_eq!(opened.len(), 1, "{opened:?}");
        assert!(opened[0].0.contains("response_flags=\"-\""), "{opened:?}");
        // An early denial (ztunnel's `log_early_deny`) is ours alone; a
        // tunnel that timed out is NETWORK_POLICY.
        let refused = flow(Direction::Outbound, peer("client"), peer("server"));
        refused.refuse(&metrics, FailReason::EnginePort, "loop");
        refused.refuse(&metrics, FailReason::TunnelTimeout, "no answer");
        assert!(failed("-").is_empty());
        assert_eq!(failed("NETWORK_POLICY")[0].1, "1");
        let text = metrics.encode().expect("encodes");
        assert!(
            text.contains("reason=\"engine_port\"} 1")
                && text.contains("reason=\"tunnel_timeout\"} 1"),
            "{text}"
        );
        assert_eq!(metrics.open_connections(), 0);
    }
}
