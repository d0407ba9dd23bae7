//! xDS counters on `/metrics`, named as Istio's node proxy names them
//! (`istio_xds_connection_terminations_total{reason}`,
//! `istio_xds_message_total{url}`, `istio_xds_message_bytes_total{url}`),
//! plus what it does not count: NACKed responses and rejected resources.

use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family},
    registry::{Registry, Unit},
};

use super::wire::Response;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct UrlLabels {
    url: String,
}

/// Why a stream to istiod ended, with Istio's label values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Termination {
    /// istiod could not be reached (TCP, TLS, token).
    ConnectionError,
    /// The stream failed once up.
    Error,
    /// istiod ended the stream cleanly.
    Complete,
}

impl Termination {
    fn label(self) -> &'static str {
        match self {
            Termination::ConnectionError => "ConnectionError",
            Termination::Error => "Error",
            Termination::Complete => "Complete",
        }
    }
}

/// The xDS client's counters (cheap to clone: the families are shared).
#[derive(Debug, Clone, Default)]
pub struct XdsMetrics {
    terminations: Family<ReasonLabels, Counter>,
    messages: Family<UrlLabels, Counter>,
    bytes: Family<UrlLabels, Counter>,
    nacks: Family<UrlLabels, Counter>,
}

impl XdsMetrics {
    /// Counters registered in `registry` (the agent's, which serves
    /// `/metrics`).
    pub fn registered(registry: &mut Registry) -> Self {
        let this = Self::default();
        registry.register(
            "istio_xds_connection_terminations",
            "Streams to istiod that ended, by reason",
            this.terminations.clone(),
        );
        registry.register(
            "istio_xds_message",
            "xDS responses received, by type",
            this.messages.clone(),
        );
        registry.register_with_unit(
            "istio_xds_message",
            "Bytes of resources received over xDS, by type",
            Unit::Bytes,
            this.bytes.clone(),
        );
        registry.register(
            "dataplane_xds_nacks",
            "xDS responses NACKed (some resource in them did not validate; the rest applied), by type",
            this.nacks.clone(),
        );
        this
    }

    /// Counts a response.
    pub fn received(&self, response: &Response) {
        let labels = UrlLabels {
            url: response.type_url().to_owned(),
        };
        self.messages.get_or_create(&labels).inc();
        self.bytes
            .get_or_create(&labels)
            .inc_by(response.body_bytes());
    }

    /// Counts a NACK sent for a response of `type_url`.
    pub fn nacked(&self, type_url: &str) {
        self.nacks
            .get_or_create(&UrlLabels {
                url: type_url.to_owned(),
            })
            .inc();
    }

    /// Counts a stream that ended.
    pub fn terminated(&self, why: Termination) {
        self.terminations
            .get_or_create(&ReasonLabels {
                reason: why.label(),
            })
            .inc();
    }
}
