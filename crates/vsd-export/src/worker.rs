//! Queue workers: each worker thread serves one or more virtqueues (queue q
//! goes to thread q % `num-threads`) and owns them outright, each with its
//! own I/O queue, request slots and statistics, so the request path takes
//! no lock.
//!
//! A thread sleeps on one epoll over the kick and engine descriptors of all
//! its queues; per wake-up it runs a round of each queue: drain the
//! available ring (with notifications off, EVENT_IDX style), push every
//! request to the engine, submit the batch with one call, reap what
//! completed, publish the used entries, and signal the guest once if it
//! asked to be told. A thread serving one queue does just that, as a
//! thread per queue would.
//!
//! Each stage is timed (unless `trace=off`) into the queue's own
//! [`QueueStats`] with clock reads per round, none per request: the
//! requests of a round share their stamps, so their stage times are equal
//! and one histogram record covers each run of them ([`Runs`]).
//!
//! With `poll-us`, a thread left with nothing to do first polls its rings
//! for a while ([`PollWindow`], each queue's own; the longest is used)
//! with guest kicks left off, and only then turns kicks back on and sleeps.
//!
//! With `call-batch-us`, a queue that published completions while more
//! requests are in flight holds the guest's notification for up to that
//! long, spinning on the engine and the ring, so that one interrupt covers
//! the completions that follow (RSD's call batching): fewer interrupts for
//! at most that much added latency.
//!
//! Starting or stopping a queue restarts its thread (see
//! [`crate::session`]): the thread's queues finish their requests in
//! flight and are handed back, and a new thread takes the new set.

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::os::unix::thread::JoinHandleExt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock, mpsc};
use std::thread::JoinHandle;
use std::time::Duration;

use virtio_queue::desc::split::Descriptor;
use vm_memory::{GuestAddressSpace, GuestMemoryAtomic, GuestMemoryMmap};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};
use vsd_block::{Completion, IoOp, IoQueue, IoVecs};
use vsd_trace::{Clock, OpKind, QueueStats, Runs, Stage};

use crate::device::BlkDevice;
use crate::inflight::InflightQueue;
use crate::poll::PollWindow;
use vsd_virtio::dirty_log::{DirtyLog, GuestWrites, Unlogged};
use vsd_virtio::ram::GuestRam;
use vsd_virtio::request::{self, Action, MAX_IOVECS, status};
use vsd_virtio::ring::{RingError, SplitQueue};

type Memory = GuestMemoryMmap;

/// The epoll token of the thread's stop; a queue's are below it (see
/// [`Wake`]).
const TOKEN_STOP: u64 = u64::MAX;

/// What woke a worker thread, from an epoll token: the stop, or the kick or
/// engine of the queue at a position in the thread's list (two tokens per
/// queue).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Wake {
    Stop,
    Kick(usize),
    Io(usize),
}

impl Wake {
    fn token(self) -> u64 {
        match self {
            Wake::Stop => TOKEN_STOP,
            Wake::Kick(at) => 2 * at as u64,
            Wake::Io(at) => 2 * at as u64 + 1,
        }
    }

    fn from_token(token: u64) -> Self {
        match (token, (token / 2) as usize) {
            (TOKEN_STOP, _) => Wake::Stop,
            (token, at) if token % 2 == 0 => Wake::Kick(at),
            (_, at) => Wake::Io(at),
        }
    }
}

/// What a worker needs to run a queue, and hands back when it stops.
pub(crate) struct QueueRun {
    pub(crate) index: u16,
    pub(crate) queue: SplitQueue,
    pub(crate) kick: File,
    pub(crate) call: Option<File>,
    /// The queue's part of the front-end's inflight region, if it gave one
    /// (INFLIGHT_SHMFD): requests are marked there while in flight.
    pub(crate) inflight: Option<InflightQueue>,
    /// Set when taking over from a back-end that died: the heads it left
    /// in flight, oldest first, served before anything else.
    pub(crate) resubmit: Option<Vec<u16>>,
    /// The guest broke the ring: no more requests are taken from it until
    /// the front-end sets the queue up again. Kept here, with the queue,
    /// so that a restart of its thread for another queue's sake does not
    /// forget it.
    pub(crate) broken: bool,
    /// During a migration, the dirty log that every guest page the
    /// requests write is marked in (the used ring's writes are the
    /// queue's own, see [`SplitQueue::log_used_ring`]).
    pub(crate) log: Option<Arc<DirtyLog>>,
    /// With the log: the front-end's eventfd to signal after a batch that
    /// wrote to it (SET_LOG_FD), if it gave one.
    pub(crate) log_call: Option<Arc<File>>,
}

