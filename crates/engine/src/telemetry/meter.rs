//! The byte counters a relay counts into as bytes pass, so metrics show a
//! long-lived connection's traffic before it closes.

use prometheus_client::metrics::counter::Counter;

/// Where a relay counts bytes as they pass. `Meter::default()` counts into
/// counters nobody reads.
#[derive(Debug, Clone, Default)]
pub struct Meter {
    /// Bytes from the first end to the second (downstream to upstream; for
    /// a tunnel relay, TCP into the tunnel).
    pub forward: Counter,
    /// Bytes the other way.
    pub backward: Counter,
}
