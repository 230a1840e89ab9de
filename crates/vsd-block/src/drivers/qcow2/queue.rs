//! One thread's queue on a qcow2 node.
//!
//! Reads and in-place writes are split by [`Image::map`] into extents and
//! sent to the child queues asynchronously; zero and unallocated extents
//! are filled here. A write into clusters the image does not own yet gets
//! them allocated ([`Image::start_write`]); the old bytes their new
//! contents keep are read (see `copyup`) and the new contents written,
//! all as child requests too; each is linked into its table when its
//! write completes; the bytes it has in clusters the image owns go in
//! place beside them; a durable write's flush follows. The rest of what
//! changes metadata (write-zeroes, discard, a durable write alone on the
//! queue) runs synchronously through the image's metadata path and is
//! answered at once.
//!
//! A flush with metadata to write goes to the node's flusher (see
//! `flusher`) while other requests are in flight here, and is done in
//! place otherwise.
//!
//! A request that would change the metadata of a cluster whose allocation
//! is in flight (on any queue) is held back and routed again once an
//! allocation finishes: the image wakes this queue through an eventfd in
//! its epoll set.
//!
//! A request whose mapping needs an L2 table slice the cache lacks waits
//! while the slice is read like any other child request (see `loads`);
//! the others go on meanwhile, and the request is routed again (from where
//! it stopped) once the slice is in. Requests that change metadata load the
//! slices they need the same way before they take the metadata mutex, and
//! so does an allocating write the refcount block its allocation scans.
//!
//! A guest request that maps onto one child request, all of it (the common
//! case: a read or write within a cluster), goes down under the guest's own
//! tag, and its completion comes back up as it is. Child tags from the
//! guest's depth on carry the parts of the other requests.

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::Arc;
use std::task::{Wake, Waker};

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};
use vsd_engine::{Completion, IoOp, IoQueue, IoVecs};
use vsd_qcow2::buf::AlignedBuf;
use vsd_qcow2::{
    Allocation, Busy, CorruptMetadata, EpochPin, Extent, Image, ImageIo, MapMemo, Mapping, MissingTable, NeedsLoad,
    Origin, Piece,
};

use super::copyup::CopyUps;
use super::flusher::{Answers, Flusher, Request};
use super::health::Health;
use super::loads::{self, Loads, Waiting};
use crate::drivers::child::ChildQueue;

/// Which child a request goes to.
#[derive(Clone, Copy)]
enum Target {
    /// The image file.
    File,
    /// Where guest data lives: the external data file, else the image file.
    Data,
    /// The backing file.
    Backing,
}

/// A guest request and the child requests it still waits for.
#[derive(Clone, Copy, Default)]
struct Parent {
    remaining: u32,
    errno: i32,
    /// A durable write whose clusters are being allocated: once they are
    /// linked, a flush makes them durable before it is answered.
    flush_after: bool,
}

/// A guest request that is one child request, all of it.
struct Whole(Target, IoOp);

/// What a part's completion does besides settling its parent.
// Parts are slots made once per queue: an allocation kept inline costs
// their memory, not a heap allocation per allocating write.
#[allow(clippy::large_enum_variant)]
enum Then {
    Nothing,
    /// Links the allocation whose contents the part wrote.
    Link(Allocation),
    /// Counts one read of a copy-up's old bytes (its slot in `copy_ups`).
    CopiedIn(usize),
}

/// A child request that found no free tag; sent from `reap`.
struct Deferred {
    parent: u32,
    target: Target,
    op: IoOp,
    iov: Vec<libc::iovec>,
    then: Then,
}

/// A child request carrying part of a guest request.
struct Part {
    parent: u32,
    /// The slice of the parent's buffers it covers (or an allocation's).
    iov: Vec<libc::iovec>,
    then: Then,
}

/// A guest request held back by an allocation in flight: routed again
/// once allocations finished since `seen`.
struct Blocked {
    tag: u32,
    op: IoOp,
    seen: u64,
}

/// Wakes the queue's owner when an allocation it waits for finishes (on
/// whichever thread): the eventfd is in the queue's epoll set.
struct WakeFd(EventFd);

impl Wake for WakeFd {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        if let Err(e) = self.0.write(1) {
            log::warn!("qcow2: cannot wake a queue: {e}");
        }
    }
}

/// A queue's channels to the node's children.
pub(crate) struct Children {
    pub(crate) file: ChildQueue,
    pub(crate) data: Option<ChildQueue>,
    pub(crate) backing: Option<ChildQueue>,
}

