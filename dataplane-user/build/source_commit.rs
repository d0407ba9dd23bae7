//! The source commit `dataplane version` reports, as `DP_SOURCE_COMMIT`
//! (40 hex digits, or `unknown`) and `DP_SOURCE_DIRTY` (`true`, `false`
//! or `unknown`).
//!
//! Where it comes from, first match wins:
//! 1. `DP_SOURCE_COMMIT` in the build's environment (`<commit>` or
//!    `<commit>-dirty`): builds without `.git`, such as the container
//!    build, pass it in (`deploy/Containerfile`'s `SOURCE_COMMIT`).
//! 2. `git rev-parse HEAD` of the checkout this crate sits in, dirty when
//!    a tracked file of what goes into the binary differs from it. A git
//!    repository around an unpacked crate (a vendored copy inside another
//!    project) is not ours: its top must be this workspace's root.
//! 3. `unknown`.
//!
//! Rebuilds: the script reruns when HEAD moves (checkout, commit, reset),
//! when the index changes, and when a file of the binary's sources
//! changes (which rebuilds the crate anyway), never on a build with
//! nothing changed.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

/// Paths, relative to the workspace root, whose content ends up in the
/// agent binary: a change to one makes the tree dirty for this binary.
const SOURCES: [&str; 9] = [
    "Cargo.toml",
    "Cargo.lock",
    "common",
    "dataplane-ebpf",
    "dataplane-user/Cargo.toml",
    "dataplane-user/build.rs",
    "dataplane-user/build",
    "dataplane-user/src",
    "crates",
];

/// The environment variable that overrides git.
const OVERRIDE: &str = "DP_SOURCE_COMMIT";

/// Emits `DP_SOURCE_COMMIT` and `DP_SOURCE_DIRTY` for the crate, and
/// what should rerun this.
pub fn emit() {
    println!("cargo:rerun-if-env-changed={OVERRIDE}");
    let (commit, dirty) = match std::env::var(OVERRIDE) {
        Ok(given) if !given.trim().is_empty() => from_override(given.trim()),
        _ => from_git().unwrap_or_else(|| ("unknown".to_owned(), "unknown")),
    };
    println!("cargo:rustc-env=DP_SOURCE_COMMIT={commit}");
    println!("cargo:rustc-env=DP_SOURCE_DIRTY={dirty}");
}

fn from_override(given: &str) -> (String, &'static str) {
    let (commit, dirty) = match given.strip_suffix("-dirty") {
        Some(commit) => (commit, "true"),
        None => (given, "false"),
    };
    if commit.len() < 7 || !commit.bytes().all(|b| b.is_ascii_hexdigit()) {
        println!(
            "cargo:warning={OVERRIDE}={given:?} is not a commit id (hex, optionally with -dirty); `dataplane version` says unknown"
        );
        return ("unknown".to_owned(), "unknown");
    }
    (commit.to_owned(), dirty)
}

/// The commit and dirtiness from git, or `None` when this crate is not
/// in a git checkout of its workspace (or git is missing).
fn from_git() -> Option<(String, &'static str)> {
    let root = workspace_root()?;
    let top = git(&root, &["rev-parse", "--show-toplevel"])?;
    if std::fs::canonicalize(top.trim()).ok()? != root {
        return None;
    }
    watch_git_metadata(&root);
    for source in SOURCES {
        println!("cargo:rerun-if-changed={}", root.join(source).display());
    }
    let commit = git(&root, &["rev-parse", "HEAD"])?.trim().to_owned();
    // `--no-optional-locks`: status would otherwise refresh the index it
    // reads, and a rewritten index reruns this script once more.
    let mut status = vec![
        "--no-optional-locks",
        "status",
        "--porcelain",
        "--untracked-files=no",
        "--",
    ];
    status.extend(SOURCES);
    let dirty = match git(&root, &status) {
        Some(changes) if changes.trim().is_empty() => "false",
        Some(_) => "true",
        None => "unknown",
    };
    Some((commit, dirty))
}

/// The workspace root (this crate's parent), canonical.
fn workspace_root() -> Option<PathBuf> {
    let manifest = std::env::var_os("CARGO_MANIFEST_DIR")?;
    std::fs::canonicalize(Path::new(&manifest).parent()?).ok()
}

/// Reruns on a move of HEAD (its file, the branch it names, packed refs)
/// and on a change of the index (staging, committing). Worktrees keep
/// HEAD and the index in their own git directory, refs in the common one.
fn watch_git_metadata(root: &Path) {
    let Some(git_dir) = git(root, &["rev-parse", "--absolute-git-dir"]) else {
        return;
    };
    let git_dir = PathBuf::from(git_dir.trim());
    let common = git(root, &["rev-parse", "--git-common-dir"])
        .map(|c| root.join(c.trim()))
        .unwrap_or_else(|| git_dir.clone());
    let mut watched = vec![
        git_dir.join("HEAD"),
        git_dir.join("index"),
        common.join("packed-refs"),
    ];
    if let Some(branch) = git(root, &["symbolic-ref", "-q", "HEAD"]) {
        watched.push(common.join(branch.trim()));
    }
    // A path that does not exist would rerun every build; one that
    // appears later (packed refs) comes with a change to one that exists.
    for path in watched.iter().filter(|p| p.exists()) {
        println!("cargo:rerun-if-changed={}", path.display());
    }
}

/// `git -C root ARGS`'s stdout, or `None` if git is missing or fails.
fn git(root: &Path, args: &[&str]) -> Option<String> {
    let out = Command::new("git")
        .arg("-C")
        .arg(root)
        .args(args)
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}
