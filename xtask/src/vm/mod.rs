//! `cargo xtask vm-test`: the redirection suite on every supported kernel.
//!
//! eBPF programs that pass the verifier on one kernel can fail on another,
//! so the suite runs on Debian's 5.10, 6.1 and 6.12 cloud kernels under
//! qemu, and on the host's kernel, and the result is one table.
//!
//! For each kernel: fetch it once ([`kernels`], cached under `target/` and
//! `~/.cache/dataplane/kernels`), pack an initramfs ([`initramfs`]) holding
//! busybox, `ip` and `bpftool` with their libraries, the agent and the test
//! binaries (the eBPF object is embedded in them) and `tests/vm/init.sh` as
//! `/init`; boot it ([`qemu`]); the guest mounts cgroup2 and bpffs, creates
//! its own namespaces, veths and cgroups, runs every binary of [`SUITE`]
//! and reports on a second serial port ([`report`]). Test binaries are the
//! ones `cargo xtask test` builds (debug profile), with their debug info
//! stripped. Guests run two at a time (`--jobs`); the host's run comes last,
//! alone.
//!
//! Nothing outlives a run: qemu is killed by a guard (and dies with xtask),
//! and the work directory `target/vm/run-<pid>` is removed on the way out,
//! also after Ctrl-C; one left by a killed xtask is removed by the next run.
//! Logs of the last run stay in `target/vm/logs/`, the table in
//! `target/vm/report.md`.

mod initramfs;
mod kernels;
pub use kernels::private_apt;
mod qemu;
mod report;

use std::{
    collections::BTreeMap,
    fs,
    path::{Path, PathBuf},
    process::{Command, ExitCode, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use serde_json::Value;

use crate::{build, cmd, setup};
use initramfs::Tree;
use kernels::KernelSeries;
use report::{BinaryRun, Ending, KernelRun};

/// The redirection suite: every integration test of the kernel programs
/// and of the agent driving them, in run order.
pub const SUITE: [&str; 8] = [
    "kernel_features",
    "connect4_seed",
    "redirect_kernel",
    "topology",
    "agent_lifecycle",
    "capture_e2e",
    "external_proxy",
    "fast_path",
];

/// Integration tests left out of the matrix, with why (every one runs on
/// the host kernel in `cargo xtask test`; `--test NAME` runs one in VMs).
const LEFT_OUT: [(&str, &str); 1] = [(
    "hbone_e2e",
    "HBONE (TLS, HTTP/2) on top of the capture `capture_e2e` proves on each kernel; \
     its debug-build TLS transfers of 16 MiB under software emulation take 2 to 5 \
     minutes per kernel and brush against its 30 s I/O timeouts",
)];

/// Why the other integration tests are left out.
const NOT_REDIRECTION: &str = "Kubernetes, CNI, config and deployment integration, not the \
                               redirection suite";

/// Binaries the tests spawn, found next to the test executables.
const SPAWNED: [&str; 4] = ["dataplane", "dp-probe", "dp-stream", "dp-inpod-proxy"];

/// Host tools the tests call, packed with their libraries.
const TOOLS: [(&str, &str); 2] = [
    ("ip", "network namespaces, veths, bridges, addresses"),
    (
        "bpftool",
        "redirect_kernel lists sk_lookup links, external_proxy tc filters",
    ),
];

/// How long one test binary may run inside a guest.
const PER_BINARY_LIMIT: Duration = Duration::from_secs(900);

/// `cargo xtask vm-test` options.
#[derive(Debug, clap::Args)]
pub struct VmTestArgs {
    /// Kernels to run the suite on: 5.10, 6.1, 6.12 (in VMs), host, or
    /// all of them. Repeatable.
    #[arg(
        long = "kernel",
        value_name = "KERNEL",
        default_value = "all",
        value_parser = ["5.10", "6.1", "6.12", "host", "all"],
    )]
    kernels: Vec<String>,
    /// Look for newer kernel packages instead of reusing cached ones.
    #[arg(long)]
    refresh: bool,
    /// Time limit per VM, in seconds (boot, suite and power-off).
    #[arg(long, value_name = "SECONDS", default_value_t = 1200)]
    timeout: u64,
    /// Guests to run at once. Each is mostly one busy host thread (qemu's
    /// software emulation), so two share a 2-core machine well.
    #[arg(long, value_name = "N", default_value_t = 2)]
    jobs: usize,
    /// Run only these test binaries of the suite (e.g. `redirect_kernel`).
    /// Repeatable.
    #[arg(long = "test", value_name = "NAME")]
    tests: Vec<String>,
}

