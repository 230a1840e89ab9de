//! Direct I/O of any alignment: requests whose offset, length or buffers
//! do not meet what an O_DIRECT file needs go through bounce buffers, as
//! QEMU pads requests to its `request_alignment` (block/io.c).
//!
//! ```text
//!   guest bytes [start, end) ─▶ whole blocks [lo, hi), a bounce buffer's worth at a time
//!     read:          read the chunk into the buffer, copy the guest's bytes out
//!     write:         read the partial edge blocks, copy the guest's bytes in,
//!                    write the chunk back (read-modify-write)
//!     write-zeroes:  partial edge blocks as writes of zeroes, the whole
//!                    blocks between them as one write-zeroes
//!     discard:       only the whole blocks inside it (discards are advisory)
//! ```
//!
//! Aligned requests go straight to the engine below: a few masks decide,
//! nothing is recorded for them and completions pass through untouched
//! while no request is bounced. The buffers are a per-queue pool allocated
//! up front; a misaligned request that finds none free waits for one.
//!
//! Two writes that read-modify-write the same edge block must not overlap
//! in time, or the later write-back brings back the bytes the other wrote
//! there. Edge blocks are leased node-wide ([`EdgeLeases`]), so that holds
//! across the queues of an export too (a guest writes neighbouring
//! sectors from two CPUs); a request whose edge is leased waits, and the
//! release wakes its queue. Writes of whole blocks take no lease, so that
//! aligned writes cost nothing: one that lands on an edge block while it
//! is being read-modify-written overlaps the guest's own sectors in flight
//! there, an order no guest relies on, and the rest of that block may then
//! keep its old contents (QEMU orders those too).

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::collections::VecDeque;
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::FileTypeExt;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use crate::{Completion, IoOp, IoQueue, IoVecs};

/// Bounce buffers per queue: enough for misaligned requests to overlap a
/// little, few enough to cost little memory (zeroed pages stay unmapped
/// until a bounce first touches them).
const BUFFERS: usize = 4;
/// Bytes per bounce buffer (at least two blocks); larger requests are
/// bounced a buffer's worth at a time.
const BUFFER_BYTES: usize = 128 << 10;
const PAGE: usize = 4096;

/// What O_DIRECT needs of a file's requests, in bytes (powers of two).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Alignment {
    /// File offsets and lengths (QEMU's `request_alignment`).
    pub request: u32,
    /// Buffer addresses in memory.
    pub memory: u32,
}

impl Alignment {
    /// Anything goes: a file without O_DIRECT.
    pub const ANY: Self = Self { request: 1, memory: 1 };

    /// What requests to `file` need: [`Alignment::ANY`] unless it was
    /// opened with O_DIRECT; then what `statx` says (Linux 6.1+), the
    /// logical block size of a block device, or what reads at offset 0
    /// accept, as QEMU's `raw_probe_alignment`.
    pub fn of(file: &File) -> io::Result<Self> {
        if !vsd_sys::residence(file)?.direct {
            return Ok(Self::ANY);
        }
        if let Some((memory, request)) = vsd_sys::dio_alignment(file)? {
            return Ok(Self::new(request, memory));
        }
        if file.metadata()?.file_type().is_block_device() {
            let block = vsd_sys::logical_block_size(file)?;
            return Ok(Self::new(block, block));
        }
        Ok(Self::probe(file))
    }

    /// Sizes rounded up to powers of two, at least 1.
    fn new(request: u32, memory: u32) -> Self {
        let round = |n: u32| n.max(1).checked_next_power_of_two().unwrap_or(1 << 31);
        Self { request: round(request), memory: round(memory) }
    }

    /// The smallest alignments that reads at offset 0 accept; 4096 if none.
    fn probe(file: &File) -> Self {
        const CANDIDATES: [u32; 5] = [1, 512, 1024, 2048, 4096];
        let buf = Buffers::new(2 * PAGE, 1, PAGE);
        let works = |at: usize, len: usize| {
            let iov = [libc::iovec { iov_base: buf.at(at).cast(), iov_len: len }];
            // SAFETY: iov names bytes at..at + len of `buf`, which holds
            // two pages and outlives the call.
            unsafe { vsd_sys::preadv2(file.as_fd(), &iov, 0, 0) }.is_ok()
        };
        let request = CANDIDATES.into_iter().find(|&a| works(0, a as usize)).unwrap_or(4096);
        let memory = CANDIDATES.into_iter().find(|&a| works(a as usize, PAGE)).unwrap_or(4096);
        Self { request, memory }
    }

    /// Whether requests of any alignment reach the file unchanged.
    pub fn is_any(&self) -> bool {
        *self == Self::ANY
    }
}

/// The whole blocks of `block` bytes around `[start, end)`.
fn span(start: u64, end: u64, block: u64) -> (u64, u64) {
    (start & !(block - 1), end.next_multiple_of(block))
}

/// What a bounced request does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Read,
    Write { durable: bool },
    Zero { may_unmap: bool },
}

/// How one chunk of a bounced request reaches the file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Chunk {
    /// Through the buffer: bytes `lo..hi` of the file.
    Buffered { lo: u64, hi: u64 },
    /// Whole blocks to zero in place.
    Zeroes { lo: u64, hi: u64 },
}

