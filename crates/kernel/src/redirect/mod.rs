//! The redirector: loads the embedded kernel programs, attaches them to the
//! agent's cgroup as BPF links, pins maps and links in bpffs, and enrolls
//! pods (outbound and inbound capture state, per-pod `sk_lookup` links).
//!
//! Minimum kernel: [`MIN_KERNEL`] (5.9); the project supports 5.10 and newer
//! (probed at start: [`crate::features`]).
//!
//! Programs are attached through BPF links (always multi-attach), so other
//! tools' cgroup programs (a CNI's, a runtime's) keep running beside ours, and
//! pinning the links keeps capture in place while the agent restarts. A
//! restarted agent loads fresh programs against the *same* pinned maps, attaches
//! them, and only then detaches the previous generation: there is no moment
//! without a capture program. Per-pod `sk_lookup` links are replaced the same
//! way when the restarted agent re-enrolls the pod.
//!
//! Modules by concern: `pods` (enrolling pods: [`PodCapture`],
//! [`Exclusions`]), `external` (pods served by an external in-pod proxy
//! such as Istio's ztunnel: [`ExternalPodCapture`]), `harvest` (copies of
//! that proxy's listening sockets), `proxy_syn` (its `lo` tc program),
//! `listeners` (checks on the engine's listener sockets),
//! `links` (attach, pin, replace, detach), `raw_link` (the link commands aya
//! lacks), `kernel_maps` (typed map handles), `keys` (address and CIDR key
//! forms), `pins` (bpffs layout), `adopt` (pinned maps checked against
//! the object before they are reused), `object` (the embedded object's
//! programs and map definitions), `orig_dst` (the engine's original-destination lookups),
//! `stats` (decision counters), `error`.
//!
//! ```no_run
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use dataplane_kernel::redirect::{PinLayout, Redirector, RedirectorOptions, ExitMode};
//! let options = RedirectorOptions::new(
//!     "/sys/fs/cgroup".into(),
//!     PinLayout::new("/sys/fs/bpf".as_ref(), "default"),
//! );
//! let redirector = Redirector::attach(&options)?;
//! redirector.shutdown(ExitMode::Detach)?;
//! # Ok(()) }
//! ```

mod adopt;
#[cfg(test)]
mod contract_tests;
mod error;
mod external;
mod fast_path;
pub mod harvest;
mod kernel_maps;
mod keys;
mod links;
mod listeners;
mod object;
mod orig_dst;
mod pins;
mod pods;
mod proxy_syn;
mod raw_link;
mod stats;
mod tproxy;

use std::{collections::HashMap, fs::File, io, net::IpAddr, path::PathBuf};

use aya::{Ebpf, EbpfLoader, programs::links::PinnedLink};
use dataplane_common::{
    AGENT_FAIL_OPEN, AgentConfig, DEFAULT_PROXY_MARK, DEFAULT_TRANSPARENT_MARK, DNS_PROXY_PORT,
    HBONE_PORT, INBOUND_PLAINTEXT_PORT, IpAddr16, OUTBOUND_PORT,
    maps::{
        PROBE_SOURCES, PROG_CONNECT4, PROG_CONNECT6, PROG_DNS_RECVMSG4, PROG_DNS_RECVMSG6,
        PROG_DNS_SENDMSG4, PROG_DNS_SENDMSG6, PROG_GETPEERNAME4, PROG_GETPEERNAME6,
        PROG_GETSOCKOPT, PROG_GETSOCKOPT_BY_TUPLE, PROG_SOCKOPS,
    },
};
use tracing::{info, warn};

pub use error::RedirectError;
pub use external::{ExternalListeners, ExternalPodCapture};
pub use fast_path::{Cached, FastPathTable};
pub use harvest::{HarvestError, HarvestedListener};
pub use object::{
    EMBEDDED_OBJECT, MapDefinition, ObjectError, ProgramInfo, catalogue, map_definitions,
};
pub use orig_dst::{OrigDstTable, tuple_of};
pub use pins::{LAYOUT_VERSION, PinLayout};
pub use pods::{Exclusions, PodCapture};
pub use stats::{CounterValue, read_counters, read_enrolled_cookies, read_pod_inbound};
pub use tproxy::TproxyTable;

