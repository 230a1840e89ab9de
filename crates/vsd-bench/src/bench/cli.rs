//! Command-line flags of the `vsd-bench` binary and their validation.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, ValueEnum};
use serde::Serialize;

use super::{BenchConfig, BenchError};
use crate::client::ClientOptions;
use vsd_sys::size::parse_size;

/// Default warm-up before measuring: long enough for all jobs to reach
/// steady state, short enough not to matter for quick runs.
pub const DEFAULT_RAMP_SECONDS: f64 = 1.0;

/// Largest accepted `--bs` (64 MiB).
pub const MAX_BLOCK_SIZE: u64 = 64 << 20;

/// The I/O pattern.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
pub enum RwMode {
    /// Random reads.
    #[value(name = "randread")]
    #[serde(rename = "randread")]
    RandRead,
    /// Random writes.
    #[value(name = "randwrite")]
    #[serde(rename = "randwrite")]
    RandWrite,
    /// Random mix of reads and writes (`--rwmixread`, default 50 % reads).
    #[value(name = "randrw")]
    #[serde(rename = "randrw")]
    RandRw,
    /// Sequential reads.
    #[value(name = "read")]
    #[serde(rename = "read")]
    Read,
    /// Sequential writes.
    #[value(name = "write")]
    #[serde(rename = "write")]
    Write,
}

impl RwMode {
    /// The flag value naming this mode (`randread`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            RwMode::RandRead => "randread",
            RwMode::RandWrite => "randwrite",
            RwMode::RandRw => "randrw",
            RwMode::Read => "read",
            RwMode::Write => "write",
        }
    }

    /// Whether offsets are random (else sequential).
    pub fn is_random(self) -> bool {
        matches!(self, RwMode::RandRead | RwMode::RandWrite | RwMode::RandRw)
    }

    /// Percentage of reads, given the optional `--rwmixread`.
    fn read_percent(self, rwmixread: Option<u8>) -> Result<u8, BenchError> {
        match (self, rwmixread) {
            (RwMode::RandRw, mix) => Ok(mix.unwrap_or(50)),
            (_, Some(_)) => Err(BenchError::Config("--rwmixread only applies to --rw randrw".into())),
            (RwMode::RandRead | RwMode::Read, None) => Ok(100),
            (RwMode::RandWrite | RwMode::Write, None) => Ok(0),
        }
    }
}

impl std::fmt::Display for RwMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// CPUs to pin job threads to, e.g. `3` or `0-3,8`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CpuList(pub Vec<usize>);

/// Benchmarks a vhost-user-blk back-end through libblkio.
///
/// Each job is a thread that owns one device queue (job j uses queue j) and
/// keeps `--iodepth` requests in flight on it.
#[derive(Clone, Debug, Parser)]
#[command(name = "vsd-bench", version)]
pub struct Args {
    /// vhost-user socket of the back-end.
    #[arg(long)]
    pub socket: PathBuf,
    /// I/O pattern.
    #[arg(long, value_enum, default_value_t = RwMode::RandRead)]
    pub rw: RwMode,
    /// Percentage of reads for --rw randrw (default 50).
    #[arg(long, value_parser = clap::value_parser!(u8).range(0..=100))]
    pub rwmixread: Option<u8>,
    /// Block size per request; accepts k/m/g suffixes (binary).
    #[arg(long, default_value = "4k", value_parser = parse_size)]
    pub bs: u64,
    /// Requests kept in flight per job (1..=256).
    #[arg(long, default_value_t = 1)]
    pub iodepth: u32,
    /// Device queues to set up (default: --jobs); must be >= --jobs.
    #[arg(long)]
    pub queues: Option<u32>,
    /// Client threads; job j drives queue j.
    #[arg(long, default_value_t = 1)]
    pub jobs: u32,
    /// Measured duration in seconds.
    #[arg(long, default_value_t = 10.0)]
    pub seconds: f64,
    /// Warm-up before measuring, in seconds.
    #[arg(long, default_value_t = DEFAULT_RAMP_SECONDS)]
    pub ramp_seconds: f64,
    /// Bytes of the device to touch, from offset 0 (default: whole device).
    #[arg(long, value_parser = parse_size)]
    pub size: Option<u64>,
    /// Use libblkio poll queues and busy-poll for completions.
    #[arg(long)]
    pub poll: bool,
    /// Pin job threads to these CPUs (job j to the j-th listed, cycling),
    /// e.g. `2` or `0-3,8`.
    #[arg(long, value_parser = parse_cpu_list)]
    pub cpu: Option<CpuList>,
    /// Print one JSON object instead of a human summary.
    #[arg(long)]
    pub json: bool,
    /// At the end, ask the daemon at this QMP socket (vsd) where the time
    /// went inside it, and print that beside the client's latency.
    #[arg(long, value_name = "QMP_SOCKET")]
    pub breakdown: Option<PathBuf>,
}