/// The chunk of a `kind` request for guest bytes `[start, end)` that begins
/// at `at` (a block boundary), with `block`-byte blocks and `buffer`-byte
/// bounce buffers.
fn chunk_at(kind: Kind, start: u64, end: u64, at: u64, block: u64, buffer: u64) -> Chunk {
    let (_, hi) = span(start, end, block);
    match kind {
        Kind::Zero { .. } if at < start || at + block > end => Chunk::Buffered { lo: at, hi: at + block },
        Kind::Zero { .. } => Chunk::Zeroes { lo: at, hi: end & !(block - 1) },
        _ => Chunk::Buffered { lo: at, hi: hi.min(at + buffer) },
    }
}

/// What a write must read of chunk `[lo, hi)` before it overwrites it with
/// guest bytes `[start, end)`: the blocks the guest covers only in part.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fill {
    Nothing,
    /// The whole chunk: both edges are partial and make up all of it.
    Whole,
    Head,
    Tail,
    HeadThenTail,
}

fn fill_for(start: u64, end: u64, lo: u64, hi: u64, block: u64) -> Fill {
    match (lo < start, hi > end) {
        (false, false) => Fill::Nothing,
        (true, false) => Fill::Head,
        (false, true) => Fill::Tail,
        (true, true) if hi - lo <= 2 * block => Fill::Whole,
        (true, true) => Fill::HeadThenTail,
    }
}

/// The edge blocks a write of `[start, end)` read-modify-writes: the
/// blocks where it starts and ends, if it covers them only in part.
fn edges(start: u64, end: u64, block: u64) -> ([u64; 2], usize) {
    let (head, tail) = (start & !(block - 1), (end - 1) & !(block - 1));
    match (!start.is_multiple_of(block), !end.is_multiple_of(block)) {
        (true, true) if head == tail => ([head, 0], 1),
        (true, true) => ([head, tail], 2),
        (true, false) => ([head, 0], 1),
        (false, true) => ([tail, 0], 1),
        (false, false) => ([0, 0], 0),
    }
}

/// The whole blocks inside `[offset, offset + len)`, if any.
fn inner_blocks(offset: u64, len: u64, block: u64) -> Option<(u64, u64)> {
    let lo = offset.next_multiple_of(block);
    let hi = (offset + len) & !(block - 1);
    (lo < hi).then(|| (lo, hi - lo))
}

/// Where a bounced request is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Idle,
    /// For a buffer or an edge lease.
    Waiting,
    /// Reading a chunk (a read's, or a write's whole edge chunk).
    Reading,
    ReadingHead,
    ReadingTail,
    Writing,
}

#[derive(Clone, Copy, Debug)]
struct Bounce {
    op: IoOp,
    phase: Phase,
    buffer: usize,
    chunk: Chunk,
    /// Leased edge blocks.
    edges: ([u64; 2], usize),
    /// The one iovec of the step in flight (the engine reads it until then).
    iov: libc::iovec,
}

// SAFETY: the iovec names the queue's own bounce buffer, which moves
// with the queue to whichever thread owns it.
unsafe impl Send for Bounce {}

/// Zeroed, page-aligned memory: `count` buffers of `len` bytes each.
struct Buffers {
    ptr: NonNull<u8>,
    layout: Layout,
    len: usize,
}

impl Buffers {
    fn new(len: usize, count: usize, align: usize) -> Self {
        let layout = Layout::from_size_align(len * count.max(1), align.max(PAGE)).expect("bounce buffers are small");
        // SAFETY: the layout has a non-zero size (len and count are).
        let ptr = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        Self { ptr, layout, len }
    }

    /// The address of byte `at` of the memory.
    fn at(&self, at: usize) -> *mut u8 {
        self.ptr.as_ptr().wrapping_add(at)
    }

    /// Buffer `index`'s bytes.
    ///
    /// # Safety
    /// No request in flight may use the buffer.
    unsafe fn get(&mut self, index: usize) -> &mut [u8] {
        // SAFETY: index < count (the pool hands out only those), so the
        // bytes lie inside the allocation; the caller guarantees that the
        // kernel is not using them.
        unsafe { std::slice::from_raw_parts_mut(self.at(index * self.len), self.len) }
    }
}

impl Drop for Buffers {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

// SAFETY: Buffers owns its memory; nothing else points into it but the
// requests of the queue that owns it.
unsafe impl Send for Buffers {}

/// The edge blocks being read-modify-written on one node, by all of its
/// queues (see the module's comment).
#[derive(Default)]
pub struct EdgeLeases {
    table: Mutex<Table>,
}

#[derive(Default)]
struct Table {
    /// (block offset, owner): the owner is (queue, tag).
    held: Vec<(u64, (u64, u32))>,
    /// Queues waiting for a lease, woken by the next release.
    sleepers: Vec<Arc<OwnedFd>>,
    queues: u64,
}

impl EdgeLeases {
    /// No leases; one per node.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    fn lock(&self) -> MutexGuard<'_, Table> {
        // Each update is one push, retain or clear: a panic cannot leave
        // the table half done.
        self.table.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn register(&self) -> u64 {
        let mut table = self.lock();
        table.queues += 1;
        table.queues
    }

    /// Leases `blocks` to `owner` if nobody holds any of them; otherwise
    /// `waker` is signalled at the next release.
    fn try_acquire(&self, owner: (u64, u32), blocks: &[u64], waker: Option<&Arc<OwnedFd>>) -> bool {
        let mut table = self.lock();
        if table.held.iter().any(|(block, _)| blocks.contains(block)) {
            if let Some(waker) = waker
                && !table.sleepers.iter().any(|s| Arc::ptr_eq(s, waker))
            {
                table.sleepers.push(waker.clone());
            }
            return false;
        }
        table.held.extend(blocks.iter().map(|&block| (block, owner)));
        true
    }

