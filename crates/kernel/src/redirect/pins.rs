//! Where an agent instance keeps its kernel state in bpffs.
//!
//! `<bpffs>/dataplane/<instance>/v3/{maps,links}/<name>`: one directory per
//! agent instance so two agents (two simulated nodes) can share a kernel, and
//! a layout version. An agent never adopts a pinned map whose definition
//! differs from its object's (`adopt` checks every one and refuses to
//! start); bumping [`LAYOUT_VERSION`] with a layout change instead lets the
//! new agent start on fresh state beside the old one.

use std::path::{Path, PathBuf};

/// Version of the pinned map layout.
pub const LAYOUT_VERSION: &str = "v3";

/// Pinned file names, chosen to explain themselves in `bpftool map show
/// pinned ...` and `ls`. Every map of the object is pinned, so a restarted
/// agent re-adopts all of its state (`contract_tests` fails when a map of the
/// object is missing here).
pub(crate) const MAP_PINS: [(&str, &str); 24] = {
    use dataplane_common::maps as m;
    [
        (m::ENROLLED_NETNS, "enrolled_netns_by_cookie"),
        (m::ORIG_DST_COOKIE, "orig_dst_by_socket_cookie"),
        (m::ORIG_DST, "orig_dst_by_tuple"),
        (m::AGENT_CONFIG, "agent_config"),
        (m::REDIRECT_STATS, "redirect_decision_counters"),
        (m::OUT_EXCL_PORTS, "outbound_excluded_ports_by_netns"),
        (m::OUT_EXCL_CIDRS, "outbound_excluded_cidrs_by_netns"),
        (m::POD_INBOUND, "inbound_pods_by_ip"),
        (m::POD_SOURCE, "outbound_source_by_netns"),
        (m::IN_EXCL_PORTS, "inbound_excluded_ports_by_pod_ip"),
        (m::PROBE_SOURCES, "inbound_probe_sources"),
        (m::LISTENERS, "engine_listeners_by_pod_ip_and_port"),
        (m::DNS_ORIG_COOKIE, "dns_server_asked_by_socket_cookie"),
        (m::TPROXY_TUPLES, "transparent_connects_by_tuple"),
        (m::NODE_NETNS, "node_netns_cookie"),
        (m::NODE_CONNECTS, "node_connects_by_socket_cookie"),
        (m::NODE_TUPLES, "node_connections_by_tuple"),
        (m::FAST_VERDICTS, "fast_path_verdicts"),
        (m::FAST_GENERATION, "fast_path_generation"),
        (m::FAST_BY_COOKIE, "fast_path_clients_by_socket_cookie"),
        (m::FAST_BY_TUPLE, "fast_path_connections_by_tuple"),
        (m::FAST_CLOSED, "fast_path_closed_connections"),
        (m::FAST_SERVICES, "fast_path_service_verdicts"),
        (m::FAST_VIP_BY_COOKIE, "fast_path_vip_by_socket_cookie"),
    ]
};

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

    /// Pin path of the link that attaches `dp_sk_lookup` to the network
    /// namespace with this cookie: `links/sk_lookup_netns_<cookie>`.
    pub fn sk_lookup_link(&self, netns_cookie: u64) -> PathBuf {
        self.links_dir()
            .join(format!("{SK_LOOKUP_LINK_PREFIX}{netns_cookie}"))
    }

    /// The netns cookie of an `sk_lookup` link pin's file name, or `None`
    /// for any other name.
    pub fn sk_lookup_link_cookie(file_name: &str) -> Option<u64> {
        file_name.strip_prefix(SK_LOOKUP_LINK_PREFIX)?.parse().ok()
    }
}

/// File-name prefix of the per-netns `sk_lookup` link pins.
const SK_LOOKUP_LINK_PREFIX: &str = "sk_lookup_netns_";
