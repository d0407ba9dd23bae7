//! What one single-workload xDS update costs the agent, stage by stage, at
//! the sizes of issue 31's synthetic meshes (N workloads with one IP, one
//! service per ten workloads, one namespace policy per hundred), held as
//! istiod sent them:
//!
//! - `apply/<N>`: the client applies the one-resource delta to what it
//!   holds while the published snapshot still shares it (as it does
//!   between two pushes);
//! - `translate/<N>`: istiod's resources into the mesh model, from
//!   nothing (the first push);
//! - `update/<N>`: the model brought up to a push that changed one
//!   workload (what every later push does);
//! - `build/<N>`: the file merged in (empty here) and the mesh state built
//!   whole (the first state);
//! - `whole/<N>`: apply, model update, merge and the next state made from
//!   the one in force, in a row: what a push costs before the install
//!   re-checks connections (the previous state dropped included).
//!
//! Alone: `cargo bench -p dataplane-user --bench xds_update`.

use std::{collections::HashMap, hint::black_box, sync::Arc, time::Duration};

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use dataplane_user::{
    config::LocalConfig,
    istio_api::{
        ADDRESS_TYPE, AUTHORIZATION_TYPE,
        discovery::{DeltaDiscoveryResponse, Resource},
        security::{self, Authorization, Clause, Rule, StringMatch, string_match},
        workload::{self, Address, NetworkAddress, Port, PortList, TunnelProtocol, address},
    },
    sources::{FileIndex, merge_changes, merged_state},
    xds::{XdsModel, XdsResources, translate},
};
use prost::Message;

/// The i-th workload's IPv4 address bytes (10.x.y.z).
fn workload_ip(i: usize) -> Vec<u8> {
    let [_, a, b, c] = u32::try_from(i).unwrap_or(u32::MAX).to_be_bytes();
    vec![10, a, b, c]
}

fn resource(name: String, version: &str, type_url: &str, body: &impl Message) -> Resource {
    Resource {
        name,
        version: version.to_owned(),
        resource: Some(prost_types::Any {
            type_url: type_url.to_owned(),
            value: body.encode_to_vec(),
        }),
        ..Resource::default()
    }
}

fn response(type_url: &str, resources: Vec<Resource>) -> DeltaDiscoveryResponse {
    DeltaDiscoveryResponse {
        type_url: type_url.to_owned(),
        resources,
        nonce: "n".to_owned(),
        ..DeltaDiscoveryResponse::default()
    }
}

/// Workload `i` at `version`, an endpoint of service `i % services`.
fn workload(i: usize, services: usize, namespaces: usize, version: &str) -> Resource {
    let s = i % services;
    let ns = format!("ns{}", s % namespaces);
    let body = Address {
        r#type: Some(address::Type::Workload(workload::Workload {
            uid: format!("Kubernetes//Pod/{ns}/w{i}"),
            name: format!("w{i}"),
            namespace: ns.clone(),
            addresses: vec![workload_ip(i)],
            tunnel_protocol: TunnelProtocol::Hbone.into(),
            trust_domain: "cluster.local".to_owned(),
            service_account: format!("sa{}", i % 500),
            node: format!("node{}", i % 100),
            canonical_name: format!("app{s}"),
            canonical_revision: version.to_owned(),
            workload_name: format!("app{s}"),
            cluster_id: "Kubernetes".to_owned(),
            services: HashMap::from([(
                format!("{ns}/svc{s}.{ns}.svc.cluster.local"),
                PortList {
                    ports: vec![Port {
                        service_port: 80,
                        target_port: 8080,
                    }],
                },
            )]),
            ..workload::Workload::default()
        })),
    };
    resource(
        format!("Kubernetes//Pod/{ns}/w{i}"),
        version,
        ADDRESS_TYPE,
        &body,
    )
}

