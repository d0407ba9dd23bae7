//! Which pods are in the mesh, decided as istio-cni decides it. The
//! reconciler and the CNI plugin share this rule, so they always agree with
//! each other and with istiod, which advertises a pod as captured only when
//! istio-cni's rule enrolled it.
//!
//! The rule comes from istio/istio at 86c9f01f:
//! - **Enablement selectors** (`CompiledEnablementSelectors::Matches`,
//!   `cni/pkg/util/enablement_selector.go`; the istio-cni chart's
//!   `ambient.enablementSelectors`). A pod is enrolled when any selector
//!   matches: its `podSelector` matches the pod's labels and its
//!   `namespaceSelector` matches the namespace's labels. A missing
//!   selector matches everything. Istio's default ([`istio_default_selectors`])
//!   enrolls a pod labelled `istio.io/dataplane-mode=ambient`, and every pod
//!   of a namespace labelled so unless the pod is labelled `none`. Only
//!   labels count: an `istio.io/dataplane-mode` *annotation* does nothing.
//! - **Sidecars** (`podHasSidecar`, `cni/pkg/util/podutil.go`): a pod
//!   annotated `sidecar.istio.io/status` already has a proxy of its own and
//!   is never enrolled.
//! - **Host network** (the same `Matches`): such a pod shares the node's
//!   network namespace and is never enrolled.
//! - **Excluded namespaces** (`isNamespaceExcluded`,
//!   `cni/pkg/nodeagent/informers.go`; the chart's `excludeNamespaces`,
//!   `[kube-system]` by default): their pods are never enrolled, by the
//!   CNI plugin nor by the node agent.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, LabelSelectorRequirement};
use kube::core::{Selector, SelectorExt as _};
use serde::{Deserialize, Serialize};

/// The label (on namespaces and pods) that opts in or out.
pub const DATAPLANE_MODE: &str = "istio.io/dataplane-mode";
/// [`DATAPLANE_MODE`] value that opts in.
pub const MODE_AMBIENT: &str = "ambient";
/// [`DATAPLANE_MODE`] value that opts a pod out.
pub const MODE_NONE: &str = "none";
/// The annotation Istio's sidecar injector leaves on a pod it injected.
pub const SIDECAR_STATUS: &str = "sidecar.istio.io/status";
/// istio-cni's default `excludeNamespaces`.
pub const DEFAULT_EXCLUDED_NAMESPACE: &str = "kube-system";

/// Whether a pod belongs in the mesh, and why.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OptIn {
    /// Enroll: the enablement selector at this index matched.
    Enroll {
        /// Index of the first selector that matched.
        selector: usize,
    },
    /// Leave out.
    Skip(SkipReason),
}

/// Why a pod is left out of the mesh.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SkipReason {
    /// No enablement selector matches the pod and its namespace.
    NotSelected,
    /// No selector matches, and the pod is labelled
    /// `istio.io/dataplane-mode=none`.
    OptedOut,
    /// The pod uses the node's network namespace.
    HostNetwork,
    /// The pod has a sidecar (`sidecar.istio.io/status`).
    Sidecar,
    /// The pod's namespace is excluded.
    NamespaceExcluded,
}

impl std::fmt::Display for SkipReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::NotSelected => {
                "no enablement selector matches the pod and its namespace (by default: neither has the label istio.io/dataplane-mode=ambient)"
            }
            Self::OptedOut => "the pod has the label istio.io/dataplane-mode=none",
            Self::HostNetwork => "the pod uses the host network",
            Self::Sidecar => "the pod has an Istio sidecar (sidecar.istio.io/status)",
            Self::NamespaceExcluded => "the pod's namespace is excluded",
        })
    }
}

/// What the rule looks at.
#[derive(Debug, Clone, Copy)]
pub struct OptInInput<'a> {
    /// The pod's namespace.
    pub namespace: &'a str,
    /// The pod's labels.
    pub pod_labels: &'a BTreeMap<String, String>,
    /// The pod's annotations.
    pub pod_annotations: &'a BTreeMap<String, String>,
    /// Whether the pod uses the host network.
    pub host_network: bool,
    /// Its namespace's labels.
    pub namespace_labels: &'a BTreeMap<String, String>,
}

/// One enablement selector, as the istio-cni chart's
/// `ambient.enablementSelectors` entries are written.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct EnablementSelector {
    /// Matched against the pod's labels; absent matches every pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_selector: Option<LabelSelector>,
    /// Matched against the namespace's labels; absent matches every
    /// namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace_selector: Option<LabelSelector>,
}

/// Errors of reading the enrollment rule.
#[derive(Debug, thiserror::Error)]
pub enum RuleError {
    /// The selectors are not a YAML or JSON list of selectors.
    #[error(
        "cannot read the enablement selectors (a YAML or JSON list of {{podSelector, namespaceSelector}}): {reason}"
    )]
    Parse {
        /// The parser's message.
        reason: String,
    },
    /// One selector is not a valid Kubernetes label selector.
    #[error("enablement selector {index} ({which}): {reason}")]
    Selector {
        /// Its position in the list, from 0.
        index: usize,
        /// `podSelector` or `namespaceSelector`.
        which: &'static str,
        /// Why it is invalid.
        reason: String,
    },
}

