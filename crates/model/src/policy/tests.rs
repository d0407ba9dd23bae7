#![expect(
    clippy::unwrap_used,
    reason = "a bad fixture should fail the test loudly"
)]

use super::*;

fn set(policies: &str) -> PolicySet {
    let text = format!("policies:\n{policies}");
    crate::fuzz_seeds::seed("config", &text);
    PolicySet::from_config(&LocalConfig::parse(&text, "t").unwrap())
}

fn id(ns: &str, sa: &str) -> Identity {
    Identity::new("cluster.local", ns, sa).unwrap()
}

fn decide(
    set: &PolicySet,
    peer: Option<&Identity>,
    src: &str,
    dst: &str,
    ns: &str,
    listed: &[String],
) -> Decision {
    let request = Request {
        peer,
        src: std::net::SocketAddr::new(src.parse().unwrap(), 40000),
        dst: dst.parse().unwrap(),
    };
    set.evaluate(
        &request,
        &Target {
            namespace: ns,
            policies: listed,
        },
    )
    .decision
}

const DST: &str = "10.0.0.9:8080";

#[test]
fn no_policy_allows() {
    assert!(decide(&PolicySet::default(), None, "10.0.0.1", DST, "shop", &[]).allowed());
}

#[test]
fn allow_policy_denies_what_it_does_not_match() {
    let s = set(
        "- {name: a, namespace: shop, scope: Namespace, action: Allow, rules: [[[{namespaces: [front]}]]]}\n",
    );
    let front = id("front", "web");
    let other = id("other", "web");
    assert!(decide(&s, Some(&front), "10.0.0.1", DST, "shop", &[]).allowed());
    assert_eq!(
        decide(&s, Some(&other), "10.0.0.1", DST, "shop", &[]),
        Decision::Deny {
            reason: "no ALLOW policy matched".into()
        }
    );
    // Another namespace's policy does not apply.
    assert!(decide(&s, Some(&other), "10.0.0.1", DST, "elsewhere", &[]).allowed());
    // Plaintext (no identity) cannot match a namespace.
    assert!(!decide(&s, None, "10.0.0.1", DST, "shop", &[]).allowed());
}

#[test]
fn deny_wins_over_allow() {
    let s = set(concat!(
        "- {name: allow-all, namespace: shop, scope: Namespace, action: Allow, rules: [[]]}\n",
        "- {name: no-port-22, namespace: shop, scope: Global, action: Deny, rules: [[[{destinationPorts: [22]}]]]}\n",
    ));
    let p = id("front", "web");
    assert!(decide(&s, Some(&p), "10.0.0.1", DST, "shop", &[]).allowed());
    assert_eq!(
        decide(&s, Some(&p), "10.0.0.1", "10.0.0.9:22", "shop", &[]),
        Decision::Deny {
            reason: "denied by policy shop/no-port-22".into()
        }
    );
}

#[test]
fn allow_with_no_rules_matches_nothing() {
    // Istio's "allow-nothing".
    let s = set("- {name: nothing, namespace: shop, scope: Namespace, action: Allow}\n");
    assert!(!decide(&s, Some(&id("shop", "x")), "10.0.0.1", DST, "shop", &[]).allowed());
}

#[test]
fn rules_or_clauses_and_values_or() {
    // (ns front AND port 8080) OR (sa batch)
    let s = set(concat!(
        "- name: p\n  namespace: shop\n  scope: Namespace\n  action: Allow\n  rules:\n",
        "  - [[{namespaces: [front]}], [{destinationPorts: [8080, 9090]}]]\n",
        "  - [[{serviceAccounts: [jobs/batch]}, {principals: ['cluster.local/ns/ops/*']}]]\n",
    ));
    let front = id("front", "web");
    assert!(decide(&s, Some(&front), "10.0.0.1", "10.0.0.9:9090", "shop", &[]).allowed());
    assert!(
        !decide(&s, Some(&front), "10.0.0.1", "10.0.0.9:7000", "shop", &[]).allowed(),
        "clauses are ANDed"
    );
    assert!(
        decide(
            &s,
            Some(&id("jobs", "batch")),
            "10.0.0.1",
            "10.0.0.9:7000",
            "shop",
            &[]
        )
        .allowed()
    );
    assert!(
        !decide(
            &s,
            Some(&id("other", "batch")),
            "10.0.0.1",
            "10.0.0.9:7000",
            "shop",
            &[]
        )
        .allowed()
    );
    assert!(
        decide(
            &s,
            Some(&id("ops", "anyone")),
            "10.0.0.1",
            "10.0.0.9:7000",
            "shop",
            &[]
        )
        .allowed(),
        "principal prefix wildcard"
    );
}

#[test]
fn not_fields_exclude() {
    let s = set(concat!(
        "- name: deny-outsiders\n  namespace: shop\n  scope: Namespace\n  action: Deny\n",
        "  rules: [[[{notSourceIps: [10.1.0.0/16], notPrincipals: ['*/sa/admin']}]]]\n",
    ));
    let user = id("front", "web");
    let admin = id("front", "admin");
    assert!(
        decide(&s, Some(&user), "10.1.2.3", DST, "shop", &[]).allowed(),
        "inside the range"
    );
    assert!(
        !decide(&s, Some(&user), "192.168.1.1", DST, "shop", &[]).allowed(),
        "outside the range"
    );
    assert!(
        decide(&s, Some(&admin), "192.168.1.1", DST, "shop", &[]).allowed(),
        "admin exempt"
    );
    assert!(
        !decide(&s, Some(&user), "::ffff:192.168.1.1", DST, "shop", &[]).allowed(),
        "mapped IPv4 is IPv4"
    );
}

#[test]
fn workload_selector_policies_apply_only_where_listed() {
    let s = set(
        "- {name: lock, namespace: shop, scope: WorkloadSelector, action: Deny, rules: [[]]}\n",
    );
    let p = id("front", "web");
    assert!(decide(&s, Some(&p), "10.0.0.1", DST, "shop", &[]).allowed());
    assert!(!decide(&s, Some(&p), "10.0.0.1", DST, "shop", &["shop/lock".into()]).allowed());
}

#[test]
fn dry_run_only_reports() {
    let s = set(
        "- {name: trial, namespace: shop, scope: Global, action: Deny, rules: [[]], dryRun: true}\n",
    );
    let request = Request {
        peer: None,
        src: "10.0.0.1:40000".parse().unwrap(),
        dst: DST.parse().unwrap(),
    };
    let eval = s.evaluate(
        &request,
        &Target {
            namespace: "shop",
            policies: &[],
        },
    );
    assert!(eval.decision.allowed());
    assert_eq!(eval.dry_run, vec![("shop/trial".to_owned(), true)]);
}

#[test]
fn bad_cidr_and_port_are_rejected_with_position() {
    for (bad, what) in [
        ("[[[{sourceIps: [10.0.0.0/33]}]]]", "sourceIps"),
        ("[[[{destinationPorts: [70000]}]]]", "destinationPorts"),
    ] {
        let text = format!(
            "policies:\n- name: p\n  namespace: n\n  scope: Global\n  action: Deny\n  rules: {bad}\n"
        );
        let err = LocalConfig::parse(&text, "cfg.yaml").unwrap_err();
        let msg = dataplane_core::error::Chain(&err).to_string();
        assert!(msg.contains("cfg.yaml"), "{msg}");
        assert!(msg.contains("line 6"), "{what}: {msg}");
    }
}
