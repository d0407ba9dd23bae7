//! The redirector: loads the embedded kernel programs, attaches them to the
//! agent's cgroup as BPF links, and pins maps and links in bpffs.
//!
//! Minimum kernel: 5.7 (BPF links for cgroup programs and
//! `bpf_get_netns_cookie` in `cgroup/connect4`); the project supports 6.1 and
//! newer.
//!
//! Programs are attached through BPF links (always multi-attach), so other
//! tools' cgroup programs (a CNI's, a runtime's) keep running beside ours, and
//! pinning the links keeps capture in place while the agent restarts. A
//! restarted agent loads fresh programs against the *same* pinned maps, attaches
//! them, and only then detaches the previous generation: there is no moment
//! without a capture program.
//!
//! ```no_run
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use dataplane_user::redirect::{PinLayout, Redirector, RedirectorOptions, ExitMode};
//! let options = RedirectorOptions::new(
//!     "/sys/fs/cgroup".into(),
//!     PinLayout::new("/sys/fs/bpf".as_ref(), "default"),
//! );
//! let redirector = Redirector::attach(&options)?;
//! redirector.shutdown(ExitMode::Detach)?;
//! # Ok(()) }
//! ```

mod object;
mod orig_dst;
mod pins;
mod stats;

use std::{fs::File, io, path::PathBuf};

use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, HashMap, MapData, MapError},
    pin::PinError,
    programs::{
        CgroupAttachMode, CgroupSockAddr, ProgramError, SockOps,
        links::{FdLink, LinkError, PinnedLink},
    },
};
use dataplane_common::{
    AgentConfig, DEFAULT_PROXY_MARK, ENROLLED_CAPTURE_OUTBOUND, EnrolledNetns, HBONE_PORT,
    INBOUND_PLAINTEXT_PORT, OUTBOUND_PORT,
    maps::{AGENT_CONFIG, ENROLLED_NETNS, PROG_CONNECT4, PROG_SOCKOPS},
};
use tracing::{debug, info, warn};

pub use object::{EMBEDDED_OBJECT, ObjectError, ProgramInfo, catalogue};
pub use orig_dst::{OrigDstTable, tuple_of};
pub use pins::{LAYOUT_VERSION, PinLayout};
pub use stats::{CounterValue, read_counters};

/// Errors of the redirector.
#[derive(Debug, thiserror::Error)]
pub enum RedirectError {
    /// A directory for pins could not be created.
    #[error("cannot create pin directory {path} (is bpffs mounted there and writable?)")]
    PinDir {
        /// The directory.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The kernel refused the object (maps or BTF).
    #[error("loading the kernel object failed")]
    Load {
        /// aya's error, which carries the verifier log when there is one.
        #[source]
        source: Box<aya::EbpfError>,
    },
    /// The object lacks a program the agent expects.
    #[error(
        "the embedded object has no program `{name}`; agent and object are out of step (rebuild)"
    )]
    MissingProgram {
        /// Program name.
        name: &'static str,
    },
    /// The object lacks a map the agent expects.
    #[error("the embedded object has no map `{name}`; agent and object are out of step (rebuild)")]
    MissingMap {
        /// Map name.
        name: &'static str,
    },
    /// A program was rejected by the verifier or has the wrong type.
    #[error("program `{name}` failed to load or attach")]
    Program {
        /// Program name.
        name: &'static str,
        /// aya's error (with the verifier log when it is a verifier error).
        #[source]
        source: ProgramError,
    },
    /// The attach cgroup could not be opened.
    #[error("cannot open cgroup {path} (pass an existing cgroup v2 directory with --cgroup)")]
    OpenCgroup {
        /// The cgroup directory.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// A link could not be turned into a pinnable fd link.
    #[error("program `{name}` was attached without a BPF link (kernel >= 5.7 is required)")]
    NotALink {
        /// Program name.
        name: &'static str,
        /// aya's error.
        #[source]
        source: LinkError,
    },
    /// Pinning a link failed.
    #[error("cannot pin the link of `{name}` at {path}")]
    PinLink {
        /// Program name.
        name: &'static str,
        /// Pin path.
        path: PathBuf,
        /// aya's error.
        #[source]
        source: PinError,
    },
    /// A map operation failed.
    #[error("operation on map `{name}` failed")]
    Map {
        /// Map name.
        name: &'static str,
        /// aya's error.
        #[source]
        source: MapError,
    },
    /// Removing pinned state failed.
    #[error("cannot remove pinned state {path}")]
    Unpin {
        /// The path that could not be removed.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
}

/// What happens to the kernel state when the agent stops.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Deserialize)]
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
    /// Settings written to `AGENT_CONFIG`.
    pub config: AgentConfig,
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
                _pad: 0,
                flags: 0,
            },
        }
    }
}

