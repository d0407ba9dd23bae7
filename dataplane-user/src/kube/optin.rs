//! Which pods are in the mesh: the Istio-style opt-in rule, shared by the
//! reconciler and the CNI plugin so both always agree.
//!
//! A pod is enrolled when its namespace carries the label
//! `istio.io/dataplane-mode=ambient`, or the pod itself carries it as a
//! label or annotation. A pod labelled or annotated
//! `istio.io/dataplane-mode=none` is never enrolled, whatever its
//! namespace says. Host-network pods share the node's network namespace
//! and are never enrolled.

use std::collections::BTreeMap;

/// The label (on namespaces and pods) and annotation (on pods) that opt in
/// or out.
pub const DATAPLANE_MODE: &str = "istio.io/dataplane-mode";
/// [`DATAPLANE_MODE`] value that opts in.
pub const MODE_AMBIENT: &str = "ambient";
/// [`DATAPLANE_MODE`] value that opts a pod out.
pub const MODE_NONE: &str = "none";

/// Whether a pod belongs in the mesh, and why.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OptIn {
    /// Enroll: the pod opted in.
    Enroll(OptInSource),
    /// Leave out.
    Skip(SkipReason),
}

/// Where the opt-in came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OptInSource {
    /// The pod's own label or annotation.
    Pod,
    /// Its namespace's label.
    Namespace,
}

/// Why a pod is left out of the mesh.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SkipReason {
    /// Neither the pod nor its namespace opted in.
    NotOptedIn,
    /// The pod opted out (`istio.io/dataplane-mode=none`).
    OptedOut,
    /// The pod uses the node's network namespace.
    HostNetwork,
}

impl std::fmt::Display for SkipReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::NotOptedIn => {
                "neither the pod nor its namespace has istio.io/dataplane-mode=ambient"
            }
            Self::OptedOut => "the pod has istio.io/dataplane-mode=none",
            Self::HostNetwork => "the pod uses the host network",
        })
    }
}

/// What the rule looks at.
#[derive(Debug, Clone, Copy)]
pub struct OptInInput<'a> {
    /// The pod's labels.
    pub pod_labels: &'a BTreeMap<String, String>,
    /// The pod's annotations.
    pub pod_annotations: &'a BTreeMap<String, String>,
    /// Whether the pod uses the host network.
    pub host_network: bool,
    /// Its namespace's labels.
    pub namespace_labels: &'a BTreeMap<String, String>,
}

/// Applies the rule.
pub fn decide(input: OptInInput<'_>) -> OptIn {
    if input.host_network {
        return OptIn::Skip(SkipReason::HostNetwork);
    }
    let pod_modes = [
        input.pod_labels.get(DATAPLANE_MODE),
        input.pod_annotations.get(DATAPLANE_MODE),
    ];
    if pod_modes.iter().flatten().any(|m| *m == MODE_NONE) {
        return OptIn::Skip(SkipReason::OptedOut);
    }
    if pod_modes.iter().flatten().any(|m| *m == MODE_AMBIENT) {
        return OptIn::Enroll(OptInSource::Pod);
    }
    if input
        .namespace_labels
        .get(DATAPLANE_MODE)
        .is_some_and(|m| m == MODE_AMBIENT)
    {
        return OptIn::Enroll(OptInSource::Namespace);
    }
    OptIn::Skip(SkipReason::NotOptedIn)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    fn run(pod_labels: &[(&str, &str)], pod_ann: &[(&str, &str)], ns: &[(&str, &str)]) -> OptIn {
        decide(OptInInput {
            pod_labels: &map(pod_labels),
            pod_annotations: &map(pod_ann),
            host_network: false,
            namespace_labels: &map(ns),
        })
    }

    #[test]
    fn namespace_label_opts_in() {
        assert_eq!(
            run(&[], &[], &[(DATAPLANE_MODE, "ambient")]),
            OptIn::Enroll(OptInSource::Namespace)
        );
    }

    #[test]
    fn pod_annotation_or_label_opts_in() {
        assert_eq!(
            run(&[], &[(DATAPLANE_MODE, "ambient")], &[]),
            OptIn::Enroll(OptInSource::Pod)
        );
        assert_eq!(
            run(&[(DATAPLANE_MODE, "ambient")], &[], &[]),
            OptIn::Enroll(OptInSource::Pod)
        );
    }

    #[test]
    fn pod_opt_out_wins_over_namespace() {
        assert_eq!(
            run(
                &[],
                &[(DATAPLANE_MODE, "none")],
                &[(DATAPLANE_MODE, "ambient")]
            ),
            OptIn::Skip(SkipReason::OptedOut)
        );
        assert_eq!(
            run(
                &[(DATAPLANE_MODE, "none")],
                &[(DATAPLANE_MODE, "ambient")],
                &[]
            ),
            OptIn::Skip(SkipReason::OptedOut)
        );
    }

    #[test]
    fn nothing_or_other_values_leave_the_pod_out() {
        assert_eq!(run(&[], &[], &[]), OptIn::Skip(SkipReason::NotOptedIn));
        assert_eq!(
            run(&[], &[], &[(DATAPLANE_MODE, "sidecar")]),
            OptIn::Skip(SkipReason::NotOptedIn)
        );
    }

    #[test]
    fn host_network_pods_are_never_enrolled() {
        let ns = map(&[(DATAPLANE_MODE, "ambient")]);
        let empty = BTreeMap::new();
        assert_eq!(
            decide(OptInInput {
                pod_labels: &empty,
                pod_annotations: &empty,
                host_network: true,
                namespace_labels: &ns,
            }),
            OptIn::Skip(SkipReason::HostNetwork)
        );
    }
}