/// A directory removed (recursively) on drop.
#[derive(Debug)]
pub struct TempDir {
    path: PathBuf,
}

impl TempDir {
    /// Creates `<parent>/<name>`, replacing a stale one.
    pub fn new(parent: &Path, name: &str) -> Result<Self> {
        let path = parent.join(name);
        if path.exists() {
            fs::remove_dir_all(&path)
                .with_context(|| format!("cannot remove stale {}", path.display()))?;
        }
        fs::create_dir_all(&path).with_context(|| format!("cannot create {}", path.display()))?;
        Ok(Self { path })
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if let Err(e) = fs::remove_dir_all(&self.path)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            eprintln!("vm-test: cannot remove {}: {e}", self.path.display());
        }
    }
}

/// What to run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Target {
    Vm(KernelSeries),
    Host,
}

impl Target {
    fn label(self) -> &'static str {
        match self {
            Target::Vm(series) => series.name,
            Target::Host => "host",
        }
    }
}

fn targets(chosen: &[String]) -> Vec<Target> {
    let all = chosen.iter().any(|k| k == "all");
    let mut out: Vec<Target> = kernels::SERIES
        .iter()
        .filter(|s| all || chosen.iter().any(|k| k == s.name))
        .map(|s| Target::Vm(*s))
        .collect();
    if all || chosen.iter().any(|k| k == "host") {
        out.push(Target::Host);
    }
    out
}

/// `cargo xtask vm-test`.
pub fn vm_test(args: &VmTestArgs) -> Result<ExitCode> {
    let started = Instant::now();
    let suite: Vec<&str> = if args.tests.is_empty() {
        SUITE.to_vec()
    } else {
        let known = integration_tests();
        for name in &args.tests {
            anyhow::ensure!(
                known.contains(name),
                "{name} is not an integration test of tests/tests/ ({})",
                known.join(", ")
            );
        }
        args.tests.iter().map(String::as_str).collect()
    };
    setup::setup(None)?;
    let built = build_suite(&suite)?;

    qemu::catch_interrupts()?;
    let vm_dir = cmd::target_dir().join("vm");
    fs::create_dir_all(&vm_dir)?;
    remove_stale_work_dirs(&vm_dir);
    let work = TempDir::new(&vm_dir, &format!("run-{}", std::process::id()))?;
    let logs = vm_dir.join("logs");
    fs::create_dir_all(&logs)?;

    let chosen = targets(&args.kernels);
    let series: Vec<KernelSeries> = chosen
        .iter()
        .filter_map(|t| match t {
            Target::Vm(s) => Some(*s),
            Target::Host => None,
        })
        .collect();
    let mut runs = Vec::new();
    if !series.is_empty() {
        // Fetching shares one apt state: one kernel at a time, then boot.
        let kernels: Vec<(KernelSeries, Result<kernels::Kernel>)> = series
            .iter()
            .map(|s| (*s, kernels::kernel(*s, args.refresh)))
            .collect();
        let payload = guest_payload(&built, &suite, work.path())?;
        runs = run_vms(kernels, &payload, args, work.path(), &logs);
    }
    if chosen.contains(&Target::Host) && !qemu::interrupted() {
        // Alone: the host's tests must not compete with the guests.
        let run = run_on_host(&built, &suite);
        report_progress(&run);
        runs.push(run);
    }
    drop(work);

    let not_run = not_in_suite(&suite);
    let not_run: Vec<(&str, &str)> = not_run.iter().map(|(n, w)| (n.as_str(), *w)).collect();
    let table = report::render(&runs, &not_run, started.elapsed());
    fs::write(vm_dir.join("report.md"), &table)?;
    println!("\n{table}");
    if qemu::interrupted() {
        bail!("vm-test: interrupted; the guest was stopped and its files removed");
    }
    let failed: Vec<&str> = runs
        .iter()
        .filter(|r| !r.passed())
        .map(|r| r.label.as_str())
        .collect();
    if failed.is_empty() {
        println!("vm-test: the suite passed on every kernel");
        Ok(ExitCode::SUCCESS)
    } else {
        eprintln!("vm-test: FAILED on {}", failed.join(", "));
        Ok(ExitCode::FAILURE)
    }
}