/// A running worker thread.
pub(crate) struct Worker {
    /// The queues it serves.
    queues: Vec<u16>,
    stop: Arc<EventFd>,
    thread: JoinHandle<Vec<QueueRun>>,
    /// Hears when the thread is done.
    done: mpsc::Receiver<()>,
    /// Set while the worker reads or writes a descriptor the front-end
    /// owns (kick, call).
    front_end_io: Arc<AtomicBool>,
}

/// How often a worker that does not stop is checked for a blocked kick or
/// call.
const STOP_CHECK: Duration = Duration::from_millis(50);

/// A signal that only interrupts a system call (no `SA_RESTART`): how a
/// worker blocked on its kick or call descriptor is freed. The front-end
/// owns those: it may hand over a blocking eventfd (or anything else), fill
/// the call counter and never read it, or empty the kick counter between
/// the worker's wake-up and its read, and the worker would wait forever,
/// and with it the ring's stop (GET_VRING_BASE), the connection and the
/// export.
fn interrupt_signal() -> Option<libc::c_int> {
    static SIGNAL: OnceLock<Option<libc::c_int>> = OnceLock::new();
    *SIGNAL.get_or_init(|| {
        extern "C" fn interrupted(_: libc::c_int) {}
        let signal = libc::SIGRTMIN() + 4;
        // SAFETY: a zeroed sigaction is valid; the handler does nothing,
        // which is async-signal-safe; the mask is initialised.
        let installed = unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = interrupted as extern "C" fn(libc::c_int) as libc::sighandler_t;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(signal, &action, std::ptr::null_mut()) == 0
        };
        installed.then_some(signal)
    })
}

/// Runs `io` on a descriptor of the front-end's, flagged so that a stop
/// can interrupt it. Relaxed: a stop that misses the flag looks again
/// [`STOP_CHECK`] later, and a signal that lands elsewhere only costs an
/// interrupted system call that the worker retries or logs.
fn front_end_io<T>(flag: &AtomicBool, io: impl FnOnce() -> T) -> T {
    flag.store(true, Ordering::Relaxed);
    let result = io();
    flag.store(false, Ordering::Relaxed);
    result
}

impl Worker {
    /// Starts worker thread number `thread` serving `runs`. The block
    /// node's queues are opened on that thread; an error doing so is
    /// returned here (and the runs are dropped).
    pub(crate) fn start(
        thread: u16,
        runs: Vec<QueueRun>,
        mem: GuestMemoryAtomic<Memory>,
        device: Arc<BlkDevice>,
    ) -> io::Result<Self> {
        let queues: Vec<u16> = runs.iter().map(|run| run.index).collect();
        let stop = Arc::new(EventFd::new(EFD_NONBLOCK)?);
        let (ready_tx, ready_rx) = mpsc::sync_channel(1);
        let (done_tx, done) = mpsc::sync_channel(1);
        let flag = Arc::new(AtomicBool::new(false));
        let (stop_fd, worker_flag) = (stop.clone(), flag.clone());
        interrupt_signal();
        let name = thread_name(&device.config.id, &queues);
        let handle = std::thread::Builder::new().name(name).spawn(move || {
            let runs = match WorkerThread::new(thread, runs, mem, device, stop_fd, worker_flag) {
                Ok(mut worker) => {
                    let _ = ready_tx.send(Ok(()));
                    worker.run();
                    worker.into_runs()
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                    Vec::new()
                }
            };
            let _ = done_tx.send(());
            runs
        })?;
        match ready_rx.recv() {
            Ok(Ok(())) => Ok(Self { queues, stop, thread: handle, done, front_end_io: flag }),
            Ok(Err(e)) => {
                let _ = handle.join();
                Err(e)
            }
            Err(_) => Err(io::Error::other("queue worker died while starting")),
        }
    }

    /// Whether the thread serves queue `index`.
    pub(crate) fn serves(&self, index: u16) -> bool {
        self.queues.contains(&index)
    }

