//! The filter a write-blocking mirror (`copy-mode=write-blocking`) puts
//! above its source, as QEMU's `mirror_top`: every write of the source's
//! writers goes to the source and to the target at once, and completes
//! once both have it. What the guest writes adds nothing to copy, so the
//! mirror reaches READY and stays there whatever the guest's write rate
//! (at the target's pace).
//!
//! ```text
//!   writers ─▶ MirrorTop ─┬─▶ source ─┐
//!                         └─▶ target ─┴─▶ completed once both are done
//!   job: copy source ─▶ target, of the runs still dirty
//! ```
//!
//! A write that was in flight while the job copied a range it overlaps may
//! have reached the target before the job's stale copy did: [`InFlight`]
//! finds such crossings, and the range is dirty again (as it is when
//! either half fails), for the job to copy once more.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::{Arc, Mutex, PoisonError};

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vsd_block::dirty::DirtyRecorder;
use vsd_block::{Allocation, BlockNode, Cache, Claim, ClaimGuard, Completion, IoOp, IoQueue, LockError};

/// The job's copies and the writers' writes in flight, to find which cross.
#[derive(Default)]
pub struct InFlight {
    ranges: Mutex<Ranges>,
}

#[derive(Default)]
struct Ranges {
    copies: Vec<(u64, u64)>,
    /// By id: the range of each write, and whether a copy crossed it.
    writes: Vec<(u64, (u64, u64), bool)>,
    next_id: u64,
    /// Ranges the job must copy again.
    dirty: Vec<(u64, u64)>,
}

fn overlap(a: (u64, u64), b: (u64, u64)) -> bool {
    a.0 < b.0 + b.1 && b.0 < a.0 + a.1
}

impl InFlight {
    fn ranges(&self) -> std::sync::MutexGuard<'_, Ranges> {
        self.ranges.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The job starts copying `range`: writes in flight over it are crossed.
    pub(crate) fn copy_begins(&self, range: (u64, u64)) {
        let mut ranges = self.ranges();
        ranges.writes.iter_mut().filter(|(_, w, _)| overlap(*w, range)).for_each(|(_, _, crossed)| *crossed = true);
        ranges.copies.push(range);
    }

    /// The job's copy of `range` is on the target.
    pub(crate) fn copy_ends(&self, range: (u64, u64)) {
        let mut ranges = self.ranges();
        if let Some(at) = ranges.copies.iter().position(|c| *c == range) {
            ranges.copies.swap_remove(at);
        }
    }

    /// The ranges to copy again since last asked.
    pub(crate) fn take_dirty(&self) -> Vec<(u64, u64)> {
        std::mem::take(&mut self.ranges().dirty)
    }

    fn write_begins(&self, range: (u64, u64)) -> u64 {
        let mut ranges = self.ranges();
        let crossed = ranges.copies.iter().any(|c| overlap(*c, range));
        let id = ranges.next_id;
        ranges.next_id += 1;
        ranges.writes.push((id, range, crossed));
        id
    }

    /// Write `id` is done; `failed` if a half of it failed.
    fn write_ends(&self, id: u64, failed: bool) {
        let mut ranges = self.ranges();
        let Some(at) = ranges.writes.iter().position(|(w, _, _)| *w == id) else { return };
        let (_, range, crossed) = ranges.writes.swap_remove(at);
        if crossed || failed {
            ranges.dirty.push(range);
        }
    }
}

/// The filter node, which the source's exports serve while the job runs.
pub struct MirrorTop {
    name: String,
    source: Arc<dyn BlockNode>,
    target: Arc<dyn BlockNode>,
    in_flight: Arc<InFlight>,
}

impl MirrorTop {
    /// A filter called `name` that writes `source`'s writes to `target` too.
    pub fn new(name: String, source: Arc<dyn BlockNode>, target: Arc<dyn BlockNode>, in_flight: Arc<InFlight>) -> Self {
        Self { name, source, target, in_flight }
    }
}

impl BlockNode for MirrorTop {
    fn name(&self) -> &str {
        &self.name
    }

