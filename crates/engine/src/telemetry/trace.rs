//! The W3C trace id that joins one connection's access records on the two
//! nodes: the client's node sends it in the HBONE request's `traceparent`
//! and logs it, the server's node logs what it received (ztunnel
//! `src/proxy/outbound.rs`: a `TraceParent` per connection, sent as
//! `traceparent`; `src/proxy/inbound.rs` `extract_traceparent`, a fresh
//! one when the request has none; `src/proxy.rs` `TraceParent`'s
//! `Display`, the trace id as 32 hex digits).

use std::fmt;

/// A trace id (16 bytes, printed as 32 lower-case hex digits).
///
/// Kept as bytes so that an `Option<TraceId>` in every connection's
/// record adds 17 bytes, not the 32 of an aligned `u128`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TraceId([u8; 16]);

impl TraceId {
    /// The id whose big-endian value is `id`.
    pub fn from_u128(id: u128) -> Self {
        Self(id.to_be_bytes())
    }

    /// Its value.
    pub fn as_u128(self) -> u128 {
        u128::from_be_bytes(self.0)
    }
}

impl fmt::Display for TraceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.as_u128())
    }
}

/// The access record's `trace_id` field: the id, or `-`.
pub(super) fn field(trace: Option<TraceId>) -> String {
    trace.map_or_else(|| "-".to_owned(), |t| t.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prints_as_traceparent_carries_it() {
        let id = TraceId::from_u128(0x0af7651916cd43dd8448eb211c80319c);
        assert_eq!(id.to_string(), "0af7651916cd43dd8448eb211c80319c");
        assert_eq!(TraceId::from_u128(1).to_string().len(), 32);
        assert_eq!(field(None), "-");
        assert_eq!(std::mem::size_of::<Option<TraceId>>(), 17);
    }
}