pub(crate) struct Qcow2Queue {
    image: Arc<Image>,
    health: Arc<Health>,
    /// Takes the flushes that have metadata to write.
    flusher: Arc<Flusher>,
    /// Where it answers them.
    flushed: Arc<Answers>,
    /// Flushes handed to it and not answered yet.
    flushes_out: u32,
    /// Guest requests pushed and not reaped yet.
    in_flight: u32,
    /// The epochs they started in: clusters freed meanwhile are not
    /// handed out again while they may still use them.
    pin: EpochPin,
    /// Guest flushes with metadata to write, routed since the last submit.
    flushes_due: Vec<u32>,
    file: ChildQueue,
    data: Option<ChildQueue>,
    backing: Option<ChildQueue>,
    /// Watches the children's completion descriptors: ours is readable
    /// while any of theirs is.
    epoll: Epoll,
    /// The guest's depth: child tags below it are guest requests sent
    /// whole, the rest are parts.
    depth: u32,
    parents: Vec<Parent>,
    /// By part tag (child tag minus the guest's depth).
    parts: Vec<Part>,
    /// Free part tags.
    free: Vec<u32>,
    deferred: VecDeque<Deferred>,
    answered: Vec<Completion>,
    /// The node's `discard=unmap` (see [`Qcow2Queue::acting_on_discards`]).
    acts_on_discards: bool,
    blocked: Vec<Blocked>,
    /// Reads of table slices, and the requests waiting for them.
    loads: Loads,
    copy_ups: CopyUps,
    /// A copy-up's write was sent while completions were settled: it
    /// needs a submit.
    written_up: bool,
    /// Wakes this queue for `blocked`.
    unblocked: Arc<WakeFd>,
    waker: Waker,
    /// The last compressed cluster decompressed: (host offset, contents).
    compressed: Option<(u64, AlignedBuf)>,
    /// Extents of the write being routed.
    extents: Vec<(u64, u64, u64)>,
    memo: MapMemo,
}

impl Qcow2Queue {
    /// A queue for `depth` guest requests on children opened with
    /// `depth + parts` tags each.
    pub(crate) fn new(
        image: Arc<Image>,
        Children { file, data, backing }: Children,
        health: Arc<Health>,
        flusher: Arc<Flusher>,
        depth: u16,
        parts: u16,
    ) -> io::Result<Self> {
        let epoll = Epoll::new()?;
        let unblocked = Arc::new(WakeFd(EventFd::new(EFD_NONBLOCK)?));
        let children = [Some(&file), data.as_ref(), backing.as_ref()].into_iter().flatten();
        for fd in children.filter_map(ChildQueue::notify_fd).map(|fd| fd.as_raw_fd()).chain([unblocked.0.as_raw_fd()]) {
            epoll.ctl(ControlOperation::Add, fd, EpollEvent::new(EventSet::IN, 0))?;
        }
        let waker = Waker::from(unblocked.clone());
        let pin = image.pin(depth);
        Ok(Self {
            image,
            health,
            flusher,
            flushed: Arc::new(Answers::new(waker.clone())),
            flushes_out: 0,
            in_flight: 0,
            pin,
            flushes_due: Vec::new(),
            file,
            data,
            backing,
            epoll,
            depth: u32::from(depth),
            parents: vec![Parent::default(); usize::from(depth)],
            parts: (0..parts).map(|_| Part { parent: 0, iov: Vec::new(), then: Then::Nothing }).collect(),
            free: (u32::from(depth)..u32::from(depth) + u32::from(parts)).rev().collect(),
            deferred: VecDeque::new(),
            answered: Vec::with_capacity(usize::from(depth)),
            acts_on_discards: true,
            blocked: Vec::new(),
            loads: Loads::new(),
            copy_ups: CopyUps::default(),
            written_up: false,
            waker,
            unblocked,
            compressed: None,
            extents: Vec::new(),
            memo: MapMemo::default(),
        })
    }

    /// Whether it acts on discards (`discard=unmap`); if not, discards
    /// are answered at once and write-zeroes never deallocate.
    pub(crate) fn acting_on_discards(self, acts: bool) -> Self {
        Self { acts_on_discards: acts, ..self }
    }

    fn children(&self) -> impl Iterator<Item = &ChildQueue> {
        [Some(&self.file), self.data.as_ref(), self.backing.as_ref()].into_iter().flatten()
    }

    fn child(&mut self, target: Target) -> &mut ChildQueue {
        match target {
            Target::File => &mut self.file,
            Target::Data => self.data.as_mut().unwrap_or(&mut self.file),
            Target::Backing => self.backing.as_mut().expect("backing requests need a backing child"),
        }
    }

    fn fail(&mut self, parent: u32, errno: i32) {
        let p = &mut self.parents[parent as usize];
        if p.errno == 0 {
            p.errno = errno;
        }
    }

