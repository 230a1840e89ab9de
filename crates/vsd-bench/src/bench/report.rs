//! Benchmark results: aggregation, JSON shape and human summary.

use std::fmt;
use std::time::Duration;

use hdrhistogram::Histogram;
use serde::Serialize;

use super::job::JobStats;
use super::{BenchConfig, RwMode};
use crate::device::DeviceInfo;

const MIB: f64 = (1u64 << 20) as f64;

/// The full benchmark output; serialises to the JSON documented in the crate
/// docs.
#[derive(Clone, Debug, Serialize)]
pub struct BenchReport {
    /// The configuration, with defaults resolved.
    pub config: ConfigEcho,
    /// Device properties.
    pub device: DeviceInfo,
    /// What was measured.
    pub results: BenchResults,
}

/// The configuration as echoed in the report.
#[derive(Clone, Debug, Serialize)]
pub struct ConfigEcho {
    /// Socket path.
    pub socket: String,
    /// I/O pattern.
    pub rw: RwMode,
    /// Percentage of reads.
    pub rwmixread: u8,
    /// Bytes per request.
    pub bs: u64,
    /// Requests in flight per job.
    pub iodepth: u32,
    /// Device queues set up.
    pub queues: u32,
    /// Job threads.
    pub jobs: u32,
    /// Measured seconds.
    pub seconds: f64,
    /// Warm-up seconds.
    pub ramp_seconds: f64,
    /// Bytes of the device touched.
    pub size: u64,
    /// Poll queues used.
    pub poll: bool,
    /// CPUs jobs were pinned to (empty: none).
    pub cpus: Vec<usize>,
    /// Virtqueue size.
    pub queue_size: u32,
}

impl ConfigEcho {
    pub(crate) fn new(config: &BenchConfig, size: u64) -> ConfigEcho {
        ConfigEcho {
            socket: config.socket.display().to_string(),
            rw: config.rw,
            rwmixread: config.rwmixread,
            bs: config.bs,
            iodepth: config.iodepth,
            queues: config.queues,
            jobs: config.jobs,
            seconds: config.seconds.as_secs_f64(),
            ramp_seconds: config.ramp.as_secs_f64(),
            size,
            poll: config.poll,
            cpus: config.cpus.clone(),
            queue_size: config.queue_size,
        }
    }
}

/// Measured results over the interval after the ramp.
#[derive(Clone, Debug, Serialize)]
pub struct BenchResults {
    /// Length of the measured interval in seconds.
    pub duration_s: f64,
    /// Successful requests completed in the interval.
    pub ios: u64,
    /// Of which reads.
    pub read_ios: u64,
    /// Of which writes.
    pub write_ios: u64,
    /// `ios / duration_s`.
    pub iops: f64,
    /// Bandwidth in MiB/s (2^20 bytes per second).
    pub bw_mib_s: f64,
    /// Submit-to-completion latency.
    pub lat_us: LatencySummary,
    /// Failed requests over the whole run, ramp included.
    pub errors: u64,
    /// Description of the first failure, if any.
    pub first_error: Option<String>,
    /// User+system CPU time of the whole client process in the interval, µs.
    pub client_cpu_us: f64,
    /// `client_cpu_us / ios` (`null` if no I/O completed).
    pub client_cpu_us_per_io: Option<f64>,
}

/// Latency statistics in microseconds.
#[derive(Clone, Debug, Default, Serialize)]
pub struct LatencySummary {
    /// Mean.
    pub mean: f64,
    /// Minimum.
    pub min: f64,
    /// Median.
    pub p50: f64,
    /// 99th percentile.
    pub p99: f64,
    /// 99.9th percentile.
    pub p999: f64,
    /// Maximum.
    pub max: f64,
}

