#![expect(
    clippy::unwrap_used,
    reason = "a bad fixture should fail the test loudly"
)]

use std::net::{IpAddr, SocketAddr};

use http::{HeaderMap, HeaderValue, Method, Uri};

use super::*;
use crate::fuzz_seeds;
use crate::hbone::wire::{Baggage, connect_request, new_traceparent};

/// Parses a head given as the fuzz target's fields (and records them as a
/// seed; `_name` says which case it is where it is called).
fn parse_fields(_name: &str, fields: [&str; 5]) -> Result<RequestHead, HeadError> {
    fuzz_seeds::seed("hbone_head", fuzz_seeds::hbone_head_input(fields));
    let [method, authority, forwarded, baggage, traceparent] = fields;
    let method = Method::from_bytes(method.as_bytes()).unwrap();
    let uri = Uri::builder().authority(authority).build().unwrap();
    let mut headers = HeaderMap::new();
    for (header, value) in [
        ("forwarded", forwarded),
        ("baggage", baggage),
        ("traceparent", traceparent),
    ] {
        if !value.is_empty() {
            headers.insert(header, HeaderValue::from_str(value).unwrap());
        }
    }
    RequestHead::parse(&method, &uri, &headers)
}

fn shop_baggage() -> Baggage {
    Baggage {
        cluster: "c1".into(),
        namespace: "shop".into(),
        workload: ("deployment".into(), "web".into()),
        service: "web".into(),
        version: "v1".into(),
        ..Baggage::default()
    }
}

#[test]
fn reads_what_the_client_side_sends() {
    for source in ["10.1.0.11:40000", "[fd00::11]:40000"] {
        let source: SocketAddr = source.parse().unwrap();
        let traceparent = new_traceparent();
        let request = connect_request(
            "10.1.0.12:8080",
            source,
            Some("web.shop.svc.cluster.local"),
            &shop_baggage().value().unwrap(),
            &traceparent,
        )
        .unwrap();
        let header = |name| request.headers()[name].to_str().unwrap();
        let fields = [
            "CONNECT",
            "10.1.0.12:8080",
            header("forwarded"),
            header("baggage"),
            header("traceparent"),
        ];
        let seed = format!("client-{}", source.ip());
        let head = parse_fields(&seed, fields).unwrap();
        assert_eq!(
            head.authority,
            Authority::Addr("10.1.0.12:8080".parse().unwrap())
        );
        assert_eq!(head.forwarded_for, Some(source.ip()));
        assert_eq!(
            head.forwarded_host.as_deref(),
            Some("web.shop.svc.cluster.local")
        );
        assert_eq!(head.baggage, Some(shop_baggage()));
        let trace = head.trace.unwrap();
        assert_eq!(format!("{:032x}", trace.trace_id), traceparent[3..35]);
    }
}

#[test]
fn reads_hostname_authorities() {
    let head = parse_fields(
        "host",
        ["CONNECT", "Web.Shop.svc.cluster.local.:80", "", "", ""],
    )
    .unwrap();
    let expected = Authority::Host {
        name: "web.shop.svc.cluster.local".into(),
        port: 80,
    };
    assert_eq!(head.authority, expected);
    assert_eq!(
        (head.forwarded_for, head.baggage, head.trace),
        (None, None, None)
    );
    let v6 = parse_fields("v6", ["CONNECT", "[fd00::12]:8080", "", "", ""]).unwrap();
    assert_eq!(
        v6.authority,
        Authority::Addr("[fd00::12]:8080".parse().unwrap())
    );
}

#[test]
fn refuses_bad_methods_and_authorities() {
    let err = parse_fields("get", ["GET", "10.1.0.12:80", "", "", ""]).unwrap_err();
    assert!(matches!(err, HeadError::NotConnect { .. }), "{err}");
    for (name, authority) in [
        ("noport", "web.shop"),
        ("port0", "10.1.0.12:0"),
        ("badport", "web:99999"),
        ("underscore", "we_b.shop:80"),
        ("dash", "-web.shop:80"),
        ("emptylabel", "web..shop:80"),
    ] {
        let err = parse_fields(name, ["CONNECT", authority, "", "", ""]).unwrap_err();
        assert!(
            matches!(err, HeadError::BadAuthority { .. }),
            "{authority}: {err}"
        );
    }
    let long = format!("{}:80", "a.".repeat(130));
    let err = parse_authority(&long).unwrap_err();
    assert!(matches!(err, HeadError::BadAuthority { .. }), "{err}");
}

