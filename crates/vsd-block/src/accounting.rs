//! Per-node statistics: every node of the graph counts the requests it is
//! sent, by exports and by the nodes above it (a format's metadata I/O
//! included), with their bytes, failures and latency (submitted to the
//! node -> completed by it).
//!
//! The graph wraps each node it builds in an [`AccountedNode`], so parents
//! that look their children up in the graph open accounted queues without
//! knowing it. Exports count their requests themselves, with more detail,
//! and open their node's queue uncounted: a wrapper on the exported node
//! would count the same requests twice, for a layer of calls per request
//! (about 90 instructions on null-co at iodepth 32, +3.5 %). The queue's statistics follow [`vsd_trace`]'s single-writer
//! rule: a queue leases a [`QueueStats`] from its node for its lifetime,
//! and only that queue's thread writes it. Time is stamped per submit and
//! per reap, not per request, as the export's workers do.

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use vsd_engine::{Completion, IoOp, IoQueue};
use vsd_trace::{Clock, OpKind, QueueSnapshot, QueueStats, Runs};

use crate::BlockNode;
use crate::common::DiscardsAnswered;
use crate::dirty::{DirtyBitmaps, DirtyRecorder};
use crate::drivers::FilteredQueue;

/// The statistics of one node: one [`QueueStats`] per queue ever open at
/// once, handed out again when a queue closes, so they keep counting.
#[derive(Default)]
struct NodeStats {
    leases: Mutex<Leases>,
}

#[derive(Default)]
struct Leases {
    all: Vec<Arc<QueueStats>>,
    free: Vec<Arc<QueueStats>>,
}

impl NodeStats {
    fn lock(&self) -> MutexGuard<'_, Leases> {
        // The lists stay consistent whatever panicked while holding them.
        self.leases.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn lease(self: &Arc<Self>) -> Lease {
        let mut leases = self.lock();
        let stats = leases.free.pop().unwrap_or_else(|| {
            let stats = Arc::new(QueueStats::timed_by(Clock::get()));
            leases.all.push(stats.clone());
            stats
        });
        Lease { stats, owner: self.clone() }
    }

    fn snapshot(&self) -> QueueSnapshot {
        let mut sum = QueueSnapshot::default();
        for stats in &self.lock().all {
            sum.merge(&stats.snapshot());
        }
        sum
    }
}

/// A queue's exclusive use of one of its node's [`QueueStats`].
struct Lease {
    stats: Arc<QueueStats>,
    owner: Arc<NodeStats>,
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.owner.lock().free.push(self.stats.clone());
    }
}

/// A node of the graph: the driver's node, counting what it is sent.
pub(crate) struct AccountedNode {
    inner: Arc<dyn BlockNode>,
    stats: Arc<NodeStats>,
    /// The node's cache options, which the graph parses for every driver.
    cache: crate::Cache,
    /// And the other options QEMU gives every node.
    common: crate::common::Common,
    /// Whether the node is active ([`BlockNode::active`]): the graph keeps
    /// this for every driver.
    active: AtomicBool,
    /// The graph keeps dirty bitmaps for every driver too.
    bitmaps: Arc<DirtyBitmaps>,
    /// A filter without `discard=unmap`: its queues answer discards.
    answers_discards: bool,
}

impl AccountedNode {
    pub(crate) fn new(
        inner: Arc<dyn BlockNode>,
        cache: crate::Cache,
        common: crate::common::Common,
        active: bool,
        bitmaps: Arc<DirtyBitmaps>,
    ) -> Self {
        let answers_discards = crate::FILTERS.contains(&inner.driver()) && !common.acts_on_discards;
        Self { inner, stats: Arc::default(), cache, common, active: AtomicBool::new(active), bitmaps, answers_discards }
    }
}

