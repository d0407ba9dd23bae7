#![expect(
    clippy::unwrap_used,
    reason = "a bad fixture should fail the test loudly"
)]

use crate::xds::test_support::{resource, response};

use super::*;
use crate::istio_api::{
    discovery::Resource,
    security::{Clause, Match, Rule},
    workload::NetworkAddress,
};

fn workload(uid: &str, ip: [u8; 4]) -> Address {
    Address {
        r#type: Some(address::Type::Workload(Workload {
            uid: uid.into(),
            name: "web-0".into(),
            namespace: "shop".into(),
            addresses: vec![ip.to_vec()],
            service_account: "web".into(),
            ..Default::default()
        })),
    }
}

fn service(hostname: &str, vip: Vec<u8>) -> Address {
    Address {
        r#type: Some(address::Type::Service(Service {
            name: "web".into(),
            namespace: "shop".into(),
            hostname: hostname.into(),
            addresses: vec![NetworkAddress {
                network: String::new(),
                address: vip,
                length: None,
            }],
            ..Default::default()
        })),
    }
}

#[test]
fn valid_resources_apply_and_are_acked() {
    let mut held = XdsResources::default();
    let push = response(
        ADDRESS_TYPE,
        vec![
            resource(
                "uid-1",
                "v1",
                ADDRESS_TYPE,
                &workload("uid-1", [10, 1, 0, 5]),
            ),
            resource(
                "shop/web.shop.svc.cluster.local",
                "v1",
                ADDRESS_TYPE,
                &service("web.shop.svc.cluster.local", vec![10, 96, 0, 10]),
            ),
        ],
        &[],
    );
    assert_eq!(held.apply(&push), Verdict::Ack);
    assert_eq!(held.addresses.len(), 2);
    let versions = held.versions(ADDRESS_TYPE);
    assert_eq!(versions["uid-1"], "v1");
    assert!(held.versions(AUTHORIZATION_TYPE).is_empty());

    let removal = response(ADDRESS_TYPE, vec![], &["uid-1", "never-held"]);
    assert_eq!(held.apply(&removal), Verdict::Ack);
    assert_eq!(
        held.addresses.keys().map(|k| &**k).collect::<Vec<&str>>(),
        ["shop/web.shop.svc.cluster.local"]
    );
}

#[test]
fn an_invalid_resource_is_nacked_and_keeps_what_was_held() {
    let mut held = XdsResources::default();
    let good = workload("uid-1", [10, 1, 0, 5]);
    held.apply(&response(
        ADDRESS_TYPE,
        vec![resource("uid-1", "v1", ADDRESS_TYPE, &good)],
        &[],
    ));

    let mut bad = workload("uid-1", [10, 1, 0, 6]);
    if let Some(address::Type::Workload(w)) = &mut bad.r#type {
        w.addresses = vec![vec![1, 2, 3]];
    }
    let push = response(
        ADDRESS_TYPE,
        vec![
            resource("uid-1", "v2", ADDRESS_TYPE, &bad),
            resource(
                "uid-2",
                "v1",
                ADDRESS_TYPE,
                &workload("uid-2", [10, 1, 0, 7]),
            ),
        ],
        &[],
    );
    let Verdict::Nack(reason) = held.apply(&push) else {
        panic!("an address of 3 bytes was accepted");
    };
    assert!(
        reason.contains("uid-1") && reason.contains("3 bytes"),
        "{reason}"
    );
    assert_eq!(
        &*held.addresses["uid-1"].version, "v1",
        "the good version stays"
    );
    assert_eq!(
        *held.addresses["uid-1"],
        Versioned::new(&"uid-1".into(), "v1", &good)
    );
    assert_eq!(
        &*held.addresses["uid-2"].version, "v1",
        "the rest of the push applies"
    );
}

