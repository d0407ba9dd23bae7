//! HBONE on the wire: the CONNECT request's authority and headers, and
//! the HTTP/2 settings both sides use (values from Istio's ztunnel).

use std::{
    net::SocketAddr,
    sync::{Arc, Mutex},
};

use http::{
    HeaderName, HeaderValue, Method, Request, Uri, Version,
    header::{self, InvalidHeaderValue},
};

use dataplane_model::config::SharedStr;

use crate::telemetry::{Peer, TraceId};

/// Per-stream receive window: 4 MiB (ztunnel's `HTTP2_STREAM_WINDOW_SIZE`
/// default, `src/config.rs` `construct_config`).
pub const STREAM_WINDOW: u32 = 4 * 1024 * 1024;
/// Per-connection receive window: 16 MiB (ztunnel's
/// `HTTP2_CONNECTION_WINDOW_SIZE` default).
pub const CONNECTION_WINDOW: u32 = 16 * 1024 * 1024;
/// Largest frame accepted: 1 MiB (ztunnel's `HTTP2_FRAME_SIZE` default).
pub const MAX_FRAME: u32 = 1024 * 1024;
/// The smallest frame size HTTP/2 allows a peer to announce (RFC 9113
/// section 6.5.2, `SETTINGS_MAX_FRAME_SIZE`).
pub const MIN_FRAME_LIMIT: u32 = 16 * 1024;
/// The largest frame size HTTP/2 allows a peer to announce.
pub const MAX_FRAME_LIMIT: u32 = (1 << 24) - 1;
/// The largest flow-control window HTTP/2 allows (RFC 9113 section 6.9.1).
pub const MAX_WINDOW_LIMIT: u32 = (1 << 31) - 1;
/// Streams per pooled connection.
pub const MAX_STREAMS: u32 = 100;
/// Largest header block accepted (guards against oversized headers).
pub const MAX_HEADER_LIST: u32 = 64 * 1024;

/// The HTTP/2 receive settings both ends of an HBONE connection announce
/// in their SETTINGS frame, as ztunnel's `HTTP2_STREAM_WINDOW_SIZE`,
/// `HTTP2_CONNECTION_WINDOW_SIZE` and `HTTP2_FRAME_SIZE` (its
/// `src/proxy/h2/client.rs` `spawn_connection` and
/// `src/proxy/h2/server.rs` `serve_connection` use the same three).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct H2Settings {
    /// Bytes one stream may have in flight toward this end before it
    /// grants more (`SETTINGS_INITIAL_WINDOW_SIZE`).
    pub stream_window: u32,
    /// Bytes all of a connection's streams together may have in flight
    /// toward this end (its connection-level `WINDOW_UPDATE`). Keep it
    /// above the stream window: equal, one stream that stops reading
    /// starves the others (ztunnel's comment in `construct_config`).
    pub connection_window: u32,
    /// The largest frame this end accepts (`SETTINGS_MAX_FRAME_SIZE`),
    /// between [`MIN_FRAME_LIMIT`] and [`MAX_FRAME_LIMIT`].
    pub max_frame: u32,
}

impl Default for H2Settings {
    /// ztunnel's defaults: 4 MiB per stream, 16 MiB per connection, 1 MiB
    /// frames.
    fn default() -> Self {
        Self {
            stream_window: STREAM_WINDOW,
            connection_window: CONNECTION_WINDOW,
            max_frame: MAX_FRAME,
        }
    }
}

impl H2Settings {
    /// The settings clamped to what HTTP/2 allows, so that a bad value
    /// cannot panic the h2 builder (the agent's flags refuse them before).
    pub fn clamped(self) -> Self {
        Self {
            stream_window: self.stream_window.min(MAX_WINDOW_LIMIT),
            connection_window: self.connection_window.min(MAX_WINDOW_LIMIT),
            max_frame: self.max_frame.clamp(MIN_FRAME_LIMIT, MAX_FRAME_LIMIT),
        }
    }
}

/// Workload facts the client puts in `baggage`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Baggage {
    /// `k8s.cluster.name`.
    pub cluster: String,
    /// `k8s.namespace.name`.
    pub namespace: String,
    /// Workload kind and name, e.g. `("pod", "web-0")` -> `k8s.pod.name`.
    pub workload: (String, String),
    /// `service.name`.
    pub service: String,
    /// `service.version`.
    pub version: String,
    /// `cloud.region`, left out when empty.
    pub region: String,
    /// `cloud.availability_zone`, left out when empty.
    pub zone: String,
}

