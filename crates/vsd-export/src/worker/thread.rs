//! A worker thread's loop: it sleeps on one epoll over the stop and the
//! kick and engine descriptors of all its queues, runs a round of each
//! queue per wake-up, and, with `poll-us`, polls its rings for a while
//! before sleeping ([`PollWindow`](crate::poll::PollWindow), each queue's
//! own; the longest is used), guest kicks left off meanwhile.

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use vm_memory::GuestMemoryAtomic;
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;
use vsd_trace::Clock;

use super::queue::QueueWorker;
use super::{Memory, QueueRun};
use crate::device::BlkDevice;
use crate::poll::Awake;

/// The epoll token of the thread's stop; a queue's are below it (see
/// [`Wake`]).
const TOKEN_STOP: u64 = u64::MAX;

/// What woke a worker thread, from an epoll token: the stop, or the kick or
/// engine of the queue at a position in the thread's list (two tokens per
/// queue).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Wake {
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

/// A worker thread's side: its queues and what it sleeps on.
pub(super) struct WorkerThread {
    queues: Vec<QueueWorker>,
    /// Watches the stop and every queue's kick and engine descriptors.
    epoll: Epoll,
    events: Vec<EpollEvent>,
    /// Watched through `epoll`; held so the descriptor stays open.
    _stop: Arc<EventFd>,
    /// Times polling and sleeps.
    clock: Clock,
    awake: Awake,
}

impl WorkerThread {
    pub(super) fn new(
        thread: u16,
        runs: Vec<QueueRun>,
        mem: GuestMemoryAtomic<Memory>,
        device: Arc<BlkDevice>,
        stop: Arc<EventFd>,
        front_end_io: Arc<AtomicBool>,
        awake: Awake,
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
        Ok(Self { queues, epoll, events, _stop: stop, clock: Clock::get(), awake })
    }

    pub(super) fn into_runs(self) -> Vec<QueueRun> {
        self.queues.into_iter().map(QueueWorker::into_run).collect()
    }

    pub(super) fn run(&mut self) {
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
    /// in-flight I/O is waited for asleep. Nor while other threads with
    /// work may be waiting for the CPU ([`Awake::crowded`]).
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
            if self.awake.crowded() || self.clock.ns(self.clock.now().saturating_sub(start)) >= window_ns {
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
        let (epoll, events) = (&self.epoll, &mut self.events);
        let n = match self.awake.asleep(|| epoll.wait(-1, events)) {
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

pub(super) fn watch(epoll: &Epoll, fd: RawFd, wake: Wake) -> io::Result<()> {
    epoll.ctl(ControlOperation::Add, fd, EpollEvent::new(EventSet::IN, wake.token()))
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
}