#[test]
fn garbage_bodies_and_mismatched_types_are_nacked() {
    let mut held = XdsResources::default();
    let mut garbage = resource(
        "uid-9",
        "v1",
        ADDRESS_TYPE,
        &workload("uid-9", [10, 0, 0, 9]),
    );
    if let Some(any) = &mut garbage.resource {
        any.value = vec![0xff; 7];
    }
    let wrong_type = resource(
        "uid-8",
        "v1",
        AUTHORIZATION_TYPE,
        &workload("uid-8", [10, 0, 0, 8]),
    );
    let empty = Resource {
        name: "uid-7".into(),
        ..Default::default()
    };
    let neither = resource("uid-6", "v1", ADDRESS_TYPE, &Address { r#type: None });
    let unnamed = resource("", "v1", ADDRESS_TYPE, &workload("uid-5", [10, 0, 0, 5]));
    let push = response(
        ADDRESS_TYPE,
        vec![garbage, wrong_type, empty, neither, unnamed],
        &[],
    );
    let Verdict::Nack(reason) = held.apply(&push) else {
        panic!("garbage accepted");
    };
    assert!(reason.starts_with("5 resource(s) rejected"), "{reason}");
    for expected in [
        "not a valid protobuf",
        "istio.security.Authorization",
        "no resource body",
        "neither",
        "<unnamed>",
    ] {
        assert!(
            reason.contains(expected),
            "{expected} missing from {reason}"
        );
    }
    assert!(held.addresses.is_empty());

    let unknown = response(
        "type.googleapis.com/envoy.config.cluster.v3.Cluster",
        vec![],
        &[],
    );
    assert!(matches!(held.apply(&unknown), Verdict::Nack(_)));
}

#[test]
fn authorizations_are_checked_for_cidrs_ports_and_enums() {
    let policy = |length: u32, port: u32, action: i32| Authorization {
        name: "allow-web".into(),
        namespace: "shop".into(),
        action,
        rules: vec![Rule {
            clauses: vec![Clause {
                matches: vec![Match {
                    source_ips: vec![security::Address {
                        address: vec![10, 0, 0, 0],
                        length,
                    }],
                    destination_ports: vec![port],
                    ..Default::default()
                }],
            }],
        }],
        ..Default::default()
    };
    let mut held = XdsResources::default();
    let push = |p: Authorization| {
        response(
            AUTHORIZATION_TYPE,
            vec![resource("shop/allow-web", "v1", AUTHORIZATION_TYPE, &p)],
            &[],
        )
    };
    assert_eq!(held.apply(&push(policy(8, 8080, 0))), Verdict::Ack);
    assert!(
        matches!(held.apply(&push(policy(33, 8080, 0))), Verdict::Nack(r) if r.contains("prefix length 33"))
    );
    assert!(
        matches!(held.apply(&push(policy(8, 70000, 0))), Verdict::Nack(r) if r.contains("70000"))
    );
    assert!(
        matches!(held.apply(&push(policy(8, 80, 7))), Verdict::Nack(r) if r.contains("unknown action 7"))
    );
    assert_eq!(held.authorizations.len(), 1);
}

#[test]
fn nack_messages_are_bounded() {
    let mut held = XdsResources::default();
    let bad: Vec<Resource> = (0..500)
        .map(|i| {
            let mut body = workload(&format!("uid-{i}"), [10, 0, 0, 1]);
            if let Some(address::Type::Workload(w)) = &mut body.r#type {
                w.addresses = vec![vec![1]];
            }
            resource(&format!("uid-{i}"), "v1", ADDRESS_TYPE, &body)
        })
        .collect();
    let Verdict::Nack(reason) = held.apply(&response(ADDRESS_TYPE, bad, &[])) else {
        panic!("accepted");
    };
    assert!(reason.len() <= MAX_NACK_MESSAGE + 32, "{}", reason.len());
    assert!(reason.contains("more"), "{reason}");
    let _ = ip_from_bytes(&[0; 16]).unwrap();
}

/// A VIP range whose prefix is longer than its address is refused (ztunnel:
/// `IpNet::new` fails, and with it the service).
#[test]
fn a_vip_prefix_longer_than_its_address_is_refused() {
    let mut bad = service("bad.example.com", vec![192, 0, 2, 9]);
    if let Some(address::Type::Service(s)) = &mut bad.r#type {
        s.addresses[0].length = Some(33);
    }
    let err = check_address(&bad).unwrap_err();
    assert!(err.contains("prefix longer"), "{err}");
    if let Some(address::Type::Service(s)) = &mut bad.r#type {
        s.addresses[0].length = Some(24);
    }
    assert!(check_address(&bad).is_ok());
}