impl Args {
    /// Validates the flags that do not depend on the device.
    pub fn into_config(self) -> Result<BenchConfig, BenchError> {
        let queues = self.queues.unwrap_or(self.jobs);
        check_counts(self.jobs, queues)?;
        let queue_size = ClientOptions::queue_size_for_iodepth(self.iodepth)?;
        check_block_size(self.bs)?;
        Ok(BenchConfig {
            socket: self.socket,
            rw: self.rw,
            rwmixread: self.rw.read_percent(self.rwmixread)?,
            bs: self.bs,
            iodepth: self.iodepth,
            queues,
            jobs: self.jobs,
            seconds: duration_arg("--seconds", self.seconds, false)?,
            ramp: duration_arg("--ramp-seconds", self.ramp_seconds, true)?,
            size: self.size,
            poll: self.poll,
            cpus: self.cpu.map(|list| list.0).unwrap_or_default(),
            queue_size,
            json: self.json,
        })
    }
}

fn check_counts(jobs: u32, queues: u32) -> Result<(), BenchError> {
    if jobs == 0 {
        return Err(BenchError::Config("--jobs must be at least 1".into()));
    }
    if queues < jobs {
        return Err(BenchError::Config(format!(
            "--queues {queues} is less than --jobs {jobs}; every job owns its own queue"
        )));
    }
    Ok(())
}

fn check_block_size(bs: u64) -> Result<(), BenchError> {
    if bs == 0 || !bs.is_multiple_of(512) {
        return Err(BenchError::Config(format!("--bs {bs} must be a non-zero multiple of 512")));
    }
    if bs > MAX_BLOCK_SIZE {
        return Err(BenchError::Config(format!("--bs {bs} is larger than {MAX_BLOCK_SIZE}")));
    }
    Ok(())
}

fn duration_arg(flag: &str, seconds: f64, zero_ok: bool) -> Result<Duration, BenchError> {
    let valid = seconds.is_finite() && (seconds > 0.0 || (zero_ok && seconds == 0.0));
    let duration = valid.then(|| Duration::try_from_secs_f64(seconds).ok()).flatten();
    duration.ok_or_else(|| BenchError::Config(format!("{flag} {seconds} is not a valid number of seconds")))
}

