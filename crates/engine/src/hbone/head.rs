//! Reading an HBONE CONNECT request's head, as a stranger on 15008 may
//! send it: the authority (where the tunnel goes), and the optional
//! `forwarded`, `baggage` and `traceparent` headers the client side sets
//! (see [`super::wire::connect_request`]).
//!
//! Only the method and the authority can fail a request. The optional
//! headers are information, not instructions: a malformed one is ignored
//! (its field is `None`), never an error, so a peer with a different
//! formatter still gets its tunnel. Every reader is bounded by the header
//! list limit h2 enforces ([`super::wire::MAX_HEADER_LIST`]) and does one
//! linear pass.

use std::net::{IpAddr, SocketAddr};

use http::{HeaderMap, Method, Uri};

use super::wire::Baggage;

/// Why a request head was refused (the server answers 400).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum HeadError {
    /// The method was not CONNECT.
    #[error("only CONNECT is served, not {method}")]
    NotConnect {
        /// The method received.
        method: String,
    },
    /// The request named no authority.
    #[error("CONNECT without authority")]
    NoAuthority,
    /// The authority is neither `ip:port` nor `hostname:port`.
    #[error("authority `{authority}` is neither ip:port nor hostname:port: {reason}")]
    BadAuthority {
        /// The authority received.
        authority: String,
        /// What is wrong with it.
        reason: &'static str,
    },
}

/// Where a CONNECT asks to go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Authority {
    /// A workload address.
    Addr(SocketAddr),
    /// A service hostname, resolved by the server against the mesh state.
    Host {
        /// The hostname, lower-cased, without a trailing dot.
        name: String,
        /// The port.
        port: u16,
    },
}

impl std::fmt::Display for Authority {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Addr(addr) => write!(f, "{addr}"),
            Self::Host { name, port } => write!(f, "{name}:{port}"),
        }
    }
}

/// A W3C trace context (`traceparent`), kept to correlate logs across
/// the tunnel's two ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceContext {
    /// The trace id (never zero).
    pub trace_id: u128,
    /// The caller's span id (never zero).
    pub parent_id: u64,
    /// The trace flags (bit 0: sampled).
    pub flags: u8,
}

/// What an HBONE CONNECT request says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestHead {
    /// Where the tunnel goes.
    pub authority: Authority,
    /// The original client's address from `forwarded: for=` (the first
    /// element, the one nearest the client), when present and an address.
    pub forwarded_for: Option<IpAddr>,
    /// The service the client dialled, from `forwarded: host=` (the first
    /// element), when present and a valid hostname.
    pub forwarded_host: Option<String>,
    /// The client workload's facts from `baggage`, when present and valid.
    pub baggage: Option<Baggage>,
    /// The trace context from `traceparent`, when present and valid.
    pub trace: Option<TraceContext>,
}

impl RequestHead {
    /// Reads a request head; fails only on the method or the authority.
    pub fn parse(method: &Method, uri: &Uri, headers: &HeaderMap) -> Result<Self, HeadError> {
        if method != Method::CONNECT {
            return Err(HeadError::NotConnect {
                method: method.as_str().chars().take(32).collect(),
            });
        }
        let authority = uri.authority().ok_or(HeadError::NoAuthority)?;
        let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
        Ok(Self {
            authority: parse_authority(authority.as_str())?,
            forwarded_for: header("forwarded").and_then(parse_forwarded_for),
            forwarded_host: header("forwarded").and_then(parse_forwarded_host),
            baggage: header("baggage").and_then(parse_baggage),
            trace: header("traceparent").and_then(parse_traceparent),
        })
    }
}

/// Longest DNS name (RFC 1035), without the trailing dot.
const MAX_HOSTNAME: usize = 253;

/// Reads `ip:port`, `[ipv6]:port` or `hostname:port`.
pub fn parse_authority(authority: &str) -> Result<Authority, HeadError> {
    let bad = |reason| HeadError::BadAuthority {
        authority: authority.chars().take(300).collect(),
        reason,
    };
    if let Ok(addr) = authority.parse::<SocketAddr>() {
        if addr.port() == 0 {
            return Err(bad("port 0"));
        }
        return Ok(Authority::Addr(addr));
    }
    let (name, port) = authority.rsplit_once(':').ok_or_else(|| bad("no port"))?;
    let port: u16 = port.parse().map_err(|_| bad("port is not a number"))?;
    if port == 0 {
        return Err(bad("port 0"));
    }
    let name = name.strip_suffix('.').unwrap_or(name);
    if name.is_empty() || name.len() > MAX_HOSTNAME {
        return Err(bad("hostname empty or longer than 253 characters"));
    }
    let label_ok = |label: &str| {
        !label.is_empty()
            && label.len() <= 63
            && !label.starts_with('-')
            && !label.ends_with('-')
            && label
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-')
    };
    if !name.split('.').all(label_ok) {
        return Err(bad("not a DNS hostname"));
    }
    Ok(Authority::Host {
        name: name.to_ascii_lowercase(),
        port,
    })
}