/// The suite's test executables (by target name) and the binaries they
/// spawn (by name), debug profile.
#[derive(Debug)]
struct Built {
    tests: BTreeMap<String, PathBuf>,
    bins: BTreeMap<String, PathBuf>,
}

fn build_suite(suite: &[&str]) -> Result<Built> {
    build::build_bins(false)?;
    // The same selection as `cargo xtask test`, so that after it (as in CI)
    // nothing is rebuilt: a narrower one could unify features differently.
    let mut cargo = cmd::cargo();
    cargo.args(["test", "--no-run"]);
    build::user_workspace(&mut cargo).arg("--message-format=json-render-diagnostics");
    println!("+ {}", cmd::display(&cargo));
    let out = cargo
        .stderr(Stdio::inherit())
        .output()
        .context("cannot run cargo")?;
    if !out.status.success() {
        bail!(
            "building the test binaries failed ({})",
            cmd::describe(out.status)
        );
    }
    let mut tests = BTreeMap::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(message) = serde_json::from_str::<Value>(line) else {
            continue;
        };
        let is_test = message["target"]["kind"]
            .as_array()
            .is_some_and(|kinds| kinds.iter().any(|k| k == "test"));
        if let (true, Some(name), Some(exe)) = (
            is_test,
            message["target"]["name"].as_str(),
            message["executable"].as_str(),
        ) {
            tests.insert(name.to_owned(), PathBuf::from(exe));
        }
    }
    let dir = cmd::target_dir().join(build::profile(false).1);
    let mut bins = BTreeMap::new();
    for name in SPAWNED {
        let path = dir.join(name);
        anyhow::ensure!(path.exists(), "{} was not built", path.display());
        bins.insert(name.to_owned(), path);
    }
    for name in suite {
        anyhow::ensure!(
            tests.contains_key(*name),
            "cargo built no test binary {name}"
        );
    }
    Ok(Built { tests, bins })
}

/// Test targets of `tests/tests/` that are not in the suite, with why.
fn not_in_suite(suite: &[&str]) -> Vec<(String, &'static str)> {
    integration_tests()
        .into_iter()
        .filter(|n| !suite.contains(&n.as_str()))
        .map(|n| {
            let why = if SUITE.contains(&n.as_str()) {
                "left out by --test"
            } else if let Some((_, why)) = LEFT_OUT.iter().find(|(name, _)| *name == n) {
                why
            } else {
                NOT_REDIRECTION
            };
            (n, why)
        })
        .collect()
}