    /// Drops the leases `keep` refuses, and wakes the queues that waited.
    fn release(&self, mut keep: impl FnMut(&(u64, u32)) -> bool) {
        let mut table = self.lock();
        table.held.retain(|(_, owner)| keep(owner));
        for sleeper in table.sleepers.drain(..) {
            if let Err(e) = vsd_sys::signal_counter(sleeper.as_fd()) {
                log::warn!("cannot wake a queue waiting for a block: {e}");
            }
        }
    }
}

/// A queue that takes requests of any alignment and hands the engine
/// below only aligned ones (see the module's comment).
pub struct AlignedQueue {
    // First: dropping it waits for the requests in flight, which use the
    // buffers below.
    inner: Box<dyn IoQueue>,
    request_mask: u64,
    memory_mask: u64,
    bounces: Vec<Bounce>,
    /// Bounced requests not completed yet (waiting or running).
    active: usize,
    /// Of those, the ones with a step in flight below.
    running: usize,
    buffers: Buffers,
    free: Vec<usize>,
    waiting: VecDeque<u32>,
    /// Completed without I/O, not reaped yet.
    answered: Vec<Completion>,
    reaped: Vec<Completion>,
    /// Steps pushed below since the last submit.
    pushed: bool,
    leases: Arc<EdgeLeases>,
    id: u64,
    waker: Option<Arc<OwnedFd>>,
}

impl AlignedQueue {
    /// Wraps `inner` (a queue of `depth` tags on a file that needs
    /// `align`), sharing `leases` with the node's other queues.
    pub fn new(inner: Box<dyn IoQueue>, align: Alignment, leases: Arc<EdgeLeases>, depth: u16) -> io::Result<Self> {
        let block = align.request as usize;
        let len = BUFFER_BYTES.max(2 * block).next_multiple_of(block.max(PAGE));
        Self::with_buffers(inner, align, leases, depth, BUFFERS.min(usize::from(depth.max(1))), len)
    }

    fn with_buffers(
        inner: Box<dyn IoQueue>,
        align: Alignment,
        leases: Arc<EdgeLeases>,
        depth: u16,
        count: usize,
        len: usize,
    ) -> io::Result<Self> {
        let waker = inner.notify_fd().map(|fd| fd.try_clone_to_owned()).transpose()?.map(Arc::new);
        let idle = Bounce {
            op: IoOp::Flush,
            phase: Phase::Idle,
            buffer: 0,
            chunk: Chunk::Zeroes { lo: 0, hi: 0 },
            edges: ([0; 2], 0),
            iov: libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 },
        };
        let depth = usize::from(depth.max(1));
        Ok(Self {
            inner,
            request_mask: u64::from(align.request) - 1,
            memory_mask: u64::from(align.memory) - 1,
            bounces: vec![idle; depth],
            active: 0,
            running: 0,
            buffers: Buffers::new(len, count, align.memory as usize),
            free: (0..count).rev().collect(),
            waiting: VecDeque::with_capacity(depth),
            answered: Vec::with_capacity(depth),
            reaped: Vec::with_capacity(depth),
            pushed: false,
            id: leases.register(),
            leases,
            waker,
        })
    }

    fn block(&self) -> u64 {
        self.request_mask + 1
    }

    /// Whether the file takes a transfer of `len` bytes at `offset` from
    /// or into `iov` as it is.
    fn fits(&self, offset: u64, len: u64, iov: &IoVecs) -> bool {
        (offset | len) & self.request_mask == 0
            && iov
                .as_slice()
                .iter()
                .all(|v| (v.iov_base as u64 & self.memory_mask) | (v.iov_len as u64 & self.request_mask) == 0)
    }

    fn bounce(&mut self, tag: u32, op: IoOp) {
        let b = &mut self.bounces[tag as usize];
        b.op = op;
        b.phase = Phase::Waiting;
        self.active += 1;
        self.waiting.push_back(tag);
        let mut done = Vec::new();
        self.start_waiting(&mut done);
        self.answered.append(&mut done);
    }

    /// Starts the waiting requests that can start now, in their order.
    fn start_waiting(&mut self, out: &mut Vec<Completion>) {
        for _ in 0..self.waiting.len() {
            let Some(tag) = self.waiting.pop_front() else { break };
            if !self.try_start(tag, out) {
                self.waiting.push_back(tag);
            }
        }
    }

    /// Gives a waiting request a buffer and its edge leases and starts it;
    /// false if either is taken.
    fn try_start(&mut self, tag: u32, out: &mut Vec<Completion>) -> bool {
        let Some(&buffer) = self.free.last() else { return false };
        let op = self.bounces[tag as usize].op;
        let (kind, start, end) = describe(op);
        let edges = if kind == Kind::Read { ([0; 2], 0) } else { edges(start, end, self.block()) };
        if edges.1 > 0 && !self.leases.try_acquire((self.id, tag), &edges.0[..edges.1], self.waker.as_ref()) {
            return false;
        }
        self.free.pop();
        let b = &mut self.bounces[tag as usize];
        b.buffer = buffer;
        b.edges = edges;
        self.running += 1;
        self.start_chunk(tag, span(start, end, self.block()).0, out);
        true
    }