    /// One child request of `parent` done (or never sent): the parent's
    /// completion if it was the last.
    fn settle(&mut self, parent: u32, errno: i32) -> Option<Completion> {
        if errno != 0 {
            self.fail(parent, errno);
        }
        let p = &mut self.parents[parent as usize];
        p.remaining -= 1;
        if p.remaining > 0 {
            return None;
        }
        if std::mem::take(&mut p.flush_after) && p.errno == 0 {
            // A durable write's clusters are linked: now they are flushed.
            p.remaining += 1;
            self.flush_part(parent);
            return None;
        }
        Some(Completion { tag: parent, errno: p.errno })
    }

    /// Ends routing's hold on a guest request: answers it unless parts of
    /// it are still out.
    fn release(&mut self, tag: u32, errno: i32) {
        if let Some(done) = self.settle(tag, errno) {
            self.answered.push(done);
        }
    }

    /// Sends `op` to a child as a part of `parent`: its buffers, given as
    /// the parent's, are narrowed to the parent's bytes from `pos` on.
    fn issue(&mut self, parent: u32, target: Target, op: IoOp, pos: u64) {
        let (iov, len) = buffers(&op);
        self.send_part(parent, target, op, iov.range(pos, len), Then::Nothing);
    }

    /// Reads the old bytes an allocation of guest request `parent` (at
    /// `offset`, in buffers `iov`) keeps into its contents, then writes
    /// them (see `copyup`); with none to read, writes at once.
    fn copy_up(&mut self, parent: u32, offset: u64, iov: IoVecs, mut allocation: Allocation) {
        let mut reads = Vec::with_capacity(allocation.kept.len());
        for kept in std::mem::take(&mut allocation.kept) {
            let (target, from, len) = match kept.source {
                Origin::Data(host) => (Target::Data, host, kept.len),
                Origin::Below(guest) => {
                    // Past the backing file's end the contents stay zeroes.
                    let below = self.backing.as_ref().map_or(0, |b| b.end().saturating_sub(guest).min(kept.len));
                    (Target::Backing, guest, below)
                }
                Origin::Compressed { host, len } => {
                    let buf = allocation.contents.as_mut().expect("a copy-up has contents");
                    if let Err(e) = self.image.read_compressed(&mut self.file, host, len, buf) {
                        let errno = self.failure(e);
                        self.fail(parent, errno);
                        self.abandon(allocation);
                        return;
                    }
                    continue;
                }
            };
            if len > 0 {
                reads.push((target, from, kept.at, len));
            }
        }
        let Some(contents) = allocation.contents.as_mut().filter(|_| !reads.is_empty()) else {
            return self.write_allocation(parent, offset, iov, allocation);
        };
        let base = contents.as_mut_ptr();
        // Moving the allocation keeps its contents' heap buffer in place.
        let slot = self.copy_ups.insert(parent, offset, iov, allocation, reads.len() as u32);
        for (target, from, at, len) in reads {
            // SAFETY: `at + len` lies within the cluster-sized contents.
            let buf = libc::iovec { iov_base: unsafe { base.add(at as usize) }.cast(), iov_len: len as usize };
            let op = IoOp::Read { offset: from, len, iov: IoVecs::default() };
            self.send_part(parent, target, op, std::iter::once(buf), Then::CopiedIn(slot));
        }
    }

    /// One read of copy-up `slot` is back: once all are, the request's
    /// bytes go in and the contents are written, or, if one failed (the
    /// request fails with it), the cluster is given back.
    fn copied_in(&mut self, slot: usize, errno: i32) {
        let Some(copy) = self.copy_ups.read_done(slot, errno) else { return };
        if copy.failed {
            self.abandon(copy.allocation);
        } else {
            self.write_allocation(copy.parent, copy.offset, copy.iov, copy.allocation);
            self.written_up = true;
        }
    }

    /// Gives back an allocation never written.
    fn abandon(&mut self, allocation: Allocation) {
        if let Err(e) = self.image.finish_allocation(&mut self.file, allocation, false) {
            log::error!("qcow2: giving back a cluster whose write failed: {e}");
        }
    }

    /// Sends what an allocation of guest request `parent` (at `offset`, in
    /// buffers `iov`) writes to the data child: the cluster's new
    /// contents, or the request's own bytes in it.
    fn write_allocation(&mut self, parent: u32, offset: u64, iov: IoVecs, mut allocation: Allocation) {
        let base = allocation.request_bytes().0 - offset;
        let mut copy = copy_from(iov);
        allocation.put_request_bytes(&mut |at, buf| copy(base + at, buf));
        let (op, slice) = match allocation.to_write() {
            Some((bytes, host)) => {
                let whole = libc::iovec { iov_base: bytes.as_ptr().cast_mut().cast(), iov_len: bytes.len() };
                let len = bytes.len() as u64;
                (IoOp::Write { offset: host, len, iov: IoVecs::default(), durable: false }, vec![whole])
            }
            None => {
                let (guest, host, len) = allocation.request_bytes();
                (IoOp::Write { offset: host, len, iov, durable: false }, iov.range(guest - offset, len).collect())
            }
        };
        // Moving the allocation keeps its contents' heap buffer in place.
        self.send_part(parent, Target::Data, op, slice.into_iter(), Then::Link(allocation));
    }

