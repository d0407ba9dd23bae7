#![expect(
    clippy::unwrap_used,
    reason = "a bad fixture should fail the test loudly"
)]

use prost::Message as _;
use prost_types::Any;

use super::*;
use crate::istio_api::discovery::Resource;

fn resource(name: &str, version: &str, body: &[u8]) -> Resource {
    Resource {
        name: name.into(),
        version: version.into(),
        aliases: vec!["alias".into()],
        resource: Some(Any {
            type_url: "type.googleapis.com/istio.workload.Address".into(),
            value: body.to_vec(),
        }),
    }
}

fn message() -> DeltaDiscoveryResponse {
    DeltaDiscoveryResponse {
        system_version_info: "v7".into(),
        resources: vec![
            resource("Kubernetes//Pod/shop/web-0", "1", &[0x0a, 0x02, 0x41, 0x42]),
            resource("shop/web.shop.svc.cluster.local", "2", &[]),
            Resource {
                name: "bare".into(),
                ..Resource::default()
            },
        ],
        type_url: "type.googleapis.com/istio.workload.Address".into(),
        nonce: "n-1".into(),
        removed_resources: vec!["gone".into(), "also-gone".into()],
    }
}

/// What prost and the in-place reader make of `bytes`: both refuse it,
/// or both read the same fields.
fn agree(bytes: &[u8]) -> bool {
    match (
        Response::decode(Bytes::copy_from_slice(bytes)),
        DeltaDiscoveryResponse::decode(bytes),
    ) {
        (Ok(ours), Ok(theirs)) => {
            same(&ours, &theirs);
            true
        }
        (Err(_), Err(_)) => false,
        (ours, theirs) => panic!("disagree on {bytes:02x?}: {ours:?} / {theirs:?}"),
    }
}

fn same(ours: &Response, theirs: &DeltaDiscoveryResponse) {
    assert_eq!(ours.mismatch(theirs), None);
}

#[test]
fn a_response_reads_as_prost_decodes_it() {
    let encoded = message().encode_to_vec();
    let response = Response::decode(Bytes::from(encoded.clone())).unwrap();
    same(&response, &message());
    let first = response.resources().next().unwrap();
    assert_eq!(first.name, "Kubernetes//Pod/shop/web-0");
    assert_eq!(first.body.unwrap().value, [0x0a, 0x02, 0x41, 0x42]);
    assert_eq!(response.resources().nth(2).unwrap().body, None);
    assert_eq!(
        response.removed().collect::<Vec<_>>(),
        ["gone", "also-gone"]
    );
}

#[test]
fn the_bytes_are_kept_not_copied() {
    let encoded = Bytes::from(message().encode_to_vec());
    let range = encoded.as_ptr_range();
    let response = Response::decode(encoded.clone()).unwrap();
    let body = response.resources().next().unwrap().body.unwrap().value;
    assert!(range.contains(&body.as_ptr()), "the body was copied");
}

#[test]
fn every_prefix_is_refused_or_read_as_prost_reads_it() {
    let encoded = message().encode_to_vec();
    let mut read = 0;
    for end in 0..=encoded.len() {
        read += usize::from(agree(&encoded[..end]));
    }
    // Prefixes that end between top-level fields are whole messages.
    assert!(read >= 5, "only {read} prefixes read");
}

/// Unknown fields of every wire type, a group holding a nested group,
/// in the response, a resource and its body's `Any`.
#[test]
fn unknown_fields_are_skipped_as_prost_skips_them() {
    let unknown: &[u8] = &[
        0x78, 0x96, 0x01, // field 15, varint 150
        0x81, 0x01, 1, 2, 3, 4, 5, 6, 7, 8, // field 16, fixed64
        0x8d, 0x01, 1, 2, 3, 4, // field 17, fixed32
        0x92, 0x01, 0x02, 0xaa, 0xbb, // field 18, bytes
        0x9b, 0x01, // field 19, start group
        0xa3, 0x01, 0x08, 0x01, 0xa4, 0x01, // field 20 group with a varint
        0x9c, 0x01, // end of group 19
    ];
    let mut any = Any {
        type_url: "t".into(),
        value: vec![1, 2],
    }
    .encode_to_vec();
    any.extend_from_slice(unknown);
    let mut resource = Resource {
        name: "r".into(),
        ..Resource::default()
    }
    .encode_to_vec();
    resource.push(0x12);
    resource.push(u8::try_from(any.len()).unwrap());
    resource.extend_from_slice(&any);
    resource.extend_from_slice(unknown);
    let mut response = unknown.to_vec();
    response.push(0x12);
    response.push(u8::try_from(resource.len()).unwrap());
    response.extend_from_slice(&resource);
    response.extend_from_slice(&[0x22, 1, b'x']);
    assert!(agree(&response));
    let read = Response::decode(Bytes::from(response)).unwrap();
    assert_eq!(read.resources().next().unwrap().body.unwrap().value, [1, 2]);
}