    /// Issues the first step of the chunk at `at`.
    fn start_chunk(&mut self, tag: u32, at: u64, out: &mut Vec<Completion>) {
        let b = self.bounces[tag as usize];
        let (kind, start, end) = describe(b.op);
        let block = self.block();
        let chunk = chunk_at(kind, start, end, at, block, self.buffers.len as u64);
        self.bounces[tag as usize].chunk = chunk;
        match (kind, chunk) {
            (Kind::Zero { may_unmap }, Chunk::Zeroes { lo, hi }) => {
                let zero = IoOp::WriteZeroes { offset: lo, len: hi - lo, may_unmap, fast: false };
                self.step(tag, Phase::Writing, zero);
            }
            (Kind::Read, Chunk::Buffered { lo, hi }) => self.transfer(tag, Phase::Reading, lo, hi, false),
            (_, Chunk::Buffered { lo, hi }) => match fill_for(start, end, lo, hi, block) {
                Fill::Nothing => self.write_chunk(tag),
                Fill::Whole => self.transfer(tag, Phase::Reading, lo, hi, false),
                Fill::Head | Fill::HeadThenTail => self.transfer(tag, Phase::ReadingHead, lo, lo + block, false),
                Fill::Tail => self.transfer(tag, Phase::ReadingTail, hi - block, hi, false),
            },
            // Only zeroing makes such chunks.
            (_, Chunk::Zeroes { .. }) => self.finish(tag, libc::EIO, out),
        }
    }

    /// Reads or writes file bytes `lo..hi` through the request's buffer
    /// (the chunk starts at its first byte).
    fn transfer(&mut self, tag: u32, phase: Phase, lo: u64, hi: u64, write: bool) {
        let b = &mut self.bounces[tag as usize];
        let Chunk::Buffered { lo: base, .. } = b.chunk else { return };
        let at = b.buffer * self.buffers.len + (lo - base) as usize;
        b.iov = libc::iovec { iov_base: self.buffers.at(at).cast(), iov_len: (hi - lo) as usize };
        // SAFETY: the iovec lives in `bounces`, which is never resized, and
        // names bytes of the request's buffer; both outlive the step, which
        // `Drop` waits for.
        let iov = unsafe { IoVecs::new(&raw const b.iov, 1) };
        let len = hi - lo;
        let op = match (write, b.op) {
            (true, IoOp::Write { durable, .. }) => IoOp::Write { offset: lo, len, iov, durable },
            (true, _) => IoOp::Write { offset: lo, len, iov, durable: false },
            (false, _) => IoOp::Read { offset: lo, len, iov },
        };
        self.step(tag, phase, op);
    }

    fn step(&mut self, tag: u32, phase: Phase, op: IoOp) {
        self.bounces[tag as usize].phase = phase;
        self.pushed = true;
        // SAFETY: the op names the request's buffer, kept until its
        // completion is reaped (see `transfer`).
        unsafe { self.inner.push(tag, op) };
    }

    /// Puts the guest's bytes (or zeroes) into the chunk's buffer and
    /// writes it.
    fn write_chunk(&mut self, tag: u32) {
        let b = self.bounces[tag as usize];
        let Chunk::Buffered { lo, hi } = b.chunk else { return };
        let (_, start, end) = describe(b.op);
        let (from, to) = (start.max(lo), end.min(hi));
        // SAFETY: no step of this request is in flight, and the buffer is
        // the request's alone.
        let buf = unsafe { self.buffers.get(b.buffer) };
        let dst = &mut buf[(from - lo) as usize..(to - lo) as usize];
        match b.op {
            // SAFETY: IoQueue's contract: the guest's buffers stay valid
            // until the request completes.
            IoOp::Write { iov, .. } => unsafe { iov.copy_out(from - start, dst) },
            _ => dst.fill(0),
        }
        self.transfer(tag, Phase::Writing, lo, hi, true);
    }

    /// Takes one completion of a bounced request's step.
    fn advance(&mut self, done: Completion, out: &mut Vec<Completion>) {
        let tag = done.tag;
        if done.errno != 0 {
            return self.finish(tag, done.errno, out);
        }
        let b = self.bounces[tag as usize];
        let (_, start, end) = describe(b.op);
        let (lo, hi) = match b.chunk {
            Chunk::Buffered { lo, hi } | Chunk::Zeroes { lo, hi } => (lo, hi),
        };
        match (b.phase, b.op) {
            (Phase::Reading, IoOp::Read { iov, .. }) => {
                let (from, to) = (start.max(lo), end.min(hi));
                // SAFETY: the step that filled the buffer has completed.
                let buf = unsafe { self.buffers.get(b.buffer) };
                // SAFETY: IoQueue's contract: the guest's buffers stay valid
                // and ours alone until the request completes.
                unsafe { iov.fill(from - start, to - from, Some(&buf[(from - lo) as usize..(to - lo) as usize])) };
            }
            (Phase::ReadingHead, _) if fill_for(start, end, lo, hi, self.block()) == Fill::HeadThenTail => {
                return self.transfer(tag, Phase::ReadingTail, hi - self.block(), hi, false);
            }
            (Phase::Reading | Phase::ReadingHead | Phase::ReadingTail, _) => return self.write_chunk(tag),
            _ => {}
        }
        if hi >= span(start, end, self.block()).1 {
            return self.finish(tag, 0, out);
        }
        self.start_chunk(tag, hi, out);
    }