#[test]
fn reads_forwarded_host_bounded_and_checked() {
    let long = format!("for=a;host={}", "a".repeat(254));
    for (value, expected) in [
        (
            "for=\"10.0.0.1:1\";host=web.shop.svc.cluster.local",
            Some("web.shop.svc.cluster.local"),
        ),
        ("host=\"web\";for=x", Some("web")),
        ("for=x, host=second", None),
        ("host=", None),
        ("host=\"a b\"", None),
        ("host=evil\u{7f}", None),
        (long.as_str(), None),
    ] {
        assert_eq!(parse_forwarded_host(value).as_deref(), expected, "{value}");
    }
}

#[test]
fn reads_forwarded_for_in_every_form() {
    let v4: IpAddr = "192.0.2.60".parse().unwrap();
    let v6: IpAddr = "2001:db8:cafe::17".parse().unwrap();
    for (value, expected) in [
        ("for=192.0.2.60", Some(v4)),
        ("For=\"192.0.2.60:4711\";proto=http", Some(v4)),
        ("for=\"[2001:db8:cafe::17]\"", Some(v6)),
        (
            "proto=https; for=\"[2001:db8:cafe::17]:4711\", for=198.51.100.17",
            Some(v6),
        ),
        ("for=unknown", None),
        ("for=_hidden", None),
        ("for=\"[2001:db8:cafe::17]:x\"", None),
        ("for=\"192.0.2.60", None),
        ("by=192.0.2.60", None),
        ("", None),
    ] {
        assert_eq!(parse_forwarded_for(value), expected, "{value}");
    }
    let head = parse_fields(
        "forwarded",
        [
            "CONNECT",
            "10.1.0.12:80",
            "for=\"[2001:db8:cafe::17]:4711\"",
            "",
            "",
        ],
    )
    .unwrap();
    assert_eq!(head.forwarded_for, Some(v6));
}

#[test]
fn reads_baggage_leniently_and_bounded() {
    let header = shop_baggage().header();
    assert_eq!(parse_baggage(&header), Some(shop_baggage()));
    let spaced = " k8s.namespace.name = sh%6Fp ;prop=1 , other=x,, k8s.pod.name=web-0";
    let baggage = parse_baggage(spaced).unwrap();
    assert_eq!(baggage.namespace, "shop");
    assert_eq!(baggage.workload, ("pod".into(), "web-0".into()));
    assert_eq!(parse_baggage("only=unknown,keys=here"), None);
    assert_eq!(parse_baggage("k8s.namespace.name=bad%zz"), None);
    assert_eq!(parse_baggage("k8s.namespace.name=%ff"), None);
    assert_eq!(parse_baggage("no-equals-sign"), None);
    assert_eq!(parse_baggage("bad key=1"), None);
    let many = "a=1,".repeat(200) + "k8s.namespace.name=shop";
    assert_eq!(parse_baggage(&many), None);
    let huge = format!("k8s.namespace.name={}", "x".repeat(9000));
    assert_eq!(parse_baggage(&huge), None);
    let head = parse_fields("baggage", ["CONNECT", "10.1.0.12:80", "", spaced, ""]).unwrap();
    assert_eq!(head.baggage, Some(baggage));
}

#[test]
fn reads_traceparent_per_w3c() {
    let valid = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let trace = parse_traceparent(valid).unwrap();
    assert_eq!(trace.trace_id, 0x4bf92f3577b34da6a3ce929d0e0e4736);
    assert_eq!(trace.parent_id, 0x00f067aa0ba902b7);
    assert_eq!(trace.flags, 1);
    let future = "cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-what-the-future-holds";
    assert!(parse_traceparent(future).is_some());
    for invalid in [
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
        "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
        "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
        "00-+bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        "",
    ] {
        assert_eq!(parse_traceparent(invalid), None, "{invalid}");
    }
    let head = parse_fields("traceparent", ["CONNECT", "10.1.0.12:80", "", "", valid]).unwrap();
    assert_eq!(head.trace, Some(trace));
}
