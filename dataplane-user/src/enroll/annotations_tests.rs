#![expect(clippy::unwrap_used, reason = "tests fail loudly on unexpected errors")]

use super::*;

fn parse(pairs: &[(&str, &str)]) -> AnnotatedExclusions {
    let annotations = pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    parse_exclusions(&annotations)
}

fn nets(list: &[&str]) -> Vec<IpNet> {
    list.iter().map(|n| n.parse().unwrap()).collect()
}

/// The ignored annotations' names.
fn ignored(parsed: &AnnotatedExclusions) -> Vec<&'static str> {
    parsed.ignored.iter().map(|i| i.annotation).collect()
}

#[test]
fn no_annotation_no_exclusion() {
    assert_eq!(parse(&[]), AnnotatedExclusions::default());
}

#[test]
fn port_lists_read_as_istios_parse_ports() {
    // Accepted by Istio's `parsePorts`: the value and each entry trimmed,
    // decimal without sign, leading zeros allowed, 0..=65535, duplicates.
    for (value, want) in [
        ("80", vec![80]),
        ("80,443", vec![80, 443]),
        (" 80 , 443 ", vec![80, 443]),
        ("0080,65535,0", vec![80, 65535, 0]),
        ("80,80", vec![80]),
        ("", vec![]),
        ("   ", vec![]),
    ] {
        let parsed = parse(&[
            (EXCLUDE_INBOUND_PORTS, value),
            (EXCLUDE_OUTBOUND_PORTS, value),
        ]);
        assert!(parsed.ignored.is_empty(), "{value:?}: {:?}", parsed.ignored);
        assert_eq!(parsed.exclusions.inbound_ports, want, "{value:?}");
        assert_eq!(parsed.exclusions.outbound_ports, want, "{value:?}");
    }
    // Refused by it (`strconv.ParseUint(s, 10, 16)` on each entry).
    for value in [
        "65536", "-1", "+80", "80,", ",80", "80,,443", "http", "80 443", "0x50", "1_000", "8.0",
    ] {
        let parsed = parse(&[(EXCLUDE_OUTBOUND_PORTS, value)]);
        assert_eq!(ignored(&parsed), [EXCLUDE_OUTBOUND_PORTS], "{value:?}");
        assert!(
            matches!(parsed.ignored[0].error, AnnotationError::Port { .. }),
            "{value:?}: {}",
            parsed.ignored[0]
        );
        assert!(parsed.exclusions.outbound_ports.is_empty(), "{value:?}");
    }
}

#[test]
fn cidr_lists_read_as_gos_parse_prefix() {
    for (value, want) in [
        ("10.0.0.0/8", vec!["10.0.0.0/8"]),
        (
            "10.0.0.0/8,192.168.1.1/32,fd00::/8",
            vec!["10.0.0.0/8", "192.168.1.1/32", "fd00::/8"],
        ),
        // Host bits are accepted (Go keeps them; the kernel clears them).
        ("10.1.2.3/8", vec!["10.0.0.0/8"]),
        ("0.0.0.0/0,::/0", vec!["0.0.0.0/0", "::/0"]),
        ("::ffff:10.0.0.0/104", vec!["::ffff:10.0.0.0/104"]),
        ("10.0.0.0/8,10.0.0.0/8", vec!["10.0.0.0/8"]),
        ("", vec![]),
    ] {
        let parsed = parse(&[(EXCLUDE_OUTBOUND_IP_RANGES, value)]);
        assert!(parsed.ignored.is_empty(), "{value:?}: {:?}", parsed.ignored);
        assert_eq!(parsed.exclusions.outbound_cidrs, nets(&want), "{value:?}");
    }
    // Go's `netip.ParsePrefix` refuses these (Istio's `validateCIDRList`
    // does not trim entries).
    for value in [
        "10.0.0.1",
        "10.0.0.0/8, 192.168.0.0/16",
        " 10.0.0.0/8",
        " ",
        "10.0.0.0/33",
        "fd00::/129",
        "10.0.0.0/08",
        "10.0.0.0/+8",
        "10.0.0.0/",
        "010.0.0.0/8",
        "fe80::1%eth0/64",
        "10.0.0.0/8,",
        "example.com/32",
    ] {
        let parsed = parse(&[(EXCLUDE_OUTBOUND_IP_RANGES, value)]);
        assert_eq!(ignored(&parsed), [EXCLUDE_OUTBOUND_IP_RANGES], "{value:?}");
        assert!(
            matches!(parsed.ignored[0].error, AnnotationError::Cidr { .. }),
            "{value:?}: {}",
            parsed.ignored[0]
        );
        assert!(parsed.exclusions.outbound_cidrs.is_empty(), "{value:?}");
    }
}

#[test]
fn an_invalid_annotation_is_ignored_as_a_whole_and_the_others_apply() {
    let parsed = parse(&[
        (EXCLUDE_OUTBOUND_PORTS, "80,99999,443"),
        (EXCLUDE_INBOUND_PORTS, "8080"),
        (EXCLUDE_OUTBOUND_IP_RANGES, "10.0.0.0/8,bad"),
    ]);
    assert_eq!(
        ignored(&parsed),
        [EXCLUDE_OUTBOUND_PORTS, EXCLUDE_OUTBOUND_IP_RANGES]
    );
    assert!(parsed.exclusions.outbound_ports.is_empty());
    assert!(parsed.exclusions.outbound_cidrs.is_empty());
    assert_eq!(parsed.exclusions.inbound_ports, [8080]);
    let text = parsed.ignored[0].to_string();
    assert!(
        text.contains(EXCLUDE_OUTBOUND_PORTS) && text.contains("99999"),
        "the report names the annotation and the entry: {text}"
    );
}