    /// Stops the worker after the requests in flight complete, and returns
    /// its queues with their indexes where the worker left them.
    pub(crate) fn stop(self) -> Vec<QueueRun> {
        if let Err(e) = self.stop.write(1) {
            log::error!("cannot stop a queue worker: {e}");
        }
        // Requests in flight may take long; the kick and call descriptors
        // must not (see `interrupt_signal`).
        while let Err(mpsc::RecvTimeoutError::Timeout) = self.done.recv_timeout(STOP_CHECK) {
            if let (true, Some(signal)) = (self.front_end_io.load(Ordering::Relaxed), interrupt_signal()) {
                log::warn!("a queue worker is stuck on the front-end's kick or call descriptor; interrupting it");
                // SAFETY: the thread is not joined yet, so its handle is valid.
                unsafe { libc::pthread_kill(self.thread.as_pthread_t(), signal) };
            }
        }
        self.thread.join().unwrap_or_default()
    }
}

/// `vsd-<export>-q<queues>`: `vsd-e0-q1` for a thread serving queue 1,
/// `vsd-e0-q0,2` for one serving queues 0 and 2. (Linux keeps 15 bytes.)
fn thread_name(export: &str, queues: &[u16]) -> String {
    let list: Vec<String> = queues.iter().map(u16::to_string).collect();
    format!("vsd-{export}-q{}", list.join(","))
}

/// A worker thread's side: its queues and what it sleeps on.
struct WorkerThread {
    queues: Vec<QueueWorker>,
    /// Watches the stop and every queue's kick and engine descriptors.
    epoll: Epoll,
    events: Vec<EpollEvent>,
    /// Watched through `epoll`; held so the descriptor stays open.
    _stop: Arc<EventFd>,
    /// Times polling and sleeps.
    clock: Clock,
}

impl WorkerThread {
    fn new(
        thread: u16,
        runs: Vec<QueueRun>,
        mem: GuestMemoryAtomic<Memory>,
        device: Arc<BlkDevice>,
        stop: Arc<EventFd>,
        front_end_io: Arc<AtomicBool>,
    ) -> io::Result<Self> {
        // Pinned before anything else runs on this thread.
        if let Some(cpu) = device.config.cpu_of(thread) {
            vsd_sys::set_thread_affinity(&[cpu])?;
        }
        let epoll = Epoll::new()?;
        watch(&epoll, stop.as_raw_fd(), Wake::Stop)?;
        let mut queues = Vec::with_capacity(runs.len());
        for (at, run) in runs.into_iter().enumerate() {
            queues.push(QueueWorker::new(run, at, &epoll, mem.clone(), device.clone(), front_end_io.clone())?);
        }
        // Every descriptor may be ready at once: a stop, and a kick and an
        // engine per queue.
        let events = vec![EpollEvent::default(); 2 * queues.len() + 1];
        Ok(Self { queues, epoll, events, _stop: stop, clock: Clock::get() })
    }

    fn into_runs(self) -> Vec<QueueRun> {
        self.queues.into_iter().map(QueueWorker::into_run).collect()
    }

    fn run(&mut self) {
        for queue in &mut self.queues {
            queue.begin();
        }
        let mut stopping = false;
        loop {
            let mut again = false;
            for queue in &mut self.queues {
                again |= queue.round(stopping);
            }
            if stopping {
                // Requests in flight complete before the queues are handed back.
                match self.queues.iter_mut().find(|queue| queue.in_flight() > 0) {
                    Some(queue) => queue.wait_for_io(),
                    None => return,
                }
                continue;
            }
            if again || self.poll_for_work() || !self.turn_kicks_on() {
                continue;
            }
            stopping = self.sleep();
        }
    }

    /// Spins for up to the longest poll window of its queues until a ring
    /// has requests; guest kicks stay off meanwhile.
    ///
    /// Only with no I/O in flight: buffered io_uring I/O may finish on a
    /// kernel worker thread that needs this very CPU (on tmpfs, polling
    /// with reads in flight cost 19 % of IOPS at iodepth 32 on 2 CPUs), so
    /// in-flight I/O is waited for asleep.
    fn poll_for_work(&mut self) -> bool {
        let window_ns = self.queues.iter().map(QueueWorker::poll_window_ns).max().unwrap_or(0);
        if window_ns == 0 || self.queues.iter().any(|queue| queue.in_flight() > 0) {
            return false;
        }
        let start = self.clock.now();
        loop {
            let mut found = false;
            for queue in &mut self.queues {
                found |= queue.poll_ring();
            }
            if found {
                return true;
            }
            if self.clock.ns(self.clock.now().saturating_sub(start)) >= window_ns {
                return false;
            }
            std::hint::spin_loop();
        }
    }

