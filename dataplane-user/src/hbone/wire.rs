//! HBONE on the wire: the CONNECT request's authority and headers, and
//! the HTTP/2 settings both sides use (values from Istio's ztunnel).

use std::net::SocketAddr;

use http::{HeaderValue, Method, Request, Version};

/// Per-stream receive window: 4 MiB.
pub const STREAM_WINDOW: u32 = 4 * 1024 * 1024;
/// Per-connection receive window: 16 MiB.
pub const CONNECTION_WINDOW: u32 = 16 * 1024 * 1024;
/// Largest frame accepted: 1 MiB.
pub const MAX_FRAME: u32 = 1024 * 1024;
/// Streams per pooled connection.
pub const MAX_STREAMS: u32 = 100;
/// Largest header block accepted (guards against oversized headers).
pub const MAX_HEADER_LIST: u32 = 64 * 1024;

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

    /// What Istio's node proxy says of a workload: its pod's namespace
    /// and name (from enrollment; empty takes the mesh's), and the mesh's
    /// facts about it (`peer`), with `Kubernetes` and `latest` as defaults.
    pub fn of(peer: &crate::telemetry::Peer, namespace: &str, pod: &str) -> Self {
        let or = |value: &Option<String>, default: &str| {
            value.clone().unwrap_or_else(|| default.to_owned())
        };
        let given = |value: &str, fallback: &Option<String>| match value {
            "" => fallback.clone().unwrap_or_default(),
            value => value.to_owned(),
        };
        let pod = given(pod, &peer.workload);
        Self {
            cluster: or(&peer.cluster, "Kubernetes"),
            namespace: given(namespace, &peer.namespace),
            service: or(&peer.canonical_service, &pod),
            workload: ("pod".into(), pod),
            version: or(&peer.canonical_revision, "latest"),
            region: peer.region.clone().unwrap_or_default(),
            zone: peer.zone.clone().unwrap_or_default(),
        }
    }
}

/// Builds the CONNECT request for a tunnel to `authority` on behalf of the
/// client at `source`; `service` is the hostname of the service the client
/// dialled, when it dialled one (`forwarded: for="<source>";host=<service>`,
/// as Istio's node proxy sends it, so the far side attributes the
/// connection to that service).
pub fn connect_request(
    authority: &str,
    source: SocketAddr,
    service: Option<&str>,
    baggage: &Baggage,
    traceparent: &str,
) -> Result<Request<()>, http::Error> {
    let forwarded = match service {
        Some(host) => format!("for=\"{source}\";host={host}"),
        None => format!("for=\"{source}\""),
    };
    Request::builder()
        .method(Method::CONNECT)
        .uri(authority)
        .version(Version::HTTP_2)
        .header("forwarded", HeaderValue::from_str(&forwarded)?)
        .header("baggage", baggage.header())
        .header("traceparent", HeaderValue::from_str(traceparent)?)
        .body(())
}

/// A fresh W3C `traceparent` (version 00, random trace and span ids,
/// sampled flag off).
pub fn new_traceparent() -> String {
    let trace: u128 = rand_u128();
    let span: u64 = rand_u128() as u64;
    format!("00-{trace:032x}-{span:016x}-00")
}

fn rand_u128() -> u128 {
    // Trace ids need uniqueness, not secrecy: the std hasher's per-process
    // random keys plus a counter and the clock give that without a new
    // dependency.
    use std::{
        collections::hash_map::RandomState,
        hash::{BuildHasher, Hasher},
        sync::atomic::{AtomicU64, Ordering},
    };
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let state = RandomState::new();
    let mut hi = state.build_hasher();
    hi.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    let mut lo = state.build_hasher();
    lo.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default(),
    );
    (u128::from(hi.finish()) << 64) | u128::from(lo.finish())
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
            &baggage,
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
            &baggage,
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
}
