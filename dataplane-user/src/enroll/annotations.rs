//! A pod's capture exclusions from its annotations: Istio's
//! `ambient.istio.io/bypass-inbound-capture` and the sidecar-mode
//! `traffic.sidecar.istio.io/*` port and CIDR annotations, with Istio's
//! names and value syntax, read into the [`Exclusions`] the kernel maps
//! hold (istio/istio#49829 asks for the latter in ambient).
//!
//! The names and meanings are istio/api's (`annotation/annotations.yaml`:
//! `*` on an include list redirects everything, an empty include list
//! disables that direction's redirection, the exclude lists apply under
//! `*`). The syntax is Istio's own (istio/istio `cni/pkg/plugin/sidecar_redirect.go`:
//! `getAnnotationOrDefault`, `validatePortListWithWildcard`,
//! `validateCIDRList`, `validateCIDRListWithWildcard`, `parsePorts`;
//! the injector's `pkg/kube/inject/validate.go` checks the same lists):
//! - port lists: the value is trimmed, an empty value is no port, otherwise
//!   comma-separated entries, each trimmed, each a decimal `0`..`65535`
//!   (Go's `strconv.ParseUint(s, 10, 16)`: no sign, leading zeros allowed);
//! - CIDR lists: an empty value is no range, otherwise comma-separated
//!   entries, each read as Go's `netip.ParsePrefix` does: not trimmed, an
//!   address (IPv4 without leading zeros in its octets, IPv6 without zone),
//!   `/`, and a prefix length without sign or leading zero;
//! - `*` (the exact value) only where Istio gives it a meaning: the include
//!   lists. Istio's injector refuses it on exclude port lists
//!   (`ValidateExcludeInboundPorts`, `ValidateExcludeOutboundPorts` call
//!   `validatePortList`) and istio-iptables on
//!   `excludeOutboundIPRanges` (`tools/istio-iptables/pkg/capture/run.go`,
//!   `Run`: "invalid value for OUTBOUND_IP_RANGES_EXCLUDE"), so it is
//!   refused here too.
//!
//! An annotation whose value is invalid is ignored as a whole (nothing of
//! it applies) and reported ([`IgnoredAnnotation`]); the pod is still
//! enrolled, with its other annotations. Istio's CNI plugin fails the pod
//! instead; an ambient pod stays in the mesh.
//!
//! Each list takes at most [`MAX_ENTRIES`] entries: the kernel's exclusion
//! maps hold [`EXCLUSION_CAPACITY`](dataplane_common::maps::EXCLUSION_CAPACITY)
//! (16,384) entries for the whole node, and a pod's annotations are written
//! by whoever may create pods.
//!
//! What the kernel maps cannot express is refused with a reason: they list
//! what is *not* captured, so "capture only these inbound ports"
//! (`includeInboundPorts` other than `*` or empty) and "capture only these
//! ranges" (`includeOutboundIPRanges` other than `*` or empty) are
//! ignored, and `includeOutboundPorts` (capture these ports even to an
//! excluded range) is ignored when the pod excludes ranges: the kernel
//! leaves a connection alone when its port *or* its destination is
//! excluded.

use std::{collections::BTreeMap, net::IpAddr, str::FromStr};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};

use crate::redirect::Exclusions;

