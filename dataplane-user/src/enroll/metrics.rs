//! What the node agent reports of the pods it serves, read on each scrape:
//! ztunnel's workload-manager gauges (pods with a running proxy, pods
//! still waiting for one) and, under `--engine ztunnel`, the ZDS
//! connections.

use std::sync::Arc;

use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric},
    metrics::{MetricType, gauge::ConstGauge},
};

use super::{PodsView, ZtunnelEvents};

/// Reads the enrolled pods and the ZDS server's connections when scraped.
#[derive(Debug)]
pub struct NodeCollector {
    /// The enrolled pods.
    pub pods: PodsView,
    /// The ZDS server's events, which hold its handle once it runs
    /// (`--engine ztunnel`); `None` with the built-in engine.
    pub zds: Option<Arc<ZtunnelEvents>>,
}

/// Pods whose proxy runs, and pods waiting for one: with the built-in
/// engine every enrolled pod has its proxy; under `--engine ztunnel` a
/// pod is served once ztunnel acknowledged it (its listeners exist).
fn served_and_pending(view: &PodsView) -> (i64, i64) {
    let snapshot = view.snapshot();
    let served = snapshot
        .pods
        .iter()
        .filter(|p| p.external.as_ref().is_none_or(|e| e.served))
        .count();
    let pending = snapshot.pods.len() - served;
    let count = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
    (count(served), count(pending))
}

fn gauge(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    value: i64,
) -> Result<(), std::fmt::Error> {
    let family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
    ConstGauge::new(value).encode(family)
}

impl Collector for NodeCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        // ztunnel's names and meaning (`src/inpod/metrics.rs`, registered
        // under `workload_manager` in `src/app.rs`; set in
        // `src/inpod/statemanager.rs` `update_proxy_count_metrics`).
        let (served, pending) = served_and_pending(&self.pods);
        gauge(
            &mut encoder,
            "workload_manager_active_proxy_count",
            "Enrolled pods whose proxy is running (the built-in engine's, or ztunnel's once it \
             acknowledged the pod)",
            served,
        )?;
        gauge(
            &mut encoder,
            "workload_manager_pending_proxy_count",
            "Enrolled pods still waiting for their proxy (ztunnel not connected, or it has not \
             acknowledged or has refused the pod)",
            pending,
        )?;
        if let Some(status) = self.zds.as_ref().and_then(|z| z.status()) {
            let hello = status.connections.iter().filter(|c| c.hello).count();
            gauge(
                &mut encoder,
                "dataplane_zds_connections",
                "ztunnel processes connected to the ZDS socket that said hello (2 while one \
                 replaces another, 0 when none serves the node's pods)",
                i64::try_from(hello).unwrap_or(i64::MAX),
            )?;
        }
        Ok(())
    }
}