/// Parses a CPU list such as `3`, `0,2` or `0-3,8`.
pub fn parse_cpu_list(text: &str) -> Result<CpuList, String> {
    vsd_sys::parse_cpu_list(text, ',').map(CpuList)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(extra: &[&str]) -> Result<Args, clap::Error> {
        let mut argv = vec!["vsd-bench", "--socket", "/tmp/s.sock"];
        argv.extend_from_slice(extra);
        Args::try_parse_from(argv)
    }

    fn config(extra: &[&str]) -> Result<BenchConfig, String> {
        let args = parse(extra).map_err(|e| e.to_string())?;
        args.into_config().map_err(|e| e.to_string())
    }

    #[test]
    fn defaults() {
        let cfg = config(&[]).expect("defaults are valid");
        assert_eq!(cfg.rw, RwMode::RandRead);
        assert_eq!(cfg.rwmixread, 100);
        assert_eq!(cfg.bs, 4096);
        assert_eq!((cfg.iodepth, cfg.jobs, cfg.queues), (1, 1, 1));
        assert_eq!(cfg.seconds, Duration::from_secs(10));
        assert_eq!(cfg.ramp, Duration::from_secs(1));
        assert_eq!(cfg.size, None);
        assert!(!cfg.poll && !cfg.json);
        assert!(cfg.cpus.is_empty());
        assert_eq!(cfg.queue_size, 4);
    }

    #[test]
    fn socket_is_required() {
        assert!(Args::try_parse_from(["vsd-bench"]).is_err());
    }

    #[test]
    fn rw_modes() {
        let cases = [
            ("randread", RwMode::RandRead, 100),
            ("randwrite", RwMode::RandWrite, 0),
            ("randrw", RwMode::RandRw, 50),
            ("read", RwMode::Read, 100),
            ("write", RwMode::Write, 0),
        ];
        for (name, mode, reads) in cases {
            let cfg = config(&["--rw", name]).expect(name);
            assert_eq!((cfg.rw, cfg.rwmixread), (mode, reads), "{name}");
        }
        assert!(parse(&["--rw", "randomread"]).is_err());
        assert!(parse(&["--rw", "rand-read"]).is_err());
    }

    #[test]
    fn rwmixread() {
        let cfg = config(&["--rw", "randrw", "--rwmixread", "70"]).expect("valid mix");
        assert_eq!(cfg.rwmixread, 70);
        assert!(parse(&["--rw", "randrw", "--rwmixread", "101"]).is_err());
        assert!(config(&["--rw", "randread", "--rwmixread", "70"]).is_err());
    }

    #[test]
    fn sizes() {
        let cfg = config(&["--bs", "64k", "--size", "1G"]).expect("valid sizes");
        assert_eq!(cfg.bs, 65536);
        assert_eq!(cfg.size, Some(1 << 30));
        assert_eq!(config(&["--bs", "1m"]).map(|c| c.bs), Ok(1 << 20));
        assert_eq!(config(&["--bs", "512"]).map(|c| c.bs), Ok(512));
        assert!(config(&["--bs", "1000"]).is_err());
        assert!(config(&["--bs", "0"]).is_err());
        assert!(config(&["--bs", "128m"]).is_err());
        assert!(parse(&["--bs", "4q"]).is_err());
    }

    #[test]
    fn queue_size_follows_iodepth() {
        assert_eq!(config(&["--iodepth", "32"]).map(|c| c.queue_size), Ok(128));
        assert_eq!(config(&["--iodepth", "256"]).map(|c| c.queue_size), Ok(1024));
        assert!(config(&["--iodepth", "257"]).is_err());
        assert!(config(&["--iodepth", "0"]).is_err());
    }

    #[test]
    fn jobs_and_queues() {
        let cfg = config(&["--jobs", "4"]).expect("queues default to jobs");
        assert_eq!((cfg.jobs, cfg.queues), (4, 4));
        let cfg = config(&["--jobs", "2", "--queues", "4"]).expect("spare queues are fine");
        assert_eq!((cfg.jobs, cfg.queues), (2, 4));
        assert!(config(&["--jobs", "4", "--queues", "2"]).is_err());
        assert!(config(&["--jobs", "0"]).is_err());
    }

    #[test]
    fn durations() {
        let cfg = config(&["--seconds", "0.5", "--ramp-seconds", "0"]).expect("valid");
        assert_eq!(cfg.seconds, Duration::from_millis(500));
        assert_eq!(cfg.ramp, Duration::ZERO);
        assert!(config(&["--seconds", "0"]).is_err());
        assert!(config(&["--seconds", "inf"]).is_err());
        assert!(config(&["--ramp-seconds", "-1"]).is_err());
    }

    #[test]
    fn cpu_lists() {
        assert_eq!(parse_cpu_list("3"), Ok(CpuList(vec![3])));
        assert_eq!(parse_cpu_list("0-3,8"), Ok(CpuList(vec![0, 1, 2, 3, 8])));
        assert!(parse_cpu_list("3-1").is_err());
        assert!(parse_cpu_list("a").is_err());
        assert!(parse_cpu_list("").is_err());
        let cfg = config(&["--cpu", "1,2", "--poll", "--json"]).expect("valid");
        assert_eq!(cfg.cpus, vec![1, 2]);
        assert!(cfg.poll && cfg.json);
    }
}
