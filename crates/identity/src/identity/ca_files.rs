//! Reading and writing the CA's PEM files with safe permissions.
//!
//! The root key is the most sensitive secret the agent holds: whoever reads
//! it can mint any workload identity. It is created with mode 0600 in one
//! `open(2)` (`O_CREAT|O_EXCL`, mode 0600), so it is never world-readable,
//! not even between creating and `chmod`-ing it, and written to a temporary
//! name first so that a crash cannot leave a half-written key under the real
//! name.

use std::fs::{self, DirBuilder, OpenOptions};
use std::io::{ErrorKind, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;

use super::ca::CaError;

/// Mode of the root private key file.
pub(super) const KEY_MODE: u32 = 0o600;
/// Mode of the root certificate file (public).
pub(super) const CERT_MODE: u32 = 0o644;
/// Mode of a CA directory the agent creates.
const DIR_MODE: u32 = 0o700;

/// Whether `path` exists (an unreadable parent is an error, not "no").
pub(super) fn exists(path: &Path) -> Result<bool, CaError> {
    path.try_exists().map_err(|source| CaError::Io {
        action: "check for",
        path: path.to_owned(),
        source,
    })
}

/// Creates `dir` and missing parents with mode 0700. An existing directory is
/// left as it is (it may be a read-only mount the operator set up).
pub(super) fn create_dir_private(dir: &Path) -> Result<(), CaError> {
    DirBuilder::new()
        .recursive(true)
        .mode(DIR_MODE)
        .create(dir)
        .map_err(|source| CaError::Io {
            action: "create directory",
            path: dir.to_owned(),
            source,
        })
}

/// Holds an exclusive lock on `<dir>/.lock` until dropped, so that agents
/// starting at once on a fresh shared directory generate one root, not two
/// half-overwritten ones.
pub(super) fn lock_dir(dir: &Path) -> Result<nix::fcntl::Flock<fs::File>, CaError> {
    let path = dir.join(".lock");
    let file = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .mode(KEY_MODE)
        .open(&path)
        .map_err(|source| CaError::Io {
            action: "open the lock file",
            path: path.clone(),
            source,
        })?;
    nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusive).map_err(|(_, errno)| {
        CaError::Io {
            action: "lock",
            path,
            source: errno.into(),
        }
    })
}

/// Writes `contents` to the new file `path` with exactly `mode`: written and
/// synced under a temporary name created with that mode, then renamed.
pub(super) fn write_new(path: &Path, contents: &[u8], mode: u32) -> Result<(), CaError> {
    let mut tmp_name = path.as_os_str().to_owned();
    tmp_name.push(".tmp");
    let tmp = Path::new(&tmp_name);
    let io = |action, path: &Path| {
        let path = path.to_owned();
        move |source| CaError::Io {
            action,
            path,
            source,
        }
    };
    // A leftover from a crash may have any mode; never reuse it.
    match fs::remove_file(tmp) {
        Err(e) if e.kind() != ErrorKind::NotFound => return Err(io("remove stale", tmp)(e)),
        _ => {}
    }
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(tmp)
        .map_err(io("create", tmp))?;
    // The umask can only clear bits of `mode`; set it exactly so a restrictive
    // umask does not leave the agent unable to read its own key.
    file.set_permissions(fs::Permissions::from_mode(mode))
        .map_err(io("set permissions of", tmp))?;
    file.write_all(contents).map_err(io("write", tmp))?;
    file.sync_all().map_err(io("sync", tmp))?;
    drop(file);
    fs::rename(tmp, path).map_err(io("rename into place", path))?;
    Ok(())
}

/// Reads a whole PEM file.
pub(super) fn read_to_string(path: &Path) -> Result<String, CaError> {
    fs::read_to_string(path).map_err(|source| CaError::Io {
        action: "read",
        path: path.to_owned(),
        source,
    })
}

/// A key readable by group or others is accepted (Kubernetes mounts Secrets
/// 0644 unless told otherwise) but reported, with the fix.
pub(super) fn warn_if_readable_by_others(key: &Path) {
    if let Ok(meta) = fs::metadata(key) {
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            tracing::warn!(
                path = %key.display(),
                mode = format_args!("{mode:o}"),
                "CA root key is readable by group or others; chmod 600 it (or set defaultMode: 0400 on the Secret volume)"
            );
        }
    }
}