#[test]
fn an_application_tunnel_with_an_unknown_protocol_or_a_port_over_16_bits_is_refused() {
    let with = |protocol: i32, port: u32| {
        let mut w = workload("wp", [10, 0, 0, 9]);
        if let Some(address::Type::Workload(w)) = &mut w.r#type {
            w.application_tunnel =
                Some(crate::istio_api::workload::ApplicationTunnel { protocol, port });
        }
        check_address(&w)
    };
    let proxy = application_tunnel::Protocol::Proxy as i32;
    assert!(with(proxy, 15088).is_ok());
    assert!(with(application_tunnel::Protocol::None as i32, 0).is_ok());
    let err = with(7, 15088).unwrap_err();
    assert!(
        err.contains("unknown application tunnel protocol 7"),
        "{err}"
    );
    let err = with(proxy, 65536).unwrap_err();
    assert!(err.contains("application tunnel port 65536"), "{err}");
}

/// A workload is held once: the mesh model's entry is the translation
/// made when it arrived, and workloads of two pushes share their
/// namespace's string; the same resource sent again (a new nonce, the
/// same version and body) changes nothing the model sees.
#[test]
fn the_model_shares_what_arrived_translated() {
    use crate::xds::translate::AddressEntry;
    let mut held = XdsResources::default();
    let one = |uid: &str, ip| resource(uid, "v1", ADDRESS_TYPE, &workload(uid, ip));
    assert_eq!(
        held.apply(&response(
            ADDRESS_TYPE,
            vec![one("uid-1", [10, 1, 0, 5])],
            &[]
        )),
        Verdict::Ack
    );
    assert_eq!(
        held.apply(&response(
            ADDRESS_TYPE,
            vec![one("uid-2", [10, 1, 0, 6])],
            &[]
        )),
        Verdict::Ack
    );
    let arrived = |held: &XdsResources, uid: &str| match &held.addresses[uid].model().entry {
        AddressEntry::Workload(Some(w)) => Arc::clone(w),
        other => panic!("{uid} arrived as {other:?}"),
    };
    let mut model = crate::xds::XdsModel::default();
    let entries = model.update(&held).clone();
    for uid in ["uid-1", "uid-2"] {
        assert!(Arc::ptr_eq(&entries.workloads[uid], &arrived(&held, uid)));
        // The uid is the resource's name, held once.
        let (name, _) = held.addresses.get_key_value(uid).unwrap();
        assert!(Arc::ptr_eq(name, &arrived(&held, uid).uid), "{uid}");
    }
    assert!(crate::config::SharedStr::ptr_eq(
        &arrived(&held, "uid-1").namespace,
        &arrived(&held, "uid-2").namespace
    ));
    let before = held.clone();
    held.apply(&response(
        ADDRESS_TYPE,
        vec![one("uid-1", [10, 1, 0, 5])],
        &[],
    ));
    assert_eq!(held, before, "the same resource again is no change");
    held.apply(&response(
        ADDRESS_TYPE,
        vec![one("uid-1", [10, 1, 0, 9])],
        &[],
    ));
    assert_ne!(
        held, before,
        "another body under the same version is a change"
    );
    let entries = model.update(&held).clone();
    assert_eq!(
        *entries.workloads["uid-1"].workload_ips,
        ["10.1.0.9".parse::<IpAddr>().unwrap()]
    );
}
