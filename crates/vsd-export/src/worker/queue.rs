//! One virtqueue as its worker thread serves it: a round takes the guest's
//! requests, pushes them to the queue's own I/O queue, submits them,
//! reaps what completed, publishes it and notifies the guest.
//!
//! Guest kicks are turned off while requests are taken (EVENT_IDX style)
//! and back on as soon as the ring is empty, then the ring is checked
//! again ([`QueueWorker::kicks_back_on`]); while the thread polls, they
//! stay off until it is about to sleep ([`QueueWorker::turn_kicks_on`]);
//! while no slot is free, until one is.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use virtio_queue::desc::split::Descriptor;
use vm_memory::{GuestAddressSpace, GuestMemoryAtomic};
use vmm_sys_util::epoll::Epoll;
use vsd_block::dirty::DirtyRecorder;
use vsd_block::{Completion, IoOp, IoQueue, IoVecs};
use vsd_trace::QueueStats;
use vsd_virtio::dirty_log::GuestWrites;
use vsd_virtio::ram::GuestRam;
use vsd_virtio::request::{self, Action, status};
use vsd_virtio::ring::RingError;

mod complete;
#[cfg(test)]
mod tests;

use super::calls::CallBatch;
use super::slots::{Slot, Slots};
use super::thread::{Wake, unwatch, watch};
use super::trace::Trace;
use super::{Memory, QueueRun, front_end_io};
use crate::device::BlkDevice;
use crate::poll::{PollConfig, PollWindow};

/// One queue of a worker thread, with everything its rounds need.
pub(super) struct QueueWorker {
    run: QueueRun,
    mem: GuestMemoryAtomic<Memory>,
    /// The regions of the memory map requests were last taken with; the
    /// rings are read and written through it.
    ram: Arc<GuestRam>,
    device: Arc<BlkDevice>,
    io: Box<dyn IoQueue>,
    slots: Slots,
    parser: request::Parser,
    completions: Vec<Completion>,
    stats: Arc<QueueStats>,
    /// Set while reading the kick or writing the call descriptor (see
    /// [`front_end_io`]).
    front_end_io: Arc<AtomicBool>,
    trace: Trace,
    calls: CallBatch,
    poll: PollWindow,
    /// The ring may have requests to take: the guest kicked, polling
    /// found some, or some were left waiting for a free slot.
    kicked: bool,
    /// The thread's last wake-up was (also) for this queue.
    woken: bool,
    /// Guest kicks were left off for polling: they must be turned back on
    /// before the thread sleeps.
    kicks_off: bool,
    /// Tags pushed to the engine since its last submit.
    unsubmitted: Vec<u16>,
    /// How many requests the engine takes per submit at most
    /// ([`IoQueue::max_batch`]).
    max_batch: usize,
    /// The engine's count of kernel entries when last added to the stats
    /// (the engine is new with each worker; the stats live on).
    kernel_entries: u64,
    dirty: DirtyRecorder,
}

impl QueueWorker {
    /// Opens the block node's queue for `run` and watches its descriptors
    /// in `epoll`, as the queue at position `at` of its thread.
    pub(super) fn new(
        run: QueueRun,
        at: usize,
        epoll: &Epoll,
        mem: GuestMemoryAtomic<Memory>,
        device: Arc<BlkDevice>,
        front_end_io: Arc<AtomicBool>,
        poll: PollConfig,
    ) -> io::Result<Self> {
        let depth = run.queue.size();
        // The worker counts its requests; the node need not count them again.
        let node = device.node();
        let io = node.open_uncounted_queue(depth)?;
        // ...nor record its writes in the node's dirty bitmaps.
        let dirty = DirtyRecorder::for_node(&*node);
        watch(epoll, run.kick.as_raw_fd(), Wake::Kick(at))?;
        if let Some(fd) = io.notify_fd() {
            watch(epoll, fd.as_raw_fd(), Wake::Io(at))?;
        }
        Ok(Self {
            slots: Slots::new(depth),
            parser: request::Parser::new(),
            completions: Vec::with_capacity(usize::from(depth)),
            stats: device.stats[usize::from(run.index)].clone(),
            front_end_io,
            trace: Trace::new(device.config.trace, depth),
            calls: CallBatch::new(device.config.call_batch_us),
            poll: PollWindow::new(poll),
            // The guest may have queued requests before the thread listened.
            kicked: true,
            woken: false,
            kicks_off: false,
            unsubmitted: Vec::with_capacity(usize::from(depth)),
            max_batch: io.max_batch(),
            kernel_entries: 0,
            dirty,
            run,
            ram: Arc::new(GuestRam::new(mem.memory().into_inner())),
            mem,
            device,
            io,
        })
    }

