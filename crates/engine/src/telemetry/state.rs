//! Metrics read from agent and kernel state on each scrape: the kernel
//! programs' per-CPU counters, enrolled pods, workload certificates.

use std::{sync::Arc, time::UNIX_EPOCH};

use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric},
    metrics::{MetricType, counter::ConstCounter, gauge::ConstGauge},
};

use super::process::gauge;
use crate::{identity::CertStore, redirect::PinLayout};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EventLabels {
    event: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CaRequestLabels {
    source: &'static str,
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct IdentityLabels {
    identity: String,
}

/// Reads the kernel counters (through the pinned map), the enrolled pods
/// and the certificates when scraped.
pub struct StateCollector {
    /// The instance's pins; `None` under iptables capture (no programs).
    pub pins: Option<PinLayout>,
    /// How many pods are enrolled now (a function, so that telemetry
    /// knows nothing of enrollment).
    pub enrolled_pods: Box<dyn Fn() -> usize + Send + Sync>,
    /// The workload certificates.
    pub certs: Arc<CertStore>,
}

impl std::fmt::Debug for StateCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StateCollector")
            .field("pins", &self.pins)
            .finish()
    }
}

impl Collector for StateCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        if let Some(pins) = &self.pins
            && let Ok(counters) = crate::redirect::read_counters(pins)
        {
            let mut family = encoder.encode_descriptor(
                "dataplane_kernel_events",
                "Decisions of the kernel programs (summed over CPUs), by event",
                None,
                MetricType::Counter,
            )?;
            for c in counters {
                let labels = EventLabels { event: c.name };
                ConstCounter::new(c.value).encode(family.encode_family(&labels)?)?;
            }
        }
        let pods = (self.enrolled_pods)();
        gauge(
            &mut encoder,
            "dataplane_enrolled_pods",
            "Pods enrolled in the mesh on this node",
            pods as u64,
        )?;
        // Istio's node proxy has no metric for its CA requests; this one
        // follows our own naming.
        let (successes, failures) = self.certs.request_counts();
        let source = self.certs.source().kind();
        let mut family = encoder.encode_descriptor(
            "dataplane_ca_requests",
            "Certificate requests to the workload certificate source (the CA, or reads of \
             changed mounted files), by source and result; a refused answer counts as an error",
            None,
            MetricType::Counter,
        )?;
        for (result, count) in [("success", successes), ("error", failures)] {
            let labels = CaRequestLabels { source, result };
            ConstCounter::new(count).encode(family.encode_family(&labels)?)?;
        }
        let (held, wanted) = self.certs.counts();
        gauge(
            &mut encoder,
            "dataplane_certificates_missing",
            "Workload identities enrolled on this node that have no certificate yet",
            wanted.saturating_sub(held) as u64,
        )?;
        let issued = self.certs.issued();
        let mut family = encoder.encode_descriptor(
            "dataplane_certificate_expiry_timestamp_seconds",
            "When each workload certificate held expires (seconds since the Unix epoch); \
             rotation replaces it at half-life",
            None,
            MetricType::Gauge,
        )?;
        for cert in issued {
            let expiry = cert
                .not_after
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs());
            let labels = IdentityLabels {
                identity: cert.identity.to_uri(),
            };
            ConstGauge::new(expiry).encode(family.encode_family(&labels)?)?;
        }
        Ok(())
    }
}
