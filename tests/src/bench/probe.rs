//! What a run costs: CPU time of a cgroup (`cpu.stat`, the agents' own
//! cgroups) and of the whole machine (`/proc/stat`), resident memory of a
//! process, and CPU pinning of every thread of a process.

use std::path::Path;

/// Microseconds of CPU a cgroup's processes used so far (user + system).
pub fn cgroup_cpu_usec(cgroup: &Path) -> anyhow::Result<u64> {
    let text = std::fs::read_to_string(cgroup.join("cpu.stat"))
        .map_err(|e| anyhow::anyhow!("cannot read {}/cpu.stat: {e}", cgroup.display()))?;
    text.lines()
        .find_map(|l| l.strip_prefix("usage_usec "))
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no usage_usec in {}/cpu.stat", cgroup.display()))
}

/// Machine-wide CPU time so far, in seconds, from `/proc/stat`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct MachineCpu {
    /// Every non-idle state (user, nice, system, irq, softirq, steal).
    pub busy: f64,
    /// Kernel work: system, irq, softirq.
    pub kernel: f64,
}

impl MachineCpu {
    /// Reads `/proc/stat`.
    pub fn now() -> anyhow::Result<Self> {
        let text = std::fs::read_to_string("/proc/stat")?;
        let first = text
            .lines()
            .next()
            .ok_or_else(|| anyhow::anyhow!("/proc/stat is empty"))?;
        let ticks: Vec<u64> = first
            .split_whitespace()
            .skip(1)
            .filter_map(|v| v.parse().ok())
            .collect();
        anyhow::ensure!(ticks.len() >= 8, "unexpected /proc/stat line `{first}`");
        // SAFETY: sysconf has no preconditions.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
        let [user, nice, system, _idle, _iowait, irq, softirq, steal] =
            [0, 1, 2, 3, 4, 5, 6, 7].map(|i| ticks[i] as f64 / hz);
        Ok(Self {
            busy: user + nice + system + irq + softirq + steal,
            kernel: system + irq + softirq,
        })
    }

    /// Time spent since `earlier`.
    pub fn since(self, earlier: Self) -> Self {
        Self {
            busy: self.busy - earlier.busy,
            kernel: self.kernel - earlier.kernel,
        }
    }
}

/// Resident set size of `pid`, in bytes (`VmRSS`).
pub fn rss_bytes(pid: u32) -> anyhow::Result<u64> {
    status_bytes(pid, "VmRSS")
}

/// The most memory `pid` has had resident since it started (`VmHWM`), in
/// bytes.
pub fn peak_rss_bytes(pid: u32) -> anyhow::Result<u64> {
    status_bytes(pid, "VmHWM")
}

/// A size `/proc/<pid>/status` gives in kB, in bytes.
fn status_bytes(pid: u32, field: &str) -> anyhow::Result<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kib: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no {field} for pid {pid}"))?;
    Ok(kib * 1024)
}

/// Pins every thread of `pid` to `cpu`, or lets them run anywhere again
/// (`None`).
pub fn set_affinity(pid: u32, cpu: Option<usize>) -> anyhow::Result<()> {
    // SAFETY: cpu_set_t is plain data; CPU_SET writes within it.
    let set = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        match cpu {
            Some(cpu) => libc::CPU_SET(cpu, &mut set),
            None => {
                for cpu in 0..online_cpus() {
                    libc::CPU_SET(cpu, &mut set);
                }
            }
        }
        set
    };
    for entry in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        let Ok(tid) = entry?.file_name().to_string_lossy().parse::<libc::pid_t>() else {
            continue;
        };
        // SAFETY: the set is initialised; a thread that exited meanwhile
        // makes the call fail, which is fine.
        unsafe {
            libc::sched_setaffinity(tid, std::mem::size_of_val(&set), &set);
        }
    }
    Ok(())
}

/// Online CPUs.
pub fn online_cpus() -> usize {
    std::thread::available_parallelism().map_or(1, usize::from)
}

/// This process's descriptor limit (soft), which children inherit.
pub fn nofile_limit() -> u64 {
    // SAFETY: getrlimit writes the struct.
    unsafe {
        let mut limit: libc::rlimit = std::mem::zeroed();
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) == 0 {
            limit.rlim_cur
        } else {
            1024
        }
    }
}