    fn driver(&self) -> &'static str {
        "mirror_top"
    }

    fn size(&self) -> u64 {
        self.source.size()
    }

    fn read_only(&self) -> bool {
        self.source.read_only()
    }

    fn cache(&self) -> Cache {
        self.source.cache()
    }

    fn children(&self) -> Vec<(&'static str, Arc<dyn BlockNode>)> {
        vec![("file", self.source.clone())]
    }

    fn claim(&self, claim: Claim) -> Result<Vec<ClaimGuard>, LockError> {
        self.source.claim(claim)
    }

    fn refresh_size(&self) -> io::Result<u64> {
        self.source.refresh_size()
    }

    fn block_status(&self, offset: u64, len: u64) -> io::Result<(Allocation, u64)> {
        self.source.block_status(offset, len)
    }

    fn allocation_depth(&self, offset: u64, len: u64) -> io::Result<(u32, u64)> {
        self.source.allocation_depth(offset, len)
    }

    fn cluster_size(&self) -> Option<u64> {
        self.source.cluster_size()
    }

    fn open_queue(&self, depth: u16) -> io::Result<Box<dyn IoQueue>> {
        // Counted where they entered the graph, as through any filter; the
        // source's bitmaps are recorded here (see `BothQueue::dirty`).
        let source = self.source.open_uncounted_queue(depth)?;
        let target = self.target.open_queue(depth)?;
        let dirty = DirtyRecorder::for_node(&*self.source);
        Ok(Box::new(BothQueue::new(source, target, dirty, self.in_flight.clone(), depth)?))
    }
}

/// A write in flight on both queues.
#[derive(Clone, Copy)]
struct Pending {
    id: u64,
    /// Halves not completed yet.
    halves: u8,
    /// The source's answer, which the writer gets.
    errno: i32,
    failed: bool,
}

const TOKEN_SOURCE: u64 = 0;
const TOKEN_TARGET: u64 = 1;

struct BothQueue {
    source: Box<dyn IoQueue>,
    target: Box<dyn IoQueue>,
    /// The source's bitmaps, which its uncounted queue does not record.
    /// The job's own record is apart from them ([`vsd_block::dirty::Tracker::apart`]):
    /// writes that reach the target need no copy.
    dirty: DirtyRecorder,
    in_flight: Arc<InFlight>,
    /// By tag, the writes in flight.
    pending: Vec<Option<Pending>>,
    /// Requests on each queue not reaped yet.
    on_source: usize,
    on_target: usize,
    done: Vec<Completion>,
    /// Both queues' descriptors: what the owner waits on.
    epoll: Epoll,
}

impl BothQueue {
    fn new(
        source: Box<dyn IoQueue>,
        target: Box<dyn IoQueue>,
        dirty: DirtyRecorder,
        in_flight: Arc<InFlight>,
        depth: u16,
    ) -> io::Result<Self> {
        let epoll = Epoll::new()?;
        for (queue, token) in [(&source, TOKEN_SOURCE), (&target, TOKEN_TARGET)] {
            if let Some(fd) = queue.notify_fd() {
                epoll.ctl(ControlOperation::Add, fd.as_raw_fd(), EpollEvent::new(EventSet::IN, token))?;
            }
        }
        let pending = vec![None; usize::from(depth)];
        Ok(Self { source, target, dirty, in_flight, pending, on_source: 0, on_target: 0, done: Vec::new(), epoll })
    }

    /// One half of the write with `tag` is done; the completion the
    /// writer gets once both are.
    fn half_done(&mut self, completion: Completion, from_source: bool) -> Option<Completion> {
        let slot = self.pending.get_mut(completion.tag as usize)?;
        let pending = slot.as_mut()?;
        pending.halves -= 1;
        pending.failed |= completion.errno != 0;
        if from_source {
            pending.errno = completion.errno;
        }
        if pending.halves > 0 {
            return None;
        }
        let Pending { id, errno, failed, .. } = slot.take()?;
        self.in_flight.write_ends(id, failed);
        Some(Completion { tag: completion.tag, errno })
    }
}

