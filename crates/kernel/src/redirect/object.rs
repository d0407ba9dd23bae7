//! The kernel object embedded in the agent, and what it holds read from the
//! object itself: a catalogue of its programs (so `dataplane version` cannot
//! drift from what is actually shipped) and its map definitions (which the
//! pinned maps a restarted agent adopts must match).

use std::{collections::BTreeMap, fmt};

use aya_obj::{
    EbpfSectionKind, Object, ProgramSection,
    generated::bpf_map_type,
    programs::{CgroupSockAddrAttachType, CgroupSockoptAttachType},
};

/// The compiled `dataplane-ebpf` object (BTF included), built by `build.rs`.
pub static EMBEDDED_OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/dataplane-ebpf"));

/// One program in the embedded object.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ProgramInfo {
    /// Program (function) name, as the kernel shows it.
    pub name: String,
    /// Kernel program type, e.g. `cgroup_sock_addr`.
    pub program_type: String,
    /// Where the agent attaches it.
    pub attach_point: String,
}

/// Errors reading the embedded object.
#[derive(Debug, thiserror::Error)]
pub enum ObjectError {
    /// The embedded bytes are not a valid BPF ELF object.
    #[error("the embedded kernel object does not parse; rebuild the agent")]
    Parse {
        /// What the ELF parser reported.
        #[source]
        source: aya_obj::ParseError,
    },
}

/// What the kernel fixes about a map when it creates it: a pinned map can
/// only be used by programs built for exactly this definition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MapDefinition {
    /// `BPF_MAP_TYPE_*` number.
    pub map_type: u32,
    /// Key size in bytes.
    pub key_size: u32,
    /// Value size in bytes (per CPU for per-CPU maps).
    pub value_size: u32,
    /// Capacity.
    pub max_entries: u32,
    /// `BPF_F_*` creation flags.
    pub map_flags: u32,
}

impl MapDefinition {
    /// The fields in which `self` differs from `other`, each as
    /// `<field> <self> vs <other>`.
    pub fn differences(&self, other: &Self) -> Vec<String> {
        let mut out = Vec::new();
        if self.map_type != other.map_type {
            out.push(format!(
                "type {} vs {}",
                MapTypeName(self.map_type),
                MapTypeName(other.map_type)
            ));
        }
        let sizes = [
            ("key size", self.key_size, other.key_size),
            ("value size", self.value_size, other.value_size),
            ("max entries", self.max_entries, other.max_entries),
        ];
        for (field, mine, theirs) in sizes {
            if mine != theirs {
                out.push(format!("{field} {mine} vs {theirs}"));
            }
        }
        if self.map_flags != other.map_flags {
            out.push(format!(
                "flags {:#x} vs {:#x}",
                self.map_flags, other.map_flags
            ));
        }
        out
    }
}

/// A map type number shown as the kernel's name (`BPF_MAP_TYPE_HASH`).
struct MapTypeName(u32);

impl fmt::Display for MapTypeName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match bpf_map_type::try_from(self.0) {
            Ok(known) => write!(f, "{known:?}"),
            Err(_) => write!(f, "map type {}", self.0),
        }
    }
}

/// The state maps of a kernel object (its `maps`/`.maps` sections) by name,
/// with their definitions. Data sections (`.rodata`, `.data`, `.bss`) are
/// left out: the loader fills them from the object at every load, so they
/// hold no state to pin.
pub fn map_definitions(object: &[u8]) -> Result<BTreeMap<String, MapDefinition>, ObjectError> {
    let object = Object::parse(object).map_err(|source| ObjectError::Parse { source })?;
    Ok(object
        .maps
        .iter()
        .filter(|(_, map)| {
            matches!(
                map.section_kind(),
                EbpfSectionKind::Maps | EbpfSectionKind::BtfMaps
            )
        })
        .map(|(name, map)| {
            let definition = MapDefinition {
                map_type: map.map_type(),
                key_size: map.key_size(),
                value_size: map.value_size(),
                max_entries: map.max_entries(),
                map_flags: map.map_flags(),
            };
            (name.clone(), definition)
        })
        .collect())
}

/// Lists the programs in the embedded object, sorted by name.
pub fn catalogue() -> Result<Vec<ProgramInfo>, ObjectError> {
    let object = Object::parse(EMBEDDED_OBJECT).map_err(|source| ObjectError::Parse { source })?;
    let mut programs: Vec<ProgramInfo> = object
        .programs
        .iter()
        .map(|(name, program)| {
            let (program_type, attach_point) = describe(&program.section);
            ProgramInfo {
                name: name.clone(),
                program_type,
                attach_point,
            }
        })
        .collect();
    programs.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(programs)
}

