//! Reading the kernel programs' state through their pinned maps, from any
//! thread and without the redirector: the per-CPU decision counters and
//! the enrolled network namespaces.

use aya::maps::{HashMap, Map, MapData, MapError, PerCpuArray};
use dataplane_common::{
    Counter, EnrolledNetns, IpAddr16, PodInbound,
    maps::{ENROLLED_NETNS, POD_INBOUND, REDIRECT_STATS},
};

use super::{PinLayout, RedirectError};

/// One decision counter summed over CPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct CounterValue {
    /// Stable counter name.
    pub name: &'static str,
    /// Total over all CPUs since the maps were created.
    pub value: u64,
}

/// Reads every counter of the instance laid out by `pins`.
pub fn read_counters(pins: &PinLayout) -> Result<Vec<CounterValue>, RedirectError> {
    let err = map_error(REDIRECT_STATS);
    let array: PerCpuArray<MapData, u64> = open_pinned(pins, REDIRECT_STATS)?;
    Counter::ALL
        .iter()
        .map(|counter| {
            let per_cpu = array.get(&(*counter as u32), 0)?;
            Ok(CounterValue {
                name: counter.name(),
                value: per_cpu.iter().sum(),
            })
        })
        .collect::<Result<Vec<_>, MapError>>()
        .map_err(err)
}

/// The network-namespace cookies in the instance's `ENROLLED_NETNS` map.
pub fn read_enrolled_cookies(pins: &PinLayout) -> Result<Vec<u64>, RedirectError> {
    let map: HashMap<MapData, u64, EnrolledNetns> = open_pinned(pins, ENROLLED_NETNS)?;
    map.keys()
        .collect::<Result<Vec<_>, MapError>>()
        .map_err(map_error(ENROLLED_NETNS))
}

/// The instance's `POD_INBOUND` map: which network namespace (by cookie)
/// inbound connections to each pod IP are captured for.
pub fn read_pod_inbound(
    pins: &PinLayout,
) -> Result<std::collections::HashMap<std::net::IpAddr, u64>, RedirectError> {
    let map: HashMap<MapData, IpAddr16, PodInbound> = open_pinned(pins, POD_INBOUND)?;
    map.iter()
        .map(|entry| entry.map(|(ip, pod)| (super::keys::ip_of(&ip), pod.netns_cookie)))
        .collect::<Result<_, MapError>>()
        .map_err(map_error(POD_INBOUND))
}

/// The pinned map `name` of the instance, as a typed aya map.
pub(super) fn open_pinned<T>(pins: &PinLayout, name: &'static str) -> Result<T, RedirectError>
where
    T: TryFrom<Map, Error = MapError>,
{
    let data = MapData::from_pin(pins.map(name)).map_err(map_error(name))?;
    let map = Map::from_map_data(data).map_err(map_error(name))?;
    T::try_from(map).map_err(map_error(name))
}

fn map_error(name: &'static str) -> impl Fn(MapError) -> RedirectError {
    move |source| RedirectError::Map { name, source }
}
