//! The kernel programs' decision counters of one redirector instance, read
//! from its pinned per-CPU array (summed over CPUs), whoever attached it: an
//! agent process or a test's in-process redirector.

use std::collections::HashMap;

use dataplane_user::redirect::{PinLayout, read_counters};

/// Every counter by name.
pub fn all(pins: &PinLayout) -> anyhow::Result<HashMap<&'static str, u64>> {
    Ok(read_counters(pins)?
        .into_iter()
        .map(|c| (c.name, c.value))
        .collect())
}

/// One counter; an error names a counter the programs do not have.
pub fn one(pins: &PinLayout, name: &str) -> anyhow::Result<u64> {
    all(pins)?
        .get(name)
        .copied()
        .ok_or_else(|| anyhow::anyhow!("no counter {name}"))
}
