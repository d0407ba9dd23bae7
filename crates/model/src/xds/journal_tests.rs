#![expect(
    clippy::unwrap_used,
    reason = "a bad fixture should fail the test loudly"
)]

//! The model brought up to date from the journal's names is the model
//! brought up to date by comparing the maps whole, and every case the
//! journal cannot vouch for falls back to that comparison.

use std::sync::Arc;

use crate::xds::test_support::{resource, response};

use super::MAX_NAMES;
use crate::istio_api::{
    ADDRESS_TYPE, AUTHORIZATION_TYPE,
    security::Authorization,
    workload::{Address, NetworkAddress, Service, Workload, address},
};
use crate::xds::{Response, Verdict, XdsEntries, XdsModel, XdsResources};

/// A small deterministic generator: the same sequence every run, so a
/// failure reproduces.
struct Lcg(u64);

impl Lcg {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (self.0 >> 33) % n
    }
}

fn workload(uid: &str, ips: &[u8], network: &str) -> Address {
    Address {
        r#type: Some(address::Type::Workload(Workload {
            uid: uid.into(),
            name: format!("{uid}-pod"),
            namespace: "shop".into(),
            addresses: ips.iter().map(|last| vec![10, 0, 0, *last]).collect(),
            network: network.into(),
            ..Default::default()
        })),
    }
}

fn service(i: u64, vip: u8, hostname: bool) -> Address {
    Address {
        r#type: Some(address::Type::Service(Service {
            name: format!("s{i}"),
            namespace: "shop".into(),
            // No hostname: refused, the name keeps what it held.
            hostname: if hostname {
                format!("s{i}.shop")
            } else {
                String::new()
            },
            addresses: vec![NetworkAddress {
                network: String::new(),
                address: vec![10, 0, 0, vip],
                length: None,
            }],
            ..Default::default()
        })),
    }
}

fn policy(name: &str, action: i32) -> Authorization {
    Authorization {
        name: name.into(),
        namespace: "shop".into(),
        action,
        ..Default::default()
    }
}

/// A random response over small pools of names and addresses, so that
/// entries often claim one another's addresses (conflicts to resolve
/// again), resources are sent again unchanged, removed when not held,
/// and sometimes refused.
fn random_response(rng: &mut Lcg) -> Response {
    if rng.below(5) == 0 {
        let resources = (0..rng.below(3))
            .map(|_| {
                let name = format!("p{}", rng.below(4));
                let action = rng.below(2) as i32;
                let body = policy(&name, action);
                resource(
                    &format!("shop/{name}"),
                    &format!("{action}"),
                    AUTHORIZATION_TYPE,
                    &body,
                )
            })
            .collect();
        let removed: Vec<String> = (0..rng.below(2))
            .map(|_| format!("shop/p{}", rng.below(4)))
            .collect();
        let removed: Vec<&str> = removed.iter().map(String::as_str).collect();
        return response(AUTHORIZATION_TYPE, resources, &removed);
    }
    let mut resources = Vec::new();
    for _ in 0..=rng.below(3) {
        if rng.below(3) == 0 {
            let i = rng.below(4);
            let vip = 1 + rng.below(9) as u8;
            let valid = rng.below(6) != 0;
            let body = service(i, vip, valid);
            resources.push(resource(
                &format!("shop/s{i}.shop"),
                &format!("{vip}"),
                ADDRESS_TYPE,
                &body,
            ));
        } else {
            let uid = format!("w{:02}", rng.below(12));
            let mut ips = vec![1 + rng.below(9) as u8];
            if rng.below(4) == 0 {
                ips.push(1 + rng.below(9) as u8);
            }
            let network = if rng.below(4) == 0 { "east" } else { "" };
            let version = format!("{ips:?}{network}");
            let body = workload(&uid, &ips, network);
            resources.push(resource(&uid, &version, ADDRESS_TYPE, &body));
        }
    }
    let removed: Vec<String> = (0..rng.below(3) / 2)
        .map(|_| {
            if rng.below(2) == 0 {
                format!("w{:02}", rng.below(12))
            } else {
                format!("shop/s{}.shop", rng.below(4))
            }
        })
        .collect();
    let removed: Vec<&str> = removed.iter().map(String::as_str).collect();
    response(ADDRESS_TYPE, resources, &removed)
}