use kernel_maps::{KernelMaps, collect_keys, ignore_missing};
use pods::Registration;

/// Oldest kernel the redirector works on (defined with the feature probes
/// that check it).
pub use crate::features::MIN_KERNEL;

/// The cgroup programs, in attach order, with the hook part of their link
/// pin names. `sockops` goes first so that the tuple record exists for every
/// connection `connect4`/`connect6` steer from the moment they run; the
/// DNS `recvmsg` hooks go before the hooks that steer DNS, so no steered
/// query's reply is ever seen unrewritten.
const CGROUP_PROGRAMS: [(&str, &str); 10] = [
    ("cgroup_sockops", PROG_SOCKOPS),
    ("cgroup_getsockopt", PROG_GETSOCKOPT),
    ("cgroup_getpeername4", PROG_GETPEERNAME4),
    ("cgroup_getpeername6", PROG_GETPEERNAME6),
    ("cgroup_recvmsg4", PROG_DNS_RECVMSG4),
    ("cgroup_recvmsg6", PROG_DNS_RECVMSG6),
    ("cgroup_sendmsg4", PROG_DNS_SENDMSG4),
    ("cgroup_sendmsg6", PROG_DNS_SENDMSG6),
    ("cgroup_connect4", PROG_CONNECT4),
    ("cgroup_connect6", PROG_CONNECT6),
];

/// What happens to the kernel state when the agent stops.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ExitMode {
    /// Leave programs attached and maps pinned, so a restarted agent re-adopts
    /// them and enrolled pods stay captured (their connections are refused
    /// until the agent's listeners are back: fail-closed).
    Keep,
    /// Detach every program and remove every pin: pods fall back to direct,
    /// uncaptured traffic (fail-open) and nothing is left in bpffs.
    Detach,
}

/// How to load and attach.
#[derive(Debug, Clone)]
pub struct RedirectorOptions {
    /// cgroup v2 directory the cgroup programs attach to (the v2 root on a
    /// node; a test's own subtree in tests).
    pub cgroup: PathBuf,
    /// Where pins go.
    pub pins: PinLayout,
    /// Settings written to `AGENT_CONFIG` (its `AGENT_FAIL_OPEN` bit is
    /// replaced by [`RedirectorOptions::fail_open`]).
    pub config: AgentConfig,
    /// While an enrolled pod's engine is down (listeners closed, or engine
    /// readiness cleared), let its traffic through uncaptured instead of
    /// refusing it.
    pub fail_open: bool,
    /// Sources whose inbound connections are never captured, besides each
    /// pod's node-side address (kubelet probe addresses such as
    /// 169.254.7.127). Replaces the previous generation's list.
    pub probe_sources: Vec<IpAddr>,
    /// The node's own network namespace, whose sockets' connections to
    /// enrolled pods are never captured (kubelet's probes); `None`: the
    /// agent's own (a node agent runs in the host's network).
    pub node_netns: Option<PathBuf>,
    /// Whether the pods' inbound listeners take IPv6 (`[::]`, dual-stack);
    /// `false` (the agent's `--ipv6-enabled false`): they are IPv4 sockets,
    /// and a pod's IPv6 addresses get no `LISTENERS` entry, so `sk_lookup`
    /// drops their inbound connections (passes them with `fail_open`)
    /// rather than anyone registering an IPv4 socket for them.
    pub ipv6_listeners: bool,
}

impl RedirectorOptions {
    /// Options with the standard ports and proxy mark.
    pub fn new(cgroup: PathBuf, pins: PinLayout) -> Self {
        Self {
            cgroup,
            pins,
            config: AgentConfig {
                proxy_mark: DEFAULT_PROXY_MARK,
                outbound_port: OUTBOUND_PORT,
                inbound_port: INBOUND_PLAINTEXT_PORT,
                hbone_port: HBONE_PORT,
                // Pods capture DNS only with ENROLLED_CAPTURE_DNS.
                dns_port: DNS_PROXY_PORT,
                flags: 0,
                transparent_mark: DEFAULT_TRANSPARENT_MARK,
            },
            fail_open: false,
            probe_sources: Vec::new(),
            node_netns: None,
            ipv6_listeners: true,
        }
    }

