//! The stream job (`block-stream`): an overlay copies into itself what it
//! reads from its backing chain above a base (or all of it), then names
//! the base as its backing file (or none): the images between can go.
//!
//! ```text
//!   for each run the overlay reads from below itself, above the base:
//!     overlay.read (through the chain) ─▶ overlay.populate (only clusters still unallocated)
//!   then, writers stopped: overlay.set_backing(base)
//! ```
//!
//! Writers go on meanwhile: `populate` leaves alone every cluster a write
//! allocated first (it did its own copy-on-write), so the job never
//! overwrites a guest's data, and a write that comes later lands on top.

use std::sync::Arc;
use std::time::{Duration, Instant};

use vsd_block::{BlockNode, IoOp, IoQueue, IoVecs};
use vsd_qcow2::buf::AlignedBuf;

use crate::copy::{Failure, MAX_COPY, Pace, errno, run_one, turn};
use crate::mirror::Writers;
use crate::{ErrorPolicy, Job, JobBody, strerror};

/// How long a run that failed under the `ignore` or `stop` policy waits
/// before it is tried again.
const RETRY_DELAY: Duration = Duration::from_millis(100);

/// How a stream is made.
pub struct StreamSpec {
    /// The overlay that takes the data.
    pub top: Arc<dyn BlockNode>,
    /// Where the copying stops: the backing node that stays, if any.
    pub base: Option<Arc<dyn BlockNode>>,
    /// How deep `base` lies below `top` (1 is `top` itself); data stored
    /// deeper than `top` and shallower than this is copied. Without a
    /// base, everything below `top`.
    pub base_depth: Option<u32>,
    /// The backing file name and format the overlay's header names at
    /// the end (none without a base).
    pub header: Option<(String, String)>,
    /// Who writes to `top`: their queues restart on the new chain.
    pub writers: Arc<dyn Writers>,
    /// On a read error of the chain or a write error of the overlay.
    pub on_error: ErrorPolicy,
}

/// The stream job's body.
pub struct Stream {
    spec: StreamSpec,
}

impl Stream {
    /// A stream as `spec` says.
    pub fn new(spec: StreamSpec) -> Self {
        Self { spec }
    }

    /// Bytes looked at per step: whole clusters of the overlay, so that
    /// the runs of a step stay inside it.
    fn step(&self) -> u64 {
        MAX_COPY.max(self.spec.top.cluster_size().unwrap_or(1))
    }

    /// Whether data stored at `depth` below the overlay is copied.
    fn copies(&self, depth: u32) -> bool {
        depth > 1 && self.spec.base_depth.is_none_or(|base| depth < base)
    }

    /// The bytes the job looks at: none if no image lies between the
    /// overlay and the base (QEMU's job then counts 0 of 0 too).
    fn span(&self) -> u64 {
        let top = &self.spec.top;
        match self.spec.base_depth {
            Some(depth) if depth <= 2 => 0,
            None if !top.children().iter().any(|(role, _)| *role == "backing") => 0,
            _ => top.size(),
        }
    }

    /// The parts of `offset..offset + len` (whole clusters of the
    /// overlay) to copy, in whole clusters: `populate` fills clusters, and
    /// only their parts the overlay does not hold.
    fn runs(&self, offset: u64, len: u64) -> std::io::Result<Vec<(u64, u64)>> {
        let top = &self.spec.top;
        let cluster = top.cluster_size().unwrap_or(1);
        let end = offset + len;
        let mut runs: Vec<(u64, u64)> = Vec::new();
        let mut at = offset;
        while at < end {
            let (depth, n) = top.allocation_depth(at, end - at)?;
            let n = n.clamp(1, end - at);
            if self.copies(depth) {
                let (first, last) = (at / cluster * cluster, (at + n).next_multiple_of(cluster).min(top.size()));
                match runs.last_mut() {
                    Some((start, run)) if *start + *run >= first => *run = last - *start,
                    _ => runs.push((first, last - first)),
                }
            }
            at += n;
        }
        Ok(runs)
    }
}

/// The job's queue on the overlay and its buffer; the queue first, so that
/// it is dropped (waiting for reads in flight) before the buffer.
struct Copy {
    queue: Box<dyn IoQueue>,
    buf: AlignedBuf,
}