/// `resources`' maps in a copy the journal cannot vouch for (none of its
/// history): the model compares it whole.
fn without_journal(resources: &XdsResources) -> XdsResources {
    let mut copy = XdsResources::default();
    copy.addresses = resources.addresses.clone();
    copy.authorizations = resources.authorizations.clone();
    copy
}

fn assert_same(journaled: &XdsModel, whole: &XdsModel, what: &str) {
    let (a, b): (&XdsEntries, &XdsEntries) = (journaled.entries(), whole.entries());
    assert_eq!(a.workloads, b.workloads, "{what}: workloads");
    assert_eq!(a.services, b.services, "{what}: services");
    assert_eq!(a.policies, b.policies, "{what}: policies");
    assert_eq!(a.dropped, b.dropped, "{what}: what was left out");
    assert_eq!(journaled.pending(), whole.pending(), "{what}: pending");
}

#[test]
fn journal_driven_updates_are_full_diff_updates() {
    let mut rng = Lcg(31);
    let mut client = XdsResources::default();
    let mut journaled = XdsModel::default();
    let mut whole = XdsModel::default();
    let mut last_seen = XdsResources::default();
    let (mut from_journal, mut nacks) = (0, 0);
    for step in 0..3000 {
        if client.apply(&random_response(&mut rng)) != Verdict::Ack {
            nacks += 1;
        }
        // The consumer skips snapshots while busy.
        if rng.below(3) != 0 {
            continue;
        }
        let touched = client.touched_since(&last_seen);
        from_journal += usize::from(touched.is_some());
        journaled.update(&client);
        whole.update(&without_journal(&client));
        last_seen = client.clone();
        assert_same(&journaled, &whole, &format!("step {step}"));
        if rng.below(4) != 0 {
            journaled.taken_in();
            whole.taken_in();
        }
    }
    let fresh = {
        let mut model = XdsModel::default();
        model.update(&client);
        model
    };
    assert_eq!(journaled.entries().workloads, fresh.entries().workloads);
    assert_eq!(journaled.entries().dropped, fresh.entries().dropped);
    // Every update after the first came from the journal; refusals and
    // conflicts happened.
    assert!(
        from_journal > 900,
        "only {from_journal} updates from the journal"
    );
    assert!(nacks > 100, "only {nacks} refusals");
    assert!(
        journaled.entries().dropped.len() + nacks > 0,
        "no conflict left anything out"
    );
}

/// Workloads `w0000..` at the given count, in one response, at `version`.
fn many_workloads(count: usize, version: &str) -> Response {
    let resources = (0..count)
        .map(|i| {
            let uid = format!("w{i:04}");
            let body = Address {
                r#type: Some(address::Type::Workload(Workload {
                    uid: uid.clone(),
                    name: format!("{uid}-{version}"),
                    namespace: "shop".into(),
                    addresses: vec![vec![10, 1, (i / 250) as u8, (i % 250) as u8 + 1]],
                    ..Default::default()
                })),
            };
            resource(&uid, version, ADDRESS_TYPE, &body)
        })
        .collect();
    response(ADDRESS_TYPE, resources, &[])
}

/// Brings `model` up to `resources` and checks it against one that
/// compared the maps whole from nothing.
fn update_and_check(model: &mut XdsModel, resources: &XdsResources, what: &str) {
    model.update(resources);
    model.taken_in();
    let mut whole = XdsModel::default();
    whole.update(&without_journal(resources));
    whole.taken_in();
    assert_same(model, &whole, what);
}

#[test]
fn a_response_naming_more_than_the_journal_keeps_is_compared_whole() {
    let mut client = XdsResources::default();
    let mut model = XdsModel::default();
    client.apply(&many_workloads(10, "v1"));
    update_and_check(&mut model, &client, "first");
    let seen = client.clone();
    // One response naming more than the journal keeps: every name changed.
    client.apply(&many_workloads(MAX_NAMES + 10, "v2"));
    assert_eq!(client.touched_since(&seen), None);
    update_and_check(&mut model, &client, "one large response");
    // Many small ones between two looks, more names than kept in all.
    let seen = client.clone();
    for i in 0..=MAX_NAMES {
        let uid = format!("w{:04}", i % (MAX_NAMES + 10));
        let body = workload(&uid, &[1 + (i % 200) as u8], "");
        client.apply(&response(
            ADDRESS_TYPE,
            vec![resource(&uid, &format!("v3-{i}"), ADDRESS_TYPE, &body)],
            &[],
        ));
    }
    assert_eq!(client.touched_since(&seen), None);
    update_and_check(&mut model, &client, "many small responses");
    // And within reach again afterwards.
    let seen = client.clone();
    client.apply(&response(ADDRESS_TYPE, Vec::new(), &["w0003"]));
    let touched = client.touched_since(&seen).unwrap();
    assert_eq!(touched.addresses, [Arc::from("w0003")]);
    update_and_check(&mut model, &client, "after the overflow");
}

