//! Copying ranges of one node into another on a job's own queues: the
//! backup's and the mirror's data path. Holes of the source become zeroes
//! on the target.

use std::sync::Arc;
use std::time::{Duration, Instant};

use vsd_block::{Allocation, BlockNode, IoOp, IoQueue, IoVecs};
use vsd_qcow2::buf::AlignedBuf;

use crate::{CANCELLED, ErrorPolicy, Job, strerror};

/// The most bytes one [`Copier::copy`] takes.
pub(crate) const MAX_COPY: u64 = 1 << 20;

/// How far the source's allocation can be trusted once asked.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Extents {
    /// Until the range is copied: writes to it wait for the copy (backup).
    Stable,
    /// Writers change it at any time (mirror): a hole is asked again each
    /// time, as a write may have filled it; data read as data is harmless.
    Changing,
}

/// Why a copy failed.
pub(crate) enum Failure {
    /// A request failed with this errno: a read of the source or a write
    /// of the target.
    Io { write: bool, errno: i32 },
    /// The engine itself failed: nothing can be retried.
    Engine(String),
}

impl Failure {
    /// What the job fails with: an I/O error is also reported
    /// (BLOCK_JOB_ERROR, action `report`).
    pub(crate) fn report(self, job: &Job) -> String {
        match self {
            Failure::Io { write, errno } => {
                job.io_error(ErrorPolicy::Report, write, errno);
                strerror(errno)
            }
            Failure::Engine(text) => text,
        }
    }
}

/// The job thread's queues and buffer. The queues come first: they are
/// dropped first, waiting for anything in flight in the buffer.
pub(crate) struct Copier {
    source_queue: Box<dyn IoQueue>,
    target_queue: Box<dyn IoQueue>,
    source: Arc<dyn BlockNode>,
    buf: AlignedBuf,
    /// The last extent block status gave, as far as it reaches: asked once
    /// for the rest of the node, not once per run (a file's SEEK_HOLE
    /// scans to the next hole: on tmpfs, 0.6 ms per call on 256 MiB).
    extent: Option<(Allocation, u64, u64)>,
    extents: Extents,
    /// Pieces end on multiples of it (or at the end of the range): a page,
    /// or the target's cluster when writing compressed.
    grain: u64,
    /// Data is written compressed ([`Copier::compressed`]).
    compress: bool,
}

/// Runs one request to its end on `queue`.
pub(crate) fn run_one(queue: &mut dyn IoQueue, op: IoOp) -> Result<(), Failure> {
    let write = !matches!(op, IoOp::Read { .. });
    // SAFETY: the buffers `op` names are the copier's, which outlives the
    // queue (dropped first); the request is reaped below before they are
    // used again.
    unsafe { queue.push(0, op) };
    queue.submit().map_err(|e| Failure::Engine(e.to_string()))?;
    let mut done = Vec::with_capacity(1);
    loop {
        queue.reap(&mut done);
        if let Some(completion) = done.pop() {
            return match completion.errno {
                0 => Ok(()),
                errno => Err(Failure::Io { write, errno }),
            };
        }
        queue.wait().map_err(|e| Failure::Engine(e.to_string()))?;
    }
}

impl Copier {
    pub(crate) fn open(
        source: &Arc<dyn BlockNode>,
        target: &Arc<dyn BlockNode>,
        extents: Extents,
    ) -> Result<Self, String> {
        let open = |node: &Arc<dyn BlockNode>| {
            node.open_queue(4).map_err(|e| format!("Cannot open a queue on node '{}': {e}", node.name()))
        };
        Ok(Self {
            source_queue: open(source)?,
            target_queue: open(target)?,
            source: source.clone(),
            buf: AlignedBuf::zeroed(MAX_COPY as usize),
            extent: None,
            extents,
            grain: 4096,
            compress: false,
        })
    }

    /// Writes data compressed from now on, whole target clusters of
    /// `cluster` bytes at a time (ranges copied start on one); holes are
    /// still written as zeroes, as QEMU's block-copy does.
    pub(crate) fn compressed(&mut self, cluster: u64) {
        self.grain = cluster;
        self.compress = true;
        if cluster > MAX_COPY {
            self.buf = AlignedBuf::zeroed(cluster as usize);
        }
    }