fn written_range(op: &IoOp) -> Option<(u64, u64)> {
    match *op {
        IoOp::Write { offset, len, .. }
        | IoOp::WriteCompressed { offset, len, .. }
        | IoOp::WriteZeroes { offset, len, .. }
        | IoOp::Discard { offset, len } => Some((offset, len)),
        IoOp::Read { .. } | IoOp::Flush => None,
    }
}

impl IoQueue for BothQueue {
    unsafe fn push(&mut self, tag: u32, op: IoOp) {
        self.on_source += 1;
        if let Some(range) = written_range(&op) {
            self.dirty.record(tag, &op);
            let id = self.in_flight.write_begins(range);
            match self.pending.get_mut(tag as usize) {
                Some(slot) => {
                    *slot = Some(Pending { id, halves: 2, errno: 0, failed: false });
                    self.on_target += 1;
                    // SAFETY: the owner's guarantee for `op` holds until its
                    // completion is reaped, which is after both halves are.
                    unsafe { self.target.push(tag, op) };
                }
                // A tag beyond the depth breaks the owner's contract: the
                // job copies the range instead.
                None => self.in_flight.write_ends(id, true),
            }
        }
        // SAFETY: as above.
        unsafe { self.source.push(tag, op) }
    }

    fn submit(&mut self) -> io::Result<()> {
        let target = self.target.submit();
        self.source.submit()?;
        target
    }

    fn reap(&mut self, out: &mut Vec<Completion>) {
        let before = out.len();
        let mut done = std::mem::take(&mut self.done);
        self.source.reap(&mut done);
        self.on_source -= done.len();
        for completion in done.drain(..) {
            match self.pending.get(completion.tag as usize) {
                Some(Some(_)) => out.extend(self.half_done(completion, true)),
                _ => out.push(completion),
            }
        }
        self.target.reap(&mut done);
        self.on_target -= done.len();
        for completion in done.drain(..) {
            out.extend(self.half_done(completion, false));
        }
        self.done = done;
        self.dirty.completed(&out[before..]);
    }

    fn wait(&mut self) -> io::Result<()> {
        if self.on_source > 0 { self.source.wait() } else { self.target.wait() }
    }

    fn notify_fd(&self) -> Option<BorrowedFd<'_>> {
        // SAFETY: the epoll set lives as long as the queue, and the borrow
        // cannot outlive it.
        Some(unsafe { BorrowedFd::borrow_raw(self.epoll.as_raw_fd()) })
    }

    fn rearm(&mut self) {
        let mut events = [EpollEvent::default(); 2];
        let ready = self.epoll.wait(0, &mut events).unwrap_or(0);
        for event in &events[..ready] {
            match event.data() {
                TOKEN_SOURCE => self.source.rearm(),
                _ => self.target.rearm(),
            }
        }
    }

    fn max_batch(&self) -> usize {
        self.source.max_batch().min(self.target.max_batch())
    }

    fn kernel_entries(&self) -> u64 {
        self.source.kernel_entries() + self.target.kernel_entries()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_write_a_copy_crossed_is_dirty_again_and_one_alone_is_not() {
        let in_flight = InFlight::default();
        let alone = in_flight.write_begins((0, 4096));
        in_flight.write_ends(alone, false);
        assert!(in_flight.take_dirty().is_empty());

        // The copy begins while the write is in flight...
        let before = in_flight.write_begins((4096, 4096));
        in_flight.copy_begins((0, 65536));
        // ...or the write begins while the copy is.
        let during = in_flight.write_begins((8192, 512));
        let beside = in_flight.write_begins((65536, 4096));
        in_flight.copy_ends((0, 65536));
        for id in [before, during, beside] {
            in_flight.write_ends(id, false);
        }
        assert_eq!(in_flight.take_dirty(), [(4096, 4096), (8192, 512)]);
    }

    #[test]
    fn a_failed_half_makes_the_write_dirty() {
        let in_flight = InFlight::default();
        let id = in_flight.write_begins((0, 512));
        in_flight.write_ends(id, true);
        assert_eq!(in_flight.take_dirty(), [(0, 512)]);
    }
}