impl Copy {
    /// Reads `offset..offset + len` through the chain and puts it where
    /// the overlay has nothing of its own.
    fn run(&mut self, top: &dyn BlockNode, offset: u64, len: u64) -> Result<(), Failure> {
        if len > self.buf.len() as u64 {
            return Err(Failure::Engine(format!("a run of {len} bytes does not fit the job's buffer")));
        }
        let iov = [libc::iovec { iov_base: self.buf.as_mut_ptr().cast(), iov_len: len as usize }];
        // SAFETY: `iov` names `len` bytes of the buffer (at most
        // checked above), and both live until the read is reaped in `run_one`.
        let iovecs = unsafe { IoVecs::new(iov.as_ptr(), 1) };
        run_one(&mut *self.queue, IoOp::Read { offset, len, iov: iovecs })?;
        top.populate(offset, &self.buf[..len as usize]).map_err(|e| Failure::Io { write: true, errno: errno(&e) })
    }
}

impl JobBody for Stream {
    /// The length is known from the start (QEMU's too), whenever the job's
    /// thread begins.
    fn prepare(&mut self, job: &Arc<Job>) -> Result<(), String> {
        job.set_total(self.span());
        Ok(())
    }

    fn run(&mut self, job: &Arc<Job>) -> Result<(), String> {
        let top = self.spec.top.clone();
        let size = self.span();
        let queue = top.open_queue(4).map_err(|e| format!("Cannot open a queue on node '{}': {e}", top.name()))?;
        let step = self.step();
        let mut copy = Copy { queue, buf: AlignedBuf::zeroed(step as usize) };
        let mut pace = Pace::new();
        let mut at = 0;
        while at < size {
            if !turn(job, &pace)? {
                continue;
            }
            let len = step.min(size - at);
            match self.chunk(&mut copy, at, len) {
                Ok(copied) => {
                    pace.copied(copied);
                    job.add_progress(len);
                    at += len;
                }
                Err(Failure::Io { write, errno }) => {
                    if !job.io_error(self.spec.on_error, write, errno) {
                        return Err(strerror(errno));
                    }
                    job.wait(Some(Instant::now() + RETRY_DELAY));
                }
                Err(Failure::Engine(text)) => return Err(text),
            }
        }
        if self.spec.base.is_none() && !top.children().iter().any(|(role, _)| *role == "backing") {
            return Ok(()); // no chain: nothing to take in or to drop
        }
        // With the writers stopped, nothing changes under the last check.
        let writers = self.spec.writers.clone();
        let mut relink = || {
            self.copy_leftovers(job, &mut copy)?;
            let (base, header) = (self.spec.base.clone(), self.spec.header.clone());
            top.set_backing(base, header).map_err(|e| e.to_string())
        };
        writers.stopped(Some(&top), &mut relink)
    }
}

impl Stream {
    /// Copies what the first pass left (clusters a write was allocating
    /// then, since discarded), and makes sure nothing is left before the
    /// backing file goes.
    fn copy_leftovers(&self, job: &Job, copy: &mut Copy) -> Result<(), String> {
        let size = self.spec.top.size();
        let step = self.step();
        let chunks = || (0..size).step_by(step as usize).map(move |at| (at, step.min(size - at)));
        for (at, len) in chunks() {
            self.chunk(copy, at, len).map_err(|f| f.report(job))?;
        }
        let mut left = 0;
        for (at, len) in chunks() {
            left += self.runs(at, len).map_err(|e| e.to_string())?.iter().map(|(_, n)| n).sum::<u64>();
        }
        if left > 0 {
            return Err(format!(
                "{left} bytes of node '{}' still read from its backing chain: its backing file stays",
                self.spec.top.name()
            ));
        }
        Ok(())
    }

    /// Copies what chunk `offset..offset + len` needs; returns the bytes copied.
    fn chunk(&self, copy: &mut Copy, offset: u64, len: u64) -> Result<u64, Failure> {
        let runs = self.runs(offset, len).map_err(|e| Failure::Io { write: false, errno: errno(&e) })?;
        for &(at, n) in &runs {
            copy.run(&*self.spec.top, at, n)?;
        }
        Ok(runs.iter().map(|(_, n)| n).sum())
    }
}
