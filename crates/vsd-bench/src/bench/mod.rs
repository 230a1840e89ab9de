//! The benchmark engine behind the `vsd-bench` binary.
//!
//! [`run`] connects with one libblkio queue per job, starts one thread per
//! job, lets them warm up for the ramp time, then measures for the
//! configured duration. Each job owns its queue and a single buffer region,
//! and its loop does not allocate per request.

mod cli;
mod job;
mod pattern;
mod report;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Barrier, OnceLock};
use std::thread;
use std::time::{Duration, Instant};

pub use cli::{Args, CpuList, DEFAULT_RAMP_SECONDS, MAX_BLOCK_SIZE, RwMode, parse_cpu_list};
pub use job::{STALL_TIMEOUT, WRITE_PATTERN};
pub use report::{BenchReport, BenchResults, ConfigEcho, LatencySummary};

use crate::client::{Client, ClientOptions};
use crate::device::DeviceInfo;
use job::{Job, JobSetup, JobStats};
use pattern::IoPattern;

/// A validated benchmark configuration (see [`Args::into_config`]).
#[derive(Clone, Debug)]
pub struct BenchConfig {
    /// vhost-user socket.
    pub socket: PathBuf,
    /// I/O pattern.
    pub rw: RwMode,
    /// Percentage of reads (100 for read modes, 0 for write modes).
    pub rwmixread: u8,
    /// Bytes per request.
    pub bs: u64,
    /// Requests in flight per job.
    pub iodepth: u32,
    /// Device queues set up (>= `jobs`).
    pub queues: u32,
    /// Job threads; job j drives queue j.
    pub jobs: u32,
    /// Measured interval.
    pub seconds: Duration,
    /// Warm-up before the measured interval.
    pub ramp: Duration,
    /// Bytes of the device touched from offset 0; `None`: the whole device.
    pub size: Option<u64>,
    /// Use poll queues and busy-polling.
    pub poll: bool,
    /// CPUs to pin job j to (`cpus[j % len]`); empty: no pinning.
    pub cpus: Vec<usize>,
    /// Virtqueue size (from `iodepth`).
    pub queue_size: u32,
    /// Machine-readable output requested.
    pub json: bool,
}

/// Why a benchmark could not run or finish.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// Invalid configuration.
    #[error("{0}")]
    Config(String),
    /// Connecting or setting up the device failed.
    #[error(transparent)]
    Client(#[from] crate::Error),
    /// Pinning a job thread failed.
    #[error("pinning job {job} to CPU {cpu}: {source}")]
    Pin {
        /// Job number.
        job: usize,
        /// CPU asked for.
        cpu: usize,
        /// The OS error.
        source: std::io::Error,
    },
    /// No completion arrived within [`STALL_TIMEOUT`], or libblkio failed.
    #[error("queue {queue} stopped completing requests: {detail}")]
    Stalled {
        /// Queue index.
        queue: usize,
        /// What happened.
        detail: String,
    },
    /// Reading the process CPU time failed.
    #[error("getrusage: {0}")]
    CpuTime(std::io::Error),
    /// A job thread could not be started or died.
    #[error("job thread {0} failed to start or panicked")]
    Thread(usize),
}

/// Phase boundaries shared by all jobs.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Timeline {
    pub(crate) start: Instant,
    pub(crate) measure_start: Instant,
    pub(crate) measure_end: Instant,
}

/// Shared by the main thread and the jobs: publishes the timeline once every
/// job is ready, and lets a failing job stop the others early.
struct StartGate {
    barrier: Barrier,
    timeline: OnceLock<Timeline>,
    stop: AtomicBool,
}

/// Runs the benchmark described by `config`.
///
/// Failed requests are counted in [`BenchResults::errors`]; an `Err` means
/// the benchmark could not be set up or a queue stalled.
pub fn run(config: &BenchConfig) -> Result<BenchReport, BenchError> {
    let mut client = connect(config)?;
    let size = region_size(config, client.info())?;
    let setups = prepare_jobs(config, &mut client, size)?;
    let echo = ConfigEcho::new(config, size);
    let device = client.info().clone();
    drop(client);
    let gate = Arc::new(StartGate {
        barrier: Barrier::new(setups.len() + 1),
        timeline: OnceLock::new(),
        stop: AtomicBool::new(false),
    });
    let (finished_tx, finished_rx) = mpsc::channel();
    let handles = spawn_jobs(config, setups, &gate, &finished_tx)?;
    drop(finished_tx);
    let timeline = open_gate(config, &gate);
    let cpu = measure_cpu(&timeline, &finished_rx);
    let stats = join_jobs(handles)?;
    let cpu_time = cpu?.unwrap_or_default();
    Ok(BenchReport::new(echo, device, &stats, config.seconds, cpu_time))
}

fn connect(config: &BenchConfig) -> Result<Client, BenchError> {
    let opts = ClientOptions {
        num_queues: usize::try_from(config.queues).unwrap_or(usize::MAX),
        poll_queues: config.poll,
        read_only: config.rwmixread == 100,
        queue_size: Some(config.queue_size),
        ..ClientOptions::default()
    };
    Ok(Client::connect(&config.socket, opts)?)
}