    /// `AGENT_CONFIG` as written: `config` with the fail-open bit set from
    /// `fail_open`.
    fn agent_config(&self) -> AgentConfig {
        let mut config = self.config;
        if self.fail_open {
            config.flags |= AGENT_FAIL_OPEN;
        } else {
            config.flags &= !AGENT_FAIL_OPEN;
        }
        config
    }
}

/// Loaded, attached and pinned kernel programs of one agent instance.
pub struct Redirector {
    /// The loaded object; `dp_sk_lookup` is attached from it per pod.
    ebpf: Ebpf,
    pins: PinLayout,
    cgroup: PathBuf,
    config: AgentConfig,
    links: Vec<(&'static str, PinnedLink)>,
    maps: KernelMaps,
    /// Whether pods served by external proxies have their original
    /// destinations keyed by tuple alone: the kernel's getsockopt programs
    /// cannot ask for the namespace (before 5.15).
    external_by_tuple: bool,
    /// [`RedirectorOptions::ipv6_listeners`].
    ipv6_listeners: bool,
    /// What each enrolled netns cookie registered in the maps.
    registry: HashMap<u64, Registration>,
}

impl std::fmt::Debug for Redirector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Redirector")
            .field("pins", &self.pins)
            .field("cgroup", &self.cgroup)
            .field(
                "links",
                &self.links.iter().map(|(n, _)| n).collect::<Vec<_>>(),
            )
            .field("pods", &self.registry.len())
            .finish()
    }
}

impl Redirector {
    /// Loads the programs against the instance's pinned maps (creating them
    /// on first start), attaches them to the cgroup and pins the links,
    /// replacing a previous generation's links without a gap.
    ///
    /// If this is the instance's first start and it fails, the pins it made
    /// are removed again; an existing instance's state is never touched by a
    /// failed start.
    pub fn attach(options: &RedirectorOptions) -> Result<Self, RedirectError> {
        let first_start = !options.pins.dir().exists();
        let result = Self::attach_inner(options);
        if result.is_err()
            && first_start
            && let Err(err) = remove_pinned_state(&options.pins)
        {
            warn!(error = %dataplane_core::error::Chain(&err), "could not remove the pins of a failed first start");
        }
        result
    }