/// Istio's `traffic.sidecar.istio.io/excludeInboundPorts`: pod ports whose
/// inbound connections are not captured.
pub const EXCLUDE_INBOUND_PORTS: &str = "traffic.sidecar.istio.io/excludeInboundPorts";
/// Istio's `traffic.sidecar.istio.io/excludeOutboundPorts`: destination
/// ports of outbound connections not captured.
pub const EXCLUDE_OUTBOUND_PORTS: &str = "traffic.sidecar.istio.io/excludeOutboundPorts";
/// Istio's `traffic.sidecar.istio.io/excludeOutboundIPRanges`: destination
/// CIDRs of outbound connections not captured.
pub const EXCLUDE_OUTBOUND_IP_RANGES: &str = "traffic.sidecar.istio.io/excludeOutboundIPRanges";
/// Istio's `traffic.sidecar.istio.io/includeInboundPorts` (default `*`):
/// only `*` and the empty value (no inbound capture) are supported.
pub const INCLUDE_INBOUND_PORTS: &str = "traffic.sidecar.istio.io/includeInboundPorts";
/// Istio's `traffic.sidecar.istio.io/includeOutboundIPRanges` (default
/// `*`): only `*` and the empty value (no outbound capture) are supported.
pub const INCLUDE_OUTBOUND_IP_RANGES: &str = "traffic.sidecar.istio.io/includeOutboundIPRanges";
/// Istio's `traffic.sidecar.istio.io/includeOutboundPorts` (default
/// empty): a no-op unless the pod excludes ranges, and then unsupported.
pub const INCLUDE_OUTBOUND_PORTS: &str = "traffic.sidecar.istio.io/includeOutboundPorts";

/// Every annotation that sets exclusions.
pub const EXCLUSION_ANNOTATIONS: [&str; 7] = [
    super::BYPASS_INBOUND_CAPTURE_ANNOTATION,
    EXCLUDE_INBOUND_PORTS,
    EXCLUDE_OUTBOUND_PORTS,
    EXCLUDE_OUTBOUND_IP_RANGES,
    INCLUDE_INBOUND_PORTS,
    INCLUDE_OUTBOUND_IP_RANGES,
    INCLUDE_OUTBOUND_PORTS,
];

/// Most entries one port or CIDR annotation may list; more and the whole
/// annotation is ignored. 32 keeps the largest pod count of a node (250)
/// with two IPs each (inbound exclusions are per pod IP: 64 entries a pod)
/// within the node's 16,384 map entries.
pub const MAX_ENTRIES: usize = 32;

/// Why an annotation's value is ignored.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AnnotationError {
    /// An entry of a port list is not a port.
    #[error("{entry:?} is not a port (a decimal number from 0 to 65535)")]
    Port {
        /// The entry as written.
        entry: String,
    },
    /// An entry of a CIDR list is not a network.
    #[error("{entry:?} is not a CIDR (address/prefix length, e.g. 10.0.0.0/8, no spaces)")]
    Cidr {
        /// The entry as written.
        entry: String,
    },
    /// More entries than [`MAX_ENTRIES`].
    #[error("{count} entries, more than the {max} allowed")]
    TooMany {
        /// Entries listed.
        count: usize,
        /// [`MAX_ENTRIES`].
        max: usize,
    },
    /// `*` where Istio refuses it (the exclude lists).
    #[error("`*` is not valid here (Istio accepts it on the include annotations only)")]
    Wildcard,
    /// A valid value the kernel maps cannot express.
    #[error("not supported: {why}")]
    Unsupported {
        /// Why the kernel cannot do it.
        why: &'static str,
    },
}

/// An annotation whose value is ignored, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("annotation {annotation}={value:?} ignored: {error}")]
pub struct IgnoredAnnotation {
    /// The annotation's name.
    pub annotation: &'static str,
    /// Its value.
    pub value: String,
    /// Why it is ignored.
    #[source]
    pub error: AnnotationError,
}

/// What a pod's annotations exclude from capture, and what they ask that
/// is ignored.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AnnotatedExclusions {
    /// The exclusions in force.
    pub exclusions: Exclusions,
    /// Annotations ignored as a whole.
    pub ignored: Vec<IgnoredAnnotation>,
}

/// A port or CIDR list, or Istio's `*`.
enum List<T> {
    All,
    Entries(Vec<T>),
}