    /// Sends `op` with buffers `iov` to a child as a part of `parent`, or
    /// defers it while no part tag is free; `then` is done when it
    /// completes.
    fn send_part(&mut self, parent: u32, target: Target, op: IoOp, iov: impl Iterator<Item = libc::iovec>, then: Then) {
        self.parents[parent as usize].remaining += 1;
        let Some(tag) = self.free.pop() else {
            self.deferred.push_back(Deferred { parent, target, op, iov: iov.collect(), then });
            return;
        };
        let part = self.claim(tag, parent);
        part.iov.clear();
        part.iov.extend(iov);
        part.then = then;
        self.push_part(tag, target, op);
    }

    /// Sends deferred parts while part tags are free; whether it sent any.
    fn send_deferred(&mut self) -> bool {
        let mut sent = false;
        while !self.free.is_empty() {
            let Some(d) = self.deferred.pop_front() else { break };
            let tag = self.free.pop().expect("checked above");
            let part = self.claim(tag, d.parent);
            // Moving the Vec (and the allocation) keeps their heap buffers
            // where they are.
            part.iov = d.iov;
            part.then = d.then;
            self.push_part(tag, d.target, d.op);
            sent = true;
        }
        sent
    }

    /// Gives part tag `tag` to `parent`.
    fn claim(&mut self, tag: u32, parent: u32) -> &mut Part {
        let part = &mut self.parts[(tag - self.depth) as usize];
        part.parent = parent;
        part
    }

    /// Pushes part `tag` with the buffer slice `claim` gave it.
    fn push_part(&mut self, tag: u32, target: Target, op: IoOp) {
        let storage = &self.parts[(tag - self.depth) as usize].iov;
        // SAFETY: the slice lives in self and is not touched again until
        // this part completes; the buffers it names are the parent's,
        // valid until the parent completes, which is after its parts.
        let op = with_iov(op, unsafe { IoVecs::new(storage.as_ptr(), storage.len()) });
        // SAFETY: as above.
        unsafe { self.child(target).push(tag, op) };
    }

    /// Turns the children's completions in `out[start..]` into guest
    /// completions: a whole request's is the guest's own, a part's settles
    /// its parent.
    fn settle_parts(&mut self, out: &mut Vec<Completion>, start: usize) {
        if self.free.len() == self.parts.len() && self.loads.idle() {
            // No part or table read is out: every completion is a guest's own.
            return;
        }
        let loads_from = self.depth + self.parts.len() as u32;
        let mut kept = start;
        for i in start..out.len() {
            let c = out[i];
            let done = match c.tag {
                tag if tag < self.depth => Some(c),
                tag if tag < loads_from => self.settle_part(c),
                tag => {
                    for w in self.loads.finish(&self.image, tag - loads_from, c.errno) {
                        self.release(w.tag, c.errno);
                    }
                    None
                }
            };
            if let Some(done) = done {
                out[kept] = done;
                kept += 1;
            }
        }
        out.truncate(kept);
    }

    fn settle_part(&mut self, c: Completion) -> Option<Completion> {
        let part = &mut self.parts[(c.tag - self.depth) as usize];
        let (parent, then) = (part.parent, std::mem::replace(&mut part.then, Then::Nothing));
        self.free.push(c.tag);
        let mut errno = c.errno;
        match then {
            Then::Nothing => {}
            Then::Link(allocation) => {
                if let Err(e) = self.image.finish_allocation(&mut self.file, allocation, errno == 0) {
                    errno = errno_of(&e);
                }
            }
            // Before the read settles its parent: the write it may send
            // keeps the parent open.
            Then::CopiedIn(slot) => self.copied_in(slot, errno),
        }
        self.settle(parent, errno)
    }

    /// Routes again the requests whose tables came in; whether there were
    /// any.
    fn resume(&mut self) -> bool {
        if self.loads.resumable.is_empty() {
            return false;
        }
        for w in std::mem::take(&mut self.loads.resumable) {
            self.proceed(w.tag, w.op, w.from, w.waits);
        }
        true
    }

    /// Routes a guest request, and sends it on, answers it, or holds it
    /// back until an allocation or a table it waits for is there.
    fn start(&mut self, tag: u32, op: IoOp) {
        // Held until routing is done, so the parent cannot complete early.
        self.parents[tag as usize] = Parent { remaining: 1, ..Parent::default() };
        self.proceed(tag, op, 0, 0);
    }