impl BlockNode for AccountedNode {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn driver(&self) -> &'static str {
        self.inner.driver()
    }
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn read_only(&self) -> bool {
        self.inner.read_only()
    }
    fn set_read_only(&self, read_only: bool) -> io::Result<()> {
        self.inner.set_read_only(read_only)
    }
    fn cache(&self) -> crate::Cache {
        self.cache
    }
    fn filename(&self) -> Option<&str> {
        self.inner.filename()
    }
    fn request_alignment(&self) -> u32 {
        self.inner.request_alignment()
    }
    fn children(&self) -> Vec<(&'static str, Arc<dyn BlockNode>)> {
        self.inner.children()
    }
    fn host_file(&self, offset: u64, len: u64) -> Option<(Arc<std::fs::File>, u64)> {
        self.inner.host_file(offset, len)
    }
    fn resize(&self, size: u64) -> io::Result<()> {
        self.inner.resize(size)?;
        self.bitmaps.resize(size);
        Ok(())
    }
    fn close(&self) -> io::Result<()> {
        self.inner.close()
    }
    fn refresh_size(&self) -> io::Result<u64> {
        let size = self.inner.refresh_size()?;
        self.bitmaps.resize(size);
        Ok(size)
    }
    /// With `force-share=on`, nothing is refused to other processes.
    fn claim(&self, claim: crate::Claim) -> Result<Vec<crate::ClaimGuard>, crate::LockError> {
        let unshared = if self.common.force_share { crate::Perms::NONE } else { claim.unshared };
        self.inner.claim(crate::Claim { unshared, ..claim })
    }
    fn active(&self) -> bool {
        self.active.load(Ordering::Acquire)
    }
    fn inactivate(&self) -> io::Result<()> {
        self.inner.inactivate()?;
        self.active.store(false, Ordering::Release);
        Ok(())
    }
    fn activate(&self) -> io::Result<()> {
        self.inner.activate()?;
        self.active.store(true, Ordering::Release);
        Ok(())
    }
    fn block_status(&self, offset: u64, len: u64) -> io::Result<(crate::Allocation, u64)> {
        self.inner.block_status(offset, len)
    }
    fn allocation_depth(&self, offset: u64, len: u64) -> io::Result<(u32, u64)> {
        self.inner.allocation_depth(offset, len)
    }
    fn throttle_group(&self) -> Option<Arc<crate::throttle::ThrottleGroup>> {
        self.inner.throttle_group()
    }
    fn internal_snapshots(&self) -> Option<&dyn crate::InternalSnapshots> {
        self.inner.internal_snapshots()
    }
    fn attach_backing(&self, backing: Arc<dyn BlockNode>) -> Result<(), crate::AttachError> {
        self.inner.attach_backing(backing)
    }
    fn populate(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.inner.populate(offset, data)
    }
    fn set_backing(&self, backing: Option<Arc<dyn BlockNode>>, header: Option<(String, String)>) -> io::Result<()> {
        self.inner.set_backing(backing, header)
    }
    fn rename_backing_file(&self, header: Option<(String, String)>) -> io::Result<()> {
        self.inner.rename_backing_file(header)
    }
    fn replace_backing(&self, backing: Option<Arc<dyn BlockNode>>) -> io::Result<()> {
        self.inner.replace_backing(backing)
    }
    fn replace_filtered(&self, child: Arc<dyn BlockNode>) -> io::Result<()> {
        self.inner.replace_filtered(child)
    }
    fn dirty_bitmaps(&self) -> Option<&Arc<DirtyBitmaps>> {
        Some(&self.bitmaps)
    }
    fn default_bitmap_granularity(&self) -> u64 {
        self.inner.default_bitmap_granularity()
    }
    fn cluster_size(&self) -> Option<u64> {
        self.inner.cluster_size()
    }
    fn supports_compressed_writes(&self) -> bool {
        self.inner.supports_compressed_writes()
    }
    fn can_store_bitmaps(&self) -> bool {
        self.inner.can_store_bitmaps()
    }
    fn persistent_bitmap_removed(&self) -> io::Result<()> {
        self.inner.persistent_bitmap_removed()
    }
    fn open_queue(&self, depth: u16) -> io::Result<Box<dyn IoQueue>> {
        let inner = self.open_uncounted_queue(depth)?;
        Ok(Box::new(AccountedQueue::new(inner, self.stats.lease(), self.bitmaps.recorder(), depth)))
    }
    fn open_uncounted_queue(&self, depth: u16) -> io::Result<Box<dyn IoQueue>> {
        let mut queue = self.inner.open_queue(depth)?;
        if self.answers_discards {
            queue = Box::new(FilteredQueue::new(queue, DiscardsAnswered, depth));
        }
        Ok(self.common.detect_zeroes.wrap(queue, depth))
    }
    fn stats(&self) -> Option<QueueSnapshot> {
        Some(self.stats.snapshot())
    }
}