impl Baggage {
    /// The W3C baggage header value.
    pub fn header(&self) -> String {
        let mut value = format!(
            "k8s.cluster.name={},k8s.namespace.name={},k8s.{}.name={},service.name={},service.version={}",
            self.cluster,
            self.namespace,
            self.workload.0,
            self.workload.1,
            self.service,
            self.version
        );
        for (key, field) in [
            ("cloud.region", &self.region),
            ("cloud.availability_zone", &self.zone),
        ] {
            if !field.is_empty() {
                value.push_str(&format!(",{key}={field}"));
            }
        }
        value
    }

    /// [`Baggage::header`] as a header value, ready to send.
    pub fn value(&self) -> Result<HeaderValue, InvalidHeaderValue> {
        HeaderValue::try_from(self.header())
    }

    /// What Istio's node proxy says of a workload: its pod's namespace
    /// and name (from enrollment; empty takes the mesh's), and the mesh's
    /// facts about it (`peer`), with `Kubernetes` and `latest` as defaults.
    pub fn of(peer: &Peer, namespace: &str, pod: &str) -> Self {
        let or = |value: &Option<SharedStr>, default: &str| {
            value.as_deref().unwrap_or(default).to_owned()
        };
        let given = |value: &str, fallback: &Option<SharedStr>| match value {
            "" => fallback.as_deref().unwrap_or_default().to_owned(),
            value => value.to_owned(),
        };
        let pod = given(pod, &peer.workload);
        Self {
            cluster: or(&peer.cluster, "Kubernetes"),
            namespace: given(namespace, &peer.namespace),
            service: or(&peer.canonical_service, &pod),
            workload: ("pod".into(), pod),
            version: or(&peer.canonical_revision, "latest"),
            region: peer.region.as_deref().unwrap_or_default().to_owned(),
            zone: peer.zone.as_deref().unwrap_or_default().to_owned(),
        }
    }
}

/// Longest workload fact taken from a peer's `baggage`: a Kubernetes
/// name's limit (DNS subdomain, RFC 1123). A longer one is left out.
pub const MAX_BAGGAGE_FACT: usize = 253;

impl Baggage {
    /// The client a peer's `baggage` describes, for telemetry when the mesh
    /// state does not know its address (another cluster, a workload the
    /// control plane has not sent yet), as ztunnel derives its source from
    /// baggage (`src/proxy/inbound.rs` `build_inbound_request`,
    /// `DerivedWorkload`; `src/proxy/metrics.rs` `with_derived_source`).
    /// `principal` is the verified identity, never the baggage's word.
    /// Empty facts, facts longer than [`MAX_BAGGAGE_FACT`] and facts with
    /// control characters are left out (`unknown` in the labels).
    pub fn peer(&self, principal: Option<SharedStr>) -> Peer {
        let fact = |value: &str| {
            let fits = !value.is_empty()
                && value.len() <= MAX_BAGGAGE_FACT
                && !value.chars().any(char::is_control);
            fits.then(|| SharedStr::from(value))
        };
        Peer {
            workload: fact(&self.workload.1),
            namespace: fact(&self.namespace),
            principal,
            canonical_service: fact(&self.service),
            canonical_revision: fact(&self.version),
            cluster: fact(&self.cluster),
            region: fact(&self.region),
            zone: fact(&self.zone),
        }
    }
}

/// A pod's `baggage` value, built once for the mesh's current view of
/// the pod rather than formatted again for every tunnel it opens.
///
/// The view is an `Arc<Peer>` that the mesh state replaces, never
/// mutates, so the value stays right as long as the `Arc` is the same;
/// holding it keeps its address from being reused by another peer.
#[derive(Debug, Default)]
pub struct BaggageCache(Mutex<Option<(Arc<Peer>, HeaderValue)>>);