    /// [`Qcow2Queue::start`] for a request routed as far as `from` bytes,
    /// which waited for slices `waits` times since it last progressed.
    fn proceed(&mut self, tag: u32, op: IoOp, from: u64, waits: u8) {
        let seen = self.image.allocations_finished();
        match self.route(tag, op, from, loads::patient(waits)) {
            // SAFETY: the caller's guarantee for `op` (see `push`) covers
            // the child request, which names the same buffers (or none).
            Ok(Some(Whole(target, op))) => unsafe { self.child(target).push(tag, op) },
            Ok(None) => self.release(tag, 0),
            Err(Refused::Failed(errno)) => self.release(tag, errno),
            Err(Refused::Corrupt(what)) => {
                let (health, image) = (self.health.clone(), self.image.clone());
                health.corrupted(&what, &image, &mut self.file);
                self.release(tag, libc::EIO);
            }
            Err(Refused::Busy) => {
                self.image.wake_after(seen, &self.waker);
                self.blocked.push(Blocked { tag, op, seen });
            }
            Err(Refused::Missing(missing, at)) => {
                // Waits count only while the request makes progress; a
                // slice it had loaded, evicted again, is none.
                let (from, waits) = if at > from { (at, 0) } else { (from, waits) };
                let waiting = Waiting { tag, op, from, waits };
                if let Some((number, read)) = self.loads.wait(&self.image, missing, waiting) {
                    let tag = self.depth + self.parts.len() as u32 + number;
                    // SAFETY: the read's buffers live in `self.loads` until
                    // it completes (see `Loads::wait`).
                    unsafe { self.file.push(tag, read) };
                }
            }
        }
    }

    /// Routes again the held-back requests that allocations finished
    /// since; whether there were any.
    fn retry_blocked(&mut self) -> bool {
        let now = self.image.allocations_finished();
        if self.blocked.iter().all(|b| b.seen == now) {
            return false;
        }
        let (retry, wait): (Vec<_>, Vec<_>) =
            std::mem::take(&mut self.blocked).into_iter().partition(|b| b.seen != now);
        self.blocked = wait;
        for b in retry {
            self.start(b.tag, b.op);
        }
        true
    }

    /// Routes guest request `tag` from `from` bytes on; a `patient` one may
    /// wait for a table slice.
    fn route(&mut self, tag: u32, op: IoOp, from: u64, patient: bool) -> Routed {
        if self.health.is_corrupt() || crate::drivers::out_of_bounds(&op, self.image.size()) {
            return Err(Refused::Failed(libc::EIO));
        }
        match op {
            IoOp::Read { offset, len, iov } => match self.owned(offset, len) {
                Some((host, _)) if from == 0 => Ok(Some(Whole(Target::Data, IoOp::Read { offset: host, len, iov }))),
                _ => self.read(tag, offset, len, iov, from, patient),
            },
            // A durable write must not land on a cluster whose allocation
            // is still only in memory: then the metadata path flushes it too.
            IoOp::Write { offset, len, iov, durable } => match self.owned(offset, len) {
                Some((host, true)) if !(durable && self.image.metadata_dirty()) => {
                    Ok(Some(Whole(Target::Data, IoOp::Write { offset: host, len, iov, durable })))
                }
                _ => self.write(tag, offset, len, iov, durable, patient),
            },
            IoOp::Flush if self.image.metadata_dirty() => {
                // Done at `submit`, when the requests that came with it are known.
                self.parents[tag as usize].remaining += 1;
                self.flushes_due.push(tag);
                Ok(None)
            }
            IoOp::Flush if self.data.is_none() => Ok(Some(Whole(Target::File, IoOp::Flush))),
            IoOp::Flush => {
                self.issue(tag, Target::File, IoOp::Flush, 0);
                self.issue(tag, Target::Data, IoOp::Flush, 0);
                Ok(None)
            }
            IoOp::Discard { .. } if !self.acts_on_discards => Ok(None),
            IoOp::Discard { offset, len } => {
                self.preload(offset, len, patient)?;
                self.sync(|image, io| image.discard(io, offset, len))
            }
            IoOp::WriteZeroes { offset, len, may_unmap, fast } => {
                self.preload(offset, len, patient)?;
                let may_unmap = may_unmap && self.acts_on_discards;
                self.sync(|image, io| image.write_zeroes(io, offset, len, may_unmap, fast))
            }
            // A job's, one at a time: nothing gains from the asynchronous path.
            IoOp::WriteCompressed { offset, len, iov } => {
                self.preload(offset, len, patient)?;
                self.sync(|image, io| image.write_compressed(io, offset, len, &mut copy_from(iov)))
            }
        }
    }

    /// Where guest bytes `offset..offset + len` are in the data child, and
    /// whether they may be written in place, if one cluster the cache maps
    /// holds them all: the common request, routed without the general
    /// walk (`read`, `write`) it would also find its way through.
    #[inline(always)]
    fn owned(&mut self, offset: u64, len: u64) -> Option<(u64, bool)> {
        match self.image.map_cached(&mut self.memo, offset, len) {
            Ok(Extent { mapping: Mapping::Data { host, in_place }, len: mapped }) if mapped == len => {
                Some((host, in_place))
            }
            _ => None,
        }
    }

