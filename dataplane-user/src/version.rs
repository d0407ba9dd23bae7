//! `dataplane version`: what this binary is and what it carries.

use serde::Serialize;

use crate::redirect::{self, LAYOUT_VERSION, ObjectError, ProgramInfo};

/// Everything `dataplane version` reports.
#[derive(Debug, Serialize)]
pub struct VersionReport {
    /// The agent's own version.
    pub version: &'static str,
    /// Locked versions of key dependencies ("name version").
    pub dependencies: Vec<&'static str>,
    /// Version of the pinned-state layout in bpffs.
    pub pin_layout: &'static str,
    /// Programs in the embedded kernel object.
    pub programs: Vec<ProgramInfo>,
}

/// Builds the report from the binary itself.
pub fn report() -> Result<VersionReport, ObjectError> {
    Ok(VersionReport {
        version: env!("CARGO_PKG_VERSION"),
        dependencies: env!("DP_DEPENDENCY_VERSIONS")
            .split(", ")
            .filter(|s| !s.is_empty())
            .collect(),
        pin_layout: LAYOUT_VERSION,
        programs: redirect::catalogue()?,
    })
}

impl std::fmt::Display for VersionReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "dataplane {}", self.version)?;
        writeln!(f, "dependencies: {}", self.dependencies.join(", "))?;
        writeln!(f, "pinned state layout: {}", self.pin_layout)?;
        writeln!(f, "embedded kernel programs:")?;
        let width = self
            .programs
            .iter()
            .map(|p| p.name.len())
            .max()
            .unwrap_or(0);
        let type_width = self
            .programs
            .iter()
            .map(|p| p.program_type.len())
            .max()
            .unwrap_or(0);
        for p in &self.programs {
            writeln!(
                f,
                "  {:width$}  {:type_width$}  {}",
                p.name, p.program_type, p.attach_point
            )?;
        }
        Ok(())
    }
}
