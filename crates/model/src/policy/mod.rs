//! L4 authorization with Istio's semantics.
//!
//! The policies that apply to a destination workload are the Global ones,
//! those of its namespace (scope Namespace) and those it lists (scope
//! WorkloadSelector). Then: any matching DENY denies; with no ALLOW policy
//! the connection is allowed; otherwise some ALLOW must match. A policy
//! matches when any of its rules matches; a rule when all its clauses do; a
//! clause when any of its matches does; a match when every non-empty
//! positive field matches (values ORed) and no `not*` field does. `dryRun`
//! policies are evaluated and logged but never decide.
//!
//! Policies are indexed by scope when the config is loaded, so a decision
//! only looks at the policies that apply to its destination: cost does not
//! grow with the number of policies elsewhere in the mesh.
//!
//! This module owns both the decision ([`PolicySet::authorize`], asked by
//! plaintext inbound and by the HBONE server for every stream) and the
//! re-check of connections already open when the policies change
//! ([`LiveConnections`]). The mesh state only finds the destination's
//! [`Target`].

mod live;

use std::{net::SocketAddr, sync::Arc};

use tracing::info;

pub use live::{LiveConnections, LiveGuard};

use crate::{
    config::{
        Action, LocalConfig, Match, Policy, Scope,
        entries::{EntryKey, Multi},
    },
    identity::Identity,
};

/// A connection asking to reach a workload.
#[derive(Debug, Clone, Copy)]
pub struct Request<'a> {
    /// The client's verified identity (none for plaintext inbound), as
    /// read from its certificate when the TLS connection was accepted.
    pub peer: Option<&'a Identity>,
    /// The client's address.
    pub src: SocketAddr,
    /// Where it is going.
    pub dst: SocketAddr,
}

/// The destination workload, as far as policy scoping cares.
#[derive(Debug, Clone, Copy)]
pub struct Target<'a> {
    /// Its namespace.
    pub namespace: &'a str,
    /// `namespace/name` of the WorkloadSelector policies it lists.
    pub policies: &'a [String],
}

/// The outcome.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Let it through.
    Allow,
    /// Refuse it.
    Deny {
        /// Why: the DENY policy that matched, or that no ALLOW matched.
        reason: String,
    },
}

impl Decision {
    /// Whether the connection may proceed.
    pub fn allowed(&self) -> bool {
        matches!(self, Decision::Allow)
    }
}

/// A decision plus what dry-run policies would have done.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Evaluation {
    /// The enforced decision.
    pub decision: Decision,
    /// `(policy, would-match)` for every applicable dry-run policy.
    pub dry_run: Vec<(String, bool)>,
}

/// Every policy, indexed by scope.
#[derive(Debug, Clone, Default)]
pub struct PolicySet {
    global: imbl::OrdMap<EntryKey, Arc<Policy>>,
    by_namespace: Multi<String, Arc<Policy>>,
    by_key: Multi<String, Arc<Policy>>,
    entries: imbl::OrdMap<EntryKey, Arc<Policy>>,
}

impl PolicySet {
    /// Indexes the config's policies.
    pub fn from_config(config: &LocalConfig) -> Self {
        let mut set = Self::default();
        set.apply(&crate::config::changes::Changes::of_file(config).policies);
        set
    }

    /// Replaces the policies `changes` names (`None`: removes it).
    pub fn apply(&mut self, changes: &[(EntryKey, Option<Arc<Policy>>)]) {
        for (entry, new) in changes {
            if let Some(old) = self.entries.remove(entry) {
                match old.scope {
                    Scope::Global => {
                        self.global.remove(entry);
                    }
                    Scope::Namespace => self.by_namespace.remove(old.namespace.as_str(), entry),
                    Scope::WorkloadSelector => {}
                }
                self.by_key.remove(old.key().as_str(), entry);
            }
            let Some(policy) = new else {
                continue;
            };
            match policy.scope {
                Scope::Global => {
                    self.global.insert(entry.clone(), Arc::clone(policy));
                }
                Scope::Namespace => self.by_namespace.insert(
                    policy.namespace.clone(),
                    entry.clone(),
                    Arc::clone(policy),
                ),
                Scope::WorkloadSelector => {}
            }
            self.by_key
                .insert(policy.key(), entry.clone(), Arc::clone(policy));
            self.entries.insert(entry.clone(), Arc::clone(policy));
        }
    }

    /// Number of policies.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The policy held under `entry`.
    pub fn get(&self, entry: &EntryKey) -> Option<&Arc<Policy>> {
        self.entries.get(entry)
    }

    /// Every policy, in entry order (the file's, then istiod's by name).
    pub fn iter(&self) -> impl Iterator<Item = &Arc<Policy>> {
        self.entries.values()
    }

