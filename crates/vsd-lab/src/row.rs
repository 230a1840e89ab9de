//! The raw results: one JSON line per run, with the full configuration and
//! the machine's facts, so a results file explains itself.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use vsd_trace::{QueueSnapshot, Stage};

use crate::config::Config;

/// One run of one configuration.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Row {
    /// The spec's name.
    pub spec: String,
    /// The name of the spec's matrix the configuration came from.
    pub matrix: String,
    /// [`Config::id`].
    pub id: String,
    /// Repetition, from 0.
    pub rep: u32,
    /// When the run started, seconds since the Unix epoch.
    pub started_unix: u64,
    /// Measured seconds (after the ramp).
    pub seconds: f64,
    /// The configuration.
    pub config: Config,
    /// What the run measured; `None` when it failed.
    pub result: Option<Measured>,
    /// Why the run failed.
    pub error: Option<String>,
    /// The machine it ran on.
    pub machine: Machine,
}

/// The figures of one run.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Measured {
    /// Requests completed per second.
    pub iops: f64,
    /// MiB (2^20 bytes) per second.
    pub bw_mib_s: f64,
    /// Request latency as the driver (client, host fio or guest fio) saw it.
    pub lat_us: Latency,
    /// The daemon's CPU time over the run, in percent of one CPU (`None`
    /// when there is no daemon process: the host floor, QEMU's own buses).
    pub daemon_cpu_pct: Option<f64>,
    /// The daemon's CPU time per request, in microseconds.
    pub daemon_cpu_us_per_io: Option<f64>,
    /// The driver's CPU time over the run, in percent of one CPU.
    pub client_cpu_pct: Option<f64>,
    /// vsd's own account of where the time went (vsd runs only).
    pub breakdown: Option<Breakdown>,
}

/// Latency figures, in microseconds.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Latency {
    /// Mean.
    pub mean: f64,
    /// Median.
    pub p50: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Maximum.
    pub max: f64,
}

/// Where a request's time went inside vsd, from its per-stage tracing.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Breakdown {
    /// The stages in request order (kick -> pop, ..., used -> call).
    pub stages: Vec<StageTime>,
    /// Mean time inside the daemon, kick noticed -> guest notified.
    pub total_mean_us: f64,
    /// Costly events per request: "kicks", "calls", "io_uring_enter",
    /// "wakeups", "poll_hits", "batches".
    pub events_per_io: BTreeMap<String, f64>,
}

impl Breakdown {
    /// The figures of an export's statistics over a run.
    pub fn from_snapshot(stats: &QueueSnapshot) -> Self {
        let us = |ns: f64| ns / 1000.0;
        let stages = Stage::ALL
            .iter()
            .map(|&stage| {
                let h = stats.stage(stage);
                StageTime {
                    name: stage.name().into(),
                    label: stage.label().into(),
                    mean_us: us(h.mean_ns()),
                    p50_us: us(h.quantile_ns(0.5) as f64),
                    p99_us: us(h.quantile_ns(0.99) as f64),
                }
            })
            .collect();
        let e = &stats.events;
        let per_io = |n: u64| if e.requests == 0 { 0.0 } else { n as f64 / e.requests as f64 };
        let events = [
            ("kicks", e.kicks),
            ("calls", e.calls),
            ("io_uring_enter", e.kernel_entries),
            ("wakeups", e.wakeups),
            ("poll_hits", e.poll_hits),
            ("batches", e.batches),
        ];
        Self {
            stages,
            total_mean_us: us(stats.total.mean_ns()),
            events_per_io: events.into_iter().map(|(name, n)| (name.to_owned(), per_io(n))).collect(),
        }
    }
}

/// One stage's time.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StageTime {
    /// Identifier ("pop", "submit", "complete", "used", "call").
    pub name: String,
    /// The two events it lies between ("kick -> pop").
    pub label: String,
    /// Mean, median and 99th percentile, in microseconds.
    pub mean_us: f64,
    /// Median.
    pub p50_us: f64,
    /// 99th percentile.
    pub p99_us: f64,
}

/// What the runs ran on.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Machine {
    /// `/proc/cpuinfo`'s model name.
    pub cpu_model: String,
    /// Online CPUs.
    pub cpus: u32,
    /// Memory, GiB.
    pub mem_gib: f64,
    /// `uname -r`.
    pub kernel: String,
    /// The clock source (`tsc`, `kvm-clock`...).
    pub clocksource: String,
    /// vsd's version.
    pub vsd_version: String,
    /// `qemu-storage-daemon --version`'s first line (empty if absent).
    pub qemu_version: String,
    /// `fio --version` (empty if absent).
    pub fio_version: String,
    /// CPUs the daemon was pinned to ("" = not pinned).
    pub daemon_cpus: String,
    /// CPUs the driver was pinned to ("" = not pinned).
    pub client_cpus: String,
    /// File system type of the disk back-end's directory.
    pub disk_fs: String,
}

/// Reads every row of a results file (a missing file has none). A torn last
/// line (the run was killed while writing it) is dropped, not an error.
pub fn read_rows(path: &Path) -> Result<Vec<Row>> {
    let file = match File::open(path) {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e).with_context(|| format!("cannot open '{}'", path.display())),
    };
    let lines: Vec<String> = BufReader::new(file).lines().collect::<std::io::Result<_>>()?;
    let last = lines.len().saturating_sub(1);
    let mut rows = Vec::new();
    for (n, line) in lines.iter().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        match serde_json::from_str(line) {
            Ok(row) => rows.push(row),
            Err(_) if n == last => {}
            Err(e) => anyhow::bail!("'{}' line {}: {e}", path.display(), n + 1),
        }
    }
    Ok(rows)
}

/// Appends `row` as one line and makes it durable, so an interrupted run
/// keeps every finished row.
pub fn append_row(file: &mut File, row: &Row) -> Result<()> {
    let mut line = serde_json::to_string(row)?;
    line.push('\n');
    file.write_all(line.as_bytes())?;
    file.sync_data()?;
    Ok(())
}
