//! The kernel object embedded in the agent, and a catalogue of its programs
//! read from the object itself (so `dataplane version` cannot drift from what
//! is actually shipped).

use aya_obj::{Object, ProgramSection};

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
    match section {
        ProgramSection::CgroupSockAddr { attach_type } => (
            "cgroup_sock_addr".into(),
            format!("cgroup/{attach_type:?} on the agent's cgroup (--cgroup)").to_lowercase(),
        ),
        ProgramSection::SockOps => (
            "sock_ops".into(),
            "cgroup sockops on the agent's cgroup (--cgroup)".into(),
        ),
        ProgramSection::CgroupSockopt { attach_type } => (
            "cgroup_sockopt".into(),
            format!("cgroup/{attach_type:?} on the agent's cgroup (--cgroup)").to_lowercase(),
        ),
        ProgramSection::SkLookup => (
            "sk_lookup".into(),
            "each enrolled pod's network namespace".into(),
        ),
        other => (format!("{other:?}").to_lowercase(), "not attached".into()),
    }
}