    /// Turns every queue's guest kicks back on before sleeping. Returns
    /// false if requests arrived meanwhile: take them instead.
    fn turn_kicks_on(&mut self) -> bool {
        let mut quiet = true;
        for queue in &mut self.queues {
            quiet &= queue.turn_kicks_on();
        }
        quiet
    }

    /// Sleeps until a kick, a completion or the stop. Returns whether to stop.
    fn sleep(&mut self) -> bool {
        let slept_from = self.clock.now();
        let n = match self.epoll.wait(-1, &mut self.events) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => return false,
            Err(e) => {
                log::error!("{}: epoll failed: {e}", std::thread::current().name().unwrap_or("queue worker"));
                return true;
            }
        };
        let mut stop = false;
        for event in &self.events[..n] {
            match Wake::from_token(event.data()) {
                Wake::Stop => stop = true,
                Wake::Kick(at) => self.queues[at].kicked_awake(slept_from),
                Wake::Io(at) => self.queues[at].io_ready(),
            }
        }
        for queue in &mut self.queues {
            queue.count_wakeup();
        }
        stop
    }
}

fn watch(epoll: &Epoll, fd: RawFd, wake: Wake) -> io::Result<()> {
    epoll.ctl(ControlOperation::Add, fd, EpollEvent::new(EventSet::IN, wake.token()))
}

/// When a request passed the stages up to its submission, in [`Clock`]
/// ticks (0 with tracing off). Stamped per round and shared by the round's
/// requests: `popped` is when the worker began popping the round's batch,
/// so a request's pop -> submit stage is the time its batch took to parse
/// and push, which it waits out before being submitted with the others.
#[derive(Clone, Copy, Default, PartialEq, Eq)]
struct Stamps {
    kicked: u64,
    popped: u64,
    submitted: u64,
}

/// Per-request state, kept from pop to completion.
struct Slot {
    head: u16,
    /// The status byte, in guest memory that `ram` keeps mapped.
    status: *mut u8,
    used_len: u32,
    kind: OpKind,
    bytes: u64,
    stamps: Stamps,
    /// Keeps the guest memory the request points into mapped until it
    /// completes, even if the front-end replaces the memory table meanwhile.
    ram: Option<Arc<GuestRam>>,
}

/// One queue of a worker thread, with everything its rounds need.
struct QueueWorker {
    run: QueueRun,
    mem: GuestMemoryAtomic<Memory>,
    /// The regions of the memory map requests were last taken with; the
    /// rings are read and written through it.
    ram: Arc<GuestRam>,
    device: Arc<BlkDevice>,
    io: Box<dyn IoQueue>,
    slots: Vec<Slot>,
    /// One iovec array per slot, allocated once.
    iovecs: Vec<[libc::iovec; MAX_IOVECS]>,
    parser: request::Parser,
    free: Vec<u16>,
    completions: Vec<Completion>,
    /// Used entries published since the guest was last signalled.
    unsignalled: bool,
    /// When the first of those was published (with call batching only).
    unsignalled_since: u64,
    /// `call-batch-us`, in nanoseconds.
    call_batch_ns: u64,
    stats: Arc<QueueStats>,
    /// Set while reading the kick or writing the call descriptor (see
    /// [`front_end_io`]).
    front_end_io: Arc<AtomicBool>,
    /// Times polling, and stamps requests unless `trace=off`.
    clock: Clock,
    tracing: bool,
    poll: PollWindow,
    /// The ring may have requests to take: the guest kicked, polling
    /// found some, or some were left waiting for a free slot.
    kicked: bool,
    /// The thread's last wake-up was (also) for this queue.
    woken: bool,
    /// Guest kicks are off (left off for polling): they must be turned
    /// back on before the thread sleeps.
    kicks_off: bool,
    /// When the last kick was noticed.
    woke_at: u64,
    /// When the worker began popping the current round's requests.
    popping_at: u64,
    /// Tags pushed to the engine since its last submit.
    unsubmitted: Vec<u16>,
    /// How many requests the engine takes per submit at most
    /// ([`IoQueue::max_batch`]).
    max_batch: usize,
    /// The stamps of the requests being completed, for their stages.
    completing: Runs<Stamps>,
    /// Requests published since the guest was last signalled: when their
    /// kick was noticed and their kind, for their latency.
    awaiting_call: Runs<(u64, OpKind)>,
    /// When those were published.
    used_at: u64,
    /// The engine's count of kernel entries when last added to the stats
    /// (the engine is new with each worker; the stats live on).
    kernel_entries: u64,
}