#[test]
fn a_copy_of_another_history_is_compared_whole() {
    let mut model = XdsModel::default();
    let mut one = XdsResources::default();
    one.apply(&many_workloads(20, "v1"));
    update_and_check(&mut model, &one, "first");
    // Another client given the same first state, then a different change.
    let mut other = XdsResources::default();
    other.apply(&many_workloads(20, "v1"));
    other.apply(&response(ADDRESS_TYPE, Vec::new(), &["w0001"]));
    assert_eq!(other.touched_since(&one), None);
    update_and_check(&mut model, &other, "another client");
    // Two copies of one state going separate ways (a branch).
    let mut left = other.clone();
    let mut right = other.clone();
    left.apply(&response(ADDRESS_TYPE, Vec::new(), &["w0002"]));
    right.apply(&response(ADDRESS_TYPE, Vec::new(), &["w0003"]));
    update_and_check(&mut model, &left, "left");
    assert_eq!(right.touched_since(&left), None);
    update_and_check(&mut model, &right, "right after left");
    assert!(model.entries().workloads.contains_key("w0002"));
}

#[test]
fn maps_changed_outside_the_journal_are_compared_whole() {
    let mut model = XdsModel::default();
    let mut client = XdsResources::default();
    client.apply(&many_workloads(20, "v1"));
    update_and_check(&mut model, &client, "first");
    // The copy given to the model changed directly.
    let mut direct = client.clone();
    let mut source = XdsResources::default();
    source.apply(&many_workloads(21, "v1"));
    let (name, held) = source.addresses.get_key_value("w0020").unwrap();
    direct.addresses.insert(name.clone(), held.clone());
    assert_eq!(direct.touched_since(&client), None);
    update_and_check(&mut model, &direct, "changed directly");
    assert!(model.entries().workloads.contains_key("w0020"));
    // The client goes on without that change: the model held the changed
    // copy, whose state the journal cannot vouch for.
    let seen = client.clone();
    client.apply(&response(ADDRESS_TYPE, Vec::new(), &["w0005"]));
    assert!(client.touched_since(&seen).is_some());
    assert_eq!(client.touched_since(&direct), None);
    update_and_check(&mut model, &client, "the client after the direct change");
    assert!(!model.entries().workloads.contains_key("w0020"));
    // The client itself changed directly, then given a response: the
    // journal does not link it to the copy the model holds.
    let seen = client.clone();
    client.addresses.insert(name.clone(), held.clone());
    client.apply(&response(ADDRESS_TYPE, Vec::new(), &["w0008"]));
    assert_eq!(client.touched_since(&seen), None);
    update_and_check(&mut model, &client, "a response after changing the client");
    assert!(model.entries().workloads.contains_key("w0020"));
    // A copy changed directly and then given a response: the journal
    // starts over there, and vouches for it from then on.
    let mut policies = XdsResources::default();
    policies.apply(&response(
        AUTHORIZATION_TYPE,
        vec![resource("shop/p", "1", AUTHORIZATION_TYPE, &policy("p", 0))],
        &[],
    ));
    let (name, held) = policies.authorizations.get_key_value("shop/p").unwrap();
    direct.authorizations.insert(name.clone(), held.clone());
    update_and_check(&mut model, &direct, "changed directly again");
    // Its next response starts a history the journal cannot link to the
    // copy the model holds; the one after that it vouches for.
    let seen = direct.clone();
    direct.apply(&response(ADDRESS_TYPE, Vec::new(), &["w0006"]));
    assert_eq!(direct.touched_since(&seen), None);
    update_and_check(&mut model, &direct, "a response after the direct change");
    let seen = direct.clone();
    direct.apply(&response(ADDRESS_TYPE, Vec::new(), &["w0007"]));
    assert!(direct.touched_since(&seen).is_some());
    update_and_check(&mut model, &direct, "the next response");
    assert!(model.entries().policies.contains_key("shop/p"));
    assert!(!model.entries().workloads.contains_key("w0006"));
    assert!(!model.entries().workloads.contains_key("w0007"));
}
