//! A worker thread's loop: it sleeps on one epoll over its control
//! descriptor and the kick and engine descriptors of all its queues, runs
//! a round of each queue per wake-up, and, with `poll-us`, polls its rings
//! for a while before sleeping ([`PollWindow`](crate::poll::PollWindow),
//! each queue's own; the longest is used), guest kicks left off meanwhile.
//!
//! Queues come and go in groups (the queues of one export a session hands
//! over at once): an attached group's queues are served from the next
//! round; a group that is detached takes no more requests, its requests in
//! flight complete while the other groups go on, and its queues are then
//! handed back. A thread of its own serves one group (see
//! [`super::Worker`]); an I/O thread, any number ([`crate::IoThread`]).

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError, mpsc};

use vm_memory::GuestMemoryAtomic;
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};
use vsd_trace::Clock;

use super::queue::QueueWorker;
use super::{Memory, QueueRun};
use crate::device::BlkDevice;
use crate::poll::{Awake, PollConfig};

/// The epoll token of the thread's control descriptor; a queue's are below
/// it (see [`Wake`]).
const TOKEN_CONTROL: u64 = u64::MAX;

/// What woke a worker thread, from an epoll token: its control, or the
/// kick or engine of the queue in a slot of the thread's list (two tokens
/// per slot).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Wake {
    Control,
    Kick(usize),
    Io(usize),
}

impl Wake {
    fn token(self) -> u64 {
        match self {
            Wake::Control => TOKEN_CONTROL,
            Wake::Kick(at) => 2 * at as u64,
            Wake::Io(at) => 2 * at as u64 + 1,
        }
    }

    fn from_token(token: u64) -> Self {
        match (token, (token / 2) as usize) {
            (TOKEN_CONTROL, _) => Wake::Control,
            (token, at) if token % 2 == 0 => Wake::Kick(at),
            (_, at) => Wake::Io(at),
        }
    }
}

/// Queues to serve from now on, and where to say which group they are.
pub(super) struct Attach {
    pub(super) runs: Vec<QueueRun>,
    pub(super) mem: GuestMemoryAtomic<Memory>,
    pub(super) device: Arc<BlkDevice>,
    pub(super) front_end_io: Arc<AtomicBool>,
    /// How these queues poll.
    pub(super) poll: PollConfig,
    /// The group's number, or why its queues could not be opened (they
    /// are dropped then).
    pub(super) reply: mpsc::SyncSender<io::Result<u64>>,
}

/// What a thread is asked to do between rounds.
pub(super) enum Command {
    Attach(Box<Attach>),
    /// Stop serving a group; its queues come back once idle.
    Detach {
        group: u64,
        reply: mpsc::SyncSender<Vec<QueueRun>>,
    },
    /// End the thread once it serves no group.
    Exit,
}

/// How a thread is told what to do: commands in a list, and a descriptor
/// in its epoll that wakes it.
pub(super) struct Control {
    commands: Mutex<Vec<Command>>,
    /// Set with a command queued: checked every round, without a system call.
    pending: AtomicBool,
    wake: EventFd,
}

impl Control {
    pub(super) fn new() -> io::Result<Arc<Self>> {
        Ok(Arc::new(Self {
            commands: Mutex::new(Vec::new()),
            pending: AtomicBool::new(false),
            wake: EventFd::new(EFD_NONBLOCK)?,
        }))
    }

    pub(super) fn send(&self, command: Command) {
        self.commands.lock().unwrap_or_else(PoisonError::into_inner).push(command);
        self.pending.store(true, Ordering::Release);
        if let Err(e) = self.wake.write(1) {
            log::error!("cannot wake a queue worker: {e}");
        }
    }

