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

mod calls;
mod queue;
mod slots;
mod thread;
mod trace;

use std::fs::File;
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError, mpsc};
use std::thread::JoinHandle;
use std::time::Duration;

use vm_memory::{GuestMemoryAtomic, GuestMemoryMmap};
use vsd_virtio::dirty_log::DirtyLog;
use vsd_virtio::ring::SplitQueue;

use crate::IoThread;
use crate::device::BlkDevice;
use crate::inflight::InflightQueue;
use crate::poll::{Awake, PollConfig};
use thread::{Attach, Command, Control, WorkerThread};

type Memory = GuestMemoryMmap;

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
    /// queue's own, see [`SplitQueue::set_used_log`]).
    pub(crate) log: Option<Arc<DirtyLog>>,
    /// With the log: the front-end's eventfd to signal after a batch that
    /// wrote to it (SET_LOG_FD), if it gave one.
    pub(crate) log_call: Option<Arc<File>>,
}

/// A running worker thread, told what to serve through its [`Control`].
pub(crate) struct ThreadHandle {
    control: Arc<Control>,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// Set while the thread reads or writes a descriptor a front-end owns
    /// (kick, call).
    front_end_io: Arc<AtomicBool>,
}

/// How often a worker that does not stop is checked for a blocked kick or
/// call.
const STOP_CHECK: Duration = Duration::from_millis(50);

/// Runs `io` on a descriptor of the front-end's, flagged so that a stop
/// can interrupt it. Relaxed: a stop that misses the flag looks again
/// [`STOP_CHECK`] later, and a signal that lands elsewhere only costs an
/// interrupted system call that the worker retries or logs.
pub(super) fn front_end_io<T>(flag: &AtomicBool, io: impl FnOnce() -> T) -> T {
    flag.store(true, Ordering::Relaxed);
    let result = io();
    flag.store(false, Ordering::Relaxed);
    result
}

impl ThreadHandle {
    /// Starts a worker thread named `name`, pinned to `cpus` unless empty,
    /// serving nothing yet.
    pub(crate) fn spawn(name: String, cpus: Vec<usize>) -> io::Result<Self> {
        let control = Control::new()?;
        // Before any worker may need freeing from the front-end's
        // descriptors (see `detach`).
        if let Err(e) = vsd_sys::interrupt::prepare_interrupts() {
            log::warn!("a worker stuck on the front-end's descriptors could not be freed: {e}");
        }
        let awake = Awake::count_in();
        let (ready_tx, ready_rx) = mpsc::sync_channel(1);
        let thread_control = control.clone();
        let handle = std::thread::Builder::new().name(name).spawn(move || {
            match WorkerThread::new(&cpus, thread_control, awake) {
                Ok(mut worker) => {
                    let _ = ready_tx.send(Ok(()));
                    worker.run();
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                }
            }
        })?;
        match ready_rx.recv() {
            Ok(Ok(())) => {
                Ok(Self { control, thread: Mutex::new(Some(handle)), front_end_io: Arc::new(AtomicBool::new(false)) })
            }
            Ok(Err(e)) => {
                let _ = handle.join();
                Err(e)
            }
            Err(_) => Err(io::Error::other("queue worker died while starting")),
        }
    }

    /// Has the thread serve `runs` (the block node's queues are opened on
    /// it; an error doing so is returned here, and the runs are dropped).
    /// Returns their group.
    fn attach(
        &self,
        runs: Vec<QueueRun>,
        mem: GuestMemoryAtomic<Memory>,
        device: Arc<BlkDevice>,
        poll: PollConfig,
    ) -> io::Result<u64> {
        let (reply, answer) = mpsc::sync_channel(1);
        let front_end_io = self.front_end_io.clone();
        self.control.send(Command::Attach(Box::new(Attach { runs, mem, device, front_end_io, poll, reply })));
        answer.recv().map_err(|_| io::Error::other("queue worker died"))?
    }

