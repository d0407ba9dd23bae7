//! bpf-linker, built against the nightly toolchain's own libLLVM so that the
//! bitcode rustc emits and the LLVM that links it always match.
//!
//! `cargo install` links bpf-linker to `$LLVM_PREFIX/lib/libLLVM.so` and
//! records `$LLVM_PREFIX/lib` as its RUNPATH, where the loader then looks for
//! libLLVM's soname. The prefix therefore holds two symlinks into the nightly
//! sysroot (`libLLVM.so` and the soname file) and lives in a cache directory
//! that `cargo clean` leaves alone. Builds run bpf-linker under
//! `rustup run nightly` (aya-build does), which also puts the sysroot's
//! `lib` on `LD_LIBRARY_PATH`; that is how presence is checked. When nightly
//! moves to another LLVM the old soname disappears, the check fails, and
//! setup rebuilds.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context as _, Result, anyhow, bail};

use super::Progress;
use crate::cmd;

/// The bpf-linker release this project builds with.
const VERSION: &str = "0.13.0";

/// Checks bpf-linker and installs it when missing, of another version, or
/// unable to load its libLLVM. `root` replaces cargo's install root.
pub fn ensure(progress: &mut Progress, root: Option<&Path>) -> Result<()> {
    let thing = format!("bpf-linker {VERSION}");
    if let Some(path) = locate(root)
        && version_under_nightly(&path).as_deref() == Some(VERSION)
    {
        progress.present(&format!("{thing} ({})", path.display()));
        return Ok(());
    }

    let (major, sysroot) = nightly_llvm()?;
    let prefix = prefix_dir()?;
    let libllvm = find_libllvm(&sysroot.join("lib"), major)?;
    populate_prefix(&prefix, &libllvm)?;
    progress.installing(&thing);
    println!("building it against the nightly toolchain's LLVM {major}: this takes a few minutes");
    install(&prefix, major, root)?;

    let installed = install_root(root)?.join("bin").join("bpf-linker");
    match standalone_version(&installed) {
        Some(version) if version == VERSION => {}
        other => bail!(
            "{} was installed but `--version` reports {other:?}; check `ldd {}`",
            installed.display(),
            installed.display()
        ),
    }
    if root.is_none() && locate(None).as_deref() != Some(installed.as_path()) {
        eprintln!(
            "warning: another bpf-linker comes first on PATH; builds will use it, not {}",
            installed.display()
        );
    }
    Ok(())
}

/// `<root>/bin/bpf-linker` if `root` is given, else the first bpf-linker on
/// `PATH`, else cargo's install directory (which may not be on `PATH`).
fn locate(root: Option<&Path>) -> Option<PathBuf> {
    let candidates = match root {
        Some(root) => vec![root.join("bin")],
        None => std::env::var_os("PATH")
            .map(|path| std::env::split_paths(&path).collect::<Vec<_>>())
            .unwrap_or_default()
            .into_iter()
            .chain(install_root(None).ok().map(|root| root.join("bin")))
            .collect(),
    };
    candidates
        .into_iter()
        .map(|dir| dir.join("bpf-linker"))
        .find(|path| path.is_file())
}

/// The version `bpf-linker --version` reports when run as builds run it.
fn version_under_nightly(path: &Path) -> Option<String> {
    let out = cmd::probe(
        Command::new("rustup")
            .args(["run", "nightly"])
            .arg(path)
            .arg("--version"),
    )?;
    parse_version(&out)
}

/// The version `bpf-linker --version` reports when run on its own.
fn standalone_version(path: &Path) -> Option<String> {
    parse_version(&cmd::probe(Command::new(path).arg("--version"))?)
}

/// Reads `bpf-linker 0.13.0`.
fn parse_version(out: &str) -> Option<String> {
    out.split_whitespace()
        .skip_while(|word| *word != "bpf-linker")
        .nth(1)
        .map(str::to_owned)
}

/// The nightly toolchain's LLVM major version and its sysroot.
fn nightly_llvm() -> Result<(u32, PathBuf)> {
    let verbose = cmd::output(Command::new("rustc").args(["+nightly", "-vV"]))?;
    let major = parse_llvm_major(&verbose)?;
    let sysroot = cmd::output(Command::new("rustc").args(["+nightly", "--print", "sysroot"]))?;
    Ok((major, PathBuf::from(sysroot.trim())))
}

/// Reads the `LLVM version: 22.1.4` line of `rustc -vV`.
fn parse_llvm_major(verbose: &str) -> Result<u32> {
    let version = verbose
        .lines()
        .find_map(|line| line.strip_prefix("LLVM version:"))
        .ok_or_else(|| anyhow!("`rustc +nightly -vV` printed no `LLVM version:` line"))?;
    let major = version.trim().split('.').next().unwrap_or_default();
    major.parse().with_context(|| {
        format!(
            "cannot read the LLVM major version from `{}`",
            version.trim()
        )
    })
}

/// The shared libLLVM in a toolchain's `lib` directory: the file matching
/// `libLLVM.so.<major>*` (e.g. `libLLVM.so.22.1-rust-1.97.0-nightly`).
fn find_libllvm(lib_dir: &Path, major: u32) -> Result<PathBuf> {
    let stem = format!("libLLVM.so.{major}");
    let entries =
        std::fs::read_dir(lib_dir).with_context(|| format!("cannot list {}", lib_dir.display()))?;
    let mut found = Vec::new();
    for entry in entries {
        let name = entry?.file_name();
        let name = name.to_string_lossy();
        if let Some(rest) = name.strip_prefix(&stem)
            && (rest.is_empty() || rest.starts_with(['.', '-']))
        {
            found.push(lib_dir.join(name.as_ref()));
        }
    }
    found.sort();
    found.into_iter().next().ok_or_else(|| {
        anyhow!(
            "no {stem}* in {}: the nightly toolchain ships no shared LLVM to link bpf-linker to",
            lib_dir.display()
        )
    })
}