    fn take(&self) -> Vec<Command> {
        self.pending.store(false, Ordering::Relaxed);
        // Nothing to read is fine: the flag, not the counter, says there is work.
        let _ = self.wake.read();
        std::mem::take(&mut *self.commands.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

/// A queue the thread serves, and the group it came with.
struct Member {
    queue: QueueWorker,
    group: u64,
    /// Its group is detached: it takes no more requests.
    leaving: bool,
}

/// A group being detached, waiting for its requests in flight.
struct Departure {
    group: u64,
    reply: mpsc::SyncSender<Vec<QueueRun>>,
}

/// A worker thread's side: its queues and what it sleeps on.
pub(super) struct WorkerThread {
    /// By slot; a slot's epoll tokens are its queue's while it serves one.
    members: Vec<Option<Member>>,
    departures: Vec<Departure>,
    exiting: bool,
    next_group: u64,
    /// The slot the current round starts with.
    first: usize,
    /// Watches the control and every queue's kick and engine descriptors.
    epoll: Epoll,
    events: Vec<EpollEvent>,
    control: Arc<Control>,
    /// Times polling and sleeps.
    clock: Clock,
    awake: Awake,
}

impl WorkerThread {
    /// The calling thread's loop, pinned to `cpus` unless empty.
    pub(super) fn new(cpus: &[usize], control: Arc<Control>, awake: Awake) -> io::Result<Self> {
        // Pinned before anything else runs on this thread.
        if !cpus.is_empty() {
            vsd_sys::set_thread_affinity(cpus)?;
        }
        let epoll = Epoll::new()?;
        watch(&epoll, control.wake.as_raw_fd(), Wake::Control)?;
        Ok(Self {
            members: Vec::new(),
            departures: Vec::new(),
            exiting: false,
            next_group: 0,
            first: 0,
            epoll,
            events: vec![EpollEvent::default(); 1],
            control,
            clock: Clock::get(),
            awake,
        })
    }

    /// Serves until told to exit with no group left.
    pub(super) fn run(&mut self) {
        loop {
            if self.control.pending.load(Ordering::Acquire) {
                for command in self.control.take() {
                    self.obey(command);
                }
            }
            // Each round starts one slot further on: the queue served
            // first has its completions out first, and its client back
            // first, so a fixed order would favour the lowest slots.
            self.first = if self.first + 1 < self.members.len() { self.first + 1 } else { 0 };
            let (served_last, served_first) = self.members.split_at_mut(self.first);
            let mut again = false;
            for member in served_first.iter_mut().chain(served_last).flatten() {
                again |= member.queue.round(member.leaving);
            }
            if !self.departures.is_empty() {
                self.finish_departures();
            }
            if self.exiting && self.members.iter().all(Option::is_none) {
                return;
            }
            if again || self.poll_for_work() || !self.turn_kicks_on() {
                continue;
            }
            self.sleep();
        }
    }

    fn obey(&mut self, command: Command) {
        match command {
            Command::Attach(attach) => {
                let Attach { runs, mem, device, front_end_io, poll, reply } = *attach;
                let _ = reply.send(self.attach(runs, mem, device, front_end_io, poll));
            }
            Command::Detach { group, reply } => {
                for member in self.members.iter_mut().flatten().filter(|m| m.group == group) {
                    member.leaving = true;
                }
                self.departures.push(Departure { group, reply });
            }
            Command::Exit => self.exiting = true,
        }
    }

    /// Opens the node's queue for each run and serves them as a new group.
    fn attach(
        &mut self,
        runs: Vec<QueueRun>,
        mem: GuestMemoryAtomic<Memory>,
        device: Arc<BlkDevice>,
        front_end_io: Arc<AtomicBool>,
        poll: PollConfig,
    ) -> io::Result<u64> {
        let group = self.next_group;
        self.next_group += 1;
        for run in runs {
            let at = match self.members.iter().position(Option::is_none) {
                Some(at) => at,
                None => {
                    self.members.push(None);
                    // Every descriptor may be ready at once: the control,
                    // and a kick and an engine per slot.
                    self.events.resize(2 * self.members.len() + 1, EpollEvent::default());
                    self.members.len() - 1
                }
            };
            let opened =
                QueueWorker::new(run, at, &self.epoll, mem.clone(), device.clone(), front_end_io.clone(), poll);
            match opened {
                Ok(mut queue) => {
                    queue.begin();
                    self.members[at] = Some(Member { queue, group, leaving: false });
                }
                Err(e) => {
                    // The group's queues opened so far go too.
                    drop(self.remove_group(group));
                    return Err(e);
                }
            }
        }
        Ok(group)
    }

    /// Hands back the queues of every departing group whose requests have
    /// all completed.
    fn finish_departures(&mut self) {
        let mut at = 0;
        while at < self.departures.len() {
            let group = self.departures[at].group;
            let busy = self.members.iter().flatten().any(|m| m.group == group && m.queue.in_flight() > 0);
            if busy {
                at += 1;
                continue;
            }
            let departure = self.departures.swap_remove(at);
            let _ = departure.reply.send(self.remove_group(group));
        }
    }

    /// Stops watching a group's queues and returns them.
    fn remove_group(&mut self, group: u64) -> Vec<QueueRun> {
        let mut runs = Vec::new();
        for slot in &mut self.members {
            if let Some(member) = slot.take_if(|m| m.group == group) {
                member.queue.unwatch(&self.epoll);
                runs.push(member.queue.into_run());
            }
        }
        runs
    }

    fn queues(&self) -> impl Iterator<Item = &QueueWorker> {
        self.members.iter().flatten().map(|m| &m.queue)
    }

    /// Spins for up to the longest poll window of its queues until a ring
    /// has requests; guest kicks stay off meanwhile.
    ///
    /// Only with no I/O in flight: buffered io_uring I/O may finish on a
    /// kernel worker thread that needs this very CPU (on tmpfs, polling
    /// with reads in flight cost 19 % of IOPS at iodepth 32 on 2 CPUs), so
    /// in-flight I/O is waited for asleep. Requests a throttle holds back
    /// are no such I/O: a throttled export does not stop its thread's
    /// polling for the others. Nor while other threads with work may be
    /// waiting for the CPU ([`Awake::crowded`]), or a command.
    fn poll_for_work(&mut self) -> bool {
        let window_ns = self.queues().map(QueueWorker::poll_window_ns).max().unwrap_or(0);
        if window_ns == 0 || self.queues().any(QueueWorker::has_io_in_flight) {
            return false;
        }
        let start = self.clock.now();
        loop {
            let mut found = false;
            for member in self.members.iter_mut().flatten() {
                found |= !member.leaving && member.queue.poll_ring();
            }
            if found {
                return true;
            }
            let spent = self.clock.ns(self.clock.now().saturating_sub(start));
            if self.awake.crowded() || self.control.pending.load(Ordering::Relaxed) || spent >= window_ns {
                return false;
            }
            std::hint::spin_loop();
        }
    }

    /// Turns every queue's guest kicks back on before sleeping. Returns
    /// false if requests arrived meanwhile: take them instead.
    fn turn_kicks_on(&mut self) -> bool {
        let mut quiet = true;
        for member in self.members.iter_mut().flatten() {
            quiet &= member.queue.turn_kicks_on();
        }
        quiet
    }

    /// Sleeps until a kick, a completion or a command.
    fn sleep(&mut self) {
        let slept_from = self.clock.now();
        let (epoll, events) = (&self.epoll, &mut self.events);
        let n = match self.awake.asleep(|| epoll.wait(-1, events)) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => return,
            Err(e) => {
                // Not seen in practice (the descriptors are the thread's
                // own): serve on, looking again a millisecond later.
                log::error!("{}: epoll failed: {e}", std::thread::current().name().unwrap_or("queue worker"));
                std::thread::sleep(std::time::Duration::from_millis(1));
                return;
            }
        };
        for event in &self.events[..n] {
            let (at, kick) = match Wake::from_token(event.data()) {
                Wake::Control => continue,
                Wake::Kick(at) => (at, true),
                Wake::Io(at) => (at, false),
            };
            // A slot emptied by this round's commands may still have had events.
            let Some(member) = self.members.get_mut(at).and_then(Option::as_mut) else { continue };
            if kick {
                member.queue.kicked_awake(slept_from);
            } else {
                member.queue.io_ready();
            }
        }
        for member in self.members.iter_mut().flatten() {
            member.queue.count_wakeup();
        }
    }
}

pub(super) fn watch(epoll: &Epoll, fd: RawFd, wake: Wake) -> io::Result<()> {
    epoll.ctl(ControlOperation::Add, fd, EpollEvent::new(EventSet::IN, wake.token()))
}

pub(super) fn unwatch(epoll: &Epoll, fd: RawFd) {
    if let Err(e) = epoll.ctl(ControlOperation::Delete, fd, EpollEvent::default()) {
        log::warn!("cannot stop watching descriptor {fd}: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_queue_of_a_thread_has_its_own_tokens() {
        let wakes =
            [Wake::Control, Wake::Kick(0), Wake::Io(0), Wake::Kick(1), Wake::Io(1), Wake::Kick(63), Wake::Io(63)];
        let tokens: Vec<u64> = wakes.iter().map(|wake| wake.token()).collect();
        assert_eq!(tokens, [u64::MAX, 0, 1, 2, 3, 126, 127]);
        for wake in wakes {
            assert_eq!(Wake::from_token(wake.token()), wake);
        }
    }
}
