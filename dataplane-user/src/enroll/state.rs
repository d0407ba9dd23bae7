//! The instance's record of enrolled pods, so a restarted agent can re-adopt
//! them: `<state dir>/<instance>/pods.json`, replaced atomically.

use std::{
    io,
    path::{Path, PathBuf},
};

use super::PodStatus;

/// Errors reading or writing the state file.
#[derive(Debug, thiserror::Error)]
pub enum StateFileError {
    /// Reading or writing failed.
    #[error("cannot {action} enrollment state {path}")]
    Io {
        /// What was attempted.
        action: &'static str,
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The file exists but is not valid.
    #[error(
        "enrollment state {path} is corrupt (fix or delete it; pods it named must then be re-enrolled)"
    )]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// The parser's error.
        #[source]
        source: serde_json::Error,
    },
}

/// The state file of one agent instance.
#[derive(Debug, Clone)]
pub struct StateFile {
    path: PathBuf,
}

impl StateFile {
    /// The state file in `dir` (the instance's state directory).
    pub fn in_dir(dir: &Path) -> Self {
        Self {
            path: dir.join("pods.json"),
        }
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The recorded pods; none when the file does not exist.
    pub fn load(&self) -> Result<Vec<PodStatus>, StateFileError> {
        let text = match std::fs::read_to_string(&self.path) {
            Ok(text) => text,
            Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(source) => {
                return Err(StateFileError::Io {
                    action: "read",
                    path: self.path.clone(),
                    source,
                });
            }
        };
        serde_json::from_str(&text).map_err(|source| StateFileError::Corrupt {
            path: self.path.clone(),
            source,
        })
    }

    /// Replaces the record (write to a temporary file, then rename, so a
    /// crash never leaves half a file).
    pub fn save(&self, pods: &[PodStatus]) -> Result<(), StateFileError> {
        let io_err = |action, source| StateFileError::Io {
            action,
            path: self.path.clone(),
            source,
        };
        if let Some(dir) = self.path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| io_err("create the directory of", e))?;
        }
        let text = serde_json::to_string_pretty(pods).map_err(|e| io_err("serialise", e.into()))?;
        let tmp = self.path.with_extension("json.tmp");
        std::fs::write(&tmp, text).map_err(|e| io_err("write", e))?;
        std::fs::rename(&tmp, &self.path).map_err(|e| io_err("replace", e))
    }

    /// Deletes the record; a missing file is fine.
    pub fn remove(&self) -> Result<(), StateFileError> {
        match std::fs::remove_file(&self.path) {
            Ok(()) => Ok(()),
            Err(err) if err.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(source) => Err(StateFileError::Io {
                action: "remove",
                path: self.path.clone(),
                source,
            }),
        }
    }
}