// SAFETY: the raw pointers in `iovecs` point into guest memory that the
// slots keep mapped; they are only used by the thread that owns the worker.
unsafe impl Send for QueueWorker {}

impl QueueWorker {
    /// Opens the block node's queue for `run` and watches its descriptors
    /// in `epoll`, as the queue at position `at` of its thread.
    fn new(
        run: QueueRun,
        at: usize,
        epoll: &Epoll,
        mem: GuestMemoryAtomic<Memory>,
        device: Arc<BlkDevice>,
        front_end_io: Arc<AtomicBool>,
    ) -> io::Result<Self> {
        let depth = run.queue.size();
        // The worker counts its requests; the node need not count them again.
        let io = device.node.open_uncounted_queue(depth)?;
        watch(epoll, run.kick.as_raw_fd(), Wake::Kick(at))?;
        if let Some(fd) = io.notify_fd() {
            watch(epoll, fd.as_raw_fd(), Wake::Io(at))?;
        }
        let empty = libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 };
        let depth = usize::from(depth);
        let stats = device.stats[usize::from(run.index)].clone();
        let idle = || Slot {
            head: 0,
            status: std::ptr::null_mut(),
            used_len: 0,
            kind: OpKind::Flush,
            bytes: 0,
            stamps: Stamps::default(),
            ram: None,
        };
        Ok(Self {
            slots: (0..depth).map(|_| idle()).collect(),
            iovecs: vec![[empty; MAX_IOVECS]; depth],
            parser: request::Parser::new(),
            free: (0..depth as u16).rev().collect(),
            completions: Vec::with_capacity(depth),
            stats,
            front_end_io,
            clock: Clock::get(),
            tracing: device.config.trace,
            poll: PollWindow::new(device.config.poll_us),
            call_batch_ns: u64::from(device.config.call_batch_us) * 1000,
            // The guest may have queued requests before the thread listened.
            kicked: true,
            woken: false,
            kicks_off: false,
            woke_at: 0,
            popping_at: 0,
            unsubmitted: Vec::with_capacity(depth),
            max_batch: io.max_batch(),
            completing: Runs::with_capacity(depth),
            awaiting_call: Runs::with_capacity(depth),
            used_at: 0,
            kernel_entries: 0,
            run,
            ram: Arc::new(GuestRam::new(mem.memory().into_inner())),
            mem,
            device,
            io,
            unsignalled: false,
            unsignalled_since: 0,
        })
    }

    fn into_run(self) -> QueueRun {
        self.run
    }

    fn in_flight(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    /// The time, if requests are being traced.
    fn now(&self) -> u64 {
        if self.tracing { self.clock.now() } else { 0 }
    }

    /// Readies the queue for its first round, serving first what a
    /// back-end that died left in flight.
    fn begin(&mut self) {
        self.woke_at = self.now();
        if let Some(heads) = self.run.resubmit.take() {
            self.take_over(heads);
        }
    }

    /// One round: takes the guest's requests if it kicked, submits them,
    /// reaps what completed, publishes it and signals the guest. Returns
    /// whether the queue wants another round at once rather than a sleep.
    fn round(&mut self, stopping: bool) -> bool {
        if self.kicked && !stopping {
            self.kicked = self.take_requests();
        }
        self.submit();
        self.complete_requests();
        if self.unsignalled {
            if self.holding_call(stopping) {
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
        !stopping && self.kicked && !self.free.is_empty()
    }

    /// Blocks until some of the requests in flight may have completed.
    fn wait_for_io(&mut self) {
        if let Err(e) = self.io.wait() {
            log::error!("queue {}: waiting for I/O failed: {e}", self.run.index);
        }
    }

    /// How long this queue would have its thread poll: its window, unless
    /// the ring is broken.
    fn poll_window_ns(&self) -> u64 {
        if self.run.broken { 0 } else { self.poll.window_ns() }
    }

    /// Looks at the ring while the thread polls; true if it has requests.
    fn poll_ring(&mut self) -> bool {
        if self.run.broken || !self.ring_has_requests() {
            return false;
        }
        self.stats.poll_hits.add(1);
        self.woke_at = self.now();
        self.kicked = true;
        true
    }

    /// The guest kicked this queue, ending its thread's sleep begun at
    /// `slept_from`.
    fn kicked_awake(&mut self, slept_from: u64) {
        // Only a sleep with nothing in flight waits for the guest alone:
        // the kick that ends it tells how long polling would have had to
        // last. (Nothing completes while the thread sleeps.)
        if self.in_flight() == 0 {
            self.poll.slept(self.clock.ns(self.clock.now().saturating_sub(slept_from)));
        }
        self.woke_at = self.now();
        front_end_io(&self.front_end_io, || drain(self.run.kick.as_fd()));
        self.stats.kicks.add(1);
        self.kicked = true;
        self.woken = true;
    }

    /// The engine's descriptor ended the thread's sleep.
    fn io_ready(&mut self) {
        self.io.rearm();
        self.woken = true;
    }

    /// Counts the wake-up if this queue was among its causes.
    fn count_wakeup(&mut self) {
        if std::mem::take(&mut self.woken) {
            self.stats.wakeups.add(1);
        }
    }

    /// Call batching: whether to hold the guest's notification a little
    /// longer, for requests still in flight to complete and share it.
    fn holding_call(&self, stopping: bool) -> bool {
        self.call_batch_ns > 0
            && !stopping
            && self.in_flight() > 0
            && self.clock.ns(self.clock.now().saturating_sub(self.unsignalled_since)) < self.call_batch_ns
    }

    fn ring_has_requests(&self) -> bool {
        // A broken ring counts too: taking from it marks it broken.
        self.run.queue.available(&self.ram) != Ok(0)
    }

    /// Turns guest kicks back on before sleeping, if polling left them off.
    /// Returns false if requests arrived meanwhile: they are taken in the
    /// next round instead.
    fn turn_kicks_on(&mut self) -> bool {
        if !std::mem::take(&mut self.kicks_off) || self.run.broken {
            return true;
        }
        let quiet = match self.run.queue.enable_kicks(&self.ram) {
            Ok(more) => !more,
            Err(e) => !self.mark_broken(e),
        };
        if !quiet {
            // Requests the guest added without a kick (kicks were off)
            // are noticed now: their kick -> pop stage starts here, not at
            // the queue's last kick.
            self.woke_at = self.now();
            self.kicked = true;
        }
        quiet
    }

    /// Hands the requests pushed so far to the engine.
    fn submit(&mut self) {
        // Stamped before the call: an engine may do the I/O inside it
        // (io_uring reads of cached data), which is the engine's time.
        let now = self.now();
        for tag in self.unsubmitted.drain(..) {
            self.slots[usize::from(tag)].stamps.submitted = now;
        }
        if let Err(e) = self.io.submit() {
            log::error!("queue {}: submitting I/O failed: {e}", self.run.index);
        }
        let entries = self.io.kernel_entries();
        self.stats.kernel_entries.add(entries - self.kernel_entries);
        self.kernel_entries = entries;
    }

    /// Takes requests until the ring is empty or the slots run out.
    /// Returns whether requests are left waiting for a free slot.
    fn take_requests(&mut self) -> bool {
        if self.run.broken {
            return false;
        }
        let before = self.stats.requests.get();
        self.popping_at = self.now();
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
            for _ in 0..usize::from(announced).min(self.free.len()) {
                let head = match self.run.queue.pop(&ram) {
                    Ok(head) => head,
                    Err(e) => return self.mark_broken(e),
                };
                if let Some(inflight) = &mut self.run.inflight {
                    inflight.begin(head);
                }
                self.start_request(head, self.run.queue.chain(&ram, head), &ram, &limits);
            }
            if self.free.is_empty() {
                return true;
            }
            if self.poll.enabled() {
                // Kicks stay off while the worker polls; they are turned
                // back on (and the ring checked again) before it sleeps.
                self.kicks_off = true;
                return false;
            }
            match self.run.queue.enable_kicks(&self.ram) {
                Ok(true) => continue,
                Ok(false) => return false,
                Err(e) => return self.mark_broken(e),
            }
        }
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
        self.popping_at = self.now();
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
        let Some(tag) = self.free.pop() else { return };
        self.stats.requests.add(1);
        let iov = &mut self.iovecs[usize::from(tag)];
        // `parse` found the status byte inside guest memory.
        let parsed = self.parser.parse(chain, ram, limits, iov).ok();
        let Some((request, status)) = parsed.and_then(|r| Some((r, ram.host(r.status.0, 1)?))) else {
            log::debug!("queue {}: chain {head} has no status byte", self.run.index);
            self.free.push(tag);
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
            Action::WriteZeroes { offset, len, unmap } => (IoOp::WriteZeroes { offset, len, may_unmap: unmap }, 0),
            Action::GetId => {
                // SAFETY: the iovecs were just mapped by `parse` for this
                // GET_ID request and `mem` keeps them mapped.
                let written = unsafe { request::write_id(&iov[..request.iovcnt], &self.device.id) };
                if let Some(log) = &self.run.log {
                    for v in &iov[..request.iovcnt] {
                        log.wrote(ram, v.iov_base.cast(), v.iov_len);
                    }
                }
                self.free.push(tag);
                self.finish(head, status, status::OK, written as u32 + 1);
                if let Some(log) = &self.run.log {
                    log.wrote(ram, status, 1);
                }
                return;
            }
            Action::Done(code) => {
                self.stats.invalid.add(1);
                self.free.push(tag);
                self.finish(head, status, code, 1);
                if let Some(log) = &self.run.log {
                    log.wrote(ram, status, 1);
                }
                return;
            }
        };
        let (kind, bytes) = vsd_block::counted_as(&op);
        let slot = &mut self.slots[usize::from(tag)];
        *slot = Slot {
            head,
            status,
            used_len: data_len + 1,
            kind,
            bytes,
            stamps: Stamps { kicked: self.woke_at, popped: self.popping_at, submitted: 0 },
            ram: Some(ram.clone()),
        };
        self.unsubmitted.push(tag);
        // SAFETY: the buffers live in guest memory kept mapped by the slot,
        // and the iovec array is the slot's own; both outlive the request,
        // which completes before the slot is reused or the worker drops.
        unsafe { self.io.push(u32::from(tag), op) };
        if self.unsubmitted.len() >= self.max_batch {
            self.submit();
        }
    }

    fn complete_requests(&mut self) {
        self.io.reap(&mut self.completions);
        if self.completions.is_empty() {
            return;
        }
        // The used ring is written through the current memory map.
        self.current_ram();
        let completed_at = self.now();
        let mut completions = std::mem::take(&mut self.completions);
        // Chosen once per batch: without a log, nothing per request.
        match self.run.log.clone() {
            Some(log) => {
                self.finish_completed(&completions, &*log);
                self.signal_log_call();
            }
            None => self.finish_completed(&completions, &Unlogged),
        }
        self.used_at = self.now();
        if self.tracing {
            let used = self.used_at.saturating_sub(completed_at);
            self.stats.stage(Stage::Used).record_n(used, completions.len() as u64);
            self.record_stages(completed_at);
        }
        completions.clear();
        self.completions = completions;
    }

    /// Writes the status of each completed request and returns it to the
    /// guest, recording in `writes` the guest memory it wrote.
    fn finish_completed<W: GuestWrites>(&mut self, completions: &[Completion], writes: &W) {
        for done in completions {
            let tag = done.tag as usize;
            self.account(tag, done.errno);
            let slot = &mut self.slots[tag];
            // Keeps the buffers and the status byte mapped until they are
            // written and marked.
            let held = slot.ram.take();
            let (head, status) = (slot.head, slot.status);
            let (code, used_len) = if done.errno == 0 { (status::OK, slot.used_len) } else { (status::IOERR, 1) };
            if done.errno != 0 {
                log::debug!(
                    "queue {}: request {head} failed: {}",
                    self.run.index,
                    io::Error::from_raw_os_error(done.errno)
                );
            }
            self.finish(head, status, code, used_len);
            if let (true, Some(ram)) = (W::RECORDS, &held) {
                self.record_writes(writes, ram, tag);
            }
            self.free.push(done.tag as u16);
        }
    }

    /// Records what the request in slot `tag` wrote to guest memory: a
    /// read's buffers (even a failed read may have written part of them)
    /// and the status byte.
    fn record_writes(&self, writes: &impl GuestWrites, ram: &GuestRam, tag: usize) {
        let slot = &self.slots[tag];
        if slot.kind == OpKind::Read {
            // A read's used length is its data and the status byte.
            let mut left = u64::from(slot.used_len.saturating_sub(1));
            for v in &self.iovecs[tag] {
                if left == 0 {
                    break;
                }
                let n = left.min(v.iov_len as u64);
                writes.wrote(ram, v.iov_base.cast(), n as usize);
                left -= n;
            }
        }
        writes.wrote(ram, slot.status, 1);
    }

    /// Tells the front-end that the dirty log was written, if it asked to be.
    fn signal_log_call(&self) {
        if let Some(call) = &self.run.log_call
            && let Err(e) = front_end_io(&self.front_end_io, || vsd_sys::signal_counter(call.as_fd()))
        {
            log::warn!("queue {}: cannot signal the dirty log's eventfd: {e}", self.run.index);
        }
    }

    /// Counts a completed request and records its stages up to completion.
    fn account(&mut self, tag: usize, errno: i32) {
        let slot = &self.slots[tag];
        let op = self.stats.op(slot.kind);
        op.ops.add(1);
        if errno == 0 {
            op.bytes.add(slot.bytes);
        } else {
            op.failed.add(1);
        }
        if self.tracing {
            self.completing.push(slot.stamps);
            self.awaiting_call.push((slot.stamps.kicked, slot.kind));
        }
    }

    /// Records the stages up to completion of the requests just completed,
    /// once per run of requests that share their stamps.
    fn record_stages(&mut self, completed_at: u64) {
        // In ticks of the clock, as the statistics record them.
        let stage = |s| self.stats.stage(s);
        for (at, n) in self.completing.drain() {
            stage(Stage::Pop).record_n(at.popped.saturating_sub(at.kicked), n);
            stage(Stage::Submit).record_n(at.submitted.saturating_sub(at.popped), n);
            stage(Stage::Complete).record_n(completed_at.saturating_sub(at.submitted), n);
        }
    }

    /// Writes the status byte and returns the chain to the guest.
    fn finish(&mut self, head: u16, status: *mut u8, code: u8, used_len: u32) {
        // SAFETY: `status` was found inside guest memory when the request
        // was parsed, and the caller holds that memory map.
        unsafe { status.write_volatile(code) };
        self.publish(head, used_len);
    }

    fn publish(&mut self, head: u16, used_len: u32) {
        if let Some(inflight) = &self.run.inflight {
            inflight.publishing(head);
        }
        match self.run.queue.push_used(&self.ram, head, used_len) {
            Ok(()) => {
                if let Some(inflight) = &self.run.inflight {
                    inflight.published(head, self.run.queue.next_used());
                }
                if !self.unsignalled && self.call_batch_ns > 0 {
                    self.unsignalled_since = self.clock.now();
                }
                self.unsignalled = true;
            }
            Err(e) => {
                self.mark_broken(e);
            }
        }
    }

    fn signal_guest(&mut self) {
        self.unsignalled = false;
        self.run.queue.mark_published();
        let wanted = self.run.queue.needs_notification(&self.ram).unwrap_or(true);
        if let (true, Some(call)) = (wanted, &self.run.call) {
            match front_end_io(&self.front_end_io, || vsd_sys::signal_counter(call.as_fd())) {
                Ok(()) => self.stats.calls.add(1),
                Err(e) => log::warn!("queue {}: cannot signal the guest: {e}", self.run.index),
            }
        }
        if self.tracing && !self.awaiting_call.is_empty() {
            let called_at = self.clock.now();
            let mut requests = 0;
            for ((kicked_at, kind), n) in self.awaiting_call.drain() {
                self.stats.op(kind).latency.record_n(called_at.saturating_sub(kicked_at), n);
                requests += n;
            }
            self.stats.stage(Stage::Call).record_n(called_at.saturating_sub(self.used_at), requests);
        }
    }
}

fn drain(fd: BorrowedFd<'_>) {
    if let Err(e) = vsd_sys::read_counter(fd) {
        log::warn!("cannot read an event counter: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_queue_of_a_thread_has_its_own_tokens() {
        let wakes = [Wake::Stop, Wake::Kick(0), Wake::Io(0), Wake::Kick(1), Wake::Io(1), Wake::Kick(63), Wake::Io(63)];
        let tokens: Vec<u64> = wakes.iter().map(|wake| wake.token()).collect();
        assert_eq!(tokens, [u64::MAX, 0, 1, 2, 3, 126, 127]);
        for wake in wakes {
            assert_eq!(Wake::from_token(wake.token()), wake);
        }
    }

    #[test]
    fn threads_are_named_after_their_export_and_queues() {
        assert_eq!(thread_name("e0", &[3]), "vsd-e0-q3");
        assert_eq!(thread_name("e0", &[0, 2, 4]), "vsd-e0-q0,2,4");
    }
}
