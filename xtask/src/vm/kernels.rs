//! The kernels of the matrix: Debian's `-cloud-amd64` images (small, quick
//! to boot), fetched with `apt-get download` through a private apt
//! configuration (the system's sources are never touched), unpacked with
//! `dpkg-deb -x`, and cached.
//!
//! Cache: `$XDG_CACHE_HOME/dataplane/kernels/<package>/` (default
//! `~/.cache/...`) holds the kernel image, the modules the tests need
//! (decompressed, with their dependencies) and the release; it survives
//! `cargo clean` and fresh clones. `target/vm/kernels/<series>/` holds hard
//! links to the one in use. A run resolves the newest package only when
//! neither exists or `--refresh` is given; a cached kernel needs no network.

use std::{
    collections::{BTreeMap, HashMap},
    fs,
    path::{Path, PathBuf},
    process::Command,
    sync::atomic::{AtomicBool, Ordering},
};

use anyhow::{Context as _, Result, bail};

use super::TempDir;
use crate::cmd;

/// A kernel series of the matrix and the Debian suite that carries it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelSeries {
    /// `major.minor`, as `--kernel` takes it.
    pub name: &'static str,
    /// The archive's URL.
    pub archive: &'static str,
    /// The suite whose `linux-image-cloud-amd64` depends on this series.
    pub suite: &'static str,
}

/// Every series of the matrix, oldest first.
pub const SERIES: [KernelSeries; 3] = [
    KernelSeries {
        name: "5.10",
        archive: "http://deb.debian.org/debian-security",
        suite: "bullseye-security",
    },
    KernelSeries {
        name: "6.1",
        archive: "http://deb.debian.org/debian-security",
        suite: "bookworm-security",
    },
    KernelSeries {
        name: "6.12",
        archive: "http://deb.debian.org/debian",
        suite: "bookworm-backports",
    },
];

/// The meta-package each suite points at its newest cloud kernel with.
const META_PACKAGE: &str = "linux-image-cloud-amd64";

/// Modules the tests need that the cloud kernels build as modules, with
/// what needs them; their dependencies come along.
pub const MODULES: [(&str, &str); 6] = [
    ("veth", "pods' links to their node (veth pairs)"),
    ("bridge", "each simulated node's bridge"),
    (
        "sch_ingress",
        "the clsact qdisc dp_proxy_syn hangs off a pod's lo (external_proxy)",
    ),
    ("cls_bpf", "dp_proxy_syn's bpf filter (external_proxy)"),
    (
        "inet_diag",
        "sock_diag for TCP: the fast path resets connections a policy change denies (fast_path)",
    ),
    ("tcp_diag", "SOCK_DESTROY of TCP sockets (fast_path)"),
];

/// A kernel ready to boot.
#[derive(Debug, Clone)]
pub struct Kernel {
    /// The series.
    pub series: KernelSeries,
    /// Its `uname -r`.
    pub release: String,
    /// The kernel image.
    pub image: PathBuf,
    /// Modules in load order (dependencies first).
    pub modules: Vec<PathBuf>,
}

/// Files of a cached kernel.
const IMAGE: &str = "vmlinuz";
const RELEASE: &str = "release";
const MODULES_DIR: &str = "modules";
/// The module load order, one module file name a line.
const LOAD_ORDER: &str = "load-order";
/// The names of [`MODULES`] the cached kernel was extracted for, one a
/// line: a cache made for other modules is extracted again.
const MODULES_WANTED: &str = "modules-wanted";

/// The kernel of `series`: from `target/vm/kernels`, else the user cache,
/// else fetched. `refresh` resolves the newest package first.
pub fn kernel(series: KernelSeries, refresh: bool) -> Result<Kernel> {
    let in_target = target_kernels_dir().join(series.name);
    if !refresh
        && has_wanted_modules(&in_target)
        && let Ok(kernel) = read_cached(series, &in_target)
    {
        return Ok(kernel);
    }
    let cache = cache_dir()?;
    let remembered = cache.join(format!("{}.package", series.name));
    let package = match fs::read_to_string(&remembered) {
        Ok(name)
            if !refresh
                && cache.join(name.trim()).join(RELEASE).exists()
                && has_wanted_modules(&cache.join(name.trim())) =>
        {
            name.trim().to_owned()
        }
        _ => {
            let apt = PrivateApt::new(&cache.join("apt"))?;
            let package = apt.newest(series)?;
            if !cache.join(&package).join(RELEASE).exists()
                || !has_wanted_modules(&cache.join(&package))
            {
                fetch(&apt, &package, &cache)?;
            }
            fs::write(&remembered, &package)?;
            package
        }
    };
    link_tree(&cache.join(&package), &in_target)?;
    read_cached(series, &in_target)
}