#[test]
fn malformed_fields_are_refused_as_prost_refuses_them() {
    let cases: [&[u8]; 9] = [
        &[0x0a, 0x01, 0xff],             // system_version_info not UTF-8
        &[0x12, 0x03, 0x1a, 0x01, 0xc3], // a resource's name not UTF-8
        &[0x20, 0x01],                   // type_url as a varint
        &[0x12, 0x02, 0x10, 0x01],       // a resource's body as a varint
        &[0x0c],                         // a group's end with none open
        &[0x9b, 0x01, 0x08, 0x01],       // a group never ended
        &[0x9b, 0x01, 0xa4, 0x01],       // a group ended by another's tag
        &[
            0x78, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02,
        ], // varint over 64 bits
        &[0x07],                         // wire type 7
    ];
    for case in cases {
        assert!(!agree(case), "{case:02x?} was read");
    }
    // Field number 0, and a key over 32 bits.
    assert!(!agree(&[0x02, 0x00]));
    assert!(!agree(&[0x80, 0x80, 0x80, 0x80, 0x10, 0x00]));
}

/// A body given twice is merged, each of its fields the later one's.
#[test]
fn a_body_given_twice_is_merged_as_prost_merges_it() {
    let first = Any {
        type_url: "first".into(),
        value: vec![1],
    }
    .encode_to_vec();
    let second = Any {
        type_url: String::new(),
        value: vec![2, 2],
    }
    .encode_to_vec();
    let mut resource = vec![0x12, u8::try_from(first.len()).unwrap()];
    resource.extend_from_slice(&first);
    resource.push(0x12);
    resource.push(u8::try_from(second.len()).unwrap());
    resource.extend_from_slice(&second);
    let mut response = vec![0x12, u8::try_from(resource.len()).unwrap()];
    response.extend_from_slice(&resource);
    assert!(agree(&response));
}

/// Random damage to a valid response: every result agrees with prost.
#[test]
fn damaged_responses_are_refused_or_read_as_prost_reads_them() {
    let encoded = message().encode_to_vec();
    let mut state = 0x9e37_79b9_7f4a_7c15_u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let (mut read, mut refused) = (0, 0);
    for _ in 0..20_000 {
        let mut damaged = encoded.clone();
        for _ in 0..=next() % 3 {
            let at = (next() % damaged.len() as u64) as usize;
            damaged[at] = next() as u8;
        }
        if agree(&damaged) {
            read += 1;
        } else {
            refused += 1;
        }
    }
    // Both outcomes were exercised.
    assert!(
        read > 100 && refused > 100,
        "read {read}, refused {refused}"
    );
}

#[test]
fn a_response_of_more_entries_than_its_size_allows_is_refused() {
    // Empty removed names: 2 bytes on the wire, 8 as spans. Under the
    // floor (64 KiB of spans, 8192 entries) they are read; past it the
    // spans would outgrow the message, and it is refused.
    let of = |n: usize| DeltaDiscoveryResponse {
        removed_resources: vec![String::new(); n],
        ..DeltaDiscoveryResponse::default()
    };
    let read = Response::from_message(&of(8192)).unwrap();
    assert_eq!(read.removed_count(), 8192);
    let err = Response::from_message(&of(8193)).unwrap_err();
    assert_eq!(
        err,
        WireError::TooManyEntries {
            len: 8193 * 2,
            max: 8192
        }
    );
    // Resources count too, and a message large enough earns room in
    // proportion: 40,000 empty resources (80 KB) fit 10,000 spans.
    let resources = DeltaDiscoveryResponse {
        resources: vec![Resource::default(); 40_000],
        ..DeltaDiscoveryResponse::default()
    };
    assert!(matches!(
        Response::from_message(&resources),
        Err(WireError::TooManyEntries {
            len: 80_000,
            max: 10_000
        })
    ));
    // Real resources are far past the bound.
    let real = DeltaDiscoveryResponse {
        resources: (0..20_000)
            .map(|i| resource(&format!("Kubernetes//Pod/shop/web-{i}"), "1", &[]))
            .collect(),
        ..DeltaDiscoveryResponse::default()
    };
    assert_eq!(
        Response::from_message(&real).unwrap().resource_count(),
        20_000
    );
}