/// The integration test targets of `tests/tests/`, sorted.
fn integration_tests() -> Vec<String> {
    let dir = cmd::workspace_root().join("tests").join("tests");
    let mut names: Vec<String> = fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .filter_map(|e| {
                    let name = e.file_name().to_string_lossy().into_owned();
                    name.strip_suffix(".rs").map(str::to_owned)
                })
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

/// Removes `run-<pid>` work directories of xtask processes that are gone.
fn remove_stale_work_dirs(vm_dir: &Path) {
    let Ok(entries) = fs::read_dir(vm_dir) else {
        return;
    };
    for entry in entries.filter_map(Result::ok) {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix("run-")
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if !Path::new("/proc").join(pid.to_string()).exists() {
            let _ = fs::remove_dir_all(entry.path());
        }
    }
}

/// The part of the guest's filesystem every kernel shares.
fn guest_payload(built: &Built, suite: &[&str], work: &Path) -> Result<Tree> {
    println!("vm-test: packing the suite");
    let stripped = work.join("stripped");
    fs::create_dir_all(stripped.join("deps"))?;
    let mut tree = Tree::default();
    for dir in ["/proc", "/sys", "/dev", "/tmp", "/run", "/etc/dp"] {
        tree.dir(dir);
    }
    tree.symlink("/var/run", "/run");
    tree.executable("/bin/busybox", &find_tool("busybox")?)?;
    for (tool, _why) in TOOLS {
        tree.executable(&format!("/bin/{tool}"), &find_tool(tool)?)?;
    }
    for (name, path) in &built.bins {
        let small = initramfs::stripped(path, &stripped, name)?;
        tree.executable(&format!("/dp/{name}"), &small)?;
    }
    for name in suite {
        let small = initramfs::stripped(&built.tests[*name], &stripped.join("deps"), name)?;
        tree.executable(&format!("/dp/deps/{name}"), &small)?;
    }
    let init = cmd::workspace_root().join("tests/vm/init.sh");
    tree.file("/init", &init, 0o755);
    tree.bytes("/etc/dp/suite", suite.join("\n") + "\n", 0o644);
    tree.bytes(
        "/etc/dp/per-binary-limit",
        format!("{}\n", PER_BINARY_LIMIT.as_secs()),
        0o644,
    );
    Ok(tree)
}

/// A host tool on `PATH` or in the sbin directories.
fn find_tool(name: &str) -> Result<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin", "/usr/bin", "/bin"].map(PathBuf::from))
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
        .with_context(|| format!("{name} is not installed (cargo xtask setup installs it)"))
}

fn report_progress(run: &KernelRun) {
    println!(
        "vm-test: {} {}",
        run.label,
        if run.passed() { "passed" } else { "FAILED" }
    );
}

/// Boots every kernel, `--jobs` guests at a time, and returns their rows in
/// the order given.
fn run_vms(
    kernels: Vec<(KernelSeries, Result<kernels::Kernel>)>,
    payload: &Tree,
    args: &VmTestArgs,
    work: &Path,
    logs: &Path,
) -> Vec<KernelRun> {
    // Popped from the end: oldest kernel first.
    let mut pending: Vec<_> = kernels.into_iter().enumerate().collect();
    pending.reverse();
    let queue = std::sync::Mutex::new(pending);
    let done = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for _ in 0..args.jobs.max(1) {
            scope.spawn(|| {
                loop {
                    let next = queue
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .pop();
                    let Some((index, (series, kernel))) = next else {
                        break;
                    };
                    let mut run = KernelRun::new(Target::Vm(series).label());
                    if qemu::interrupted() {
                        run.ending = Ending::Interrupted;
                    } else {
                        match kernel {
                            Ok(kernel) => run_in_vm(&mut run, &kernel, payload, args, work, logs),
                            Err(e) => {
                                run.ending = Ending::NotRun(format!(
                                    "cannot fetch Linux {}: {e:#}",
                                    series.name
                                ));
                            }
                        }
                    }
                    report_progress(&run);
                    done.lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .push((index, run));
                }
            });
        }
    });
    let mut done = done
        .into_inner()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    done.sort_by_key(|(index, _)| *index);
    done.into_iter().map(|(_, run)| run).collect()
}

