//! Policy evaluation cost at mesh scale: 10,000 policies spread over 1,000
//! namespaces plus a few global ones. A decision only looks at the policies
//! that apply to its destination (global + its namespace + the ones it
//! lists), so its cost must not grow with the mesh's total.

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use dataplane_user::{
    config::LocalConfig,
    identity::Identity,
    policy::{PolicySet, Request, Target},
};

fn config(policies: usize, namespaces: usize) -> String {
    let mut text = String::from("policies:\n");
    for i in 0..policies {
        let ns = i % namespaces;
        text.push_str(&format!(
            "- {{name: p{i}, namespace: ns{ns}, scope: Namespace, action: {action}, rules: [[[{{namespaces: [front{i}], destinationPorts: [{port}]}}], [{{sourceIps: [10.{a}.0.0/16]}}]]]}}\n",
            action = if i % 3 == 0 { "Deny" } else { "Allow" },
            port = 8000 + (i % 100),
            a = i % 250,
        ));
    }
    for g in 0..5 {
        text.push_str(&format!(
            "- {{name: global{g}, namespace: mesh, scope: Global, action: Deny, rules: [[[{{notPrincipals: ['cluster.local/*'], destinationPorts: [{}]}}]]]}}\n",
            9000 + g
        ));
    }
    text
}

fn bench(c: &mut Criterion) {
    let set = PolicySet::from_config(
        &LocalConfig::parse(&config(10_000, 1_000), "bench").expect("bench config parses"),
    );
    assert_eq!(set.len(), 10_005);
    let peer = Identity::new("cluster.local", "front7", "web").expect("valid identity");
    let request = Request {
        peer: Some(&peer),
        src: "10.7.3.4:40000".parse().expect("addr"),
        dst: "10.200.0.9:8007".parse().expect("addr"),
    };
    let target = Target {
        namespace: "ns7",
        policies: &[],
    };
    c.bench_function("policy_evaluate_10k_policies", |b| {
        b.iter(|| black_box(set.evaluate(black_box(&request), black_box(&target))))
    });
    let none = Target {
        namespace: "unpoliced",
        policies: &[],
    };
    c.bench_function("policy_evaluate_namespace_without_policies", |b| {
        b.iter(|| black_box(set.evaluate(black_box(&request), black_box(&none))))
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