    /// Completes a bounced request: its buffer and leases go back.
    fn finish(&mut self, tag: u32, errno: i32, out: &mut Vec<Completion>) {
        let b = &mut self.bounces[tag as usize];
        b.phase = Phase::Idle;
        self.free.push(b.buffer);
        if b.edges.1 > 0 {
            b.edges.1 = 0;
            let me = (self.id, tag);
            self.leases.release(|owner| *owner != me);
        }
        self.running -= 1;
        self.active -= 1;
        out.push(Completion { tag, errno });
        self.start_waiting(out);
    }
}

/// A bounced request's kind and guest byte range.
fn describe(op: IoOp) -> (Kind, u64, u64) {
    match op {
        IoOp::Read { offset, len, .. } => (Kind::Read, offset, offset + len),
        IoOp::Write { offset, len, durable, .. } => (Kind::Write { durable }, offset, offset + len),
        IoOp::WriteZeroes { offset, len, may_unmap, .. } => (Kind::Zero { may_unmap }, offset, offset + len),
        // Never bounced.
        IoOp::Discard { offset, len } => (Kind::Zero { may_unmap: true }, offset, offset + len),
        IoOp::WriteCompressed { offset, len, .. } => (Kind::Write { durable: false }, offset, offset + len),
        IoOp::Flush => (Kind::Read, 0, 0),
    }
}

impl IoQueue for AlignedQueue {
    unsafe fn push(&mut self, tag: u32, op: IoOp) {
        let aligned = match op {
            IoOp::Read { offset, len, ref iov } | IoOp::Write { offset, len, ref iov, .. } => {
                self.fits(offset, len, iov)
            }
            IoOp::WriteZeroes { offset, len, fast, .. } => {
                let aligned = (offset | len) & self.request_mask == 0;
                if fast && !aligned {
                    // Its edges would be written through a bounce buffer.
                    self.answered.push(Completion { tag, errno: libc::EOPNOTSUPP });
                    return;
                }
                aligned
            }
            IoOp::Discard { offset, len } if (offset | len) & self.request_mask != 0 => {
                // Advisory: the whole blocks inside it, or nothing.
                match inner_blocks(offset, len, self.block()) {
                    // SAFETY: a discard names no buffers.
                    Some((offset, len)) => unsafe { self.inner.push(tag, IoOp::Discard { offset, len }) },
                    None => self.answered.push(Completion { tag, errno: 0 }),
                }
                return;
            }
            IoOp::Discard { .. } | IoOp::Flush => true,
            IoOp::WriteCompressed { .. } => {
                self.answered.push(Completion { tag, errno: libc::ENOTSUP });
                return;
            }
        };
        if aligned || op.extent().is_some_and(|(_, len)| len == 0) {
            // SAFETY: the caller's guarantee for `op`.
            unsafe { self.inner.push(tag, op) }
        } else {
            self.bounce(tag, op);
        }
    }

    fn submit(&mut self) -> io::Result<()> {
        self.pushed = false;
        self.inner.submit()
    }

    fn reap(&mut self, out: &mut Vec<Completion>) {
        out.append(&mut self.answered);
        if self.active == 0 {
            return self.inner.reap(out);
        }
        // Another queue may have released the lease a request waits for.
        self.start_waiting(out);
        loop {
            let mut reaped = std::mem::take(&mut self.reaped);
            self.inner.reap(&mut reaped);
            for done in reaped.drain(..) {
                match self.bounces[done.tag as usize].phase {
                    Phase::Idle | Phase::Waiting => out.push(done),
                    _ => self.advance(done, out),
                }
            }
            self.reaped = reaped;
            // Next steps pushed here must reach the engine now: the owner
            // may sleep until their requests complete.
            if !self.pushed {
                break;
            }
            if let Err(e) = self.submit() {
                log::warn!("cannot submit the next step of a bounced request: {e}");
                break;
            }
        }
    }

    fn wait(&mut self) -> io::Result<()> {
        if !self.answered.is_empty() {
            return Ok(());
        }
        if self.active > self.running && self.running == 0 {
            // Only waiting for another queue's lease: that queue's owner
            // may be this thread, so look again soon rather than block.
            std::thread::sleep(Duration::from_micros(100));
            return Ok(());
        }
        self.inner.wait()
    }

    crate::forward_to_inner!(inner: notify_fd, rearm, max_batch, kernel_entries);
}

impl Drop for AlignedQueue {
    fn drop(&mut self) {
        // Bounced requests run to their end, so that their leases go back.
        let mut sink = Vec::new();
        while self.running > 0 {
            if self.inner.wait().is_err() {
                break;
            }
            self.reap(&mut sink);
            sink.clear();
        }
        let id = self.id;
        self.leases.release(|owner| owner.0 != id);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};

    use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

    use super::*;

    const BLOCK: u64 = 4096;
    const ALIGN: Alignment = Alignment { request: 4096, memory: 512 };