/// Boots `kernel` with the suite and reads its report into `run`.
fn run_in_vm(
    run: &mut KernelRun,
    kernel: &kernels::Kernel,
    payload: &Tree,
    args: &VmTestArgs,
    work: &Path,
    logs: &Path,
) {
    let series = kernel.series;
    run.release.clone_from(&kernel.release);
    let mut tree = payload.clone();
    let mut order = String::new();
    for module in &kernel.modules {
        let file = module
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        tree.file(&format!("/lib/modules/dp/{file}"), module, 0o644);
        order.push_str(&file);
        order.push('\n');
    }
    tree.bytes("/etc/dp/modules", order, 0o644);

    let initramfs = work.join(format!("initramfs-{}.cpio", series.name));
    let console = work.join(format!("{}.console.log", series.name));
    let report_file = work.join(format!("{}.report.log", series.name));
    if let Err(e) = tree.write(&initramfs) {
        run.ending = Ending::NotRun(format!("cannot write the initramfs: {e:#}"));
        return;
    }
    println!(
        "vm-test: booting Linux {} ({})",
        series.name, kernel.release
    );
    let started = Instant::now();
    let ended = qemu::run(&qemu::Boot {
        image: &kernel.image,
        initramfs: &initramfs,
        console: &console,
        report: &report_file,
        limit: Duration::from_secs(args.timeout),
    });
    run.elapsed = started.elapsed();
    let _ = fs::remove_file(&initramfs);
    let report_text = fs::read_to_string(&report_file).unwrap_or_default();
    let console_text = fs::read_to_string(&console).unwrap_or_default();
    run.read_guest_report(&report_text);
    let _ = fs::copy(&console, logs.join(format!("{}.console.log", series.name)));
    let _ = fs::copy(
        &report_file,
        logs.join(format!("{}.report.log", series.name)),
    );
    match ended {
        // qemu may have seen the terminal's SIGINT before the wait loop did.
        _ if qemu::interrupted() => run.ending = Ending::Interrupted,
        Err(e) => run.ending = Ending::NotRun(format!("cannot run qemu: {e:#}")),
        Ok(qemu::Ending::TimedOut) => run.ending = Ending::TimedOut,
        Ok(qemu::Ending::Interrupted) => run.ending = Ending::Interrupted,
        Ok(qemu::Ending::Exited) if run.ending != Ending::Completed => {
            run.ending = Ending::Crashed(tail(&console_text, 40));
        }
        Ok(qemu::Ending::Exited) => {}
    }
}

/// The last `lines` lines of `text`.
fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// The suite on the host's own kernel, binary by binary as in a guest.
fn run_on_host(built: &Built, suite: &[&str]) -> KernelRun {
    let mut run = KernelRun::new(Target::Host.label());
    run.release = host_release();
    let started = Instant::now();
    for name in suite {
        if qemu::interrupted() {
            run.ending = Ending::Interrupted;
            return run;
        }
        let exe = &built.tests[*name];
        println!("+ {}", exe.display());
        let begun = Instant::now();
        let out = Command::new(exe).stdin(Stdio::null()).output();
        let seconds = begun.elapsed().as_secs();
        let binary = match out {
            Ok(out) => {
                let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
                text.push_str(&String::from_utf8_lossy(&out.stderr));
                BinaryRun::from_output(name, text, out.status.code(), seconds)
            }
            Err(e) => BinaryRun::from_output(name, format!("cannot run: {e}"), None, seconds),
        };
        run.binaries.push(binary);
    }
    run.elapsed = started.elapsed();
    run.ending = Ending::Completed;
    run
}

/// The host's `uname -r`.
fn host_release() -> String {
    fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_owned())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_means_every_vm_and_the_host() {
        let labels: Vec<_> = targets(&["all".to_owned()])
            .into_iter()
            .map(Target::label)
            .collect();
        assert_eq!(labels, ["5.10", "6.1", "6.12", "host"]);
        let one: Vec<_> = targets(&["6.1".to_owned()])
            .into_iter()
            .map(Target::label)
            .collect();
        assert_eq!(one, ["6.1"]);
    }

    #[test]
    fn the_guest_init_script_exists() {
        assert!(cmd::workspace_root().join("tests/vm/init.sh").is_file());
    }
}
