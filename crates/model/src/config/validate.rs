//! Checks that span entries (duplicates, references), run after parsing.
//! serde reports positions for values it rejects itself; for these the
//! position is found by locating the offending value in the text.

use std::collections::{HashMap, HashSet};

use super::{ConfigError, LocalConfig, Scope};
use crate::identity::Identity;

/// Every cross-entry rule, first violation wins.
pub(super) fn check(config: &LocalConfig, text: &str) -> Result<(), ConfigError> {
    let invalid = |field: String, needle: &str, nth: usize, reason: String| {
        let (line, column) = locate(text, needle, nth);
        ConfigError::Invalid {
            origin: config.origin.clone(),
            line,
            column,
            field,
            reason,
        }
    };

    let mut uids = HashSet::new();
    // Unique by network address, as the mesh state indexes them (ztunnel
    // `src/state/workload.rs` `WorkloadStore::by_addr`): two networks may
    // use the same pod range.
    let mut ips: HashMap<(&str, std::net::IpAddr), &str> = HashMap::new();
    for (i, w) in config.workloads.iter().enumerate() {
        if !uids.insert(&*w.uid) {
            return Err(invalid(
                format!("workloads[{i}].uid"),
                &w.uid,
                2,
                format!(
                    "uid `{}` is used by two workloads; uids must be unique",
                    w.uid
                ),
            ));
        }
        if let Err(e) = Identity::new(&*w.trust_domain, &*w.namespace, &*w.service_account) {
            return Err(invalid(
                format!("workloads[{i}]"),
                &w.uid,
                1,
                format!(
                    "namespace, serviceAccount and trustDomain do not form a SPIFFE identity: {e}"
                ),
            ));
        }
        if let Some(reason) = w.waypoint.as_deref().and_then(waypoint_problem) {
            return Err(invalid(
                format!("workloads[{i}].waypoint"),
                &w.uid,
                1,
                reason,
            ));
        }
        if let Some(reason) = w.network_gateway.as_deref().and_then(waypoint_problem) {
            // Same shape as a waypoint (ztunnel parses both as a
            // `GatewayAddress`), so the same checks.
            return Err(invalid(
                format!("workloads[{i}].networkGateway"),
                &w.uid,
                1,
                reason,
            ));
        }
        if w.application_tunnel.is_some_and(|t| t.port == Some(0)) {
            // xDS says "unset" with 0; the file says it by leaving it out.
            return Err(invalid(
                format!("workloads[{i}].applicationTunnel.port"),
                &w.uid,
                1,
                "port 0 is not a port (leave `port` out to keep the one the client asked for)"
                    .to_owned(),
            ));
        }
        if let Some(reason) = dns_name_problem(&w.hostname) {
            return Err(invalid(
                format!("workloads[{i}].hostname"),
                &w.hostname,
                1,
                reason,
            ));
        }
        for ip in w.own_ips() {
            if let Some(first) = ips.insert((&*w.network, *ip), &w.uid) {
                return Err(invalid(
                    format!("workloads[{i}].workloadIps"),
                    &ip.to_string(),
                    2,
                    format!(
                        "IP {ip} is claimed by workloads `{first}` and `{}` on network `{}`; workload IPs must be unique on their network",
                        w.uid, w.network
                    ),
                ));
            }
        }
    }

    let mut service_keys = HashSet::new();
    // Services of different namespaces may share a VIP, as istiod's may
    // (a client gets the one its namespace sees first); one namespace may
    // not give one VIP two services.
    let mut vips = HashSet::new();
    for (i, s) in config.services.iter().enumerate() {
        if !service_keys.insert(s.key()) {
            return Err(invalid(
                format!("services[{i}].hostname"),
                &s.hostname,
                2,
                format!("service `{}` is defined twice", s.key()),
            ));
        }
        for vip in &s.vips {
            // Per network, as ztunnel keys both (`NetworkAddress`).
            if !vips.insert((vip, s.namespace.as_str()))
                || ips.contains_key(&(&*vip.network, vip.ip))
            {
                return Err(invalid(
                    format!("services[{i}].vips"),
                    &vip.to_string(),
                    2,
                    format!(
                        "VIP {} is already used on network `{}` by a workload or by another \
                         service of namespace `{}` (only services of different namespaces or \
                         networks may share one)",
                        vip.ip, vip.network, s.namespace
                    ),
                ));
            }
        }
        if let Some(reason) = s.waypoints().find_map(waypoint_problem) {
            return Err(invalid(
                format!("services[{i}].waypoint"),
                &s.hostname,
                1,
                reason,
            ));
        }
        for san in &s.subject_alt_names {
            let uri = if san.starts_with("spiffe://") {
                san.clone()
            } else {
                format!("spiffe://{san}")
            };
            if Identity::parse(&uri).is_err() {
                return Err(invalid(
                    format!("services[{i}].subjectAltNames"),
                    san,
                    1,
                    format!("`{san}` is not a SPIFFE identity (spiffe://<td>/ns/<ns>/sa/<sa>)"),
                ));
            }
        }
    }

    let mut policy_scopes = HashMap::new();
    for (i, p) in config.policies.iter().enumerate() {
        if policy_scopes.insert(p.key(), p.scope).is_some() {
            return Err(invalid(
                format!("policies[{i}].name"),
                &p.name,
                2,
                format!("policy `{}` is defined twice", p.key()),
            ));
        }
    }

    for (i, w) in config.workloads.iter().enumerate() {
        for key in w.services.keys() {
            if !service_keys.contains(key) {
                return Err(invalid(
                    format!("workloads[{i}].services"),
                    key,
                    1,
                    format!(
                        "service `{key}` is not defined under `services` (keys are namespace/hostname)"
                    ),
                ));
            }
        }
        for key in &w.authorization_policies {
            match policy_scopes.get(key) {
                None => {
                    return Err(invalid(
                        format!("workloads[{i}].authorizationPolicies"),
                        key,
                        1,
                        format!(
                            "policy `{key}` is not defined under `policies` (keys are namespace/name)"
                        ),
                    ));
                }
                Some(scope) if *scope != Scope::WorkloadSelector => {
                    return Err(invalid(
                        format!("workloads[{i}].authorizationPolicies"),
                        key,
                        1,
                        format!(
                            "policy `{key}` has scope {scope:?}; only WorkloadSelector policies are listed on workloads"
                        ),
                    ));
                }
                Some(_) => {}
            }
        }
    }
    Ok(())
}