    /// Stops serving a group after its requests in flight complete, and
    /// returns its queues where the worker left them.
    fn detach(&self, group: u64) -> Vec<QueueRun> {
        let (reply, answer) = mpsc::sync_channel(1);
        self.control.send(Command::Detach { group, reply });
        // Requests in flight may take long; the kick and call descriptors
        // must not. The front-end owns those: it may hand over a blocking
        // eventfd (or anything else), fill the call counter and never read
        // it, or empty the kick counter between the worker's wake-up and its
        // read, and the worker would wait forever, and with it the ring's
        // stop (GET_VRING_BASE), the connection and the export.
        loop {
            match answer.recv_timeout(STOP_CHECK) {
                Ok(runs) => return runs,
                Err(mpsc::RecvTimeoutError::Disconnected) => return Vec::new(),
                Err(mpsc::RecvTimeoutError::Timeout) => self.free_if_stuck(),
            }
        }
    }

    fn free_if_stuck(&self) {
        if !self.front_end_io.load(Ordering::Relaxed) {
            return;
        }
        log::warn!("a queue worker is stuck on a front-end's kick or call descriptor; interrupting it");
        if let Some(thread) = self.thread.lock().unwrap_or_else(PoisonError::into_inner).as_ref()
            && let Err(e) = vsd_sys::interrupt::interrupt(thread)
        {
            log::error!("cannot interrupt it: {e}");
        }
    }

    /// Ends the thread once it serves no group.
    pub(crate) fn exit(&self) {
        self.control.send(Command::Exit);
        if let Some(thread) = self.thread.lock().unwrap_or_else(PoisonError::into_inner).take() {
            let _ = thread.join();
        }
    }
}

/// Queues of one session served by one thread: a thread of its own, or a
/// shared I/O thread's.
pub(crate) struct Worker {
    /// The queues it serves.
    queues: Vec<u16>,
    thread: Arc<ThreadHandle>,
    group: u64,
    /// The thread is the worker's own, ended with it.
    own: bool,
}

impl Worker {
    /// Starts worker thread number `thread` of the export, serving `runs`.
    pub(crate) fn start(
        thread: u16,
        runs: Vec<QueueRun>,
        mem: GuestMemoryAtomic<Memory>,
        device: Arc<BlkDevice>,
    ) -> io::Result<Self> {
        let queues: Vec<u16> = runs.iter().map(|run| run.index).collect();
        let name = thread_name(&device.config.id, &queues);
        let handle = Arc::new(ThreadHandle::spawn(name, device.config.cpu_of(thread).into_iter().collect())?);
        let poll = PollConfig::up_to_us(device.config.poll_us);
        match handle.attach(runs, mem, device, poll) {
            Ok(group) => Ok(Self { queues, thread: handle, group, own: true }),
            Err(e) => {
                handle.exit();
                Err(e)
            }
        }
    }

    /// Serves `runs` on a shared I/O thread.
    pub(crate) fn start_on(
        io_thread: &IoThread,
        runs: Vec<QueueRun>,
        mem: GuestMemoryAtomic<Memory>,
        device: Arc<BlkDevice>,
    ) -> io::Result<Self> {
        let queues: Vec<u16> = runs.iter().map(|run| run.index).collect();
        let thread = io_thread.thread.clone();
        let group = thread.attach(runs, mem, device, io_thread.poll)?;
        Ok(Self { queues, thread, group, own: false })
    }

    /// Whether the worker serves queue `index`.
    pub(crate) fn serves(&self, index: u16) -> bool {
        self.queues.contains(&index)
    }

    /// Stops the worker after the requests in flight complete, and returns
    /// its queues with their indexes where the worker left them.
    pub(crate) fn stop(self) -> Vec<QueueRun> {
        let runs = self.thread.detach(self.group);
        if self.own {
            self.thread.exit();
        }
        runs
    }
}

/// `vsd-<export>-q<queues>`: `vsd-e0-q1` for a thread serving queue 1,
/// `vsd-e0-q0,2` for one serving queues 0 and 2. (Linux keeps 15 bytes.)
fn thread_name(export: &str, queues: &[u16]) -> String {
    let list: Vec<String> = queues.iter().map(u16::to_string).collect();
    format!("vsd-{export}-q{}", list.join(","))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn threads_are_named_after_their_export_and_queues() {
        assert_eq!(thread_name("e0", &[3]), "vsd-e0-q3");
        assert_eq!(thread_name("e0", &[0, 2, 4]), "vsd-e0-q0,2,4");
    }
}