#[test]
fn the_wildcard_only_where_istio_accepts_it() {
    // Istio's injector refuses `*` on the exclude lists, istio-iptables on
    // excludeOutboundIPRanges.
    for name in [
        EXCLUDE_INBOUND_PORTS,
        EXCLUDE_OUTBOUND_PORTS,
        EXCLUDE_OUTBOUND_IP_RANGES,
    ] {
        let parsed = parse(&[(name, "*")]);
        assert_eq!(ignored(&parsed), [name]);
        assert_eq!(parsed.ignored[0].error, AnnotationError::Wildcard);
        assert_eq!(parsed.exclusions, Exclusions::default());
    }
    // On the include lists `*` is the default: everything captured.
    let parsed = parse(&[
        (INCLUDE_INBOUND_PORTS, "*"),
        (INCLUDE_OUTBOUND_IP_RANGES, "*"),
        (INCLUDE_OUTBOUND_PORTS, "*"),
    ]);
    assert_eq!(parsed, AnnotatedExclusions::default());
    // Only the exact value (Istio compares before trimming).
    let parsed = parse(&[(INCLUDE_INBOUND_PORTS, " *")]);
    assert_eq!(ignored(&parsed), [INCLUDE_INBOUND_PORTS]);
}

#[test]
fn empty_include_lists_capture_nothing_of_their_direction() {
    let parsed = parse(&[(INCLUDE_INBOUND_PORTS, "")]);
    assert!(parsed.ignored.is_empty());
    assert!(parsed.exclusions.bypass_inbound);
    let parsed = parse(&[
        (INCLUDE_OUTBOUND_IP_RANGES, ""),
        (EXCLUDE_OUTBOUND_IP_RANGES, "10.0.0.0/8"),
    ]);
    assert!(parsed.ignored.is_empty());
    assert_eq!(
        parsed.exclusions.outbound_cidrs,
        nets(&["10.0.0.0/8", "0.0.0.0/0", "::/0"])
    );
}

#[test]
fn include_lists_the_kernel_cannot_express_are_refused() {
    let parsed = parse(&[
        (INCLUDE_INBOUND_PORTS, "8080"),
        (INCLUDE_OUTBOUND_IP_RANGES, "10.0.0.0/8"),
    ]);
    assert_eq!(
        ignored(&parsed),
        [INCLUDE_INBOUND_PORTS, INCLUDE_OUTBOUND_IP_RANGES]
    );
    assert!(
        parsed
            .ignored
            .iter()
            .all(|i| matches!(i.error, AnnotationError::Unsupported { .. }))
    );
    assert_eq!(parsed.exclusions, Exclusions::default());
    // includeOutboundPorts is moot without excluded ranges, unsupported
    // with them; its syntax is checked either way.
    assert!(
        parse(&[(INCLUDE_OUTBOUND_PORTS, "3306")])
            .ignored
            .is_empty()
    );
    let parsed = parse(&[
        (INCLUDE_OUTBOUND_PORTS, "3306"),
        (EXCLUDE_OUTBOUND_IP_RANGES, "10.0.0.0/8"),
    ]);
    assert_eq!(ignored(&parsed), [INCLUDE_OUTBOUND_PORTS]);
    assert_eq!(parsed.exclusions.outbound_cidrs, nets(&["10.0.0.0/8"]));
    let parsed = parse(&[(INCLUDE_OUTBOUND_PORTS, "x")]);
    assert!(matches!(
        parsed.ignored[0].error,
        AnnotationError::Port { .. }
    ));
}

#[test]
fn lists_are_capped() {
    let ports = |n: usize| (1..=n).map(|p| p.to_string()).collect::<Vec<_>>().join(",");
    let parsed = parse(&[(EXCLUDE_OUTBOUND_PORTS, &ports(MAX_ENTRIES))]);
    assert!(parsed.ignored.is_empty());
    assert_eq!(parsed.exclusions.outbound_ports.len(), MAX_ENTRIES);
    let parsed = parse(&[(EXCLUDE_INBOUND_PORTS, &ports(MAX_ENTRIES + 1))]);
    assert_eq!(
        parsed.ignored[0].error,
        AnnotationError::TooMany {
            count: MAX_ENTRIES + 1,
            max: MAX_ENTRIES
        }
    );
    assert!(parsed.exclusions.inbound_ports.is_empty());
    let cidrs = (1..=MAX_ENTRIES + 1)
        .map(|i| format!("10.0.{i}.0/24"))
        .collect::<Vec<_>>()
        .join(",");
    let parsed = parse(&[(EXCLUDE_OUTBOUND_IP_RANGES, &cidrs)]);
    assert!(matches!(
        parsed.ignored[0].error,
        AnnotationError::TooMany { .. }
    ));
}

#[test]
fn bypass_inbound_capture_reads_as_go_parse_bool() {
    let bypass = |v: &str| {
        parse(&[(super::super::BYPASS_INBOUND_CAPTURE_ANNOTATION, v)])
            .exclusions
            .bypass_inbound
    };
    assert!(bypass("true") && bypass("1") && bypass("T"));
    assert!(!bypass("false") && !bypass("yes"));
}

#[test]
fn pod_list_summarizes_the_exclusions_in_force() {
    let parsed = parse(&[
        (EXCLUDE_INBOUND_PORTS, "8080"),
        (EXCLUDE_OUTBOUND_PORTS, "5432"),
        (EXCLUDE_OUTBOUND_IP_RANGES, "10.0.0.0/8"),
        (INCLUDE_INBOUND_PORTS, ""),
    ]);
    assert_eq!(
        super::super::exclusions_summary(&parsed.exclusions),
        "in:*,in:8080,out:5432,out:10.0.0.0/8"
    );
    assert_eq!(
        super::super::exclusions_summary(&Exclusions::default()),
        "-"
    );
}