impl LatencySummary {
    fn from_nanos(hist: &Histogram<u64>) -> LatencySummary {
        if hist.is_empty() {
            return LatencySummary::default();
        }
        let us = |ns: u64| ns as f64 / 1000.0;
        LatencySummary {
            mean: hist.mean() / 1000.0,
            min: us(hist.min()),
            p50: us(hist.value_at_quantile(0.50)),
            p99: us(hist.value_at_quantile(0.99)),
            p999: us(hist.value_at_quantile(0.999)),
            max: us(hist.max()),
        }
    }
}

impl BenchReport {
    pub(crate) fn new(
        config: ConfigEcho,
        device: DeviceInfo,
        jobs: &[JobStats],
        measured: Duration,
        cpu: Duration,
    ) -> BenchReport {
        let results = BenchResults::aggregate(jobs, measured, cpu, config.bs);
        BenchReport { config, device, results }
    }
}

impl BenchResults {
    fn aggregate(jobs: &[JobStats], measured: Duration, cpu: Duration, bs: u64) -> BenchResults {
        let merged = merge_histograms(jobs);
        let read_ios = jobs.iter().map(|j| j.read_ios).sum::<u64>();
        let write_ios = jobs.iter().map(|j| j.write_ios).sum::<u64>();
        let ios = read_ios + write_ios;
        let secs = measured.as_secs_f64();
        let client_cpu_us = cpu.as_secs_f64() * 1e6;
        BenchResults {
            duration_s: secs,
            ios,
            read_ios,
            write_ios,
            iops: ios as f64 / secs,
            bw_mib_s: ios as f64 * bs as f64 / MIB / secs,
            lat_us: merged.as_ref().map(LatencySummary::from_nanos).unwrap_or_default(),
            errors: jobs.iter().map(|j| j.errors).sum(),
            first_error: jobs.iter().find_map(|j| j.first_error.clone()),
            client_cpu_us,
            client_cpu_us_per_io: (ios > 0).then(|| client_cpu_us / ios as f64),
        }
    }
}

fn merge_histograms(jobs: &[JobStats]) -> Option<Histogram<u64>> {
    let mut iter = jobs.iter();
    let mut merged = iter.next()?.latency_ns.clone();
    for job in iter {
        // All job histograms share the same bounds, so adding cannot fail;
        // saturate rather than abort if it ever did.
        if merged.add(&job.latency_ns).is_err() {
            for value in job.latency_ns.iter_recorded() {
                merged.saturating_record_n(value.value_iterated_to(), value.count_at_value());
            }
        }
    }
    Some(merged)
}

impl fmt::Display for BenchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.config;
        let r = &self.results;
        let mode = if c.poll { "poll" } else { "interrupt" };
        writeln!(
            f,
            "vsd-bench {} {} bs={} iodepth={} jobs={} queues={} ({mode}, queue-size {})",
            c.socket, c.rw, c.bs, c.iodepth, c.jobs, c.queues, c.queue_size
        )?;
        writeln!(
            f,
            "  region {} of {} bytes, {:.1} s measured after {:.1} s ramp",
            c.size, self.device.capacity, r.duration_s, c.ramp_seconds
        )?;
        writeln!(f, "  IOPS       {:.0} (reads {}, writes {})", r.iops, r.read_ios, r.write_ios)?;
        writeln!(f, "  bandwidth  {:.1} MiB/s", r.bw_mib_s)?;
        let l = &r.lat_us;
        writeln!(
            f,
            "  latency us mean {:.1}  p50 {:.1}  p99 {:.1}  p99.9 {:.1}  (min {:.1}, max {:.1})",
            l.mean, l.p50, l.p99, l.p999, l.min, l.max
        )?;
        match r.client_cpu_us_per_io {
            Some(per_io) => writeln!(f, "  client CPU {per_io:.2} us/IO ({:.0} us user+sys)", r.client_cpu_us)?,
            None => writeln!(f, "  client CPU {:.0} us user+sys", r.client_cpu_us)?,
        }
        match &r.first_error {
            Some(first) => write!(f, "  errors     {} (first: {first})", r.errors),
            None => write!(f, "  errors     {}", r.errors),
        }
    }
}
