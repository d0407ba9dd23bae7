//! The kernel/user contract, checked against the objects actually embedded:
//! every state map of the redirection object is on the pin list (a map left
//! off it would silently not be pinned, and its state lost on restart), and
//! every map's definition is the one `dataplane-common` describes (its key
//! and value types' sizes, its capacity). Adding a map to the kernel crate,
//! or changing a shared type on one side only, fails here.

#![expect(
    clippy::unwrap_used,
    reason = "a broken embedded object should fail the test loudly"
)]

use std::{
    collections::{BTreeMap, BTreeSet},
    mem::size_of,
};

use aya_obj::generated::{BPF_F_NO_PREALLOC, bpf_map_type};
use dataplane_common::{
    AgentConfig, COUNTER_SLOTS, CapturedDst, DnsOrigDst, EnrolledNetns, FastConn, FastKey,
    FastService, FastVerdict, FastVip, IpAddr16, ListenerKey, NetnsAddr, NetnsPort, OrigDst,
    OrigDstKey, PodInbound, PodPort, PodSource, SockTuple, maps as m,
};

use super::{EMBEDDED_OBJECT, MapDefinition, map_definitions, pins::MAP_PINS};

/// A definition from Rust types: sizes as the kernel counts them.
fn def<K, V>(map_type: bpf_map_type, max_entries: u32, map_flags: u32) -> MapDefinition {
    let size = |n: usize| u32::try_from(n).unwrap();
    MapDefinition {
        map_type: map_type as u32,
        key_size: size(size_of::<K>()),
        value_size: size(size_of::<V>()),
        max_entries,
        map_flags,
    }
}

/// An LPM trie's key is the prefix length (`u32`) followed by the data.
#[repr(C)]
struct LpmKey<K> {
    _prefix_len: u32,
    _data: K,
}

/// The redirection object's maps as `dataplane-common` describes them.
fn expected() -> BTreeMap<String, MapDefinition> {
    use bpf_map_type::*;
    let no_prealloc = BPF_F_NO_PREALLOC;
    [
        (
            m::ENROLLED_NETNS,
            def::<u64, EnrolledNetns>(BPF_MAP_TYPE_HASH, m::ENROLLED_CAPACITY, 0),
        ),
        (
            m::ORIG_DST_COOKIE,
            def::<u64, CapturedDst>(BPF_MAP_TYPE_LRU_HASH, m::ORIG_DST_CAPACITY, 0),
        ),
        (
            m::ORIG_DST,
            def::<OrigDstKey, OrigDst>(BPF_MAP_TYPE_LRU_HASH, m::ORIG_DST_CAPACITY, 0),
        ),
        (
            m::AGENT_CONFIG,
            def::<u32, AgentConfig>(BPF_MAP_TYPE_ARRAY, 1, 0),
        ),
        (
            m::REDIRECT_STATS,
            def::<u32, u64>(BPF_MAP_TYPE_PERCPU_ARRAY, COUNTER_SLOTS, 0),
        ),
        (
            m::OUT_EXCL_PORTS,
            def::<NetnsPort, u8>(BPF_MAP_TYPE_HASH, m::EXCLUSION_CAPACITY, 0),
        ),
        (
            m::OUT_EXCL_CIDRS,
            def::<LpmKey<NetnsAddr>, u8>(BPF_MAP_TYPE_LPM_TRIE, m::EXCLUSION_CAPACITY, no_prealloc),
        ),
        (
            m::POD_INBOUND,
            def::<IpAddr16, PodInbound>(BPF_MAP_TYPE_HASH, m::POD_IP_CAPACITY, 0),
        ),
        (
            m::POD_SOURCE,
            def::<u64, PodSource>(BPF_MAP_TYPE_HASH, m::ENROLLED_CAPACITY, 0),
        ),
        (
            m::IN_EXCL_PORTS,
            def::<PodPort, u8>(BPF_MAP_TYPE_HASH, m::EXCLUSION_CAPACITY, 0),
        ),
        (
            m::PROBE_SOURCES,
            def::<IpAddr16, u8>(BPF_MAP_TYPE_HASH, m::PROBE_SOURCES_CAPACITY, 0),
        ),
        // A sock hash's values are socket descriptors (u32) on the way in.
        (
            m::LISTENERS,
            def::<ListenerKey, u32>(BPF_MAP_TYPE_SOCKHASH, m::LISTENERS_CAPACITY, 0),
        ),
        (
            m::DNS_ORIG_COOKIE,
            def::<u64, DnsOrigDst>(BPF_MAP_TYPE_LRU_HASH, m::DNS_ORIG_CAPACITY, 0),
        ),
        (
            m::TPROXY_TUPLES,
            def::<SockTuple, u8>(BPF_MAP_TYPE_LRU_HASH, m::TPROXY_CAPACITY, 0),
        ),
        (m::NODE_NETNS, def::<u32, u64>(BPF_MAP_TYPE_ARRAY, 1, 0)),
        (
            m::NODE_CONNECTS,
            def::<u64, u8>(BPF_MAP_TYPE_LRU_HASH, m::NODE_CONNECT_CAPACITY, 0),
        ),
        (
            m::NODE_TUPLES,
            def::<SockTuple, u8>(BPF_MAP_TYPE_LRU_HASH, m::NODE_CONNECT_CAPACITY, 0),
        ),
        (
            m::FAST_VERDICTS,
            def::<FastKey, FastVerdict>(BPF_MAP_TYPE_LRU_HASH, m::FAST_VERDICT_CAPACITY, 0),
        ),
        (
            m::FAST_GENERATION,
            def::<u32, u64>(BPF_MAP_TYPE_ARRAY, 1, 0),
        ),
        (
            m::FAST_BY_COOKIE,
            def::<u64, FastConn>(BPF_MAP_TYPE_LRU_HASH, m::FAST_CONN_CAPACITY, 0),
        ),
        (
            m::FAST_BY_TUPLE,
            def::<SockTuple, FastConn>(BPF_MAP_TYPE_LRU_HASH, m::FAST_CONN_CAPACITY, 0),
        ),
        (
            m::FAST_SERVICES,
            def::<FastKey, FastService>(BPF_MAP_TYPE_LRU_HASH, m::FAST_SERVICE_CAPACITY, 0),
        ),
        (
            m::FAST_VIP_BY_COOKIE,
            def::<u64, FastVip>(BPF_MAP_TYPE_LRU_HASH, m::FAST_CONN_CAPACITY, 0),
        ),
        // A ring buffer has neither key nor value; its size is its byte
        // count.
        (
            m::FAST_CLOSED,
            def::<(), ()>(BPF_MAP_TYPE_RINGBUF, m::FAST_CLOSED_BYTES, 0),
        ),
    ]
    .into_iter()
    .map(|(name, definition)| (name.to_owned(), definition))
    .collect()
}