/// Reads the exclusions of a pod's annotations (see the module
/// documentation for the syntax and what is refused).
pub fn parse_exclusions(annotations: &BTreeMap<String, String>) -> AnnotatedExclusions {
    let mut out = AnnotatedExclusions::default();
    let ignore =
        |annotation: &'static str, value: &str, error: AnnotationError| IgnoredAnnotation {
            annotation,
            value: value.to_owned(),
            error,
        };
    let mut ignored = Vec::new();
    let ex = &mut out.exclusions;
    ex.bypass_inbound =
        super::annotation_flag(annotations, super::BYPASS_INBOUND_CAPTURE_ANNOTATION)
            .unwrap_or(false);
    let get = |name: &str| annotations.get(name).map(String::as_str);

    // `*` is refused on the exclude lists (Istio's injector and
    // istio-iptables refuse it): `ports`/`cidrs` say so without it.
    for (name, slot) in [
        (EXCLUDE_INBOUND_PORTS, &mut ex.inbound_ports),
        (EXCLUDE_OUTBOUND_PORTS, &mut ex.outbound_ports),
    ] {
        if let Some(value) = get(name) {
            match entries(ports(value, false)) {
                Ok(list) => *slot = list,
                Err(e) => ignored.push(ignore(name, value, e)),
            }
        }
    }
    if let Some(value) = get(EXCLUDE_OUTBOUND_IP_RANGES) {
        match entries(cidrs(value, false)) {
            Ok(list) => ex.outbound_cidrs = list,
            Err(e) => ignored.push(ignore(EXCLUDE_OUTBOUND_IP_RANGES, value, e)),
        }
    }
    if let Some(value) = get(INCLUDE_INBOUND_PORTS) {
        match ports(value, true) {
            Ok(List::All) => {}
            // istio-iptables `handleInboundPortsInclude`: an empty list
            // intercepts no inbound port.
            Ok(List::Entries(list)) if list.is_empty() => ex.bypass_inbound = true,
            Ok(List::Entries(_)) => ignored.push(ignore(
                INCLUDE_INBOUND_PORTS,
                value,
                AnnotationError::Unsupported {
                    why: "the kernel lists excluded inbound ports; capturing only some would take \
                          an entry for every other port (use excludeInboundPorts, or `*`/empty)",
                },
            )),
            Err(e) => ignored.push(ignore(INCLUDE_INBOUND_PORTS, value, e)),
        }
    }
    if let Some(value) = get(INCLUDE_OUTBOUND_IP_RANGES) {
        match cidrs(value, true) {
            Ok(List::All) => {}
            // An empty list redirects no destination (Istio's
            // `handleOutboundIncludeRules` adds no rule).
            Ok(List::Entries(list)) if list.is_empty() => push_unique(
                &mut ex.outbound_cidrs,
                [IpNet::V4(Ipv4Net::default()), IpNet::V6(Ipv6Net::default())],
            ),
            Ok(List::Entries(_)) => ignored.push(ignore(
                INCLUDE_OUTBOUND_IP_RANGES,
                value,
                AnnotationError::Unsupported {
                    why: "the kernel lists excluded destination ranges, not captured ones (use \
                          excludeOutboundIPRanges, or `*`/empty)",
                },
            )),
            Err(e) => ignored.push(ignore(INCLUDE_OUTBOUND_IP_RANGES, value, e)),
        }
    }
    if let Some(value) = get(INCLUDE_OUTBOUND_PORTS) {
        match ports(value, true) {
            Ok(List::Entries(list)) if list.is_empty() => {}
            // Without excluded ranges every port is captured already.
            Ok(_) if ex.outbound_cidrs.is_empty() => {}
            Ok(_) => ignored.push(ignore(
                INCLUDE_OUTBOUND_PORTS,
                value,
                AnnotationError::Unsupported {
                    why: "the kernel leaves a connection alone when its port or its destination \
                          is excluded; it cannot capture a port to an excluded range",
                },
            )),
            Err(e) => ignored.push(ignore(INCLUDE_OUTBOUND_PORTS, value, e)),
        }
    }
    out.ignored = ignored;
    out
}

/// The exclusions a pod's annotations ask for, without the report of what
/// is ignored ([`parse_exclusions`]).
pub fn annotation_exclusions(annotations: &BTreeMap<String, String>) -> Exclusions {
    parse_exclusions(annotations).exclusions
}