/// Loaded, attached and pinned kernel programs of one agent instance.
pub struct Redirector {
    _ebpf: Ebpf,
    pins: PinLayout,
    cgroup: PathBuf,
    links: Vec<(&'static str, PinnedLink)>,
    enrolled: HashMap<MapData, u64, EnrolledNetns>,
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
            warn!(error = %crate::logging::Chain(&err), "could not remove the pins of a failed first start");
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

        let mut config: Array<_, AgentConfig> = typed_map(&mut ebpf, AGENT_CONFIG)?;
        config
            .set(0, options.config, 0)
            .map_err(|source| RedirectError::Map {
                name: AGENT_CONFIG,
                source,
            })?;
        let enrolled = typed_map(&mut ebpf, ENROLLED_NETNS)?;

        let cgroup = File::open(&options.cgroup).map_err(|source| RedirectError::OpenCgroup {
            path: options.cgroup.clone(),
            source,
        })?;
        let mut links = Vec::new();
        for (hook, name) in [
            ("cgroup_sockops", PROG_SOCKOPS),
            ("cgroup_connect4", PROG_CONNECT4),
        ] {
            let link = attach_program(&mut ebpf, name, &cgroup)?;
            links.push((
                name,
                replace_pinned_link(pins.link(hook, name), name, link)?,
            ));
        }
        info!(
            cgroup = %options.cgroup.display(),
            pins = %pins.dir().display(),
            programs = ?[PROG_SOCKOPS, PROG_CONNECT4],
            "kernel programs attached"
        );
        Ok(Self {
            _ebpf: ebpf,
            pins: pins.clone(),
            cgroup: options.cgroup.clone(),
            links,
            enrolled,
        })
    }

    /// The pin layout this redirector uses.
    pub fn pins(&self) -> &PinLayout {
        &self.pins
    }

    /// Starts capturing the network namespace with this cookie. Idempotent.
    pub fn enroll_netns(&mut self, netns_cookie: u64) -> Result<(), RedirectError> {
        let value = EnrolledNetns {
            flags: ENROLLED_CAPTURE_OUTBOUND,
            _pad: [0; 4],
        };
        self.enrolled
            .insert(netns_cookie, value, 0)
            .map_err(|source| RedirectError::Map {
                name: ENROLLED_NETNS,
                source,
            })
    }

    /// Stops capturing the network namespace with this cookie. Idempotent.
    pub fn unenroll_netns(&mut self, netns_cookie: u64) -> Result<(), RedirectError> {
        match self.enrolled.remove(&netns_cookie) {
            Ok(()) => Ok(()),
            Err(err) if is_not_found(&err) => Ok(()),
            Err(source) => Err(RedirectError::Map {
                name: ENROLLED_NETNS,
                source,
            }),
        }
    }

    /// Stops the redirector, keeping or removing kernel state per `mode`.
    pub fn shutdown(self, mode: ExitMode) -> Result<(), RedirectError> {
        match mode {
            ExitMode::Keep => {
                info!(pins = %self.pins.dir().display(), "leaving kernel programs attached and pinned");
                Ok(())
            }
            ExitMode::Detach => {
                for (name, link) in self.links {
                    // Unpinning hands back the last reference: dropping it
                    // detaches the program from the cgroup.
                    match link.unpin() {
                        Ok(fd_link) => drop(fd_link),
                        Err(err) => {
                            warn!(program = name, error = %crate::logging::Chain(&err), "unpinning link failed")
                        }
                    }
                }
                remove_pinned_state(&self.pins)?;
                info!(pins = %self.pins.dir().display(), "kernel programs detached and pins removed");
                Ok(())
            }
        }
    }
}

