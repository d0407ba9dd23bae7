//! `dataplane version`: what this binary is and what it carries.

use serde::Serialize;

use crate::redirect::{self, LAYOUT_VERSION, ObjectError, ProgramInfo};

/// Everything `dataplane version` reports.
#[derive(Debug, Serialize)]
pub struct VersionReport {
    /// The agent's own version.
    pub version: &'static str,
    /// The source commit it was built from (`git rev-parse HEAD`, or the
    /// build's `DP_SOURCE_COMMIT`); `unknown` when built outside a git
    /// checkout without it.
    pub commit: &'static str,
    /// Whether the sources differed from [`VersionReport::commit`]
    /// (`None`: unknown).
    pub dirty: Option<bool>,
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
        commit: env!("DP_SOURCE_COMMIT"),
        dirty: match env!("DP_SOURCE_DIRTY") {
            "true" => Some(true),
            "false" => Some(false),
            _ => None,
        },
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
        match (self.commit, self.dirty) {
            ("unknown", _) => writeln!(
                f,
                "commit: unknown (built outside a git checkout without DP_SOURCE_COMMIT)"
            )?,
            (commit, Some(true)) => writeln!(f, "commit: {commit} (with uncommitted changes)")?,
            (commit, Some(false)) => writeln!(f, "commit: {commit}")?,
            (commit, None) => writeln!(f, "commit: {commit} (changes unknown)")?,
        }
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