#[test]
fn every_map_of_the_object_is_pinned() {
    let object: BTreeSet<String> = map_definitions(EMBEDDED_OBJECT)
        .unwrap()
        .into_keys()
        .collect();
    let pinned: BTreeSet<String> = MAP_PINS
        .iter()
        .map(|(name, _)| (*name).to_owned())
        .collect();
    assert_eq!(
        object, pinned,
        "the object's maps and the pin list (redirect/pins.rs MAP_PINS) differ: a map left \
         off the list is not pinned and its state is lost on restart"
    );
    let files: BTreeSet<&str> = MAP_PINS.iter().map(|(_, file)| *file).collect();
    assert_eq!(files.len(), MAP_PINS.len(), "pin file names are unique");
}

#[test]
fn every_map_has_the_definition_common_describes() {
    let object = map_definitions(EMBEDDED_OBJECT).unwrap();
    let expected = expected();
    for (name, want) in &expected {
        let got = object.get(name);
        assert_eq!(
            got,
            Some(want),
            "map {name}: object vs common: {:?}",
            got.map(|got| got.differences(want))
        );
    }
    assert_eq!(
        object.len(),
        expected.len(),
        "maps without an expectation here"
    );
}

#[test]
fn the_counter_array_has_a_slot_for_every_counter() {
    let object = map_definitions(EMBEDDED_OBJECT).unwrap();
    let stats = &object[m::REDIRECT_STATS];
    let counters = u32::try_from(dataplane_common::Counter::ALL.len()).unwrap();
    assert!(counters <= stats.max_entries);
    assert_eq!(stats.max_entries, COUNTER_SLOTS);
}

#[test]
fn the_probe_object_holds_only_the_netns_cookie_probe() {
    let object = map_definitions(crate::features::PROBES_OBJECT).unwrap();
    let expected: BTreeMap<String, MapDefinition> = [(
        m::NETNS_COOKIES.to_owned(),
        def::<u64, u64>(
            bpf_map_type::BPF_MAP_TYPE_LRU_HASH,
            m::NETNS_COOKIES_CAPACITY,
            0,
        ),
    )]
    .into();
    assert_eq!(object, expected);
    let programs = aya_obj::Object::parse(crate::features::PROBES_OBJECT)
        .unwrap()
        .programs
        .into_keys()
        .collect::<Vec<_>>();
    assert_eq!(programs, [m::PROG_NETNS_COOKIE]);
}

#[test]
fn differences_name_each_field() {
    let hash = def::<u64, u64>(bpf_map_type::BPF_MAP_TYPE_HASH, 16, 0);
    let other = MapDefinition {
        map_type: bpf_map_type::BPF_MAP_TYPE_LRU_HASH as u32,
        value_size: 16,
        ..hash
    };
    assert_eq!(
        hash.differences(&other),
        [
            "type BPF_MAP_TYPE_HASH vs BPF_MAP_TYPE_LRU_HASH",
            "value size 8 vs 16"
        ]
    );
    assert!(hash.differences(&hash).is_empty());
}