/// Logs a warning for each ignored annotation of the pod.
pub fn warn_ignored(namespace: &str, pod: &str, ignored: &[IgnoredAnnotation]) {
    for one in ignored {
        tracing::warn!(
            pod = %pod,
            namespace = %namespace,
            annotation = one.annotation,
            value = %one.value,
            reason = %one.error,
            "pod annotation ignored; the pod is captured as if it were not set"
        );
    }
}

/// A list's entries; `*` is [`AnnotationError::Wildcard`] (where a
/// parser that was told it may take `*` gave it).
fn entries<T>(list: Result<List<T>, AnnotationError>) -> Result<Vec<T>, AnnotationError> {
    match list? {
        List::Entries(list) => Ok(list),
        List::All => Err(AnnotationError::Wildcard),
    }
}

/// Istio's `*` (every port or range): allowed where `wildcard`, else
/// refused; `None` for any other value.
fn star<T>(value: &str, wildcard: bool) -> Option<Result<List<T>, AnnotationError>> {
    (value == "*").then(|| match wildcard {
        true => Ok(List::All),
        false => Err(AnnotationError::Wildcard),
    })
}

fn push_unique<T: PartialEq>(list: &mut Vec<T>, items: impl IntoIterator<Item = T>) {
    for item in items {
        if !list.contains(&item) {
            list.push(item);
        }
    }
}

/// Istio's `parsePorts` (and `*` when `wildcard`), deduplicated, at most
/// [`MAX_ENTRIES`].
fn ports(value: &str, wildcard: bool) -> Result<List<u16>, AnnotationError> {
    if let Some(all) = star(value, wildcard) {
        return all;
    }
    let value = value.trim();
    if value.is_empty() {
        return Ok(List::Entries(Vec::new()));
    }
    let entries: Vec<&str> = value.split(',').collect();
    too_many(entries.len())?;
    let mut list = Vec::new();
    for entry in entries {
        let digits = entry.trim();
        let port = (!digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()))
            .then(|| digits.parse::<u16>().ok())
            .flatten()
            .ok_or_else(|| AnnotationError::Port {
                entry: entry.to_owned(),
            })?;
        push_unique(&mut list, [port]);
    }
    Ok(List::Entries(list))
}

/// Istio's `validateCIDRList` (and `*` when `wildcard`), deduplicated,
/// at most [`MAX_ENTRIES`].
fn cidrs(value: &str, wildcard: bool) -> Result<List<IpNet>, AnnotationError> {
    if let Some(all) = star(value, wildcard) {
        return all;
    }
    if value.is_empty() {
        return Ok(List::Entries(Vec::new()));
    }
    let entries: Vec<&str> = value.split(',').collect();
    too_many(entries.len())?;
    let mut list = Vec::new();
    for entry in entries {
        let net = parse_prefix(entry).ok_or_else(|| AnnotationError::Cidr {
            entry: entry.to_owned(),
        })?;
        push_unique(&mut list, [net.trunc()]);
    }
    Ok(List::Entries(list))
}

fn too_many(count: usize) -> Result<(), AnnotationError> {
    match count > MAX_ENTRIES {
        true => Err(AnnotationError::TooMany {
            count,
            max: MAX_ENTRIES,
        }),
        false => Ok(()),
    }
}

/// Go's `netip.ParsePrefix`: `addr/bits`, nothing trimmed, no zone, the
/// length without sign or leading zero.
fn parse_prefix(entry: &str) -> Option<IpNet> {
    let (addr, bits) = entry.split_once('/')?;
    let well_formed = !bits.is_empty()
        && bits.bytes().all(|b| b.is_ascii_digit())
        && (bits.len() == 1 || !bits.starts_with('0'));
    if !well_formed {
        return None;
    }
    let bits = bits.parse::<u8>().ok()?;
    // Rust's parser, like Go's, refuses IPv4 octets with leading zeros and
    // IPv6 zones.
    let addr = IpAddr::from_str(addr).ok()?;
    IpNet::new(addr, bits).ok()
}

#[cfg(test)]
#[path = "annotations_tests.rs"]
mod tests;