    /// The mapping of the guest bytes from `offset` (`pos` bytes into the
    /// request), for at most `len` bytes. A table the cache lacks makes
    /// the request wait for it, resuming at `pos`; an impatient one loads
    /// it under the metadata mutex instead.
    #[inline(always)]
    fn map(&mut self, offset: u64, len: u64, pos: u64, patient: bool) -> Result<Extent, Refused> {
        match self.image.map_cached(&mut self.memo, offset, len) {
            Ok(extent) => Ok(extent),
            Err(missing) if patient => Err(Refused::Missing(missing, pos)),
            Err(_) => self.image.map(&mut self.memo, &mut self.file, offset, len).map_err(refused),
        }
    }

    /// Makes a request that changes the metadata of guest bytes
    /// `offset..offset + len` wait for the tables it lacks, so that the
    /// metadata path finds them cached.
    fn preload(&self, offset: u64, len: u64, patient: bool) -> Result<(), Refused> {
        match self.image.missing_table(offset, len) {
            // The slices found cached are its progress.
            Some((cached, missing)) if patient => Err(Refused::Missing(missing, cached)),
            _ => Ok(()),
        }
    }

    fn read(&mut self, tag: u32, offset: u64, len: u64, iov: IoVecs, from: u64, patient: bool) -> Routed {
        let mut pos = from;
        while pos < len {
            let extent = self.map(offset + pos, len - pos, pos, patient)?;
            let (at, n, whole) = (offset + pos, extent.len, pos == 0 && extent.len == len);
            match extent.mapping {
                Mapping::Data { host, .. } => {
                    self.issue(tag, Target::Data, IoOp::Read { offset: host, len: n, iov }, pos)
                }
                Mapping::Zero => fill(iov, pos, n, None),
                Mapping::Unallocated => {
                    let below = self.backing.as_ref().map_or(0, |b| b.end().saturating_sub(at).min(n));
                    if whole && below == n {
                        return Ok(Some(Whole(Target::Backing, IoOp::Read { offset: at, len, iov })));
                    }
                    if below > 0 {
                        self.issue(tag, Target::Backing, IoOp::Read { offset: at, len: below, iov }, pos);
                    }
                    fill(iov, pos + below, n - below, None);
                }
                Mapping::Compressed { host, len: compressed_len } => {
                    self.decompress(host, compressed_len).map_err(refused)?;
                    let within = (at % self.image.cluster_size()) as usize;
                    let (_, cluster) = self.compressed.as_ref().expect("just decompressed");
                    fill(iov, pos, n, Some(&cluster[within..within + n as usize]));
                }
                Mapping::Invalid => return Err(invalid(offset + pos)),
            }
            pos += n;
        }
        Ok(None)
    }

    fn decompress(&mut self, host: u64, len: u64) -> io::Result<()> {
        if self.compressed.as_ref().is_some_and(|(at, _)| *at == host) {
            return Ok(());
        }
        let mut cluster = match self.compressed.take() {
            Some((_, buf)) => buf,
            None => AlignedBuf::zeroed(self.image.cluster_size() as usize),
        };
        let result = self.image.read_compressed(&mut self.file, host, len, &mut cluster);
        self.compressed = result.is_ok().then_some((host, cluster));
        result
    }

    fn write(&mut self, tag: u32, offset: u64, len: u64, iov: IoVecs, durable: bool, patient: bool) -> Routed {
        self.extents.clear();
        let mut pos = 0;
        while pos < len {
            // Nothing is sent before the loop ends: a wait restarts it.
            let e = self.map(offset + pos, len - pos, 0, patient)?;
            match e.mapping {
                Mapping::Data { host, in_place: true } => self.extents.push((host, pos, e.len)),
                Mapping::Invalid => return Err(invalid(offset + pos)),
                _ => break,
            }
            pos += e.len;
        }
        // Every byte lands on data this image owns (a durable write only
        // if no allocation awaits a flush, as in `route`): in place, in parts.
        if pos == len && !(durable && self.image.metadata_dirty()) {
            for i in 0..self.extents.len() {
                let (host, at, n) = self.extents[i];
                self.issue(tag, Target::Data, IoOp::Write { offset: host, len: n, iov, durable }, at);
            }
            return Ok(None);
        }
        self.preload(offset, len, patient)?;
        // Clusters to allocate: their old bytes are read and their contents
        // written asynchronously, the rest in place (a durable write's
        // flush follows once every piece is done), unless the write is
        // durable and alone on its queue: then nothing waits behind it,
        // and the blocking metadata path does it without round trips
        // through the ring.
        if durable && self.in_flight <= 1 {
            return self.sync(|image, io| {
                image.write(io, offset, len, &mut copy_from(iov))?;
                image.flush(io)
            });
        }
        // A refcount block the allocation scans is loaded like a slice,
        // unless the request has waited enough.
        let pieces = self
            .with_io(|image, io| match patient {
                true => image.try_start_write(io, offset, len),
                false => image.start_write(io, offset, len),
            })
            .map_err(refused)?;
        self.parents[tag as usize].flush_after = durable;
        for piece in pieces {
            match piece {
                Piece::InPlace { pos, host, len } => {
                    self.issue(tag, Target::Data, IoOp::Write { offset: host, len, iov, durable: false }, pos)
                }
                Piece::Allocate(allocation) => self.copy_up(tag, offset, iov, allocation),
            }
        }
        Ok(None)
    }

