//! The maps shared with user space. Their key and value types live in
//! `dataplane-common`; their names and capacities in `dataplane_common::maps`.

use aya_ebpf::{
    macros::map,
    maps::{Array, HashMap, LpmTrie, LruHashMap, PerCpuArray, RingBuf, SockHash},
};
use dataplane_common::{
    AgentConfig, COUNTER_SLOTS, CapturedDst, Counter, DnsOrigDst, EnrolledNetns, FastConn, FastKey,
    FastService, FastVerdict, FastVip, IpAddr16, ListenerKey, NetnsAddr, NetnsPort, OrigDst,
    OrigDstKey, PodInbound, PodPort, PodSource, SockTuple,
    maps::{
        DNS_ORIG_CAPACITY, ENROLLED_CAPACITY, EXCLUSION_CAPACITY, FAST_CLOSED_BYTES,
        FAST_CONN_CAPACITY, FAST_SERVICE_CAPACITY, FAST_VERDICT_CAPACITY, LISTENERS_CAPACITY,
        NODE_CONNECT_CAPACITY, ORIG_DST_CAPACITY, POD_IP_CAPACITY, PROBE_SOURCES_CAPACITY,
        TPROXY_CAPACITY,
    },
};

#[map]
pub static ENROLLED_NETNS: HashMap<u64, EnrolledNetns> =
    HashMap::with_max_entries(ENROLLED_CAPACITY, 0);

#[map]
pub static ORIG_DST_COOKIE: LruHashMap<u64, CapturedDst> =
    LruHashMap::with_max_entries(ORIG_DST_CAPACITY, 0);

#[map]
pub static DNS_ORIG_COOKIE: LruHashMap<u64, DnsOrigDst> =
    LruHashMap::with_max_entries(DNS_ORIG_CAPACITY, 0);

#[map]
pub static ORIG_DST: LruHashMap<OrigDstKey, OrigDst> =
    LruHashMap::with_max_entries(ORIG_DST_CAPACITY, 0);

#[map]
pub static AGENT_CONFIG: Array<AgentConfig> = Array::with_max_entries(1, 0);

#[map]
pub static REDIRECT_STATS: PerCpuArray<u64> = PerCpuArray::with_max_entries(COUNTER_SLOTS, 0);

#[map]
pub static OUT_EXCL_PORTS: HashMap<NetnsPort, u8> =
    HashMap::with_max_entries(EXCLUSION_CAPACITY, 0);

#[map]
pub static OUT_EXCL_CIDRS: LpmTrie<NetnsAddr, u8> =
    LpmTrie::with_max_entries(EXCLUSION_CAPACITY, 0);

#[map]
pub static POD_INBOUND: HashMap<IpAddr16, PodInbound> =
    HashMap::with_max_entries(POD_IP_CAPACITY, 0);

#[map]
pub static POD_SOURCE: HashMap<u64, PodSource> = HashMap::with_max_entries(ENROLLED_CAPACITY, 0);

#[map]
pub static IN_EXCL_PORTS: HashMap<PodPort, u8> = HashMap::with_max_entries(EXCLUSION_CAPACITY, 0);

#[map]
pub static PROBE_SOURCES: HashMap<IpAddr16, u8> =
    HashMap::with_max_entries(PROBE_SOURCES_CAPACITY, 0);

#[map]
pub static TPROXY_TUPLES: LruHashMap<SockTuple, u8> =
    LruHashMap::with_max_entries(TPROXY_CAPACITY, 0);

#[map]
pub static NODE_NETNS: Array<u64> = Array::with_max_entries(1, 0);

#[map]
pub static NODE_CONNECTS: LruHashMap<u64, u8> =
    LruHashMap::with_max_entries(NODE_CONNECT_CAPACITY, 0);

#[map]
pub static NODE_TUPLES: LruHashMap<SockTuple, u8> =
    LruHashMap::with_max_entries(NODE_CONNECT_CAPACITY, 0);

#[map]
pub static LISTENERS: SockHash<ListenerKey> = SockHash::with_max_entries(LISTENERS_CAPACITY, 0);

#[map]
pub static FAST_VERDICTS: LruHashMap<FastKey, FastVerdict> =
    LruHashMap::with_max_entries(FAST_VERDICT_CAPACITY, 0);

#[map]
pub static FAST_GENERATION: Array<u64> = Array::with_max_entries(1, 0);

#[map]
pub static FAST_BY_COOKIE: LruHashMap<u64, FastConn> =
    LruHashMap::with_max_entries(FAST_CONN_CAPACITY, 0);

#[map]
pub static FAST_BY_TUPLE: LruHashMap<SockTuple, FastConn> =
    LruHashMap::with_max_entries(FAST_CONN_CAPACITY, 0);

#[map]
pub static FAST_SERVICES: LruHashMap<FastKey, FastService> =
    LruHashMap::with_max_entries(FAST_SERVICE_CAPACITY, 0);

#[map]
pub static FAST_VIP_BY_COOKIE: LruHashMap<u64, FastVip> =
    LruHashMap::with_max_entries(FAST_CONN_CAPACITY, 0);

#[map]
pub static FAST_CLOSED: RingBuf = RingBuf::with_byte_size(FAST_CLOSED_BYTES, 0);

/// Adds one to a decision counter. Per-CPU slots need no atomics.
#[inline(always)]
pub fn count(counter: Counter) {
    if let Some(slot) = REDIRECT_STATS.get_ptr_mut(counter as u32) {
        // SAFETY: the pointer comes from a successful per-CPU array lookup
        // and programs do not migrate CPUs while running.
        unsafe { *slot += 1 };
    }
}

/// The agent's settings, or `None` before the agent has written them (then
/// every program lets traffic through untouched).
#[inline(always)]
pub fn agent_config() -> Option<&'static AgentConfig> {
    AGENT_CONFIG.get(0)
}