    /// Decides a connection against the policies that apply to `target`
    /// and logs what dry-run policies would have done (target `policy`).
    /// `Err` carries the reason for the access record.
    pub fn authorize(&self, request: &Request<'_>, target: &Target<'_>) -> Result<(), String> {
        let evaluation = self.evaluate(request, target);
        for (policy, matched) in &evaluation.dry_run {
            info!(
                target: "policy",
                policy,
                matched,
                src = %request.src,
                dst = %request.dst,
                peer = request.peer.map_or("-", Identity::as_uri),
                "dry-run policy evaluated"
            );
        }
        match evaluation.decision {
            Decision::Allow => Ok(()),
            Decision::Deny { reason } => Err(reason),
        }
    }

    /// Decides `request` against the policies that apply to `target`.
    pub fn evaluate(&self, request: &Request<'_>, target: &Target<'_>) -> Evaluation {
        let namespaced = self
            .by_namespace
            .all(target.namespace)
            .into_iter()
            .flat_map(|policies| policies.values());
        let selected = target
            .policies
            .iter()
            .filter_map(|key| self.by_key.last(key.as_str()))
            .filter(|p| p.scope == Scope::WorkloadSelector);
        let applicable = self.global.values().chain(namespaced).chain(selected);

        let mut dry_run = Vec::new();
        let mut deny: Option<&Policy> = None;
        let mut any_allow = false;
        let mut allow_matched = false;
        for policy in applicable {
            let matched = policy_matches(policy, request);
            if policy.dry_run {
                dry_run.push((policy.key(), matched));
                continue;
            }
            match policy.action {
                Action::Deny if matched && deny.is_none() => deny = Some(policy),
                Action::Deny => {}
                Action::Allow => {
                    any_allow = true;
                    allow_matched |= matched;
                }
            }
        }
        let decision = match deny {
            Some(policy) => Decision::Deny {
                reason: format!("denied by policy {}", policy.key()),
            },
            None if any_allow && !allow_matched => Decision::Deny {
                reason: "no ALLOW policy matched".into(),
            },
            None => Decision::Allow,
        };
        Evaluation { decision, dry_run }
    }
}

fn policy_matches(policy: &Policy, request: &Request<'_>) -> bool {
    policy.rules.iter().any(|rule| {
        rule.iter()
            .all(|clause| clause.iter().any(|m| match_matches(m, request)))
    })
}

fn match_matches(m: &Match, r: &Request<'_>) -> bool {
    let src = r.src.ip().to_canonical();
    let dst_ip = r.dst.ip().to_canonical();
    positive(&m.namespaces, |ns| {
        r.peer.is_some_and(|p| wildcard_matches(ns, &p.namespace))
    }) && positive(&m.service_accounts, |sa| {
        r.peer.is_some_and(|p| sa_matches(sa, p))
    }) && positive(&m.principals, |pr| {
        r.peer.is_some_and(|p| principal_matches(pr, p))
    }) && positive(&m.source_ips, |net| net.contains(&src))
        && positive(&m.destination_ips, |net| net.contains(&dst_ip))
        && positive(&m.destination_ports, |port| *port == r.dst.port())
        && !m
            .not_namespaces
            .iter()
            .any(|ns| r.peer.is_some_and(|p| wildcard_matches(ns, &p.namespace)))
        && !m
            .not_service_accounts
            .iter()
            .any(|sa| r.peer.is_some_and(|p| sa_matches(sa, p)))
        && !m
            .not_principals
            .iter()
            .any(|pr| r.peer.is_some_and(|p| principal_matches(pr, p)))
        && !m.not_source_ips.iter().any(|net| net.contains(&src))
        && !m
            .not_destination_ips
            .iter()
            .any(|net| net.contains(&dst_ip))
        && !m
            .not_destination_ports
            .iter()
            .any(|port| *port == r.dst.port())
}

/// An empty positive field matches everything.
fn positive<T>(values: &[T], matches: impl Fn(&T) -> bool) -> bool {
    values.is_empty() || values.iter().any(matches)
}

/// `name` matches the peer's service account; `namespace/name` its
/// namespace too.
fn sa_matches(sa: &str, peer: &Identity) -> bool {
    match sa.split_once('/') {
        Some((ns, name)) => peer.namespace == ns && peer.service_account == name,
        None => peer.service_account == sa,
    }
}

/// Istio principals are SPIFFE URIs without the scheme; `*` alone, as a
/// prefix or as a suffix is a wildcard.
fn principal_matches(pattern: &str, peer: &Identity) -> bool {
    let uri = peer.as_uri();
    let id = uri.strip_prefix("spiffe://").unwrap_or(uri);
    let pattern = pattern.strip_prefix("spiffe://").unwrap_or(pattern);
    wildcard_matches(pattern, id)
}

/// `*` alone matches anything present, `*x` a suffix, `x*` a prefix,
/// anything else exactly (Istio's StringMatch; Kubernetes names and SPIFFE
/// ids cannot contain `*` themselves).
fn wildcard_matches(pattern: &str, id: &str) -> bool {
    if pattern == "*" {
        true
    } else if let Some(suffix) = pattern.strip_prefix('*') {
        id.ends_with(suffix)
    } else if let Some(prefix) = pattern.strip_suffix('*') {
        id.starts_with(prefix)
    } else {
        id == pattern
    }
}

#[cfg(test)]
mod tests;
