//! Running external commands: print each one before it runs, and turn a
//! failure into an error that names the command and how it ended.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};

use anyhow::{Context as _, Result, bail};

/// The workspace root (the directory that holds the root `Cargo.toml`).
pub fn workspace_root() -> PathBuf {
    let xtask_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    xtask_dir.parent().unwrap_or(xtask_dir).to_path_buf()
}

/// The cargo target directory: `$CARGO_TARGET_DIR` if set, else `<root>/target`.
pub fn target_dir() -> PathBuf {
    let root = workspace_root();
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) => root.join(dir),
        None => root.join("target"),
    }
}

/// A `cargo` command (the rustup proxy on `PATH`, so `+nightly` works) that
/// runs in the workspace root.
pub fn cargo() -> Command {
    let mut cmd = Command::new("cargo");
    cmd.current_dir(workspace_root());
    cmd
}

/// Renders a command the way a shell user would type it, with the
/// environment variables it sets in front.
pub fn display(cmd: &Command) -> String {
    let envs = cmd.get_envs().filter_map(|(key, value)| {
        value.map(|value| format!("{}={}", key.to_string_lossy(), quote(value)))
    });
    let words = std::iter::once(quote(cmd.get_program())).chain(cmd.get_args().map(quote));
    envs.chain(words).collect::<Vec<_>>().join(" ")
}

/// Quotes one shell word if it needs it.
fn quote(word: &OsStr) -> String {
    let word = word.to_string_lossy();
    let plain = !word.is_empty()
        && word
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./=+:@,%".contains(c));
    if plain {
        word.into_owned()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

/// Describes how a process ended: its exit code or the signal that killed it.
pub fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt as _;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exit status {code}"),
        (None, Some(signal)) => format!("signal {signal}"),
        (None, None) => status.to_string(),
    }
}

/// Prints and runs `cmd` with inherited stdio; fails unless it exits 0.
pub fn run(cmd: &mut Command) -> Result<()> {
    let shown = display(cmd);
    println!("+ {shown}");
    let status = cmd
        .status()
        .with_context(|| format!("cannot start `{shown}`"))?;
    if !status.success() {
        bail!("`{shown}` failed with {}", describe(status));
    }
    Ok(())
}

/// Runs `cmd` quietly (a probe, not an action) and returns its stdout; fails
/// with its stderr unless it exits 0.
pub fn output(cmd: &mut Command) -> Result<String> {
    let shown = display(cmd);
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("cannot start `{shown}`"))?;
    if !out.status.success() {
        bail!(
            "`{shown}` failed with {}: {}",
            describe(out.status),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Like [`output`], but `None` when the command cannot start or fails.
pub fn probe(cmd: &mut Command) -> Option<String> {
    output(cmd).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_quotes_only_what_needs_it() {
        let mut cmd = Command::new("cargo");
        cmd.args(["install", "bpf-linker@0.13.0", "two words", "it's"])
            .env("LLVM_PREFIX", "/tmp/p");
        assert_eq!(
            display(&cmd),
            r"LLVM_PREFIX=/tmp/p cargo install bpf-linker@0.13.0 'two words' 'it'\''s'"
        );
    }

    #[test]
    fn run_names_the_failed_command_and_status() {
        let err = run(Command::new("sh").args(["-c", "exit 3"])).expect_err("must fail");
        assert_eq!(
            err.to_string(),
            "`sh -c 'exit 3'` failed with exit status 3"
        );
    }
}