/// The address in the first element's `for=` of a `forwarded` header (RFC
/// 7239): `for=192.0.2.1`, `for="192.0.2.1:4711"`, `for="[2001:db8::1]"`,
/// `for="[2001:db8::1]:4711"`. `unknown` and obfuscated names give `None`.
pub fn parse_forwarded_for(value: &str) -> Option<IpAddr> {
    let first = value.split(',').next()?;
    let node = first.split(';').find_map(|pair| {
        let (key, value) = pair.trim().split_once('=')?;
        key.trim()
            .eq_ignore_ascii_case("for")
            .then_some(value.trim())
    })?;
    let node = match node.strip_prefix('"') {
        Some(quoted) => quoted.strip_suffix('"')?,
        None => node,
    };
    if let Some(bracketed) = node.strip_prefix('[') {
        let (v6, rest) = bracketed.split_once(']')?;
        if !(rest.is_empty() || is_port(rest.strip_prefix(':')?)) {
            return None;
        }
        return v6.parse::<std::net::Ipv6Addr>().ok().map(IpAddr::V6);
    }
    if let Ok(addr) = node.parse::<SocketAddr>() {
        return Some(addr.ip());
    }
    node.parse::<std::net::Ipv4Addr>().ok().map(IpAddr::V4)
}

/// The hostname in the first element's `host=` of a `forwarded` header,
/// quoted or not; `None` when absent, empty, longer than a DNS name or not
/// made of hostname characters.
pub fn parse_forwarded_host(value: &str) -> Option<String> {
    let first = value.split(',').next()?;
    let host = first.split(';').find_map(|pair| {
        let (key, value) = pair.trim().split_once('=')?;
        key.trim()
            .eq_ignore_ascii_case("host")
            .then_some(value.trim())
    })?;
    let host = match host.strip_prefix('"') {
        Some(quoted) => quoted.strip_suffix('"')?,
        None => host,
    };
    let valid = !host.is_empty()
        && host.len() <= MAX_HOSTNAME
        && host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_'));
    valid.then(|| host.to_owned())
}

fn is_port(s: &str) -> bool {
    !s.is_empty() && s.len() <= 5 && s.bytes().all(|b| b.is_ascii_digit())
}

/// W3C baggage limits: members per header and bytes per header.
const MAX_BAGGAGE_MEMBERS: usize = 180;
const MAX_BAGGAGE_BYTES: usize = 8192;

/// Workload kinds Istio names in `k8s.<kind>.name`.
const WORKLOAD_KINDS: &[&str] = &[
    "pod",
    "deployment",
    "replicaset",
    "statefulset",
    "daemonset",
    "job",
    "cronjob",
];

/// The workload facts of a W3C `baggage` header; `None` when it is not a
/// valid baggage list or names none of them.
pub fn parse_baggage(value: &str) -> Option<Baggage> {
    if value.len() > MAX_BAGGAGE_BYTES {
        return None;
    }
    let mut baggage = Baggage::default();
    let mut known = false;
    for (index, member) in value.split(',').enumerate() {
        if index >= MAX_BAGGAGE_MEMBERS {
            return None;
        }
        let member = member.trim();
        if member.is_empty() {
            continue;
        }
        // Properties after ';' carry nothing we read.
        let pair = member.split(';').next().unwrap_or_default();
        let (key, raw) = pair.split_once('=')?;
        let key = key.trim();
        if key.is_empty() || !key.bytes().all(is_token_byte) {
            return None;
        }
        let value = percent_decode(raw.trim())?;
        let slot = match key {
            "k8s.cluster.name" => &mut baggage.cluster,
            "k8s.namespace.name" => &mut baggage.namespace,
            "service.name" => &mut baggage.service,
            "service.version" => &mut baggage.version,
            // OpenTelemetry's cloud attributes, as ztunnel reads them
            // (`src/baggage.rs` `parse_baggage_header`).
            "cloud.region" => &mut baggage.region,
            "cloud.availability_zone" => &mut baggage.zone,
            _ => match key
                .strip_prefix("k8s.")
                .and_then(|rest| rest.strip_suffix(".name"))
                .filter(|kind| WORKLOAD_KINDS.contains(kind))
            {
                Some(kind) => {
                    baggage.workload.0 = kind.to_owned();
                    &mut baggage.workload.1
                }
                None => continue,
            },
        };
        *slot = value;
        known = true;
    }
    known.then_some(baggage)
}

/// RFC 7230 `tchar`: what a baggage key may hold.
fn is_token_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// Decodes `%XX` escapes; `None` on a bad escape or a result that is not
/// UTF-8.
fn percent_decode(raw: &str) -> Option<String> {
    let bytes = raw.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes.get(i + 1..i + 3)?;
            let hex = std::str::from_utf8(hex).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// A W3C `traceparent`: `version-traceid-parentid-flags`, lower-case hex,
/// neither id all zeros, version `ff` invalid; a version above 00 may
/// append fields after the flags (`-...`).
pub fn parse_traceparent(value: &str) -> Option<TraceContext> {
    let value = value.trim();
    let mut parts = value.splitn(5, '-');
    let version = parts.next()?;
    let trace = parts.next()?;
    let parent = parts.next()?;
    let flags = parts.next()?;
    let rest = parts.next();
    let lower_hex = |s: &str, len: usize| {
        s.len() == len
            && s.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    if !lower_hex(version, 2) || version == "ff" || (version == "00" && rest.is_some()) {
        return None;
    }
    if !(lower_hex(trace, 32) && lower_hex(parent, 16) && lower_hex(flags, 2)) {
        return None;
    }
    let trace_id = u128::from_str_radix(trace, 16).ok()?;
    let parent_id = u64::from_str_radix(parent, 16).ok()?;
    if trace_id == 0 || parent_id == 0 {
        return None;
    }
    Some(TraceContext {
        trace_id,
        parent_id,
        flags: u8::from_str_radix(flags, 16).ok()?,
    })
}

#[cfg(test)]
#[path = "head_tests.rs"]
mod tests;