/// Whether the kernel cached in `dir` was extracted with today's
/// [`MODULES`].
fn has_wanted_modules(dir: &Path) -> bool {
    fs::read_to_string(dir.join(MODULES_WANTED)).is_ok_and(|wanted| wanted == modules_wanted())
}

fn modules_wanted() -> String {
    MODULES
        .iter()
        .map(|(name, _)| format!("{name}\n"))
        .collect()
}

/// `target/vm/kernels`.
pub fn target_kernels_dir() -> PathBuf {
    cmd::target_dir().join("vm").join("kernels")
}

/// `$XDG_CACHE_HOME/dataplane/kernels` (default `~/.cache/...`).
fn cache_dir() -> Result<PathBuf> {
    let cache = match std::env::var_os("XDG_CACHE_HOME") {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir),
        _ => PathBuf::from(std::env::var_os("HOME").context("HOME is not set")?).join(".cache"),
    };
    let dir = cache.join("dataplane").join("kernels");
    fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    Ok(dir)
}

fn read_cached(series: KernelSeries, dir: &Path) -> Result<Kernel> {
    let release = fs::read_to_string(dir.join(RELEASE))?.trim().to_owned();
    let order = fs::read_to_string(dir.join(LOAD_ORDER))?;
    let modules = order
        .lines()
        .filter(|l| !l.is_empty())
        .map(|name| dir.join(MODULES_DIR).join(name))
        .collect();
    let image = dir.join(IMAGE);
    anyhow::ensure!(image.exists(), "{} is missing", image.display());
    Ok(Kernel {
        series,
        release,
        image,
        modules,
    })
}

/// Replaces `to` with hard links (copies across filesystems) of the files
/// in `from`.
fn link_tree(from: &Path, to: &Path) -> Result<()> {
    if to.exists() {
        fs::remove_dir_all(to).with_context(|| format!("cannot remove {}", to.display()))?;
    }
    fs::create_dir_all(to)?;
    for entry in fs::read_dir(from)? {
        let entry = entry?;
        let target = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            link_tree(&entry.path(), &target)?;
        } else if fs::hard_link(entry.path(), &target).is_err() {
            fs::copy(entry.path(), &target)?;
        }
    }
    Ok(())
}

/// `program` (`apt-get`, `apt-cache`) on the kernel cache's private apt
/// configuration, its lists updated first (once per run): how setup
/// fetches backported packages the system's sources do not offer.
pub fn private_apt(program: &str) -> Result<Command> {
    Ok(PrivateApt::new(&cache_dir()?.join("apt"))?.command(program))
}

/// An apt configuration of its own (sources, lists, cache, empty status)
/// under a cache directory: `apt-get update` and `download` with it leave
/// the system's apt state alone.
struct PrivateApt {
    dir: PathBuf,
}

impl PrivateApt {
    /// Writes the configuration for every series and updates its lists.
    fn new(dir: &Path) -> Result<Self> {
        for sub in ["lists/partial", "archives/partial", "etc/preferences.d"] {
            fs::create_dir_all(dir.join(sub))?;
        }
        let sources: String = SERIES
            .iter()
            .map(|s| {
                format!(
                    "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] {} {} main\n",
                    s.archive, s.suite
                )
            })
            .collect();
        fs::write(dir.join("etc/sources.list"), sources)?;
        fs::write(dir.join("status"), "")?;
        let apt = Self {
            dir: dir.to_path_buf(),
        };
        // Once per run is enough for every series.
        static UPDATED: AtomicBool = AtomicBool::new(false);
        if !UPDATED.load(Ordering::SeqCst) {
            println!(
                "vm-test: updating the private apt lists in {}",
                dir.display()
            );
            cmd::output(apt.command("apt-get").args(["-q", "update"]))?;
            UPDATED.store(true, Ordering::SeqCst);
        }
        Ok(apt)
    }

