//! Typed handles on the maps the agent writes (the engine's `ORIG_DST` and
//! the counters are opened by path elsewhere), and small helpers over them.

use aya::{
    Ebpf,
    maps::{Array, HashMap, LpmTrie, MapData, MapError, SockHash, lpm_trie::Key},
};
use dataplane_common::{
    AgentConfig, EnrolledNetns, IpAddr16, ListenerKey, NetnsAddr, NetnsPort, PodInbound, PodPort,
    PodSource,
    maps::{
        AGENT_CONFIG, ENROLLED_NETNS, IN_EXCL_PORTS, LISTENERS, NODE_NETNS, OUT_EXCL_CIDRS,
        OUT_EXCL_PORTS, POD_INBOUND, POD_SOURCE, PROBE_SOURCES,
    },
};

use super::{
    RedirectError,
    error::{is_not_found, map_err},
};

/// The maps the redirector writes.
pub(crate) struct KernelMaps {
    /// `ENROLLED_NETNS`.
    pub enrolled: HashMap<MapData, u64, EnrolledNetns>,
    /// `POD_INBOUND`.
    pub pod_inbound: HashMap<MapData, IpAddr16, PodInbound>,
    /// `OUT_EXCL_PORTS`.
    pub out_excl_ports: HashMap<MapData, NetnsPort, u8>,
    /// `OUT_EXCL_CIDRS`.
    pub out_excl_cidrs: LpmTrie<MapData, NetnsAddr, u8>,
    /// `IN_EXCL_PORTS`.
    pub in_excl_ports: HashMap<MapData, PodPort, u8>,
    /// `PROBE_SOURCES`.
    pub probe_sources: HashMap<MapData, IpAddr16, u8>,
    /// `LISTENERS`.
    pub listeners: SockHash<MapData, ListenerKey>,
    /// `POD_SOURCE`.
    pub pod_source: HashMap<MapData, u64, PodSource>,
}

impl KernelMaps {
    /// Takes the maps out of a loaded object.
    pub fn take(ebpf: &mut Ebpf) -> Result<Self, RedirectError> {
        Ok(Self {
            enrolled: typed_map(ebpf, ENROLLED_NETNS)?,
            pod_inbound: typed_map(ebpf, POD_INBOUND)?,
            out_excl_ports: typed_map(ebpf, OUT_EXCL_PORTS)?,
            out_excl_cidrs: typed_map(ebpf, OUT_EXCL_CIDRS)?,
            in_excl_ports: typed_map(ebpf, IN_EXCL_PORTS)?,
            probe_sources: typed_map(ebpf, PROBE_SOURCES)?,
            listeners: typed_map(ebpf, LISTENERS)?,
            pod_source: typed_map(ebpf, POD_SOURCE)?,
        })
    }

    /// The `POD_INBOUND` entry of `addr`, if any.
    pub fn pod_inbound_of(&self, addr: &IpAddr16) -> Result<Option<PodInbound>, RedirectError> {
        absent_as_none(self.pod_inbound.get(addr, 0), POD_INBOUND)
    }

    /// Removes an `OUT_EXCL_CIDRS` entry; a missing one is not an error.
    pub fn remove_cidr(&mut self, (bits, data): (u32, NetnsAddr)) -> Result<(), RedirectError> {
        ignore_missing(
            self.out_excl_cidrs.remove(&Key::new(bits, data)),
            OUT_EXCL_CIDRS,
        )
    }
}

/// Writes the agent's settings into `AGENT_CONFIG`. The map stays in the
/// object: programs loaded later refer to it by descriptor.
pub(crate) fn write_config(ebpf: &mut Ebpf, config: AgentConfig) -> Result<(), RedirectError> {
    let map = ebpf
        .map_mut(AGENT_CONFIG)
        .ok_or(RedirectError::MissingMap { name: AGENT_CONFIG })?;
    let mut array: Array<&mut MapData, AgentConfig> =
        Array::try_from(map).map_err(map_err(AGENT_CONFIG))?;
    array.set(0, config, 0).map_err(map_err(AGENT_CONFIG))
}

/// Writes the cookie of the node's own network namespace (the agent's)
/// into `NODE_NETNS`: its sockets' connections to pods go uncaptured
/// (kubelet's probes). Written at every start: the map may be adopted.
pub(crate) fn write_node_netns(ebpf: &mut Ebpf, cookie: u64) -> Result<(), RedirectError> {
    let map = ebpf
        .map_mut(NODE_NETNS)
        .ok_or(RedirectError::MissingMap { name: NODE_NETNS })?;
    let mut array: Array<&mut MapData, u64> = Array::try_from(map).map_err(map_err(NODE_NETNS))?;
    array.set(0, cookie, 0).map_err(map_err(NODE_NETNS))
}

/// Takes the map `name` out of the object as `T`.
pub(crate) fn typed_map<T>(ebpf: &mut Ebpf, name: &'static str) -> Result<T, RedirectError>
where
    T: TryFrom<aya::maps::Map, Error = MapError>,
{
    let map = ebpf
        .take_map(name)
        .ok_or(RedirectError::MissingMap { name })?;
    T::try_from(map).map_err(map_err(name))
}

/// A removal's result with "no such key" turned into success.
pub(crate) fn ignore_missing(
    result: Result<(), MapError>,
    name: &'static str,
) -> Result<(), RedirectError> {
    match result {
        Err(err) if !is_not_found(&err) => Err(RedirectError::Map { name, source: err }),
        _ => Ok(()),
    }
}

/// A lookup's result with "no such key" turned into `None`.
pub(crate) fn absent_as_none<V>(
    result: Result<V, MapError>,
    name: &'static str,
) -> Result<Option<V>, RedirectError> {
    match result {
        Ok(value) => Ok(Some(value)),
        Err(err) if is_not_found(&err) => Ok(None),
        Err(source) => Err(RedirectError::Map { name, source }),
    }
}

/// Every key of a map, collected before the caller changes the map (a map
/// walked while entries are deleted may restart or skip).
pub(crate) fn collect_keys<K>(
    keys: impl Iterator<Item = Result<K, MapError>>,
    name: &'static str,
) -> Result<Vec<K>, RedirectError> {
    keys.collect::<Result<Vec<_>, _>>().map_err(map_err(name))
}