    pub(super) fn into_run(self) -> QueueRun {
        self.run
    }

    /// Stops `epoll` watching the queue's descriptors, before it leaves its thread.
    pub(super) fn unwatch(&self, epoll: &Epoll) {
        unwatch(epoll, self.run.kick.as_raw_fd());
        if let Some(fd) = self.io.notify_fd() {
            unwatch(epoll, fd.as_raw_fd());
        }
    }

    /// Whether requests are with an engine (not only held back by a
    /// throttle).
    pub(super) fn has_io_in_flight(&self) -> bool {
        self.in_flight() > self.io.held()
    }

    pub(super) fn in_flight(&self) -> usize {
        self.slots.in_flight()
    }

    /// Readies the queue for its first round, serving first what a
    /// back-end that died left in flight.
    pub(super) fn begin(&mut self) {
        self.trace.kicked();
        if let Some(heads) = self.run.resubmit.take() {
            self.take_over(heads);
        }
    }

    /// One round: takes the guest's requests if it kicked, submits them,
    /// reaps what completed, publishes it and signals the guest. Returns
    /// whether the queue wants another round at once rather than a sleep.
    pub(super) fn round(&mut self, stopping: bool) -> bool {
        if self.kicked && !stopping {
            self.kicked = self.take_requests();
        }
        self.submit();
        self.complete_requests();
        if self.calls.pending() {
            if self.calls.holding(self.trace.clock(), self.in_flight(), stopping) {
                self.kicked |= self.ring_has_requests();
                std::hint::spin_loop();
                return true;
            }
            self.signal_guest();
        }
        self.stats.in_flight.set(self.in_flight() as u64);
        // Requests were left waiting for a slot and completions have just
        // freed some: take them now. With no slot free, sleep until the
        // engine completes something.
        !stopping && self.kicked && self.slots.has_free()
    }

    /// How long this queue would have its thread poll: its window, unless
    /// the ring is broken.
    pub(super) fn poll_window_ns(&self) -> u64 {
        if self.run.broken { 0 } else { self.poll.window_ns() }
    }

    /// Looks at the ring while the thread polls; true if it has requests.
    pub(super) fn poll_ring(&mut self) -> bool {
        if self.run.broken || !self.ring_has_requests() {
            return false;
        }
        self.stats.poll_hits.add(1);
        self.trace.kicked();
        self.kicked = true;
        true
    }

    /// The guest kicked this queue, ending its thread's sleep begun at
    /// `slept_from`.
    pub(super) fn kicked_awake(&mut self, slept_from: u64) {
        // Only a sleep with nothing in flight waits for the guest alone:
        // the kick that ends it tells how long polling would have had to
        // last. (Nothing completes while the thread sleeps.)
        if self.in_flight() == 0 {
            let clock = self.trace.clock();
            self.poll.slept(clock.ns(clock.now().saturating_sub(slept_from)));
        }
        self.trace.kicked();
        front_end_io(&self.front_end_io, || drain(self.run.kick.as_fd()));
        self.stats.kicks.add(1);
        self.kicked = true;
        self.woken = true;
    }

    /// The engine's descriptor ended the thread's sleep.
    pub(super) fn io_ready(&mut self) {
        self.io.rearm();
        self.woken = true;
    }

    /// Counts the wake-up if this queue was among its causes.
    pub(super) fn count_wakeup(&mut self) {
        if std::mem::take(&mut self.woken) {
            self.stats.wakeups.add(1);
        }
    }

    fn ring_has_requests(&self) -> bool {
        // A broken ring counts too: taking from it marks it broken.
        self.run.queue.available(&self.ram) != Ok(0)
    }