    /// `program` with every apt directory pointed into the private one.
    fn command(&self, program: &str) -> Command {
        let d = self.dir.display();
        let mut cmd = Command::new(program);
        for option in [
            format!("Dir::Etc::SourceList={d}/etc/sources.list"),
            format!("Dir::Etc::SourceParts={d}/etc/sources.list.d"),
            format!("Dir::Etc::Preferences={d}/etc/preferences"),
            format!("Dir::Etc::PreferencesParts={d}/etc/preferences.d"),
            format!("Dir::State::Lists={d}/lists"),
            format!("Dir::State::status={d}/status"),
            format!("Dir::Cache={d}"),
            format!("Dir::Cache::Archives={d}/archives"),
            "Debug::NoLocking=1".to_owned(),
            "APT::Sandbox::User=root".to_owned(),
        ] {
            cmd.arg("-o").arg(option);
        }
        cmd.env("DEBIAN_FRONTEND", "noninteractive");
        cmd
    }

    /// The newest cloud kernel package of `series`, from its suite's
    /// meta-package.
    fn newest(&self, series: KernelSeries) -> Result<String> {
        let show = cmd::output(self.command("apt-cache").args(["show", META_PACKAGE]))?;
        newest_in(&show, series.name).with_context(|| {
            format!(
                "{} {} has no {META_PACKAGE} for Linux {}",
                series.archive, series.suite, series.name
            )
        })
    }
}

/// Reads `apt-cache show` stanzas: the package the stanza of version
/// `series.*` depends on.
fn newest_in(show: &str, series: &str) -> Option<String> {
    let prefix = format!("{series}.");
    show.split("\n\n").find_map(|stanza| {
        let field = |name: &str| {
            stanza
                .lines()
                .find_map(|l| l.strip_prefix(name).map(str::trim))
        };
        let version = field("Version:")?;
        if !version.starts_with(&prefix) {
            return None;
        }
        let depends = field("Depends:")?;
        let first = depends.split([',', '|']).next()?.trim();
        Some(first.split_whitespace().next()?.to_owned())
    })
}

/// Downloads and unpacks `package` into `<cache>/<package>`.
fn fetch(apt: &PrivateApt, package: &str, cache: &Path) -> Result<()> {
    let work = TempDir::new(cache, &format!(".fetch-{package}"))?;
    println!("vm-test: fetching {package}");
    cmd::run(
        apt.command("apt-get")
            .args(["-q", "download", package])
            .current_dir(work.path()),
    )?;
    let deb = fs::read_dir(work.path())?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "deb"))
        .with_context(|| format!("apt-get download left no .deb for {package}"))?;
    let root = work.path().join("root");
    cmd::run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&root))?;

    let out = work.path().join("kernel");
    fs::create_dir_all(out.join(MODULES_DIR))?;
    let image = fs::read_dir(root.join("boot"))?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("vmlinuz-"))
        })
        .with_context(|| format!("{package} has no boot/vmlinuz-*"))?;
    let release = image
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.strip_prefix("vmlinuz-"))
        .context("kernel image name")?
        .to_owned();
    fs::copy(&image, out.join(IMAGE))?;

    let modules_root = root.join("lib/modules").join(&release);
    let order = extract_modules(&modules_root, &out.join(MODULES_DIR))?;
    fs::write(out.join(LOAD_ORDER), order.join("\n") + "\n")?;
    fs::write(out.join(MODULES_WANTED), modules_wanted())?;
    fs::write(out.join(RELEASE), format!("{release}\n"))?;
    let final_dir = cache.join(package);
    if final_dir.exists() {
        fs::remove_dir_all(&final_dir)?;
    }
    fs::rename(&out, &final_dir)
        .with_context(|| format!("cannot move the kernel into {}", final_dir.display()))?;
    println!("vm-test: cached {release} in {}", final_dir.display());
    Ok(())
}

/// Decompresses [`MODULES`] and their dependencies (those not built in)
/// from `modules_root` into `out`; returns their file names in load order.
fn extract_modules(modules_root: &Path, out: &Path) -> Result<Vec<String>> {
    let builtin = fs::read_to_string(modules_root.join("modules.builtin")).unwrap_or_default();
    let builtin: Vec<String> = builtin
        .lines()
        .filter_map(|l| Path::new(l).file_name())
        .map(|n| module_name(&n.to_string_lossy()))
        .collect();
    let mut index = HashMap::new();
    index_modules(&modules_root.join("kernel"), &mut index)?;

    let mut order = Vec::new();
    let mut done = BTreeMap::new();
    for (name, _) in MODULES {
        add_module(name, &index, &builtin, out, &mut done, &mut order)?;
    }
    Ok(order)
}

