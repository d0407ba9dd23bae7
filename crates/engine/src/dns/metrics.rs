//! DNS metrics, under the names Istio's node proxy uses
//! (`istio_dns_requests_total`, `istio_dns_upstream_requests_total`,
//! `istio_dns_upstream_failures_total`,
//! `istio_dns_upstream_request_duration_seconds`), plus one counter per
//! answer kind (`dataplane_dns_answers_total{kind}`).

use std::time::Duration;

use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family, histogram::Histogram},
    registry::Unit,
};

use crate::telemetry::Metrics;

/// Labels of `istio_dns_requests_total`, as Istio's node proxy sets them.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    /// Record type asked, lower case (`a`, `aaaa`, ...).
    pub request_query_type: String,
    /// `udp` or `tcp`.
    pub request_protocol: &'static str,
}

/// Labels of `dataplane_dns_answers_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AnswerLabels {
    /// One of [`AnswerKind`]'s names.
    pub kind: &'static str,
}

/// How a query was answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AnswerKind {
    /// Addresses of a mesh service.
    Mesh,
    /// A mesh name without an address of the asked family (NOERROR, no
    /// records).
    Nodata,
    /// Forwarded upstream and answered (any response code but the ones
    /// below).
    Forwarded,
    /// Answered from the cache.
    Cached,
    /// Upstream said the name does not exist.
    Nxdomain,
    /// No upstream answered in time, or none is configured.
    Servfail,
    /// Refused: too many queries in flight.
    Refused,
    /// The query did not parse.
    Formerr,
    /// The answer did not fit the client's UDP size: sent truncated.
    Truncated,
}

impl AnswerKind {
    /// The `kind` label value.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Mesh => "mesh",
            Self::Nodata => "nodata",
            Self::Forwarded => "forwarded",
            Self::Cached => "cached",
            Self::Nxdomain => "nxdomain",
            Self::Servfail => "servfail",
            Self::Refused => "refused",
            Self::Formerr => "formerr",
            Self::Truncated => "truncated",
        }
    }
}

/// The DNS metric families (clones share their values with the registry).
#[derive(Debug, Clone)]
pub struct DnsMetrics {
    requests: Family<RequestLabels, Counter>,
    answers: Family<AnswerLabels, Counter>,
    upstream_requests: Counter,
    upstream_failures: Counter,
    upstream_duration: Histogram,
}

impl DnsMetrics {
    /// Registers the families in `registry`.
    pub fn register(registry: &Metrics) -> Self {
        let this = Self {
            requests: Family::default(),
            answers: Family::default(),
            upstream_requests: Counter::default(),
            upstream_failures: Counter::default(),
            upstream_duration: Histogram::new([0.0005, 0.001, 0.01, 0.1, 1.0, 5.0]),
        };
        registry.register(
            "istio_dns_requests",
            "DNS queries the in-pod resolvers received",
            None,
            this.requests.clone(),
        );
        registry.register(
            "istio_dns_upstream_requests",
            "DNS queries forwarded to an upstream server (each attempt)",
            None,
            this.upstream_requests.clone(),
        );
        registry.register(
            "istio_dns_upstream_failures",
            "Attempts to forward a DNS query upstream that failed (timeout, refused, bad reply)",
            None,
            this.upstream_failures.clone(),
        );
        registry.register(
            "istio_dns_upstream_request_duration",
            "Time an upstream server took to answer",
            Some(Unit::Seconds),
            this.upstream_duration.clone(),
        );
        registry.register(
            "dataplane_dns_answers",
            "DNS answers of the in-pod resolvers by kind (mesh, nodata, forwarded, cached, \
             nxdomain, servfail, refused, formerr, truncated)",
            None,
            this.answers.clone(),
        );
        this
    }

    /// Metrics kept nowhere (unit tests).
    pub fn unregistered() -> Self {
        Self::register(&Metrics::new())
    }

    /// Counts a received query.
    pub fn request(&self, query_type: String, protocol: &'static str) {
        self.requests
            .get_or_create(&RequestLabels {
                request_query_type: query_type,
                request_protocol: protocol,
            })
            .inc();
    }

    /// Counts an answer.
    pub fn answer(&self, kind: AnswerKind) {
        self.answers
            .get_or_create(&AnswerLabels { kind: kind.name() })
            .inc();
    }

    pub(super) fn upstream_request(&self) {
        self.upstream_requests.inc();
    }

    pub(super) fn upstream_failure(&self) {
        self.upstream_failures.inc();
    }

    pub(super) fn upstream_duration(&self, took: Duration) {
        self.upstream_duration.observe(took.as_secs_f64());
    }
}