    /// [`IoQueue::reap`]'s work: the guest requests done, into `out`.
    fn collect(&mut self, out: &mut Vec<Completion>) {
        self.take_flushed();
        out.append(&mut self.answered);
        // Deferred parts sent here may complete at once (inline, on tmpfs),
        // which makes no child's notify_fd readable, so the owner would
        // sleep on them: reap again until none are sent.
        loop {
            let start = out.len();
            self.file.reap(out);
            if let Some(data) = &mut self.data {
                data.reap(out);
            }
            if let Some(backing) = &mut self.backing {
                backing.reap(out);
            }
            self.settle_parts(out, start);
            let sent =
                self.send_deferred() | self.retry_blocked() | self.resume() | std::mem::take(&mut self.written_up);
            out.append(&mut self.answered);
            // Linking an allocation or routing a held-back request may have
            // done blocking I/O on a child, which keeps the completions
            // that arrived meanwhile: reap again for them too.
            let stashed = self.children().any(ChildQueue::has_stash);
            if !sent && !stashed {
                return;
            }
            if let Err(e) = self.submit() {
                log::error!("qcow2: submitting deferred requests failed: {e}");
            }
        }
    }

    /// Starts the metadata flushes routed since the last submit.
    fn start_flushes(&mut self) {
        for tag in std::mem::take(&mut self.flushes_due) {
            self.flush_part(tag);
        }
    }

    /// Flushes the image for guest request `tag`, a part of it: on the
    /// node's flusher while other guest requests are in flight on this
    /// queue, here otherwise (alone, it gains nothing from the thread but
    /// two wake-ups).
    fn flush_part(&mut self, tag: u32) {
        if self.in_flight > 1 {
            let (image, health, answers) = (self.image.clone(), self.health.clone(), self.flushed.clone());
            if self.flusher.flush(Request { image, health, tag, answers }).is_ok() {
                self.flushes_out += 1;
                return;
            }
        }
        let errno = match self.with_io(|image, io| image.flush(io)) {
            Ok(()) => 0,
            Err(e) => self.failure(e),
        };
        self.release(tag, errno);
    }

    /// The errno a request fails with for `e`; corrupt metadata marks the
    /// image so.
    fn failure(&mut self, e: io::Error) -> i32 {
        if let Some(what) = CorruptMetadata::of(&e) {
            let (health, image) = (self.health.clone(), self.image.clone());
            health.corrupted(what, &image, &mut self.file);
        }
        errno_of(&e)
    }

    /// Answers the flushes the flusher is done with.
    fn take_flushed(&mut self) {
        if self.flushes_out == 0 {
            return;
        }
        for done in self.flushed.take() {
            self.flushes_out -= 1;
            self.release(done.tag, done.errno);
        }
    }

    /// Runs `f` with the image and its files as blocking I/O; the request
    /// is answered when it returns.
    fn sync(&mut self, f: impl FnOnce(&Image, &mut ImageIo) -> io::Result<()>) -> Routed {
        self.with_io(f).map_err(refused)?;
        Ok(None)
    }

    /// Runs `f` with the image and its files as blocking I/O.
    fn with_io<T>(&mut self, f: impl FnOnce(&Image, &mut ImageIo) -> T) -> T {
        let mut io = ImageIo {
            meta: &mut self.file,
            data: self.data.as_mut().map(|d| d as &mut dyn vsd_qcow2::SyncIo),
            backing: self.backing.as_mut().map(|b| b as &mut dyn vsd_qcow2::SyncIo),
        };
        f(&self.image, &mut io)
    }
}

// SAFETY: the raw pointers held (in iovec slices) describe request
// buffers, which `IoVecs` already allows to cross threads; the queue
// itself is used by one thread at a time.
unsafe impl Send for Qcow2Queue {}

impl IoQueue for Qcow2Queue {
    unsafe fn push(&mut self, tag: u32, op: IoOp) {
        self.in_flight += 1;
        self.pin.enter(tag);
        self.start(tag, op);
    }