    /// Copies bytes `offset..offset + len`, data [`MAX_COPY`] bytes at a time.
    pub(crate) fn copy(&mut self, offset: u64, len: u64) -> Result<(), Failure> {
        let end = offset + len;
        let mut at = offset;
        while at < end {
            let (allocation, n) = self.status(at)?;
            // Pieces end on the grain: the requests stay aligned for
            // O_DIRECT, compressed ones take whole clusters. A hole ends
            // short of it, or if too short is copied as data.
            let mut n = n.clamp(1, end - at);
            let grain = self.grain;
            let allocation = match (at + n) / grain * grain {
                _ if (at + n).is_multiple_of(grain) || at + n == end => allocation,
                whole if allocation == Allocation::Hole && whole > at => {
                    n = whole - at;
                    allocation
                }
                _ => {
                    n = ((at + n).next_multiple_of(grain)).min(end) - at;
                    Allocation::Data
                }
            };
            match allocation {
                Allocation::Hole => self.zero(at, n)?,
                Allocation::Data => {
                    // The buffer's size, a multiple of the grain: aligned still.
                    n = n.min(self.buf.len() as u64);
                    self.copy_data(at, n)?;
                }
            }
            at += n;
        }
        Ok(())
    }

    /// Writes zeroes over bytes `offset..offset + len` of the target.
    pub(crate) fn zero(&mut self, offset: u64, len: u64) -> Result<(), Failure> {
        run_one(&mut *self.target_queue, IoOp::WriteZeroes { offset, len, may_unmap: true, fast: false })
    }

    /// How the source reads from `at`, and for how many bytes.
    pub(crate) fn status(&mut self, at: u64) -> Result<(Allocation, u64), Failure> {
        match self.extent {
            Some((allocation, start, end))
                if (start..end).contains(&at)
                    && (allocation == Allocation::Data || self.extents == Extents::Stable) =>
            {
                Ok((allocation, end - at))
            }
            _ => {
                let rest = self.source.size().saturating_sub(at).max(1);
                let (allocation, n) =
                    self.source.block_status(at, rest).map_err(|e| Failure::Io { write: false, errno: errno(&e) })?;
                self.extent = Some((allocation, at, at + n.max(1)));
                Ok((allocation, n.max(1)))
            }
        }
    }

    fn copy_data(&mut self, offset: u64, len: u64) -> Result<(), Failure> {
        let iov = [libc::iovec { iov_base: self.buf.as_mut_ptr().cast(), iov_len: len as usize }];
        // SAFETY: `iov` names `len` bytes of the buffer (a run at most),
        // and both live until the requests below are reaped.
        let iovecs = unsafe { IoVecs::new(iov.as_ptr(), 1) };
        run_one(&mut *self.source_queue, IoOp::Read { offset, len, iov: iovecs })?;
        let write = match self.compress {
            true => IoOp::WriteCompressed { offset, len, iov: iovecs },
            false => IoOp::Write { offset, len, iov: iovecs, durable: false },
        };
        run_one(&mut *self.target_queue, write)
    }

    pub(crate) fn flush(&mut self) -> Result<(), Failure> {
        run_one(&mut *self.target_queue, IoOp::Flush)
    }
}

pub(crate) fn errno(e: &std::io::Error) -> i32 {
    e.raw_os_error().unwrap_or(libc::EIO)
}

/// A job's speed limit: each copy waits for the bytes of the one before.
pub(crate) struct Pace {
    /// When the last copy was done, and its bytes.
    last: (Instant, u64),
}

impl Pace {
    pub(crate) fn new() -> Self {
        Self { last: (Instant::now(), 0) }
    }

    /// A copy of `bytes` is done.
    pub(crate) fn copied(&mut self, bytes: u64) {
        self.last = (Instant::now(), bytes);
    }

    /// When the next copy may start at `speed` bytes per second (0: no limit).
    pub(crate) fn allowed_at(&self, speed: u64) -> Instant {
        match speed {
            0 => self.last.0,
            speed => self.last.0 + Duration::from_secs_f64(self.last.1 as f64 / speed as f64),
        }
    }
}

/// Whether the job may do its next piece of work now: `Ok(false)` after
/// waiting (paused, or held to its speed), to be asked again; an error
/// once cancelled.
pub(crate) fn turn(job: &Job, pace: &Pace) -> Result<bool, String> {
    if job.cancelled() {
        return Err(CANCELLED.into());
    }
    if job.pause_point() {
        job.wait(None);
        return Ok(false);
    }
    let allowed = pace.allowed_at(job.speed());
    if Instant::now() < allowed {
        job.wait(Some(allowed));
        return Ok(false);
    }
    Ok(true)
}

/// The ranges stored in `node` or its backing chain above the layer
/// `depth` down (1 is `node` itself): with 2, what `sync=top` copies (what
/// the node holds itself); with a base's depth, what a commit copies.
pub(crate) fn extents_above(node: &dyn BlockNode, depth: u32) -> std::io::Result<Vec<(u64, u64)>> {
    let size = node.size();
    let mut extents = Vec::new();
    let mut at = 0;
    while at < size {
        let (stored, n) = node.allocation_depth(at, size - at)?;
        let n = n.clamp(1, size - at);
        if (1..depth).contains(&stored) {
            match extents.last_mut() {
                Some((start, len)) if *start + *len == at => *len += n,
                _ => extents.push((at, n)),
            }
        }
        at += n;
    }
    Ok(extents)
}