/// Removes an instance's pinned maps and links (detaching the programs the
/// links held), then the instance directory and the shared parent when they
/// are empty. Missing state is not an error.
pub fn remove_pinned_state(pins: &PinLayout) -> Result<(), RedirectError> {
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
    Ok(())
}

/// Whether a map error means "no such key" (aya reports a delete of a
/// missing key as a raw `ENOENT` syscall error).
pub(crate) fn is_not_found(err: &MapError) -> bool {
    match err {
        MapError::KeyNotFound => true,
        MapError::SyscallError(e) => e.io_error.raw_os_error() == Some(libc::ENOENT),
        _ => false,
    }
}

fn typed_map<T>(ebpf: &mut Ebpf, name: &'static str) -> Result<T, RedirectError>
where
    T: TryFrom<aya::maps::Map, Error = MapError>,
{
    let map = ebpf
        .take_map(name)
        .ok_or(RedirectError::MissingMap { name })?;
    T::try_from(map).map_err(|source| RedirectError::Map { name, source })
}

/// Flags for cgroup attachment. With BPF links (kernel >= 5.7, which aya uses
/// whenever available) the kernel always attaches in multi mode and rejects
/// any flag, so "no flags" here still means programs of other tools run beside
/// ours.
const LINK_ATTACH_MODE: CgroupAttachMode = CgroupAttachMode::Single;

fn attach_program(
    ebpf: &mut Ebpf,
    name: &'static str,
    cgroup: &File,
) -> Result<FdLink, RedirectError> {
    let program = ebpf
        .program_mut(name)
        .ok_or(RedirectError::MissingProgram { name })?;
    let program_err = |source| RedirectError::Program { name, source };
    let not_a_link = |source| RedirectError::NotALink { name, source };
    match program {
        aya::programs::Program::CgroupSockAddr(p) => {
            let p: &mut CgroupSockAddr = p;
            p.load().map_err(program_err)?;
            let id = p.attach(cgroup, LINK_ATTACH_MODE).map_err(program_err)?;
            let link = p.take_link(id).map_err(program_err)?;
            FdLink::try_from(link).map_err(not_a_link)
        }
        aya::programs::Program::SockOps(p) => {
            let p: &mut SockOps = p;
            p.load().map_err(program_err)?;
            let id = p.attach(cgroup, LINK_ATTACH_MODE).map_err(program_err)?;
            let link = p.take_link(id).map_err(program_err)?;
            FdLink::try_from(link).map_err(not_a_link)
        }
        _ => Err(RedirectError::MissingProgram { name }),
    }
}

/// Pins `link` in place of the previous generation's link for `name`, which
/// is detached only after the new one is attached.
fn replace_pinned_link(
    path: PathBuf,
    name: &'static str,
    link: FdLink,
) -> Result<PinnedLink, RedirectError> {
    let previous = if path.exists() {
        match PinnedLink::from_pin(&path) {
            Ok(old) => Some(old),
            Err(err) => {
                warn!(program = name, path = %path.display(), error = %crate::logging::Chain(&err), "ignoring unreadable link pin");
                None
            }
        }
    } else {
        None
    };
    if let Some(old) = previous {
        match old.unpin() {
            Ok(old) => {
                drop(old);
                debug!(program = name, "detached previous generation");
            }
            Err(err) => {
                warn!(program = name, error = %crate::logging::Chain(&err), "could not unpin previous link")
            }
        }
    } else if path.exists() {
        let _ = std::fs::remove_file(&path);
    }
    link.pin(&path)
        .map_err(|source| RedirectError::PinLink { name, path, source })
}
