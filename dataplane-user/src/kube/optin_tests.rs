#![expect(clippy::unwrap_used, reason = "tests fail loudly on unexpected errors")]

use super::*;

fn map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

struct Pod<'a> {
    namespace: &'a str,
    labels: &'a [(&'a str, &'a str)],
    annotations: &'a [(&'a str, &'a str)],
    host_network: bool,
    ns_labels: &'a [(&'a str, &'a str)],
}

const POD: Pod<'static> = Pod {
    namespace: "shop",
    labels: &[],
    annotations: &[],
    host_network: false,
    ns_labels: &[],
};

fn run_with(rule: &EnrollmentRule, pod: Pod<'_>) -> OptIn {
    rule.decide(OptInInput {
        namespace: pod.namespace,
        pod_labels: &map(pod.labels),
        pod_annotations: &map(pod.annotations),
        host_network: pod.host_network,
        namespace_labels: &map(pod.ns_labels),
    })
}

fn run(pod: Pod<'_>) -> OptIn {
    run_with(&EnrollmentRule::default(), pod)
}

const AMBIENT: &[(&str, &str)] = &[(DATAPLANE_MODE, MODE_AMBIENT)];
const NONE: &[(&str, &str)] = &[(DATAPLANE_MODE, MODE_NONE)];

#[test]
fn istios_default_selectors_enroll_by_namespace_or_pod_label() {
    // The namespace's label enrolls its pods (the second selector).
    assert_eq!(
        run(Pod {
            ns_labels: AMBIENT,
            ..POD
        }),
        OptIn::Enroll { selector: 1 }
    );
    // The pod's own label enrolls it wherever it is (the first), even in
    // a namespace labelled none.
    assert_eq!(
        run(Pod {
            labels: AMBIENT,
            ..POD
        }),
        OptIn::Enroll { selector: 0 }
    );
    assert_eq!(
        run(Pod {
            labels: AMBIENT,
            ns_labels: NONE,
            ..POD
        }),
        OptIn::Enroll { selector: 0 }
    );
}

#[test]
fn a_pod_labelled_none_stays_out_of_an_ambient_namespace() {
    assert_eq!(
        run(Pod {
            labels: NONE,
            ns_labels: AMBIENT,
            ..POD
        }),
        OptIn::Skip(SkipReason::OptedOut)
    );
}

#[test]
fn annotations_do_not_opt_in_or_out_only_labels_do() {
    // istio-cni's selectors read labels only.
    assert_eq!(
        run(Pod {
            annotations: AMBIENT,
            ..POD
        }),
        OptIn::Skip(SkipReason::NotSelected)
    );
    assert_eq!(
        run(Pod {
            annotations: NONE,
            ns_labels: AMBIENT,
            ..POD
        }),
        OptIn::Enroll { selector: 1 }
    );
}

#[test]
fn nothing_or_other_values_leave_the_pod_out() {
    assert_eq!(run(POD), OptIn::Skip(SkipReason::NotSelected));
    assert_eq!(
        run(Pod {
            ns_labels: &[(DATAPLANE_MODE, "sidecar")],
            ..POD
        }),
        OptIn::Skip(SkipReason::NotSelected)
    );
}

#[test]
fn sidecar_host_network_and_excluded_namespace_pods_are_never_enrolled() {
    let everything =
        EnrollmentRule::new(&[EnablementSelector::default()], ["kube-system".into()]).unwrap();
    let sidecar = Pod {
        annotations: &[(SIDECAR_STATUS, "{}")],
        labels: AMBIENT,
        ..POD
    };
    assert_eq!(
        run_with(&everything, sidecar),
        OptIn::Skip(SkipReason::Sidecar)
    );
    let host = Pod {
        host_network: true,
        labels: AMBIENT,
        ..POD
    };
    assert_eq!(
        run_with(&everything, host),
        OptIn::Skip(SkipReason::HostNetwork)
    );
    let system = Pod {
        namespace: "kube-system",
        labels: AMBIENT,
        ..POD
    };
    assert_eq!(
        run_with(&everything, system),
        OptIn::Skip(SkipReason::NamespaceExcluded)
    );
    assert_eq!(run_with(&everything, POD), OptIn::Enroll { selector: 0 });
}

#[test]
fn selectors_read_as_the_istio_cni_chart_writes_them() {
    // The chart's default, verbatim as it renders into the agent's
    // environment.
    let chart = r#"
- podSelector:
    matchLabels: {istio.io/dataplane-mode: ambient}
- podSelector:
    matchExpressions:
    - { key: istio.io/dataplane-mode, operator: NotIn, values: [none] }
  namespaceSelector:
    matchLabels: {istio.io/dataplane-mode: ambient}
"#;
    assert_eq!(parse_selectors(chart).unwrap(), istio_default_selectors());
    // A team's own: pods labelled mesh=on in namespaces of team a or b.
    let custom = parse_selectors(
        r#"[{"podSelector": {"matchLabels": {"mesh": "on"}},
             "namespaceSelector": {"matchExpressions": [{"key": "team", "operator": "In", "values": ["a", "b"]}]}}]"#,
    )
    .unwrap();
    let rule = EnrollmentRule::new(&custom, []).unwrap();
    let pod = |labels, ns_labels| Pod {
        labels,
        ns_labels,
        ..POD
    };
    assert_eq!(
        run_with(&rule, pod(&[("mesh", "on")], &[("team", "b")])),
        OptIn::Enroll { selector: 0 }
    );
    assert_eq!(
        run_with(&rule, pod(&[("mesh", "on")], &[("team", "c")])),
        OptIn::Skip(SkipReason::NotSelected)
    );
    assert_eq!(
        run_with(&rule, pod(AMBIENT, AMBIENT)),
        OptIn::Skip(SkipReason::NotSelected),
        "custom selectors replace Istio's"
    );
}

#[test]
fn invalid_selectors_are_refused_with_their_place() {
    let err = parse_selectors("podSelector: 3").unwrap_err();
    assert!(
        err.to_string()
            .contains("cannot read the enablement selectors"),
        "{err}"
    );
    let bad = parse_selectors(
        r#"[{}, {"namespaceSelector": {"matchExpressions": [{"key": "k", "operator": "Near"}]}}]"#,
    )
    .unwrap();
    let err = EnrollmentRule::new(&bad, []).unwrap_err();
    let text = err.to_string();
    assert!(
        text.starts_with("enablement selector 1 (namespaceSelector)"),
        "{text}"
    );
    let unknown = parse_selectors(r#"[{"podSelectr": {}}]"#).unwrap_err();
    assert!(unknown.to_string().contains("podSelectr"), "{unknown}");
}