/// `$XDG_CACHE_HOME/dataplane/llvm-prefix` (default `~/.cache/...`): it must
/// outlive the install, since bpf-linker finds libLLVM through it at run time.
fn prefix_dir() -> Result<PathBuf> {
    let cache = match std::env::var_os("XDG_CACHE_HOME") {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir),
        _ => home()?.join(".cache"),
    };
    Ok(cache.join("dataplane").join("llvm-prefix"))
}

/// Makes `<prefix>/lib` hold `libLLVM.so` (for the link) and libLLVM's own
/// file name (for the loader), both pointing at `libllvm`.
fn populate_prefix(prefix: &Path, libllvm: &Path) -> Result<()> {
    let lib = prefix.join("lib");
    std::fs::create_dir_all(&lib).with_context(|| format!("cannot create {}", lib.display()))?;
    for entry in std::fs::read_dir(&lib)? {
        let path = entry?.path();
        if path.is_symlink() {
            std::fs::remove_file(&path)
                .with_context(|| format!("cannot remove {}", path.display()))?;
        }
    }
    let file_name = libllvm
        .file_name()
        .ok_or_else(|| anyhow!("{} has no file name", libllvm.display()))?;
    for link in [lib.join("libLLVM.so"), lib.join(file_name)] {
        std::os::unix::fs::symlink(libllvm, &link)
            .with_context(|| format!("cannot link {} -> {}", link.display(), libllvm.display()))?;
    }
    Ok(())
}

/// Where `cargo install` puts binaries (under `bin/`): `root`, else
/// `$CARGO_HOME`, else `~/.cargo`.
fn install_root(root: Option<&Path>) -> Result<PathBuf> {
    if let Some(root) = root {
        return Ok(root.to_path_buf());
    }
    match std::env::var_os("CARGO_HOME") {
        Some(home) if !home.is_empty() => Ok(PathBuf::from(home)),
        _ => Ok(home()?.join(".cargo")),
    }
}

/// `$HOME`.
fn home() -> Result<PathBuf> {
    std::env::var_os("HOME")
        .filter(|home| !home.is_empty())
        .map(PathBuf::from)
        .ok_or_else(|| anyhow!("HOME is not set"))
}

/// `cargo install bpf-linker`, with the locked dependency set first and, if
/// that fails to build, with fresh dependencies. `--force` replaces an
/// installed bpf-linker of the same version that no longer runs.
fn install(prefix: &Path, major: u32, root: Option<&Path>) -> Result<()> {
    let attempt = |locked: bool| {
        let mut cargo = Command::new("cargo");
        // Outside the workspace, so its cargo config and toolchain files
        // play no part.
        cargo.current_dir(prefix).env("LLVM_PREFIX", prefix).args([
            "install",
            &format!("bpf-linker@{VERSION}"),
            "--force",
            "--no-default-features",
            "--features",
            &format!("llvm-{major}"),
        ]);
        if locked {
            cargo.arg("--locked");
        }
        if let Some(root) = root {
            cargo.arg("--root").arg(root);
        }
        cmd::run(&mut cargo)
    };
    attempt(true).or_else(|err| {
        eprintln!("{err:#}\nretrying without --locked");
        attempt(false)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh directory under the system temp dir.
    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("xtask-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create scratch dir");
        dir
    }

    #[test]
    fn reads_versions() {
        let verbose = "rustc 1.97.0-nightly (e50aa6fba 2026-05-19)\nbinary: rustc\n\
                       host: x86_64-unknown-linux-gnu\nLLVM version: 22.1.4\n";
        assert_eq!(parse_llvm_major(verbose).expect("major"), 22);
        assert!(parse_llvm_major("rustc 1.97.0-nightly\n").is_err());
        assert_eq!(
            parse_version("bpf-linker 0.13.0\n").as_deref(),
            Some("0.13.0")
        );
        assert_eq!(parse_version("error while loading shared libraries"), None);
    }

    #[test]
    fn finds_libllvm_and_builds_the_prefix() {
        let sysroot_lib = scratch("sysroot-lib");
        for name in [
            "libLLVM-22-rust-1.97.0-nightly.so",
            "libLLVM.so.22.1-rust-1.97.0-nightly",
            "libLLVM.so.221.0",
            "librustc_driver-b5a965480ee51f9a.so",
        ] {
            std::fs::write(sysroot_lib.join(name), name).expect("write fake library");
        }
        let libllvm = find_libllvm(&sysroot_lib, 22).expect("libLLVM found");
        assert_eq!(
            libllvm,
            sysroot_lib.join("libLLVM.so.22.1-rust-1.97.0-nightly")
        );
        assert!(find_libllvm(&sysroot_lib, 23).is_err());

        let prefix = scratch("prefix");
        // Twice: a re-run replaces the links of an earlier nightly.
        populate_prefix(&prefix, &sysroot_lib.join("libLLVM.so.221.0")).expect("prefix");
        populate_prefix(&prefix, &libllvm).expect("prefix again");
        let mut links: Vec<_> = std::fs::read_dir(prefix.join("lib"))
            .expect("prefix lib")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        links.sort();
        assert_eq!(links, ["libLLVM.so", "libLLVM.so.22.1-rust-1.97.0-nightly"]);
        for link in &links {
            let target = std::fs::read_link(prefix.join("lib").join(link)).expect("symlink");
            assert_eq!(target, libllvm);
        }
        let _ = std::fs::remove_dir_all(sysroot_lib);
        let _ = std::fs::remove_dir_all(prefix);
    }
}