    #[test]
    fn spans_chunks_and_edges() {
        assert_eq!(span(512, 1024, BLOCK), (0, 4096));
        assert_eq!(span(4096, 8192, BLOCK), (4096, 8192));
        assert_eq!(span(4095, 4097, BLOCK), (0, 8192));
        let write = Kind::Write { durable: false };
        // A buffer's worth at a time, the last chunk short.
        assert_eq!(chunk_at(write, 512, 20_000, 0, BLOCK, 8192), Chunk::Buffered { lo: 0, hi: 8192 });
        assert_eq!(chunk_at(write, 512, 20_000, 16_384, BLOCK, 8192), Chunk::Buffered { lo: 16_384, hi: 20_480 });
        // Zeroing: partial edge blocks through the buffer, the middle in place.
        let zero = Kind::Zero { may_unmap: false };
        assert_eq!(chunk_at(zero, 512, 20_000, 0, BLOCK, 8192), Chunk::Buffered { lo: 0, hi: 4096 });
        assert_eq!(chunk_at(zero, 512, 20_000, 4096, BLOCK, 8192), Chunk::Zeroes { lo: 4096, hi: 16_384 });
        assert_eq!(chunk_at(zero, 512, 20_000, 16_384, BLOCK, 8192), Chunk::Buffered { lo: 16_384, hi: 20_480 });
        assert_eq!(chunk_at(zero, 512, 1024, 0, BLOCK, 8192), Chunk::Buffered { lo: 0, hi: 4096 });
        // What a write reads first.
        assert_eq!(fill_for(512, 1024, 0, 4096, BLOCK), Fill::Whole);
        assert_eq!(fill_for(512, 8192, 0, 8192, BLOCK), Fill::Head);
        assert_eq!(fill_for(0, 7000, 0, 8192, BLOCK), Fill::Tail);
        assert_eq!(fill_for(512, 7000, 0, 8192, BLOCK), Fill::Whole);
        assert_eq!(fill_for(512, 12_000, 0, 12_288, BLOCK), Fill::HeadThenTail);
        assert_eq!(fill_for(4096, 8192, 4096, 8192, BLOCK), Fill::Nothing);
        // The blocks a write leases.
        assert_eq!(edges(512, 1024, BLOCK), ([0, 0], 1));
        assert_eq!(edges(512, 8704, BLOCK), ([0, 8192], 2));
        assert_eq!(edges(4096, 8704, BLOCK), ([8192, 0], 1));
        assert_eq!(edges(512, 8192, BLOCK), ([0, 0], 1));
        assert_eq!(edges(4096, 8192, BLOCK), ([0, 0], 0));
        // Discards keep only whole blocks.
        assert_eq!(inner_blocks(512, 16_384, BLOCK), Some((4096, 12_288)));
        assert_eq!(inner_blocks(512, 4096, BLOCK), None);
    }

    #[derive(Default)]
    struct Disk {
        bytes: Vec<u8>,
        /// Requests that broke the alignment.
        misaligned: usize,
    }

    /// An engine over bytes in memory that checks every request's
    /// alignment and runs what was pushed before each reap, in order.
    struct Mock {
        disk: Arc<Mutex<Disk>>,
        queued: Vec<(u32, IoOp)>,
        notify: EventFd,
        paused: Arc<AtomicBool>,
        /// The most requests queued at once.
        queued_max: usize,
        seen: Vec<IoOp>,
    }

    impl Mock {
        fn new(disk: &Arc<Mutex<Disk>>) -> Self {
            Mock {
                disk: disk.clone(),
                queued: Vec::new(),
                notify: EventFd::new(EFD_NONBLOCK).unwrap(),
                paused: Arc::default(),
                queued_max: 0,
                seen: Vec::new(),
            }
        }

        fn run(disk: &mut Disk, op: IoOp) {
            let grow = |bytes: &mut Vec<u8>, end: u64| {
                if bytes.len() < end as usize {
                    bytes.resize(end as usize, 0);
                }
            };
            match op {
                IoOp::Read { offset, len, iov } => {
                    let mut data = vec![0u8; len as usize];
                    let have = disk.bytes.len().saturating_sub(offset as usize).min(len as usize);
                    data[..have].copy_from_slice(&disk.bytes[offset as usize..offset as usize + have]);
                    // SAFETY: the test's buffers outlive the request.
                    unsafe { iov.fill(0, len, Some(&data)) };
                }
                IoOp::Write { offset, len, iov, .. } => {
                    grow(&mut disk.bytes, offset + len);
                    // SAFETY: as above.
                    unsafe { iov.copy_out(0, &mut disk.bytes[offset as usize..(offset + len) as usize]) };
                }
                IoOp::WriteZeroes { offset, len, .. } | IoOp::Discard { offset, len } => {
                    grow(&mut disk.bytes, offset + len);
                    disk.bytes[offset as usize..(offset + len) as usize].fill(0);
                }
                // The aligned queue answers compressed writes itself.
                IoOp::Flush | IoOp::WriteCompressed { .. } => {}
            }
        }
    }

    impl IoQueue for Mock {
        unsafe fn push(&mut self, tag: u32, op: IoOp) {
            let (req, mem) = (u64::from(ALIGN.request) - 1, u64::from(ALIGN.memory) - 1);
            let bad = match op {
                IoOp::Read { offset, len, iov } | IoOp::Write { offset, len, iov, .. } => {
                    (offset | len) & req != 0
                        || iov.as_slice().iter().any(|v| v.iov_base as u64 & mem != 0 || v.iov_len as u64 & req != 0)
                }
                IoOp::WriteZeroes { offset, len, .. } | IoOp::Discard { offset, len } => (offset | len) & req != 0,
                IoOp::Flush | IoOp::WriteCompressed { .. } => false,
            };
            self.disk.lock().unwrap().misaligned += usize::from(bad);
            self.queued.push((tag, op));
            self.queued_max = self.queued_max.max(self.queued.len());
            self.seen.push(op);
        }