/// The number of bytes to touch, checked against the device.
fn region_size(config: &BenchConfig, info: &DeviceInfo) -> Result<u64, BenchError> {
    let bs = config.bs;
    let alignment = u64::from(info.request_alignment.max(1));
    if !bs.is_multiple_of(alignment) {
        return Err(BenchError::Config(format!("--bs {bs} is not a multiple of the device's block size {alignment}")));
    }
    if info.max_segment_len > 0 && bs > u64::from(info.max_segment_len) {
        return Err(BenchError::Config(format!(
            "--bs {bs} exceeds the device's max segment length {}",
            info.max_segment_len
        )));
    }
    let size = config.size.unwrap_or(info.capacity);
    if size < bs || size > info.capacity {
        return Err(BenchError::Config(format!(
            "--size {size} must be between --bs {bs} and the capacity {}",
            info.capacity
        )));
    }
    Ok(size / bs * bs)
}

fn prepare_jobs(config: &BenchConfig, client: &mut Client, size: u64) -> Result<Vec<JobSetup>, BenchError> {
    let too_big = || BenchError::Config("--bs * --iodepth does not fit in memory".into());
    let bs = usize::try_from(config.bs).map_err(|_| too_big())?;
    let iodepth = usize::try_from(config.iodepth).map_err(|_| too_big())?;
    let buffer_len = JobSetup::buffer_len(iodepth, bs).ok_or_else(too_big)?;
    (0..config.jobs)
        .map(|job| {
            let index = usize::try_from(job).map_err(|_| too_big())?;
            Ok(JobSetup {
                queue: client.take_queue(index)?,
                buffer: client.alloc_buffer(buffer_len)?,
                pattern: IoPattern::new(config.rw, config.rwmixread, config.bs, size, job, config.jobs),
                iodepth,
                bs,
            })
        })
        .collect()
}

fn spawn_jobs(
    config: &BenchConfig,
    setups: Vec<JobSetup>,
    gate: &Arc<StartGate>,
    finished: &Sender<()>,
) -> Result<Vec<thread::JoinHandle<Result<JobStats, BenchError>>>, BenchError> {
    setups
        .into_iter()
        .enumerate()
        .map(|(job, setup)| {
            let cpu = (!config.cpus.is_empty()).then(|| config.cpus[job % config.cpus.len()]);
            let gate = Arc::clone(gate);
            let finished = finished.clone();
            thread::Builder::new()
                .name(format!("vsd-bench-job{job}"))
                .spawn(move || {
                    let result = job_thread(job, cpu, setup, &gate);
                    if result.is_err() {
                        gate.stop.store(true, Ordering::Relaxed);
                    }
                    // The main thread may have stopped listening; that is fine.
                    let _ = finished.send(());
                    result
                })
                .map_err(|_| BenchError::Thread(job))
        })
        .collect()
}

/// Body of a job thread: pin, wait for the common start, run.
fn job_thread(job: usize, cpu: Option<usize>, setup: JobSetup, gate: &StartGate) -> Result<JobStats, BenchError> {
    let pinned = cpu.map_or(Ok(()), |cpu| {
        vsd_sys::set_thread_affinity(&[cpu]).map_err(|source| BenchError::Pin { job, cpu, source })
    });
    // Both waits happen even if pinning failed so the main thread never
    // blocks forever: first "ready", then "timeline published".
    gate.barrier.wait();
    gate.barrier.wait();
    pinned?;
    let timeline = *gate.timeline.get().ok_or_else(|| BenchError::Config("start timeline was not published".into()))?;
    Job::new(setup, timeline)?.run(&gate.stop)
}

/// Waits for all jobs to be ready, then publishes the timeline.
fn open_gate(config: &BenchConfig, gate: &StartGate) -> Timeline {
    gate.barrier.wait();
    let start = Instant::now();
    let measure_start = start + config.ramp;
    let timeline = Timeline { start, measure_start, measure_end: measure_start + config.seconds };
    let _ = gate.timeline.set(timeline);
    gate.barrier.wait();
    timeline
}

/// Process CPU time (user+sys) spent during the measured interval; the main
/// thread sleeps meanwhile, so this is the jobs' cost. `None` if a job ended
/// before the interval did (it failed; its error is reported by the join).
fn measure_cpu(timeline: &Timeline, finished: &Receiver<()>) -> Result<Option<Duration>, BenchError> {
    if !sleep_until(timeline.measure_start, finished) {
        return Ok(None);
    }
    let before = vsd_sys::process::cpu_time().map_err(BenchError::CpuTime)?;
    if !sleep_until(timeline.measure_end, finished) {
        return Ok(None);
    }
    let after = vsd_sys::process::cpu_time().map_err(BenchError::CpuTime)?;
    Ok(Some(after.saturating_sub(before)))
}

/// Sleeps until `deadline`; returns false if a job finished before it
/// (a job finishing just after it, while this thread was not yet scheduled,
/// does not count).
fn sleep_until(deadline: Instant, finished: &Receiver<()>) -> bool {
    let timeout = deadline.saturating_duration_since(Instant::now());
    match finished.recv_timeout(timeout) {
        Err(RecvTimeoutError::Timeout) => true,
        Ok(()) | Err(RecvTimeoutError::Disconnected) => Instant::now() >= deadline,
    }
}

fn join_jobs(handles: Vec<thread::JoinHandle<Result<JobStats, BenchError>>>) -> Result<Vec<JobStats>, BenchError> {
    let results: Vec<_> = handles
        .into_iter()
        .enumerate()
        .map(|(job, handle)| handle.join().map_err(|_| BenchError::Thread(job))?)
        .collect();
    results.into_iter().collect()
}
