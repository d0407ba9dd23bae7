//! What operators see of the data plane: Prometheus metrics on 15020
//! `/metrics`, also served as `/stats/prometheus` as Istio's proxies do
//! (Istio's `istio_tcp_*` families with Istio's labels, plus the agent's
//! own), one access record per connection on the `access` log target, and
//! the byte counters relays count into as they pass ([`Meter`]). (The
//! warnings of the last minute for `dataplane status` are `logging`'s.)
//!
//! Every connection the engine handles is a [`Flow`]: opening it counts it,
//! closing (or dropping) it adds its bytes and writes its access record, so
//! the metrics and the log cannot disagree.

mod flow;
mod meter;
mod metrics;
mod outcome;
mod process;
mod sample;
mod state;
mod trace;

use std::sync::Arc;

use http::{Method, StatusCode};

pub use flow::{Direction, Flow, OpenFlow, Peer, Protocol, ServiceRef};
pub use meter::Meter;
pub use metrics::{Metrics, TcpLabels};
pub use outcome::{FailReason, ResponseFlags};
pub use sample::AccessSample;
pub use state::StateCollector;
use tokio::net::TcpListener;
pub use trace::TraceId;

use crate::httpd::{self, Handler, Reply};

/// Port of the metrics endpoint (Istio's).
pub const METRICS_PORT: u16 = 15020;

/// Serves `GET /metrics` until the task is dropped, also as
/// `/stats/prometheus` (Istio's proxies answer both: ztunnel
/// `src/metrics/server.rs`, Envoy's admin path for the same page).
pub async fn serve(listener: TcpListener, metrics: Arc<Metrics>) {
    let handler: Handler = Arc::new(move |request| {
        let path = request.uri.path();
        if request.method != Method::GET || !matches!(path, "/metrics" | "/stats/prometheus") {
            return Reply::text(StatusCode::NOT_FOUND, "not found; try GET /metrics\n").into();
        }
        match metrics.encode() {
            Ok(body) => Reply {
                status: StatusCode::OK,
                content_type: "text/plain; version=0.0.4; charset=utf-8",
                body: body.into(),
            }
            .into(),
            Err(_) => Reply::text(
                StatusCode::INTERNAL_SERVER_ERROR,
                "metrics could not be encoded\n",
            )
            .into(),
        }
    });
    httpd::serve(listener, "metrics", handler).await;
}