/// Adds `name` after its dependencies (depth first).
fn add_module(
    name: &str,
    index: &HashMap<String, PathBuf>,
    builtin: &[String],
    out: &Path,
    done: &mut BTreeMap<String, ()>,
    order: &mut Vec<String>,
) -> Result<()> {
    let name = module_name(name);
    if done.insert(name.clone(), ()).is_some() || builtin.contains(&name) {
        return Ok(());
    }
    let source = index
        .get(&name)
        .with_context(|| format!("module {name} is neither built in nor shipped"))?;
    let bytes = decompress(source)?;
    for dependency in depends(&bytes) {
        add_module(&dependency, index, builtin, out, done, order)?;
    }
    let file = format!("{name}.ko");
    fs::write(out.join(&file), &bytes)?;
    order.push(file);
    Ok(())
}

/// Every `*.ko[.xz|.zst]` under `dir`, by module name.
fn index_modules(dir: &Path, index: &mut HashMap<String, PathBuf>) -> Result<()> {
    for entry in fs::read_dir(dir)? {
        let entry = entry?;
        let path = entry.path();
        if entry.file_type()?.is_dir() {
            index_modules(&path, index)?;
        } else if let Some(name) = path.file_name().and_then(|n| n.to_str())
            && name.contains(".ko")
        {
            index.insert(module_name(name), path);
        }
    }
    Ok(())
}

/// `br_netfilter.ko.xz` and `br-netfilter` both name `br_netfilter`.
fn module_name(file: &str) -> String {
    file.split(".ko").next().unwrap_or(file).replace('-', "_")
}

/// A module file's contents, decompressed (`.xz`, `.zst` or plain).
fn decompress(path: &Path) -> Result<Vec<u8>> {
    let name = path.to_string_lossy();
    let tool = if name.ends_with(".xz") {
        Some("xz")
    } else if name.ends_with(".zst") {
        Some("zstd")
    } else {
        None
    };
    match tool {
        None => Ok(fs::read(path)?),
        Some(tool) => {
            let out = Command::new(tool)
                .arg("-dc")
                .arg(path)
                .output()
                .with_context(|| format!("cannot run {tool} to decompress a kernel module"))?;
            if !out.status.success() {
                bail!(
                    "{tool} -dc {name} failed: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            Ok(out.stdout)
        }
    }
}

/// The `depends=` list of a module's `.modinfo` section.
fn depends(module: &[u8]) -> Vec<String> {
    module
        .split(|b| *b == 0)
        .find_map(|field| field.strip_prefix(b"depends="))
        .map(|list| {
            String::from_utf8_lossy(list)
                .split(',')
                .filter(|d| !d.is_empty())
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_the_package_of_the_series() {
        let show = "Package: linux-image-cloud-amd64\nVersion: 6.12.95-1~bpo12+1\n\
                    Depends: linux-image-6.12.95+deb12-cloud-amd64 (= 6.12.95-1~bpo12+1)\n\n\
                    Package: linux-image-cloud-amd64\nVersion: 6.1.192-3\n\
                    Depends: linux-image-6.1.0-57-cloud-amd64 (= 6.1.192-3)\n\n\
                    Package: linux-image-cloud-amd64\nVersion: 5.10.262-1\n\
                    Depends: linux-image-5.10.0-46-cloud-amd64 (= 5.10.262-1)\n";
        assert_eq!(
            newest_in(show, "6.1").as_deref(),
            Some("linux-image-6.1.0-57-cloud-amd64")
        );
        assert_eq!(
            newest_in(show, "6.12").as_deref(),
            Some("linux-image-6.12.95+deb12-cloud-amd64")
        );
        assert_eq!(
            newest_in(show, "5.10").as_deref(),
            Some("linux-image-5.10.0-46-cloud-amd64")
        );
        assert_eq!(newest_in(show, "4.19"), None);
    }

    #[test]
    fn reads_module_dependencies() {
        let modinfo = b"\0license=GPL\0depends=stp,llc\0intree=Y\0";
        assert_eq!(depends(modinfo), ["stp", "llc"]);
        assert!(depends(b"\0depends=\0").is_empty());
        assert_eq!(module_name("br-netfilter.ko.xz"), "br_netfilter");
    }
}