    fn attach_inner(options: &RedirectorOptions) -> Result<Self, RedirectError> {
        let pins = &options.pins;
        for dir in [pins.maps_dir(), pins.links_dir()] {
            std::fs::create_dir_all(&dir).map_err(|source| RedirectError::PinDir {
                path: dir.clone(),
                source,
            })?;
        }
        // aya would adopt any map pinned under these paths, whatever its
        // definition: compare first.
        let definitions =
            map_definitions(EMBEDDED_OBJECT).map_err(|source| RedirectError::Object { source })?;
        adopt::check_pinned_maps(pins, &definitions)?;
        let map_paths: Vec<(&'static str, PathBuf)> = pins::MAP_PINS
            .iter()
            .map(|(name, _)| (*name, pins.map(name)))
            .collect();
        let mut loader = EbpfLoader::new();
        for (name, path) in &map_paths {
            loader.map_pin_path(name, path.as_path());
        }
        let mut ebpf = loader
            .load(EMBEDDED_OBJECT)
            .map_err(|source| RedirectError::Load {
                source: Box::new(source),
            })?;

        let config = options.agent_config();
        kernel_maps::write_config(&mut ebpf, config)?;
        let node_netns = match &options.node_netns {
            Some(path) => crate::netns::netns_cookie_of_path(path).map_err(|e| e.to_string()),
            None => crate::netns::current_netns_cookie().map_err(|e| e.to_string()),
        };
        match node_netns {
            Ok(cookie) => kernel_maps::write_node_netns(&mut ebpf, cookie)?,
            // Probes from the node are then captured like any connection
            // unless they come from a probe source or the node-side address.
            Err(err) => {
                warn!(error = %err, "cannot tell the node's network namespace cookie; kubelet probes from it are captured unless they come from a --probe-source address")
            }
        }
        let mut maps = KernelMaps::take(&mut ebpf)?;
        write_probe_sources(&mut maps, &options.probe_sources)?;
        links::load_sk_lookup(&mut ebpf)?;
        proxy_syn::load(&mut ebpf)?;

        let cgroup = File::open(&options.cgroup).map_err(|source| RedirectError::OpenCgroup {
            path: options.cgroup.clone(),
            source,
        })?;
        let external_by_tuple = !crate::features::sockopt_knows_netns();
        let programs = CGROUP_PROGRAMS.map(|(hook, name)| match name {
            PROG_GETSOCKOPT if external_by_tuple => (hook, PROG_GETSOCKOPT_BY_TUPLE),
            _ => (hook, name),
        });
        let mut attached = Vec::new();
        for (hook, name) in programs {
            let link = links::attach_cgroup_program(&mut ebpf, name, &cgroup, pins.dir())?;
            attached.push((
                name,
                links::replace_pinned_link(pins.link(hook, name), name, link)?,
            ));
        }
        info!(
            cgroup = %options.cgroup.display(),
            pins = %pins.dir().display(),
            programs = ?programs.map(|(_, name)| name),
            fail_open = options.fail_open,
            "kernel programs attached"
        );
        Ok(Self {
            ebpf,
            pins: pins.clone(),
            cgroup: options.cgroup.clone(),
            config,
            links: attached,
            maps,
            external_by_tuple,
            ipv6_listeners: options.ipv6_listeners,
            registry: HashMap::new(),
        })
    }

    /// Whether the kernel programs let the engine connect to apps from
    /// their clients' own addresses: a transparent mark is configured.
    pub fn original_source_supported(&self) -> bool {
        self.config.transparent_mark != 0
    }

    /// Names of the attached cgroup programs (`dp_connect4`, ...), and
    /// the cgroup they are attached to.
    pub fn attached(&self) -> (Vec<&'static str>, &std::path::Path) {
        (
            self.links.iter().map(|(name, _)| *name).collect(),
            &self.cgroup,
        )
    }

    /// The pin layout this redirector uses.
    pub fn pins(&self) -> &PinLayout {
        &self.pins
    }

    /// Stops the redirector, keeping or removing kernel state per `mode`.
    pub fn shutdown(self, mode: ExitMode) -> Result<(), RedirectError> {
        match mode {
            ExitMode::Keep => {
                info!(pins = %self.pins.dir().display(), "leaving kernel programs attached and pinned");
                Ok(())
            }
            ExitMode::Detach => {
                // Our descriptors first, then every pin: the cgroup links and
                // the per-pod sk_lookup links alike, each detached at once.
                drop(self.links);
                let pods = remove_pinned_state(&self.pins)?;
                info!(pins = %self.pins.dir().display(), pods, "kernel programs detached and pins removed");
                Ok(())
            }
        }
    }
}

/// Removes an instance's pinned maps and links (detaching the programs the
/// links held, at once), then the instance directory and the shared parent
/// when they are empty. Returns how many pods' `sk_lookup` links were
/// detached. Missing state is not an error.
pub fn remove_pinned_state(pins: &PinLayout) -> Result<usize, RedirectError> {
    let pods = links::detach_all(pins)?;
    match std::fs::remove_dir_all(pins.dir()) {
        Ok(()) => {}
        Err(err) if err.kind() == io::ErrorKind::NotFound => {}
        Err(source) => {
            return Err(RedirectError::Unpin {
                path: pins.dir().to_path_buf(),
                source,
            });
        }
    }
    // Other instances or versions may still live beside us: only remove
    // directories that are now empty.
    let instance = pins.instance_dir();
    for dir in [Some(instance), instance.parent()].into_iter().flatten() {
        if std::fs::remove_dir(dir).is_err() {
            break;
        }
    }
    Ok(pods)
}

/// Makes `PROBE_SOURCES` hold exactly `sources`.
fn write_probe_sources(maps: &mut KernelMaps, sources: &[IpAddr]) -> Result<(), RedirectError> {
    let wanted: Vec<IpAddr16> = sources.iter().map(|ip| keys::addr16(*ip)).collect();
    for key in collect_keys(maps.probe_sources.keys(), PROBE_SOURCES)? {
        if !wanted.contains(&key) {
            ignore_missing(maps.probe_sources.remove(&key), PROBE_SOURCES)?;
        }
    }
    for key in &wanted {
        maps.probe_sources
            .insert(key, 1, 0)
            .map_err(error::map_err(PROBE_SOURCES))?;
    }
    Ok(())
}