impl BaggageCache {
    /// The value for `peer`: the cached one when `peer` is the view it
    /// was built from, else `build`'s, which then replaces it. A value
    /// that is not a valid header is not cached.
    pub fn get(
        &self,
        peer: &Arc<Peer>,
        build: impl FnOnce() -> Baggage,
    ) -> Result<HeaderValue, InvalidHeaderValue> {
        // A poisoned lock only means a panic elsewhere mid-update of a
        // cache: rebuilding is always correct.
        let mut slot = self
            .0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some((cached, value)) = slot.as_ref()
            && Arc::ptr_eq(cached, peer)
        {
            return Ok(value.clone());
        }
        let value = build().value()?;
        *slot = Some((Arc::clone(peer), value.clone()));
        Ok(value)
    }
}

/// Builds the CONNECT request for a tunnel to `authority` on behalf of the
/// client at `source`; `service` is the hostname of the service the client
/// dialled, when it dialled one (`forwarded: for="<source>";host=<service>`,
/// as Istio's node proxy sends it, so the far side attributes the
/// connection to that service). `baggage` is the client's
/// ([`Baggage::value`], usually from a [`BaggageCache`]).
pub fn connect_request(
    authority: &str,
    source: SocketAddr,
    service: Option<&str>,
    baggage: &HeaderValue,
    traceparent: &str,
) -> Result<Request<()>, http::Error> {
    let forwarded = match service {
        Some(host) => format!("for=\"{source}\";host={host}"),
        None => format!("for=\"{source}\""),
    };
    // Built in place rather than through `Request::builder`, with the
    // header names as constants and room for the three headers made once:
    // this runs for every tunnel.
    let mut request = Request::new(());
    *request.method_mut() = Method::CONNECT;
    *request.uri_mut() = Uri::try_from(authority)?;
    *request.version_mut() = Version::HTTP_2;
    let headers = request.headers_mut();
    headers.reserve(3);
    headers.insert(header::FORWARDED, HeaderValue::try_from(forwarded)?);
    headers.insert(HeaderName::from_static("baggage"), baggage.clone());
    headers.insert(
        HeaderName::from_static("traceparent"),
        HeaderValue::from_str(traceparent)?,
    );
    Ok(request)
}

/// A fresh W3C `traceparent` (version 00, random trace and span ids,
/// sampled flag off).
pub fn new_traceparent() -> String {
    traceparent(new_trace_id())
}

/// A fresh random trace id for a connection.
pub fn new_trace_id() -> TraceId {
    let [hi, lo, _] = random_words();
    TraceId::from_u128((u128::from(hi) << 64) | u128::from(lo))
}

/// The W3C `traceparent` carrying `trace` (version 00, a random span id,
/// sampled flag off).
pub fn traceparent(trace: TraceId) -> String {
    let [span, ..] = random_words();
    let id = trace.as_u128();
    let mut value = String::with_capacity(55);
    value.push_str("00-");
    push_hex(&mut value, (id >> 64) as u64);
    push_hex(&mut value, id as u64);
    value.push('-');
    push_hex(&mut value, span);
    value.push_str("-00");
    value
}

/// `word` as 16 lower-case hex digits.
fn push_hex(out: &mut String, word: u64) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for shift in (0..16).rev() {
        out.push(char::from(DIGITS[((word >> (shift * 4)) & 0xf) as usize]));
    }
}

/// Three words for trace and span ids.
fn random_words() -> [u64; 3] {
    // Trace ids need uniqueness, not secrecy: the std hasher's per-process
    // random keys over a counter and the clock give that without a new
    // dependency. One clock read serves all three words.
    use std::{
        collections::hash_map::RandomState,
        hash::{BuildHasher, Hasher},
        sync::atomic::{AtomicU64, Ordering},
    };
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let state = RandomState::new();
    let count = COUNTER.fetch_add(1, Ordering::Relaxed);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    [0u8, 1, 2].map(|word| {
        let mut hasher = state.build_hasher();
        hasher.write_u8(word);
        hasher.write_u64(count);
        hasher.write_u128(now);
        hasher.finish()
    })
}

#[cfg(test)]
#[expect(
    clippy::unwrap_used,
    reason = "a bad fixture should fail the test loudly"
)]
mod tests {
    use super::*;