    fn submit(&mut self) -> io::Result<()> {
        if !self.flushes_due.is_empty() {
            self.start_flushes();
        }
        self.file.submit()?;
        if let Some(data) = &mut self.data {
            data.submit()?;
        }
        if let Some(backing) = &mut self.backing {
            backing.submit()?;
        }
        Ok(())
    }

    fn reap(&mut self, out: &mut Vec<Completion>) {
        let before = out.len();
        self.collect(out);
        self.in_flight -= (out.len() - before) as u32;
        if out.len() > before {
            for done in &out[before..] {
                self.pin.leave(done.tag);
            }
            self.pin.settle();
        }
    }

    fn wait(&mut self) -> io::Result<()> {
        let silent = self.children().any(|c| c.notify_fd().is_none());
        if !self.answered.is_empty() || silent {
            return Ok(());
        }
        let mut events = [EpollEvent::default(); 1];
        match self.epoll.wait(-1, &mut events) {
            Ok(_) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(()),
            Err(e) => Err(e),
        }
    }

    fn notify_fd(&self) -> Option<BorrowedFd<'_>> {
        // SAFETY: the epoll descriptor lives as long as self.
        Some(unsafe { BorrowedFd::borrow_raw(self.epoll.as_raw_fd()) })
    }

    fn rearm(&mut self) {
        // Non-blocking: nothing to read is not an error here.
        let _ = self.unblocked.0.read();
        self.file.rearm();
        if let Some(data) = &mut self.data {
            data.rearm();
        }
        if let Some(backing) = &mut self.backing {
            backing.rearm();
        }
    }

    fn max_batch(&self) -> usize {
        self.children().map(ChildQueue::max_batch).min().unwrap_or(usize::MAX)
    }

    fn kernel_entries(&self) -> u64 {
        self.children().map(ChildQueue::kernel_entries).sum()
    }
}

/// What routing did with a guest request: sent it whole to one child
/// (`Some`), sent it in parts or answered it here (`None`), or refused it.
type Routed = Result<Option<Whole>, Refused>;

/// Why routing stopped short of a guest request.
enum Refused {
    /// The request fails with this errno.
    Failed(i32),
    /// A cluster it would change has an allocation in flight: retry it
    /// once one finishes.
    Busy,
    /// The metadata it needs is corrupt (this says how): it fails, and
    /// the image is marked corrupt.
    Corrupt(String),
    /// It needs this L2 table slice or refcount block, which the cache
    /// lacks; its progress: for a read, the bytes routed so far (it resumes
    /// there); for a change of metadata, the slices it needs found cached
    /// (it starts again; none for a refcount block).
    Missing(MissingTable, u64),
}

fn errno_of(e: &io::Error) -> i32 {
    e.raw_os_error().unwrap_or(libc::EIO)
}

fn refused(e: io::Error) -> Refused {
    if Busy::is(&e) {
        return Refused::Busy;
    }
    if let Some(missing) = NeedsLoad::of(&e) {
        return Refused::Missing(missing, 0);
    }
    match CorruptMetadata::of(&e) {
        Some(what) => Refused::Corrupt(what.to_string()),
        None => Refused::Failed(errno_of(&e)),
    }
}

/// The mapping of guest byte `at` is invalid (an L2 entry pointing outside
/// the file or into metadata).
fn invalid(at: u64) -> Refused {
    Refused::Corrupt(format!("the L2 entry mapping guest offset {at:#x} is invalid"))
}

/// The buffers and length of a transfer; none for other requests.
fn buffers(op: &IoOp) -> (IoVecs, u64) {
    match *op {
        IoOp::Read { len, iov, .. } | IoOp::Write { len, iov, .. } => (iov, len),
        _ => (IoVecs::default(), 0),
    }
}

/// `op` with its buffers replaced by `iov`.
fn with_iov(op: IoOp, iov: IoVecs) -> IoOp {
    match op {
        IoOp::Read { offset, len, .. } => IoOp::Read { offset, len, iov },
        IoOp::Write { offset, len, durable, .. } => IoOp::Write { offset, len, iov, durable },
        other => other,
    }
}

/// Copies bytes of a write request's buffers, from the given position on.
fn copy_from(iov: IoVecs) -> impl FnMut(u64, &mut [u8]) {
    // SAFETY: a request's buffers stay valid until it completes, which is
    // after every copy made of them (into the new contents of its
    // allocations, once their old bytes are in, or by its synchronous
    // write).
    move |at, buf| unsafe { iov.copy_out(at, buf) }
}

/// Fills bytes `pos..pos + len` of a read request's buffers from `src`, or
/// with zeroes.
fn fill(iov: IoVecs, pos: u64, len: u64, src: Option<&[u8]>) {
    // SAFETY: a read request's buffers are writable guest memory, valid and
    // ours alone until the request completes, which is after this.
    unsafe { iov.fill(pos, len, src) }
}
