//! Where an agent instance keeps its kernel state in bpffs.
//!
//! `<bpffs>/dataplane/<instance>/v1/{maps,links}/<name>`: one directory per
//! agent instance so two agents (two simulated nodes) can share a kernel, and
//! a layout version so an agent never adopts maps whose layout it does not
//! know (bump [`LAYOUT_VERSION`] whenever a type in `dataplane-common` moves).

use std::path::{Path, PathBuf};

/// Version of the pinned map layout.
pub const LAYOUT_VERSION: &str = "v1";

/// Pinned file names, chosen to explain themselves in `bpftool map show
/// pinned ...` and `ls`.
pub(crate) const MAP_PINS: [(&str, &str); 5] = [
    (
        dataplane_common::maps::ENROLLED_NETNS,
        "enrolled_netns_by_cookie",
    ),
    (
        dataplane_common::maps::ORIG_DST_COOKIE,
        "orig_dst_by_socket_cookie",
    ),
    (dataplane_common::maps::ORIG_DST, "orig_dst_by_tuple"),
    (dataplane_common::maps::AGENT_CONFIG, "agent_config"),
    (
        dataplane_common::maps::REDIRECT_STATS,
        "redirect_decision_counters",
    ),
];

/// Paths of one agent instance's pinned state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PinLayout {
    dir: PathBuf,
}

impl PinLayout {
    /// The layout of `instance` under the bpffs mount (or directory) `bpffs`.
    pub fn new(bpffs: &Path, instance: &str) -> Self {
        Self {
            dir: bpffs.join("dataplane").join(instance).join(LAYOUT_VERSION),
        }
    }

    /// The instance's versioned state directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The instance directory (parent of every layout version).
    pub fn instance_dir(&self) -> &Path {
        self.dir.parent().unwrap_or(&self.dir)
    }

    /// Directory of pinned maps.
    pub fn maps_dir(&self) -> PathBuf {
        self.dir.join("maps")
    }

    /// Directory of pinned links.
    pub fn links_dir(&self) -> PathBuf {
        self.dir.join("links")
    }

    /// Pin path of the map named `name` in the object.
    pub fn map(&self, name: &str) -> PathBuf {
        let file = MAP_PINS
            .iter()
            .find(|(object_name, _)| *object_name == name)
            .map_or(name, |(_, pin)| pin);
        self.maps_dir().join(file)
    }

    /// Pin path of the link that attaches `program` (named for its hook and
    /// target, e.g. `cgroup_connect4_dp_connect4`).
    pub fn link(&self, hook: &str, program: &str) -> PathBuf {
        self.links_dir().join(format!("{hook}_{program}"))
    }
}
