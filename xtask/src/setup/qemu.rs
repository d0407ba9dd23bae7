//! `qemu-system-x86` for a machine whose `qemu-utils` came from Debian
//! backports.
//!
//! Some machines ship `qemu-utils` from `bookworm-backports` (version
//! `...~bpo12+1`) without that suite in their apt sources. The system's
//! `qemu-system-x86` is then the stable release's, whose
//! `qemu-system-common` conflicts with the newer `qemu-utils`: apt would
//! remove it, which setup never does. Instead, setup fetches
//! `qemu-system-x86`, `-common` and `-data` of exactly the installed
//! `qemu-utils` version, and the backported `seabios` they need, through
//! the kernel cache's private apt configuration (which has the backports
//! suite; the system's apt state is not touched), and installs those files
//! with the system's apt, again only if nothing would be removed.

use std::{fs, path::PathBuf, process::Command};

use anyhow::{Context as _, Result};

use super::{Progress, apt};
use crate::cmd;

/// The packages of one qemu version that must match `qemu-utils`.
const MATCHING: [&str; 3] = ["qemu-system-x86", "qemu-system-common", "qemu-system-data"];

/// Installs `package` the way described above when it is
/// `qemu-system-x86` and the installed `qemu-utils` is a backport; returns
/// whether it did.
pub fn install_matching(package: &str, progress: &mut Progress) -> Result<bool> {
    if package != MATCHING[0] {
        return Ok(false);
    }
    let Some(version) = installed_version("qemu-utils") else {
        return Ok(false);
    };
    let Some(suite) = backports_suite(&version) else {
        return Ok(false);
    };
    let dir = debs_dir()?;
    let installed = fetch_and_install(&version, suite, &dir, progress);
    let _ = fs::remove_dir_all(&dir);
    installed
}

/// Fetches the packages of `version` (and `seabios` of `suite`) into `dir`
/// and installs them unless apt would remove something.
fn fetch_and_install(
    version: &str,
    suite: &str,
    dir: &std::path::Path,
    progress: &mut Progress,
) -> Result<bool> {
    let mut wanted: Vec<String> = MATCHING.iter().map(|p| format!("{p}={version}")).collect();
    wanted.push(format!("seabios/{suite}"));
    let mut download = crate::vm::private_apt("apt-get")?;
    download
        .current_dir(dir)
        .args(["-q", "download"])
        .args(&wanted);
    if let Err(err) = cmd::run(&mut download) {
        println!(
            "warning: cannot fetch {} from {suite}: {err:#}",
            wanted.join(" ")
        );
        return Ok(false);
    }
    let files: Vec<String> = fs::read_dir(dir)?
        .filter_map(|entry| entry.ok())
        .map(|entry| entry.path())
        .filter(|path| path.extension().is_some_and(|e| e == "deb"))
        .map(|path| path.display().to_string())
        .collect();
    let removed = apt::removals(&files)?;
    if !removed.is_empty() {
        println!(
            "warning: installing qemu {version} from {suite} would remove {}",
            removed.join(" ")
        );
        return Ok(false);
    }
    progress.installing(&format!(
        "qemu {version} from {suite} (matching qemu-utils)"
    ));
    apt::install_packages(&files)?;
    Ok(true)
}

/// The installed version of `package`, if it is installed.
fn installed_version(package: &str) -> Option<String> {
    if !apt::is_installed(package) {
        return None;
    }
    cmd::probe(Command::new("dpkg-query").args(["-W", "-f=${Version}", package]))
        .map(|v| v.trim().to_owned())
        .filter(|v| !v.is_empty())
}

/// The backports suite a Debian version string comes from (`~bpo12+1`:
/// `bookworm-backports`), if it is a backport of a release setup knows.
fn backports_suite(version: &str) -> Option<&'static str> {
    let release = version.split("~bpo").nth(1)?;
    let number: String = release.chars().take_while(char::is_ascii_digit).collect();
    match number.as_str() {
        "11" => Some("bullseye-backports"),
        "12" => Some("bookworm-backports"),
        "13" => Some("trixie-backports"),
        _ => None,
    }
}

/// An empty directory for the fetched packages.
fn debs_dir() -> Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("dataplane-qemu-debs-{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::backports_suite;

    #[test]
    fn names_the_backports_suite_of_a_version() {
        assert_eq!(
            backports_suite("1:10.0.2+ds-2+deb13u1~bpo12+1"),
            Some("bookworm-backports")
        );
        assert_eq!(
            backports_suite("1.16.3-2~bpo11+1"),
            Some("bullseye-backports")
        );
        assert_eq!(backports_suite("1:7.2+dfsg-7+deb12u18"), None);
        assert_eq!(backports_suite("1~bpo99"), None);
    }
}
