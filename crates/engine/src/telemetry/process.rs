//! The standard `process_*` metrics (the set every Prometheus client
//! library exports), read from `/proc/self` on each scrape.

use procfs::process::{LimitValue, Process};
use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric},
    metrics::{counter::ConstCounter, gauge::ConstGauge},
};

/// Reads `/proc/self/{stat,fd,limits}` when scraped; a file that cannot be
/// read leaves its metrics out of that scrape rather than failing it.
#[derive(Debug)]
pub(super) struct ProcessCollector;

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Ok(me) = Process::myself() else {
            return Ok(());
        };
        if let Ok(stat) = me.stat() {
            let ticks = procfs::ticks_per_second().max(1) as f64;
            let cpu = ConstCounter::new((stat.utime + stat.stime) as f64 / ticks);
            cpu.encode(encoder.encode_descriptor(
                "process_cpu_seconds",
                "Total user and system CPU time spent in seconds",
                None,
                cpu.metric_type(),
            )?)?;
            let rss = stat.rss.saturating_mul(procfs::page_size());
            gauge(
                &mut encoder,
                "process_resident_memory_bytes",
                "Resident memory size in bytes",
                rss,
            )?;
            gauge(
                &mut encoder,
                "process_virtual_memory_bytes",
                "Virtual memory size in bytes",
                stat.vsize,
            )?;
            gauge(
                &mut encoder,
                "process_threads",
                "Number of OS threads in the process",
                u64::try_from(stat.num_threads).unwrap_or(0),
            )?;
            if let Ok(boot) = procfs::boot_time_secs() {
                let start = boot as f64 + stat.starttime as f64 / ticks;
                let g = ConstGauge::new(start);
                g.encode(encoder.encode_descriptor(
                    "process_start_time_seconds",
                    "Start time of the process since the Unix epoch in seconds",
                    None,
                    g.metric_type(),
                )?)?;
            }
        }
        if let Ok(fds) = me.fd_count() {
            gauge(
                &mut encoder,
                "process_open_fds",
                "Number of open file descriptors",
                fds as u64,
            )?;
        }
        if let Ok(limits) = me.limits()
            && let LimitValue::Value(max) = limits.max_open_files.soft_limit
        {
            gauge(
                &mut encoder,
                "process_max_fds",
                "Maximum number of open file descriptors",
                max,
            )?;
        }
        Ok(())
    }
}

/// Encodes one unlabelled gauge.
pub(super) fn gauge(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    value: u64,
) -> Result<(), std::fmt::Error> {
    let g = ConstGauge::new(value);
    g.encode(encoder.encode_descriptor(name, help, None, g.metric_type())?)
}
