//! Reading the kernel programs' per-CPU decision counters.

use aya::maps::{Map, MapData, MapError, PerCpuArray};
use dataplane_common::{Counter, maps::REDIRECT_STATS};

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
    let err = |source| RedirectError::Map {
        name: REDIRECT_STATS,
        source,
    };
    let data = MapData::from_pin(pins.map(REDIRECT_STATS)).map_err(err)?;
    let array: PerCpuArray<MapData, u64> =
        PerCpuArray::try_from(Map::from_map_data(data).map_err(err)?).map_err(err)?;
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