/// What an accounted queue remembers of a request until it completes.
#[derive(Clone, Copy)]
struct Pending {
    kind: OpKind,
    bytes: u64,
    submitted_at: u64,
}

/// A node's queue that counts each request on its way through.
struct AccountedQueue {
    inner: Box<dyn IoQueue>,
    lease: Lease,
    dirty: DirtyRecorder,
    clock: Clock,
    /// By tag.
    pending: Vec<Pending>,
    /// Tags pushed since the last submit.
    unsubmitted: Vec<u32>,
    /// Kind and submit time of the requests being reaped, for their latency.
    completing: Runs<(OpKind, u64)>,
}

impl AccountedQueue {
    fn new(inner: Box<dyn IoQueue>, lease: Lease, dirty: DirtyRecorder, depth: u16) -> Self {
        let depth = usize::from(depth);
        Self {
            inner,
            lease,
            dirty,
            clock: Clock::get(),
            pending: vec![Pending { kind: OpKind::Flush, bytes: 0, submitted_at: 0 }; depth],
            unsubmitted: Vec::with_capacity(depth),
            completing: Runs::with_capacity(depth),
        }
    }
}

/// How a request is counted, by exports and nodes alike: its kind, as
/// QEMU's accounting sees it (write-zeroes are writes), and its bytes.
pub fn counted_as(op: &IoOp) -> (OpKind, u64) {
    let kind = match op {
        IoOp::Read { .. } => OpKind::Read,
        IoOp::Write { .. } | IoOp::WriteCompressed { .. } | IoOp::WriteZeroes { .. } => OpKind::Write,
        IoOp::Flush => OpKind::Flush,
        IoOp::Discard { .. } => OpKind::Unmap,
    };
    (kind, op.extent().map_or(0, |(_, len)| len))
}

impl IoQueue for AccountedQueue {
    unsafe fn push(&mut self, tag: u32, op: IoOp) {
        // Tags are below the depth the queue was opened with; one that is
        // not goes down uncounted rather than failing here.
        if let Some(request) = self.pending.get_mut(tag as usize) {
            let (kind, bytes) = counted_as(&op);
            *request = Pending { kind, bytes, submitted_at: 0 };
            self.unsubmitted.push(tag);
        }
        self.dirty.record(tag, &op);
        // SAFETY: the caller's guarantee, passed on unchanged.
        unsafe { self.inner.push(tag, op) }
    }

    fn submit(&mut self) -> io::Result<()> {
        if !self.unsubmitted.is_empty() {
            let now = self.clock.now();
            for tag in self.unsubmitted.drain(..) {
                self.pending[tag as usize].submitted_at = now;
            }
        }
        self.inner.submit()
    }

    fn reap(&mut self, out: &mut Vec<Completion>) {
        let start = out.len();
        self.inner.reap(out);
        if out.len() == start {
            return;
        }
        self.dirty.completed(&out[start..]);
        let now = self.clock.now();
        let stats = &self.lease.stats;
        for done in &out[start..] {
            let Some(request) = self.pending.get(done.tag as usize) else { continue };
            let op = stats.op(request.kind);
            op.ops.add(1);
            if done.errno == 0 {
                op.bytes.add(request.bytes);
            } else {
                op.failed.add(1);
            }
            self.completing.push((request.kind, request.submitted_at));
        }
        for ((kind, submitted_at), n) in self.completing.drain() {
            stats.op(kind).latency.record_n(now.saturating_sub(submitted_at), n);
        }
    }

    vsd_engine::forward_to_inner!(inner: wait, notify_fd, rearm, max_batch, held, kernel_entries);
}