    #[test]
    fn connect_request_carries_authority_and_headers() {
        let baggage = Baggage {
            cluster: "c1".into(),
            namespace: "shop".into(),
            workload: ("pod".into(), "web-0".into()),
            service: "web".into(),
            version: "v1".into(),
            ..Baggage::default()
        };
        let req = connect_request(
            "10.1.0.12:8080",
            "10.1.0.11:40000".parse().unwrap(),
            None,
            &baggage.value().unwrap(),
            &new_traceparent(),
        )
        .unwrap();
        assert_eq!(req.method(), Method::CONNECT);
        assert_eq!(req.uri().authority().unwrap().as_str(), "10.1.0.12:8080");
        assert_eq!(req.headers()["forwarded"], "for=\"10.1.0.11:40000\"");
        let to_service = connect_request(
            "10.1.0.12:8080",
            "[fd00::11]:40000".parse().unwrap(),
            Some("web.shop.svc.cluster.local"),
            &baggage.value().unwrap(),
            &new_traceparent(),
        )
        .unwrap();
        assert_eq!(
            to_service.headers()["forwarded"],
            "for=\"[fd00::11]:40000\";host=web.shop.svc.cluster.local"
        );
        assert!(
            req.headers()["baggage"]
                .to_str()
                .unwrap()
                .contains("k8s.pod.name=web-0")
        );
        let tp = req.headers()["traceparent"].to_str().unwrap().to_owned();
        assert_eq!(tp.len(), 55);
        assert!(tp.starts_with("00-"));
        assert_ne!(tp, new_traceparent());
    }

    #[test]
    fn a_pods_baggage_is_built_once_per_view_of_it() {
        let cache = BaggageCache::default();
        let peer = |service: &str| {
            Arc::new(Peer {
                canonical_service: Some(service.into()),
                ..Peer::default()
            })
        };
        let (web, builds) = (peer("web"), std::cell::Cell::new(0));
        let get = |peer: &Arc<Peer>| {
            cache
                .get(peer, || {
                    builds.set(builds.get() + 1);
                    Baggage::of(peer, "shop", "web-0")
                })
                .unwrap()
        };
        let first = get(&web);
        assert!(first.to_str().unwrap().contains("service.name=web,"));
        assert_eq!(get(&web), first);
        assert_eq!(builds.get(), 1, "the same view is not formatted again");
        // The mesh replaced its view of the pod: equal fields or not, the
        // value is built for the new one.
        let shop = peer("shop");
        assert!(get(&shop).to_str().unwrap().contains("service.name=shop,"));
        assert_eq!(builds.get(), 2);
        // A value that cannot be a header is refused and not cached.
        let bad = peer("web\n");
        assert!(cache.get(&bad, || Baggage::of(&bad, "", "")).is_err());
        assert!(get(&shop).to_str().unwrap().contains("service.name=shop,"));
        assert_eq!(builds.get(), 2);
    }

    /// What a peer's baggage says becomes the client's facts, bounded:
    /// empty, oversized and control-character facts are left out, and the
    /// principal is the verified one.
    #[test]
    fn a_peers_baggage_names_the_client_within_bounds() {
        let parsed = super::super::head::parse_baggage(
            "k8s.cluster.name=west,k8s.namespace.name=shop,k8s.deployment.name=cart,\
             service.name=cart-app,service.version=v3,cloud.region=eu,cloud.availability_zone=",
        )
        .expect("valid baggage");
        let peer = parsed.peer(Some("spiffe://cluster.local/ns/shop/sa/cart".into()));
        assert_eq!(peer.workload.as_deref(), Some("cart"));
        assert_eq!(peer.namespace.as_deref(), Some("shop"));
        assert_eq!(peer.canonical_service.as_deref(), Some("cart-app"));
        assert_eq!(peer.canonical_revision.as_deref(), Some("v3"));
        assert_eq!(peer.cluster.as_deref(), Some("west"));
        assert_eq!(peer.region.as_deref(), Some("eu"));
        assert_eq!(peer.zone, None);
        assert_eq!(
            peer.principal.as_deref(),
            Some("spiffe://cluster.local/ns/shop/sa/cart")
        );
        let long = "a".repeat(MAX_BAGGAGE_FACT + 1);
        let odd = Baggage {
            namespace: long,
            service: "tab%09bed".into(),
            workload: ("pod".into(), "line\nbreak".into()),
            ..Baggage::default()
        };
        let peer = odd.peer(None);
        assert_eq!((peer.namespace, peer.workload), (None, None));
        assert_eq!(peer.canonical_service.as_deref(), Some("tab%09bed"));
    }
}