/// What istiod holds for a mesh of `n` workloads, as the client holds it
/// after the first push.
fn held(n: usize) -> XdsResources {
    let services = (n / 10).max(1);
    let namespaces = (n / 100).max(1);
    let mut addresses: Vec<Resource> = (0..n)
        .map(|i| workload(i, services, namespaces, "v1"))
        .collect();
    addresses.extend((0..services).map(|s| {
        let ns = format!("ns{}", s % namespaces);
        let hostname = format!("svc{s}.{ns}.svc.cluster.local");
        let body = Address {
            r#type: Some(address::Type::Service(workload::Service {
                name: format!("svc{s}"),
                namespace: ns.clone(),
                hostname: hostname.clone(),
                addresses: vec![NetworkAddress {
                    network: String::new(),
                    address: vec![172, 16, (s >> 8) as u8, s as u8],
                }],
                ports: vec![Port {
                    service_port: 80,
                    target_port: 8080,
                }],
                ..workload::Service::default()
            })),
        };
        resource(format!("{ns}/{hostname}"), "v1", ADDRESS_TYPE, &body)
    }));
    let policies = (0..(n / 100).max(1))
        .map(|p| {
            let ns = format!("ns{}", p % namespaces);
            let body = Authorization {
                name: format!("p{p}"),
                namespace: ns.clone(),
                scope: security::Scope::Namespace.into(),
                action: security::Action::Allow.into(),
                rules: vec![Rule {
                    clauses: vec![Clause {
                        matches: vec![security::Match {
                            namespaces: vec![StringMatch {
                                match_type: Some(string_match::MatchType::Exact(format!(
                                    "ns{}",
                                    (p + 1) % namespaces
                                ))),
                            }],
                            ..security::Match::default()
                        }],
                    }],
                }],
                dry_run: false,
            };
            resource(format!("{ns}/p{p}"), "v1", AUTHORIZATION_TYPE, &body)
        })
        .collect();
    let mut resources = XdsResources::default();
    resources.apply(&response(ADDRESS_TYPE, addresses));
    resources.apply(&response(AUTHORIZATION_TYPE, policies));
    resources
}

fn stages(c: &mut Criterion) {
    let mut group = c.benchmark_group("xds_update");
    group.sample_size(10);
    let file = LocalConfig::default();
    for n in [1_000, 10_000] {
        let resources = Arc::new(held(n));
        let services = (n / 10).max(1);
        let namespaces = (n / 100).max(1);
        // One workload relabelled, back and forth between two revisions of
        // workload n/2, so each push changes it.
        let updates = [
            response(
                ADDRESS_TYPE,
                vec![workload(n / 2, services, namespaces, "v2")],
            ),
            response(
                ADDRESS_TYPE,
                vec![workload(n / 2, services, namespaces, "v3")],
            ),
        ];
        let update = &updates[0];
        group.bench_with_input(BenchmarkId::new("apply", n), &resources, |b, held| {
            b.iter(|| {
                // The snapshot shares `held`: make_mut copies it first.
                let mut mine = Arc::clone(held);
                black_box(Arc::make_mut(&mut mine).apply(update))
            });
        });
        group.bench_with_input(BenchmarkId::new("translate", n), &resources, |b, held| {
            b.iter(|| black_box(translate(held, "xds://bench").config.workloads.len()));
        });
        group.bench_with_input(BenchmarkId::new("update", n), &resources, |b, held| {
            let mut model = XdsModel::default();
            model.update(held);
            let mut push = 0usize;
            b.iter(|| {
                push += 1;
                let mut mine = Arc::clone(held);
                Arc::make_mut(&mut mine).apply(&updates[push % 2]);
                black_box(model.update(&mine).workloads.len())
            });
        });
        let entries = XdsModel::default().update(&resources).clone();
        group.bench_with_input(BenchmarkId::new("build", n), &entries, |b, entries| {
            b.iter(|| {
                black_box(
                    merged_state(&file, Some(("xds://bench", entries))).map(|s| s.workloads.len()),
                )
            });
        });
        group.bench_with_input(BenchmarkId::new("whole", n), &resources, |b, held| {
            // The state in force shares the model's entries, as in the
            // agent.
            let index = FileIndex::of(&file);
            let mut model = XdsModel::default();
            let mut entries = model.update(held).clone();
            let Ok(mut state) = merged_state(&file, Some(("xds://bench", &entries))) else {
                return;
            };
            let mut push = 0usize;
            b.iter(|| {
                push += 1;
                let mut mine = Arc::clone(held);
                Arc::make_mut(&mut mine).apply(&updates[push % 2]);
                let new = model.update(&mine).clone();
                let mut provenance = state.provenance.clone();
                let changes = merge_changes(&index, &entries, &new, &mut provenance);
                if let Ok(mut next) = state.apply(&changes) {
                    next.provenance = provenance;
                    state = next;
                }
                entries = new;
                black_box(state.workloads.len())
            });
        });
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    targets = stages
}
criterion_main!(benches);
