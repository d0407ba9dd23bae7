//! Checks, before a (re)starting agent loads its object, that every map an
//! earlier agent pinned for this instance has exactly the definition the
//! new object declares.
//!
//! aya's loader reuses any map pinned under the requested path without
//! looking at it, and the kernel accepts programs against a map whose key
//! or value size differs from what they were compiled for: lookups would
//! then read and write misaligned state (or fail), silently. The layout
//! version in the pin path ([`super::LAYOUT_VERSION`]) only helps if someone
//! remembers to bump it. So the agent compares each pinned map's definition,
//! as the kernel reports it (`BPF_OBJ_GET` on the pin, then
//! `BPF_OBJ_GET_INFO_BY_FD`), with the object's, and refuses to start on
//! any difference, naming the map, the difference and the fix.
//!
//! It refuses rather than migrates: a map's contents only make sense under
//! the layout of the agent that wrote them, and the pods they describe are
//! re-enrolled by the new agent anyway once the old state is gone.

use std::collections::BTreeMap;

use aya::maps::MapData;

use super::{PinLayout, RedirectError, error::is_not_found, object::MapDefinition, pins::MAP_PINS};

/// Compares every pinned map of `pins` with its definition in `object`
/// (from [`super::object::map_definitions`]). Maps not pinned yet (a first
/// start) pass.
pub(crate) fn check_pinned_maps(
    pins: &PinLayout,
    object: &BTreeMap<String, MapDefinition>,
) -> Result<(), RedirectError> {
    for (name, _) in MAP_PINS {
        let path = pins.map(name);
        let pinned = match pinned_definition(&path) {
            Ok(Some(pinned)) => pinned,
            Ok(None) => continue,
            Err(source) => return Err(RedirectError::InspectPinnedMap { name, path, source }),
        };
        let expected = object.get(name).ok_or(RedirectError::MissingMap { name })?;
        let differences = pinned.differences(expected);
        if !differences.is_empty() {
            return Err(RedirectError::PinnedMapMismatch {
                name,
                path,
                differences: differences.join(", "),
                pins_dir: pins.dir().to_path_buf(),
            });
        }
    }
    Ok(())
}

/// The kernel's definition of the map pinned at `path`, `None` if nothing
/// is pinned there.
fn pinned_definition(path: &std::path::Path) -> Result<Option<MapDefinition>, aya::maps::MapError> {
    let map = match MapData::from_pin(path) {
        Ok(map) => map,
        Err(err) if is_not_found(&err) => return Ok(None),
        Err(err) => return Err(err),
    };
    let info = map.info()?;
    Ok(Some(MapDefinition {
        // aya's `MapType` carries the kernel's `BPF_MAP_TYPE_*` numbers.
        map_type: info.map_type()? as u32,
        key_size: info.key_size(),
        value_size: info.value_size(),
        max_entries: info.max_entries(),
        map_flags: info.map_flags(),
    }))
}