        fn submit(&mut self) -> io::Result<()> {
            Ok(())
        }

        fn reap(&mut self, out: &mut Vec<Completion>) {
            if self.paused.load(Ordering::Relaxed) {
                return;
            }
            let mut disk = self.disk.lock().unwrap();
            for (tag, op) in self.queued.drain(..) {
                Self::run(&mut disk, op);
                out.push(Completion { tag, errno: 0 });
            }
        }

        fn wait(&mut self) -> io::Result<()> {
            Ok(())
        }

        fn notify_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
            Some(crate::borrow_fd(&self.notify))
        }
    }

    fn queue(disk: &Arc<Mutex<Disk>>, leases: &Arc<EdgeLeases>, buffers: usize, len: usize) -> AlignedQueue {
        AlignedQueue::with_buffers(Box::new(Mock::new(disk)), ALIGN, leases.clone(), 16, buffers, len).unwrap()
    }

    fn mock(queue: &AlignedQueue) -> &Mock {
        // SAFETY: every queue of these tests is made over a Mock.
        unsafe { &*(&raw const *queue.inner).cast::<Mock>() }
    }

    /// Guest memory: `len` bytes at `skew` bytes into an allocation, split
    /// into `parts` iovecs.
    struct Guest {
        _mem: Vec<u8>,
        iov: Vec<libc::iovec>,
        ptr: *mut u8,
        len: usize,
    }

    impl Guest {
        fn new(data: &[u8], skew: usize, parts: usize) -> Self {
            let mut mem = vec![0u8; data.len() + skew + 8192];
            let base = mem.as_ptr().align_offset(4096) + skew;
            mem[base..base + data.len()].copy_from_slice(data);
            let ptr = mem[base..].as_mut_ptr();
            let cut = data.len() / parts.max(1);
            let mut iov = Vec::new();
            let mut at = 0;
            for i in 0..parts.max(1) {
                let n = if i + 1 == parts.max(1) { data.len() - at } else { cut };
                iov.push(libc::iovec { iov_base: ptr.wrapping_add(at).cast(), iov_len: n });
                at += n;
            }
            Guest { _mem: mem, iov, ptr, len: data.len() }
        }

        fn iov(&self) -> IoVecs {
            // SAFETY: the iovecs name this guest's memory, which outlives
            // every request of the test.
            unsafe { IoVecs::new(self.iov.as_ptr(), self.iov.len()) }
        }

        fn bytes(&self) -> &[u8] {
            // SAFETY: ptr names len bytes of _mem.
            unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
        }
    }

    /// Pushes `ops` (tag = index), submits, and reaps until all complete.
    fn run(queue: &mut AlignedQueue, ops: &[IoOp]) -> Vec<i32> {
        for (tag, &op) in ops.iter().enumerate() {
            // SAFETY: the buffers belong to the caller, who keeps them
            // until this returns.
            unsafe { queue.push(tag as u32, op) };
        }
        queue.submit().unwrap();
        let mut errno = vec![-1; ops.len()];
        let mut done = Vec::new();
        for _ in 0..1000 {
            queue.reap(&mut done);
            for c in done.drain(..) {
                assert_eq!(errno[c.tag as usize], -1, "tag {} completed twice", c.tag);
                errno[c.tag as usize] = c.errno;
            }
            if errno.iter().all(|&e| e >= 0) {
                return errno;
            }
            queue.wait().unwrap();
        }
        panic!("requests never completed: {errno:?}");
    }

    fn write(offset: u64, guest: &Guest) -> IoOp {
        IoOp::Write { offset, len: guest.len as u64, iov: guest.iov(), durable: false }
    }

    fn read(offset: u64, guest: &Guest) -> IoOp {
        IoOp::Read { offset, len: guest.len as u64, iov: guest.iov() }
    }

    fn pattern(seed: u64, len: usize) -> Vec<u8> {
        let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    #[test]
    fn aligned_requests_pass_through_untouched() {
        let disk = Arc::new(Mutex::new(Disk::default()));
        let mut q = queue(&disk, &EdgeLeases::new(), 2, 8192);
        let guest = Guest::new(&pattern(1, 8192), 0, 2);
        let op = write(4096, &guest);
        assert_eq!(run(&mut q, &[op]), [0]);
        let seen = &mock(&q).seen;
        assert_eq!(seen.len(), 1);
        let IoOp::Write { offset: 4096, len: 8192, iov, .. } = seen[0] else { panic!("{:?}", seen[0]) };
        assert_eq!(iov.as_slice().as_ptr(), guest.iov.as_ptr(), "the guest's own buffers");
        assert_eq!(q.active, 0);
    }

    #[test]
    fn random_requests_of_any_alignment_match_a_model() {
        let disk = Arc::new(Mutex::new(Disk { bytes: pattern(0, 65_536), misaligned: 0 }));
        let mut model = disk.lock().unwrap().bytes.clone();
        // Small buffers, so that requests take several chunks.
        let mut q = queue(&disk, &EdgeLeases::new(), 2, 8192);
        let mut rng = pattern(42, 1 << 16).into_iter().map(u64::from).cycle();
        let mut next = |n: u64| (0..3).fold(0, |acc, _| acc * 256 + rng.next().unwrap()) % n;
        for round in 0..300 {
            // Up to four requests on disjoint bytes, which may share blocks.
            let mut ops = Vec::new();
            let mut guests = Vec::new();
            let mut at = next(8192);
            while ops.len() < 4 && at < 60_000 {
                let most = if next(2) == 0 { 1024 } else { 20_000 };
                let len = 1 + next(most);
                let len = len.min(65_536 - at);
                let kind = next(4);
                let data = pattern(round * 10 + ops.len() as u64, len as usize);
                let guest = Guest::new(&data, [0, 512, 1][next(3) as usize], 1 + next(3) as usize);
                ops.push(match kind {
                    0 => read(at, &guest),
                    1 => write(at, &guest),
                    2 => IoOp::WriteZeroes { offset: at, len, may_unmap: false, fast: false },
                    _ => IoOp::Discard { offset: at, len },
                });
                guests.push(guest);
                at += len + next(3000);
            }
            let errno = run(&mut q, &ops);
            assert!(errno.iter().all(|&e| e == 0), "{errno:?}");
            for (op, guest) in ops.iter().zip(&guests) {
                match *op {
                    IoOp::Read { offset, len, .. } => {
                        assert!(guest.bytes() == &model[offset as usize..(offset + len) as usize], "round {round}")
                    }
                    IoOp::Write { offset, len, .. } => {
                        model[offset as usize..(offset + len) as usize].copy_from_slice(guest.bytes())
                    }
                    IoOp::WriteZeroes { offset, len, .. } => model[offset as usize..(offset + len) as usize].fill(0),
                    IoOp::Discard { offset, len } => {
                        if let Some((offset, len)) = inner_blocks(offset, len, BLOCK) {
                            model[offset as usize..(offset + len) as usize].fill(0);
                        }
                    }
                    IoOp::Flush | IoOp::WriteCompressed { .. } => {}
                }
            }
            let disk = disk.lock().unwrap();
            assert!(disk.bytes[..] == model[..], "round {round}: {ops:?}");
            assert_eq!(disk.misaligned, 0, "a misaligned request reached the engine");
        }
    }

    #[test]
    fn writes_sharing_a_block_on_one_queue_keep_both() {
        let disk = Arc::new(Mutex::new(Disk { bytes: vec![0; 8192], misaligned: 0 }));
        let mut q = queue(&disk, &EdgeLeases::new(), 4, 8192);
        let (a, b) = (Guest::new(&[1; 512], 0, 1), Guest::new(&[2; 512], 0, 1));
        // Both would read the block before either writes it back.
        assert_eq!(run(&mut q, &[write(512, &a), write(1536, &b)]), [0, 0]);
        let disk = disk.lock().unwrap();
        assert!(disk.bytes[512..1024].iter().all(|&x| x == 1));
        assert!(disk.bytes[1536..2048].iter().all(|&x| x == 2));
        assert!(disk.bytes[..512].iter().chain(&disk.bytes[1024..1536]).all(|&x| x == 0));
    }

    #[test]
    fn a_block_leased_by_another_queue_holds_a_write_back_until_released() {
        let disk = Arc::new(Mutex::new(Disk { bytes: vec![0; 8192], misaligned: 0 }));
        let leases = EdgeLeases::new();
        let (mut q1, mut q2) = (queue(&disk, &leases, 4, 8192), queue(&disk, &leases, 4, 8192));
        let (a, b) = (Guest::new(&[1; 512], 0, 1), Guest::new(&[2; 512], 0, 1));
        mock(&q1).paused.store(true, Ordering::Relaxed);
        // SAFETY: a and b outlive both requests.
        unsafe { q1.push(0, write(512, &a)) };
        // SAFETY: as above.
        unsafe { q2.push(0, write(1536, &b)) };
        let mut done = Vec::new();
        q2.reap(&mut done);
        let held_back = done.is_empty() && mock(&q2).seen.is_empty();
        // Before asserting: a paused engine would keep q1's drop waiting.
        mock(&q1).paused.store(false, Ordering::Relaxed);
        assert!(held_back, "the second write waits for the block");
        q1.reap(&mut done);
        assert_eq!(done, [Completion { tag: 0, errno: 0 }]);
        assert_eq!(vsd_sys::read_counter(mock(&q2).notify_fd().unwrap()).unwrap(), 1, "the release wakes q2");
        done.clear();
        q2.reap(&mut done);
        assert_eq!(done, [Completion { tag: 0, errno: 0 }]);
        let disk = disk.lock().unwrap();
        assert!(disk.bytes[512..1024].iter().all(|&x| x == 1));
        assert!(disk.bytes[1536..2048].iter().all(|&x| x == 2));
    }

    #[test]
    fn with_the_pool_taken_requests_wait_their_turn() {
        let disk = Arc::new(Mutex::new(Disk { bytes: pattern(5, 65_536), misaligned: 0 }));
        let mut q = queue(&disk, &EdgeLeases::new(), 1, 8192);
        let guests: Vec<_> = (0..3).map(|_| Guest::new(&[0; 1000], 0, 1)).collect();
        let ops: Vec<_> = guests.iter().enumerate().map(|(i, g)| read(100 + i as u64 * 5000, g)).collect();
        assert_eq!(run(&mut q, &ops), [0, 0, 0]);
        assert_eq!(mock(&q).queued_max, 1, "one buffer: one bounced step at a time");
        let disk = disk.lock().unwrap();
        for (i, g) in guests.iter().enumerate() {
            let at = 100 + i * 5000;
            assert!(g.bytes() == &disk.bytes[at..at + 1000]);
        }
    }
}