    /// Turns guest kicks back on before the thread sleeps, if polling left
    /// them off. Returns false if requests arrived meanwhile: they are
    /// taken in the next round instead.
    pub(super) fn turn_kicks_on(&mut self) -> bool {
        if !std::mem::take(&mut self.kicks_off) || self.run.broken {
            return true;
        }
        let quiet = match self.kicks_back_on() {
            Ok(more) => !more,
            Err(e) => !self.mark_broken(e),
        };
        if !quiet {
            // Their kick -> pop stage starts now, not at the last kick.
            self.trace.kicked();
            self.kicked = true;
        }
        quiet
    }

    /// Hands the requests pushed so far to the engine.
    fn submit(&mut self) {
        // Stamped before the call: an engine may do the I/O inside it
        // (io_uring reads of cached data), which is the engine's time.
        let now = self.trace.now();
        for &tag in &self.unsubmitted {
            self.slots.slot_mut(tag).stamps.submitted = now;
        }
        self.unsubmitted.clear();
        if let Err(e) = self.io.submit() {
            log::error!("queue {}: submitting I/O failed: {e}", self.run.index);
        }
        let entries = self.io.kernel_entries();
        self.stats.kernel_entries.add(entries - self.kernel_entries);
        self.kernel_entries = entries;
    }

    /// Takes requests until the ring is empty or the slots run out, guest
    /// kicks off. Returns whether requests may be left waiting for a slot.
    fn take_requests(&mut self) -> bool {
        if self.run.broken {
            return false;
        }
        let before = self.stats.requests.get();
        self.trace.popping();
        let waiting = self.take_available();
        if self.stats.requests.get() != before {
            self.stats.batches.add(1);
        }
        waiting
    }

    fn take_available(&mut self) -> bool {
        let limits = self.device.limits();
        loop {
            if let Err(e) = self.run.queue.disable_kicks(&self.ram) {
                return self.mark_broken(e);
            }
            let announced = match self.run.queue.available(&self.ram) {
                Ok(n) => n,
                Err(e) => return self.mark_broken(e),
            };
            // The memory map is read after the available index: a front-end
            // adds a region (and waits for our ack) before it publishes
            // requests using it, so this map covers every entry announced.
            let ram = self.current_ram();
            for _ in 0..usize::from(announced) {
                if !self.slots.has_free() {
                    return true;
                }
                let head = match self.run.queue.pop(&ram) {
                    Ok(head) => head,
                    Err(e) => return self.mark_broken(e),
                };
                if let Some(inflight) = &mut self.run.inflight {
                    inflight.begin(head);
                }
                self.start_request(head, self.run.queue.chain(&ram, head), &ram, &limits);
            }
            if !self.slots.has_free() {
                // Kicks stay off: what is left is taken once a completion
                // frees a slot.
                return true;
            }
            if self.poll.enabled() {
                self.kicks_off = true;
                return false;
            }
            match self.kicks_back_on() {
                Ok(true) => continue,
                Ok(false) => return false,
                Err(e) => return self.mark_broken(e),
            }
        }
    }

    /// Turns guest kicks back on; returns whether requests arrived
    /// meanwhile, which the guest need not kick for: take them first.
    fn kicks_back_on(&mut self) -> Result<bool, RingError> {
        self.run.queue.enable_kicks(&self.ram)
    }

    fn mark_broken(&mut self, error: RingError) -> bool {
        log::error!(
            "export '{}' queue {}: the guest broke the ring ({error}); no more requests are taken from it",
            self.device.config.id,
            self.run.index
        );
        self.run.broken = true;
        false
    }

    /// Takes over from a back-end that died: signals the guest, which may
    /// not have been told of the last entries that back-end published, and
    /// serves again the requests it took from the ring and never completed
    /// (still marked in the inflight region).
    fn take_over(&mut self, heads: Vec<u16>) {
        if let Some(call) = &self.run.call
            && let Err(e) = front_end_io(&self.front_end_io, || vsd_sys::signal_counter(call.as_fd()))
        {
            log::warn!("queue {}: cannot signal the guest: {e}", self.run.index);
        }
        if heads.is_empty() {
            return;
        }
        log::debug!(
            "export '{}' queue {}: serving again {} requests left in flight by the previous back-end",
            self.device.config.id,
            self.run.index,
            heads.len()
        );
        let ram = self.current_ram();
        let limits = self.device.limits();
        self.trace.popping();
        for head in heads {
            // There is a slot for every head of the ring.
            self.start_request(head, self.run.queue.chain(&ram, head), &ram, &limits);
        }
    }

