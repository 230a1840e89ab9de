//! One benchmark job: a thread keeping `iodepth` requests in flight on the
//! queue it owns.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;

use super::pattern::IoPattern;
use super::{BenchError, Timeline};
use crate::buffer::Buffer;
use crate::error::errno_text;
use crate::queue::{Queue, Reaped};

/// A job gives up when no request completes for this long with requests in
/// flight (libblkio would wait forever for a dead back-end).
pub const STALL_TIMEOUT: Duration = Duration::from_secs(10);

/// Byte written by every write request (a fixed non-zero pattern, so that
/// back-ends cannot take zero-detection shortcuts).
pub const WRITE_PATTERN: u8 = 0x5a;

/// Highest latency the histogram tracks exactly; larger values saturate.
const MAX_TRACKED_LATENCY_NS: u64 = 60_000_000_000;

/// What one job measured.
pub(crate) struct JobStats {
    pub(crate) latency_ns: Histogram<u64>,
    pub(crate) read_ios: u64,
    pub(crate) write_ios: u64,
    pub(crate) errors: u64,
    pub(crate) first_error: Option<String>,
}

/// A request slot: its data area and when its current request was
/// submitted.
struct Slot {
    data: *mut u8,
    is_read: bool,
    submitted: Instant,
}

/// Everything a job thread needs, built on the main thread.
pub(crate) struct JobSetup {
    pub(crate) queue: Queue,
    /// `iodepth` read areas of `bs` bytes followed by one `bs`-byte area
    /// holding the write pattern (writes only read it, so they share it).
    pub(crate) buffer: Buffer,
    pub(crate) pattern: IoPattern,
    pub(crate) iodepth: usize,
    pub(crate) bs: usize,
}

impl JobSetup {
    /// Bytes of buffer a job with these parameters needs.
    pub(crate) fn buffer_len(iodepth: usize, bs: usize) -> Option<usize> {
        iodepth.checked_add(1)?.checked_mul(bs)
    }
}

pub(crate) struct Job {
    queue: Queue,
    buffer: Buffer,
    pattern: IoPattern,
    slots: Vec<Slot>,
    write_data: *const u8,
    bs: usize,
    timeline: Timeline,
    stats: JobStats,
}

impl Job {
    pub(crate) fn new(mut setup: JobSetup, timeline: Timeline) -> Result<Job, BenchError> {
        let bs = setup.bs;
        let base = setup.buffer.as_mut_ptr();
        let write_area = setup.iodepth * bs;
        setup.buffer[write_area..write_area + bs].fill(WRITE_PATTERN);
        let slots = (0..setup.iodepth)
            .map(|i| Slot { data: base.wrapping_add(i * bs), is_read: true, submitted: timeline.start })
            .collect();
        Ok(Job {
            queue: setup.queue,
            write_data: base.wrapping_add(write_area).cast_const(),
            buffer: setup.buffer,
            pattern: setup.pattern,
            slots,
            bs,
            timeline,
            stats: JobStats {
                latency_ns: Histogram::new_with_bounds(1, MAX_TRACKED_LATENCY_NS, 3)
                    .map_err(|e| BenchError::Config(format!("latency histogram: {e}")))?,
                read_ios: 0,
                write_ios: 0,
                errors: 0,
                first_error: None,
            },
        })
    }

    /// Runs until the measured interval ends (or `stop` is set because
    /// another job failed) and all requests completed.
    pub(crate) fn run(mut self, stop: &AtomicBool) -> Result<JobStats, BenchError> {
        let start = Instant::now();
        for token in 0..self.slots.len() {
            self.submit(token, start);
        }
        let mut in_flight = self.slots.len();
        while in_flight > 0 {
            let reaped = match self.reap(in_flight) {
                Ok(n) => n,
                Err(e) => return Err(self.abandon(e)),
            };
            let now = Instant::now();
            let keep_going = now < self.timeline.measure_end && !stop.load(Ordering::Relaxed);
            for i in 0..reaped {
                let Some(completion) = self.queue.completion(i) else {
                    break;
                };
                in_flight -= 1;
                self.account(completion, now);
                if keep_going {
                    self.submit(completion.token, now);
                    in_flight += 1;
                }
            }
        }
        Ok(self.stats)
    }

    /// Submits pending requests and reaps at least one completion (interrupt
    /// mode: blocks on the completion fd; poll mode: spins).
    fn reap(&mut self, in_flight: usize) -> Result<usize, BenchError> {
        if !self.queue.is_poll() {
            return self.queue.reap(1, Some(STALL_TIMEOUT)).map_err(|e| self.stalled(in_flight, &e));
        }
        let waiting_since = Instant::now();
        loop {
            let n = self.queue.reap(0, None).map_err(|e| self.stalled(in_flight, &e))?;
            if n > 0 {
                return Ok(n);
            }
            if waiting_since.elapsed() > STALL_TIMEOUT {
                return Err(self.stalled(in_flight, &blkio::Error::from(blkio::Errno::TIME)));
            }
            std::hint::spin_loop();
        }
    }

    fn stalled(&self, in_flight: usize, error: &blkio::Error) -> BenchError {
        let detail = if error.errno() == blkio::Errno::TIME {
            format!("no completion for {STALL_TIMEOUT:?} with {in_flight} requests in flight")
        } else {
            format!("libblkio failed: {error}")
        };
        BenchError::Stalled { queue: self.queue.index(), detail }
    }

    fn submit(&mut self, token: usize, now: Instant) {
        let io = self.pattern.next_io();
        let Some(slot) = self.slots.get_mut(token) else {
            return;
        };
        slot.is_read = io.is_read;
        slot.submitted = now;
        if io.is_read {
            self.queue.submit_read(io.offset, slot.data, self.bs, token);
        } else {
            self.queue.submit_write(io.offset, self.write_data, self.bs, token);
        }
    }

    fn account(&mut self, completion: Reaped, now: Instant) {
        let Some(slot) = self.slots.get(completion.token) else {
            return;
        };
        if completion.ret < 0 {
            self.record_error(completion.ret);
            return;
        }
        if now < self.timeline.measure_start || now >= self.timeline.measure_end {
            return;
        }
        let latency = now.saturating_duration_since(slot.submitted);
        let nanos = u64::try_from(latency.as_nanos()).unwrap_or(u64::MAX);
        self.stats.latency_ns.saturating_record(nanos.max(1));
        if slot.is_read {
            self.stats.read_ios += 1;
        } else {
            self.stats.write_ios += 1;
        }
    }

    fn record_error(&mut self, ret: i32) {
        self.stats.errors += 1;
        if self.stats.first_error.is_none() {
            let errno = ret.saturating_neg();
            self.stats.first_error =
                Some(format!("queue {}: errno {errno} ({})", self.queue.index(), errno_text(errno)));
        }
    }

    /// Gives up on a stalled queue: requests may still be in flight, so the
    /// buffer is left mapped until the libblkio instance goes away.
    fn abandon(mut self, error: BenchError) -> BenchError {
        self.queue.mark_broken();
        self.buffer.abandon();
        error
    }
}