/// Why `name` (empty: none) cannot be a workload's DNS name: at most 253
/// characters, dot-separated labels of 1 to 63 letters, digits, `-` or
/// `_` (RFC 1035 section 2.3.4, with the underscore resolvers accept), an
/// optional final dot.
fn dns_name_problem(name: &str) -> Option<String> {
    let bare = name.strip_suffix('.').unwrap_or(name);
    if name.is_empty() {
        return None;
    }
    if bare.len() > 253 {
        return Some(format!(
            "hostname of {} characters is longer than DNS allows (253)",
            bare.len()
        ));
    }
    let bad = bare.split('.').find(|label| {
        label.is_empty()
            || label.len() > 63
            || !label
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    });
    bad.map(|label| {
        format!(
            "hostname label `{label}` is not a DNS label (1 to 63 letters, digits, `-` or `_`); \
             write a name such as `api.example.com`"
        )
    })
}

/// Why a waypoint cannot be reached, if it cannot.
pub(crate) fn waypoint_problem(waypoint: &super::Waypoint) -> Option<String> {
    match (&waypoint.address, &waypoint.hostname) {
        (Some(_), Some(_)) | (None, None) => {
            Some("a waypoint needs exactly one of `address` and `hostname`".to_owned())
        }
        (None, Some(host))
            if host
                .split_once('/')
                .is_none_or(|(ns, h)| ns.is_empty() || h.is_empty()) =>
        {
            Some(format!(
                "waypoint hostname `{host}` is not namespace/hostname"
            ))
        }
        _ if waypoint.hbone_port == 0 => Some("waypoint hbonePort 0 is not a port".to_owned()),
        _ => None,
    }
}

/// 1-based line and column of the `nth` (1-based) occurrence of `needle`,
/// or of the last one found; (0, 0) when absent.
fn locate(text: &str, needle: &str, nth: usize) -> (usize, usize) {
    let mut found = None;
    let mut from = 0;
    for _ in 0..nth.max(1) {
        match text.get(from..).and_then(|rest| rest.find(needle)) {
            Some(at) => {
                found = Some(from + at);
                from += at + needle.len().max(1);
            }
            None => break,
        }
    }
    let Some(offset) = found else {
        return (0, 0);
    };
    let before = &text[..offset];
    let line = before.matches('\n').count() + 1;
    let column = offset - before.rfind('\n').map_or(0, |nl| nl + 1) + 1;
    (line, column)
}