    /// The regions of the current memory map, snapshotted again when the
    /// front-end changed the map.
    fn current_ram(&mut self) -> Arc<GuestRam> {
        let mem = self.mem.memory();
        if !std::ptr::eq(&**self.ram.memory(), &*mem) {
            self.ram = Arc::new(GuestRam::new(mem.into_inner()));
        }
        self.ram.clone()
    }

    fn start_request(
        &mut self,
        head: u16,
        chain: impl Iterator<Item = Descriptor>,
        ram: &Arc<GuestRam>,
        limits: &request::Limits,
    ) {
        let Some(tag) = self.slots.take() else { return };
        self.stats.requests.add(1);
        let iov = self.slots.iovecs_mut(tag);
        // `parse` found the status byte inside guest memory.
        let parsed = self.parser.parse(chain, ram, limits, iov).ok();
        let Some((request, status)) = parsed.and_then(|r| Some((r, ram.host(r.status.0, 1)?))) else {
            log::debug!("queue {}: chain {head} has no status byte", self.run.index);
            self.slots.release(tag);
            self.publish(head, 0);
            return;
        };
        // SAFETY: `parse` filled `iovcnt` iovecs of this slot's array, which
        // lives as long as the worker; the slot holds the guest memory they
        // point into until the request completes.
        let data = unsafe { IoVecs::new(iov.as_ptr(), request.iovcnt) };
        let (op, data_len) = match request.action {
            Action::Read { offset, len } => (IoOp::Read { offset, len, iov: data }, len as u32),
            Action::Write { offset, len } => {
                (IoOp::Write { offset, len, iov: data, durable: !self.device.writeback() }, 0)
            }
            Action::Flush => (IoOp::Flush, 0),
            Action::Discard { offset, len } => (IoOp::Discard { offset, len }, 0),
            Action::WriteZeroes { offset, len, unmap } => {
                (IoOp::WriteZeroes { offset, len, may_unmap: unmap, fast: false }, 0)
            }
            Action::GetId => {
                // SAFETY: the iovecs were just mapped by `parse` for this
                // GET_ID request and `mem` keeps them mapped.
                let written = unsafe { request::write_id(&iov[..request.iovcnt], &self.device.id) };
                if let Some(log) = &self.run.log {
                    for v in &iov[..request.iovcnt] {
                        log.wrote(ram, v.iov_base.cast(), v.iov_len);
                    }
                }
                self.answer(tag, head, status, status::OK, written as u32 + 1, ram);
                return;
            }
            Action::Done(code) => {
                self.stats.invalid.add(1);
                self.answer(tag, head, status, code, 1, ram);
                return;
            }
        };
        let (kind, bytes) = vsd_block::counted_as(&op);
        let stamps = self.trace.stamps();
        *self.slots.slot_mut(tag) =
            Slot { head, status, used_len: data_len + 1, kind, bytes, stamps, ram: Some(ram.clone()) };
        self.unsubmitted.push(tag);
        self.dirty.record(u32::from(tag), &op);
        // SAFETY: the buffers live in guest memory kept mapped by the slot,
        // and the iovec array is the slot's own; both outlive the request,
        // which completes before the slot is reused or the worker drops.
        unsafe { self.io.push(u32::from(tag), op) };
        if self.unsubmitted.len() >= self.max_batch {
            self.submit();
        }
    }

    /// Completes a request the worker answered itself (GET_ID, a refused
    /// request) in slot `tag`.
    fn answer(&mut self, tag: u16, head: u16, status: *mut u8, code: u8, used_len: u32, ram: &GuestRam) {
        self.slots.release(tag);
        self.finish(head, status, code, used_len);
        if let Some(log) = &self.run.log {
            log.wrote(ram, status, 1);
        }
    }
}

fn drain(fd: BorrowedFd<'_>) {
    if let Err(e) = vsd_sys::read_counter(fd) {
        log::warn!("cannot read an event counter: {e}");
    }
}
