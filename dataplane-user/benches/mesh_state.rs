//! What a mesh state costs to build, at the sizes of issue 31's synthetic
//! meshes: N workloads with one IP each, one service per ten workloads
//! (each workload an endpoint of one), one namespace policy per hundred.
//!
//! - `build/<N>`: `MeshState::from_config`, a state built whole (the
//!   first state, and every change of the file; a push from istiod changes
//!   only what it names, see `xds_update`).
//!
//! Alone: `cargo bench -p dataplane-user --bench mesh_state`.

use std::{collections::BTreeMap, hint::black_box, net::Ipv4Addr, time::Duration};

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use dataplane_user::{
    config::{
        Action, LoadBalancing, LocalConfig, Match, Policy, Protocol, Scope, Service, Workload,
    },
    state::MeshState,
};

/// The i-th workload's IPv4 address (10.x.y.z, unique for i < 2^24).
fn workload_ip(i: usize) -> Ipv4Addr {
    let [_, a, b, c] = u32::try_from(i).unwrap_or(u32::MAX).to_be_bytes();
    Ipv4Addr::new(10, a, b, c)
}

/// N workloads in N/100 namespaces, N/10 services, N/100 policies.
fn mesh(n: usize) -> LocalConfig {
    let namespaces = (n / 100).max(1);
    let services: Vec<Service> = (0..(n / 10).max(1))
        .map(|s| Service {
            name: format!("svc{s}"),
            namespace: format!("ns{}", s % namespaces),
            hostname: format!("svc{s}.ns{}.svc.cluster.local", s % namespaces),
            vips: vec![std::net::IpAddr::from([172, 16, (s >> 8) as u8, s as u8]).into()],
            ports: BTreeMap::from([(80, 8080)]),
            subject_alt_names: Vec::new(),
            load_balancing: LoadBalancing::default(),
            health_policy: Default::default(),
            routing: Default::default(),
            waypoint: None,
            canonical: false,
            visibility: Default::default(),
            cidr_vips: Vec::new(),
            weighted_waypoints: Vec::new(),
            ip_families: None,
        })
        .collect();
    let workloads = (0..n)
        .map(|i| {
            let service = &services[i % services.len()];
            Workload {
                uid: format!("w{i}").into(),
                name: format!("w{i}"),
                namespace: service.namespace.as_str().into(),
                service_account: format!("sa{}", i % 500).into(),
                trust_domain: "cluster.local".into(),
                workload_ips: [workload_ip(i).into()].into(),
                protocol: Protocol::Hbone,
                node: format!("node{}", i % 100).into(),
                services: [(service.key(), service.ports.clone())]
                    .into_iter()
                    .collect(),
                ..Workload::default()
            }
        })
        .map(std::sync::Arc::new)
        .collect();
    let policies = (0..(n / 100).max(1))
        .map(|p| Policy {
            name: format!("p{p}"),
            namespace: format!("ns{}", p % namespaces),
            scope: Scope::Namespace,
            action: Action::Allow,
            rules: vec![vec![vec![Match {
                namespaces: vec![format!("ns{}", (p + 1) % namespaces)],
                ..Match::default()
            }]]],
            dry_run: false,
        })
        .collect();
    LocalConfig {
        workloads,
        services,
        policies,
        ..LocalConfig::default()
    }
}

fn build(c: &mut Criterion) {
    let mut group = c.benchmark_group("mesh_state");
    group.sample_size(10);
    for n in [1_000, 10_000] {
        let config = mesh(n);
        group.bench_with_input(BenchmarkId::new("build", n), &config, |b, config| {
            b.iter(|| black_box(MeshState::from_config(config).map(|s| s.workloads.len())));
        });
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    targets = build
}
criterion_main!(benches);