/// Kernel program type and the agent's attach point for a section.
fn describe(section: &ProgramSection) -> (String, String) {
    const AT_CGROUP: &str = "on the agent's cgroup (--cgroup)";
    match section {
        ProgramSection::CgroupSockAddr { attach_type } => {
            let hook = match attach_type {
                CgroupSockAddrAttachType::Connect4 => "connect4",
                CgroupSockAddrAttachType::Connect6 => "connect6",
                CgroupSockAddrAttachType::GetPeerName4 => "getpeername4",
                CgroupSockAddrAttachType::GetPeerName6 => "getpeername6",
                CgroupSockAddrAttachType::GetSockName4 => "getsockname4",
                CgroupSockAddrAttachType::GetSockName6 => "getsockname6",
                CgroupSockAddrAttachType::Bind4 => "bind4",
                CgroupSockAddrAttachType::Bind6 => "bind6",
                CgroupSockAddrAttachType::UDPSendMsg4 => "sendmsg4",
                CgroupSockAddrAttachType::UDPSendMsg6 => "sendmsg6",
                CgroupSockAddrAttachType::UDPRecvMsg4 => "recvmsg4",
                CgroupSockAddrAttachType::UDPRecvMsg6 => "recvmsg6",
            };
            (
                "cgroup_sock_addr".into(),
                format!("cgroup/{hook} {AT_CGROUP}"),
            )
        }
        ProgramSection::SockOps => ("sock_ops".into(), format!("cgroup sockops {AT_CGROUP}")),
        ProgramSection::CgroupSockopt { attach_type } => {
            let hook = match attach_type {
                CgroupSockoptAttachType::Get => "getsockopt",
                CgroupSockoptAttachType::Set => "setsockopt",
            };
            (
                "cgroup_sockopt".into(),
                format!("cgroup/{hook} {AT_CGROUP}"),
            )
        }
        ProgramSection::SkLookup => (
            "sk_lookup".into(),
            "each enrolled pod's network namespace (one link per pod)".into(),
        ),
        ProgramSection::SchedClassifier => (
            "sched_cls".into(),
            "tc ingress of lo in each pod served by an external in-pod proxy".into(),
        ),
        other => (format!("{other:?}").to_lowercase(), "not attached".into()),
    }
}

#[cfg(test)]
#[expect(
    clippy::unwrap_used,
    reason = "a broken embedded object should fail the test loudly"
)]
mod tests {
    use super::*;

    #[test]
    fn every_program_is_described_with_its_hook() {
        let programs = catalogue().unwrap();
        let attach = |name: &str| {
            programs
                .iter()
                .find(|p| p.name == name)
                .map(|p| (p.program_type.as_str(), p.attach_point.as_str()))
                .unwrap()
        };
        use dataplane_common::maps as m;
        assert!(attach(m::PROG_CONNECT4).1.starts_with("cgroup/connect4 "));
        assert!(attach(m::PROG_CONNECT6).1.starts_with("cgroup/connect6 "));
        assert!(
            attach(m::PROG_GETPEERNAME4)
                .1
                .starts_with("cgroup/getpeername4 ")
        );
        assert!(
            attach(m::PROG_GETPEERNAME6)
                .1
                .starts_with("cgroup/getpeername6 ")
        );
        assert_eq!(attach(m::PROG_GETSOCKOPT).0, "cgroup_sockopt");
        assert!(
            attach(m::PROG_GETSOCKOPT)
                .1
                .starts_with("cgroup/getsockopt ")
        );
        assert_eq!(attach(m::PROG_GETSOCKOPT_BY_TUPLE).0, "cgroup_sockopt");
        assert!(
            attach(m::PROG_GETSOCKOPT_BY_TUPLE)
                .1
                .starts_with("cgroup/getsockopt ")
        );
        assert_eq!(attach(m::PROG_SOCKOPS).0, "sock_ops");
        assert_eq!(attach(m::PROG_SK_LOOKUP).0, "sk_lookup");
        assert_eq!(attach(m::PROG_PROXY_SYN).0, "sched_cls");
        assert!(attach(m::PROG_PROXY_SYN).1.starts_with("tc ingress of lo "));
        for (program, hook) in [
            (m::PROG_DNS_SENDMSG4, "cgroup/sendmsg4 "),
            (m::PROG_DNS_SENDMSG6, "cgroup/sendmsg6 "),
            (m::PROG_DNS_RECVMSG4, "cgroup/recvmsg4 "),
            (m::PROG_DNS_RECVMSG6, "cgroup/recvmsg6 "),
        ] {
            assert!(attach(program).1.starts_with(hook), "{program}");
        }
        assert_eq!(programs.len(), 13);
    }
}