/// istio-cni's default `ambient.enablementSelectors`
/// (`manifests/charts/istio-cni/values.yaml`).
pub fn istio_default_selectors() -> Vec<EnablementSelector> {
    let ambient = || BTreeMap::from([(DATAPLANE_MODE.to_owned(), MODE_AMBIENT.to_owned())]);
    vec![
        EnablementSelector {
            pod_selector: Some(LabelSelector {
                match_labels: Some(ambient()),
                match_expressions: None,
            }),
            namespace_selector: None,
        },
        EnablementSelector {
            pod_selector: Some(LabelSelector {
                match_labels: None,
                match_expressions: Some(vec![LabelSelectorRequirement {
                    key: DATAPLANE_MODE.to_owned(),
                    operator: "NotIn".to_owned(),
                    values: Some(vec![MODE_NONE.to_owned()]),
                }]),
            }),
            namespace_selector: Some(LabelSelector {
                match_labels: Some(ambient()),
                match_expressions: None,
            }),
        },
    ]
}

/// Reads selectors written as the chart writes them (YAML or JSON).
pub fn parse_selectors(text: &str) -> Result<Vec<EnablementSelector>, RuleError> {
    serde_yaml_ng::from_str(text).map_err(|e| RuleError::Parse {
        reason: e.to_string(),
    })
}

/// A checked list of selectors, as a command-line value.
#[derive(Debug, Clone, PartialEq)]
pub struct EnablementSelectors(pub Vec<EnablementSelector>);

/// Reads and checks `--enablement-selectors`: an invalid selector stops
/// the command with its place named, before anything starts.
pub fn parse_selectors_arg(s: &str) -> Result<EnablementSelectors, String> {
    let selectors = parse_selectors(s).map_err(|e| e.to_string())?;
    EnrollmentRule::new(&selectors, []).map_err(|e| e.to_string())?;
    Ok(EnablementSelectors(selectors))
}

/// The compiled rule.
#[derive(Debug, Clone)]
pub struct EnrollmentRule {
    selectors: Vec<(Selector, Selector)>,
    excluded: BTreeSet<String>,
}

impl Default for EnrollmentRule {
    /// Istio's defaults: [`istio_default_selectors`], `kube-system`
    /// excluded.
    fn default() -> Self {
        // Istio's own selectors are valid; a failure here would be a bug
        // caught by the unit tests, and the fallback still excludes all.
        Self::new(
            &istio_default_selectors(),
            [DEFAULT_EXCLUDED_NAMESPACE.to_owned()],
        )
        .unwrap_or_else(|_| Self {
            selectors: Vec::new(),
            excluded: BTreeSet::new(),
        })
    }
}

impl EnrollmentRule {
    /// Compiles `selectors`; pods of `excluded` namespaces are never
    /// enrolled.
    pub fn new(
        selectors: &[EnablementSelector],
        excluded: impl IntoIterator<Item = String>,
    ) -> Result<Self, RuleError> {
        let compile = |index, which, selector: &Option<LabelSelector>| match selector {
            None => Ok(Selector::default()),
            Some(selector) => {
                Selector::try_from(selector.clone()).map_err(|e| RuleError::Selector {
                    index,
                    which,
                    reason: e.to_string(),
                })
            }
        };
        let selectors = selectors
            .iter()
            .enumerate()
            .map(|(i, s)| {
                Ok((
                    compile(i, "podSelector", &s.pod_selector)?,
                    compile(i, "namespaceSelector", &s.namespace_selector)?,
                ))
            })
            .collect::<Result<_, RuleError>>()?;
        Ok(Self {
            selectors,
            excluded: excluded.into_iter().filter(|n| !n.is_empty()).collect(),
        })
    }

    /// Whether pods of `namespace` are never enrolled.
    pub fn excludes_namespace(&self, namespace: &str) -> bool {
        self.excluded.contains(namespace)
    }

    /// Applies the rule.
    pub fn decide(&self, input: OptInInput<'_>) -> OptIn {
        if input.host_network {
            return OptIn::Skip(SkipReason::HostNetwork);
        }
        if input.pod_annotations.contains_key(SIDECAR_STATUS) {
            return OptIn::Skip(SkipReason::Sidecar);
        }
        if self.excludes_namespace(input.namespace) {
            return OptIn::Skip(SkipReason::NamespaceExcluded);
        }
        let selected = self.selectors.iter().position(|(pod, ns)| {
            pod.matches(input.pod_labels) && ns.matches(input.namespace_labels)
        });
        match selected {
            Some(selector) => OptIn::Enroll { selector },
            None if input.pod_labels.get(DATAPLANE_MODE).map(String::as_str) == Some(MODE_NONE) => {
                OptIn::Skip(SkipReason::OptedOut)
            }
            None => OptIn::Skip(SkipReason::NotSelected),
        }
    }
}

#[cfg(test)]
#[path = "optin_tests.rs"]
mod tests;
