//! `driver=throttle,throttle-group=ID,file=NODE`: the bytes of its child,
//! at the rates the group allows (QEMU's throttle filter).
//!
//! A request the group does not admit yet waits in its queue, in order
//! with the others of its direction (reads do not wait behind writes), and
//! a timer wakes the queue's owner when the group will admit the first, or
//! the group does when the queue's turn comes. The owner waits on one
//! descriptor: an epoll set of the timer, the turn and the child queue's
//! own descriptor. Flushes are not limited. A group without
//! limits costs one load per request.
//!
//! The child is sent exactly the requests the filter is, already counted
//! where they entered the graph (by the export, or by the node above), so
//! it is opened uncounted, as an export opens its node: the filter
//! records the writes in the child's dirty bitmaps (and runs their
//! copy-before-write) itself.

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::{Arc, PoisonError, RwLock};
use std::time::{Duration, Instant};

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::timerfd::TimerFd;
use vsd_engine::{Completion, IoOp, IoQueue};

use crate::dirty::DirtyRecorder;
use crate::options::OptionMap;
use crate::throttle::{Direction, Member, Refusal, ThrottleGroup};
use crate::{Allocation, BlockGraph, BlockNode, GraphError};

pub(crate) struct ThrottleNode {
    name: String,
    /// Swapped by a mirror's `replaces`: queues opened afterwards use the new one.
    child: RwLock<Arc<dyn BlockNode>>,
    group: Arc<ThrottleGroup>,
}

impl ThrottleNode {
    pub(crate) fn open(name: String, opts: &mut OptionMap, graph: &BlockGraph) -> Result<Self, GraphError> {
        let child = graph.child(opts, "file")?;
        let group = opts.require("throttle-group")?;
        let invalid = |reason| GraphError::Invalid { context: opts.context().into(), reason };
        let group = graph.throttle_group(&group).map_err(invalid)?;
        Ok(Self { name, child: RwLock::new(child), group })
    }

    fn child(&self) -> Arc<dyn BlockNode> {
        self.child.read().unwrap_or_else(PoisonError::into_inner).clone()
    }
}

impl BlockNode for ThrottleNode {
    fn name(&self) -> &str {
        &self.name
    }

    fn driver(&self) -> &'static str {
        "throttle"
    }

    fn size(&self) -> u64 {
        self.child().size()
    }

    fn read_only(&self) -> bool {
        self.child().read_only()
    }

    fn children(&self) -> Vec<(&'static str, Arc<dyn BlockNode>)> {
        vec![("file", self.child())]
    }

    fn replace_filtered(&self, child: Arc<dyn BlockNode>) -> io::Result<()> {
        *self.child.write().unwrap_or_else(PoisonError::into_inner) = child;
        Ok(())
    }

    fn claim(&self, claim: crate::Claim) -> Result<Vec<crate::ClaimGuard>, crate::LockError> {
        self.child().claim(claim)
    }

    fn resize(&self, size: u64) -> io::Result<()> {
        self.child().resize(size)
    }

    fn refresh_size(&self) -> io::Result<u64> {
        self.child().refresh_size()
    }

    fn block_status(&self, offset: u64, len: u64) -> io::Result<(Allocation, u64)> {
        self.child().block_status(offset, len)
    }

    fn allocation_depth(&self, offset: u64, len: u64) -> io::Result<(u32, u64)> {
        self.child().allocation_depth(offset, len)
    }

    fn throttle_group(&self) -> Option<Arc<ThrottleGroup>> {
        Some(self.group.clone())
    }

    fn open_queue(&self, depth: u16) -> io::Result<Box<dyn IoQueue>> {
        let inner = self.child().open_uncounted_queue(depth)?;
        let dirty = DirtyRecorder::for_node(&*self.child());
        Ok(Box::new(ThrottleQueue::new(inner, dirty, self.group.clone(), depth)?))
    }
}

/// Which limits a request counts against, and how many bytes it moves.
fn direction(op: &IoOp) -> Option<(Direction, u64)> {
    match *op {
        IoOp::Read { len, .. } => Some((Direction::Read, len)),
        IoOp::Write { len, .. }
        | IoOp::WriteCompressed { len, .. }
        | IoOp::WriteZeroes { len, .. }
        | IoOp::Discard { len, .. } => Some((Direction::Write, len)),
        IoOp::Flush => None,
    }
}

const TOKEN_CHILD: u64 = 0;
const TOKEN_TIMER: u64 = 1;
const TOKEN_TURN: u64 = 2;

struct ThrottleQueue {
    inner: Box<dyn IoQueue>,
    /// The child's bitmaps, which its uncounted queue does not record.
    dirty: DirtyRecorder,
    group: Arc<ThrottleGroup>,
    /// The queue among the group's members.
    member: Arc<Member>,
    /// Requests not admitted yet, with when they came: reads, then
    /// writes, each in order.
    waiting: [VecDeque<(u32, IoOp, Instant)>; 2],
    /// Requests handed to the child and not reaped yet.
    forwarded: usize,
    timer: TimerFd,
    /// When the timer is armed to expire, if it is.
    armed: Option<Instant>,
    /// The timer and the child's descriptor: what the owner waits on.
    epoll: Epoll,
}

impl ThrottleQueue {
    fn new(inner: Box<dyn IoQueue>, dirty: DirtyRecorder, group: Arc<ThrottleGroup>, depth: u16) -> io::Result<Self> {
        let epoll = Epoll::new()?;
        let timer = TimerFd::new()?;
        let member = Member::new()?;
        epoll.ctl(ControlOperation::Add, timer.as_raw_fd(), EpollEvent::new(EventSet::IN, TOKEN_TIMER))?;
        epoll.ctl(ControlOperation::Add, member.fd().as_raw_fd(), EpollEvent::new(EventSet::IN, TOKEN_TURN))?;
        if let Some(fd) = inner.notify_fd() {
            epoll.ctl(ControlOperation::Add, fd.as_raw_fd(), EpollEvent::new(EventSet::IN, TOKEN_CHILD))?;
        }
        let waiting = [0, 1].map(|_| VecDeque::with_capacity(usize::from(depth)));
        Ok(Self { inner, dirty, group, member, waiting, forwarded: 0, timer, armed: None, epoll })
    }

    #[inline(always)]
    fn forward(&mut self, tag: u32, op: IoOp) {
        self.forwarded += 1;
        self.dirty.record(tag, &op);
        // SAFETY: the owner's guarantee for `op`, given at push, holds until
        // its completion is reaped, which is after it reaches the child.
        unsafe { self.inner.push(tag, op) }
    }

    /// Forwards a request the group admits now, in order after those of
    /// its direction already waiting; holds it back otherwise.
    #[inline(never)]
    fn admit(&mut self, tag: u32, op: IoOp, direction: Direction, bytes: u64) {
        let lane = direction as usize;
        let now = Instant::now();
        if !self.waiting[lane].is_empty() {
            return self.waiting[lane].push_back((tag, op, now));
        }
        match self.group.admit(&self.member, direction, bytes, now) {
            Ok(()) => {
                self.group.count(direction, bytes, Duration::ZERO);
                self.forward(tag, op);
            }
            Err(refusal) => {
                self.waiting[lane].push_back((tag, op, now));
                if let Refusal::Wait(wait) = refusal {
                    self.arm(now, wait);
                }
            }
        }
    }

    /// Forwards the waiting requests the group admits now, in order; arms
    /// the timer for the first it does not (unless it waits for its turn,
    /// which the group signals). True if any went.
    fn release(&mut self) -> bool {
        let now = Instant::now();
        let mut released = false;
        let mut next: Option<Duration> = None;
        for lane in 0..2 {
            while let Some(&(tag, op, came)) = self.waiting[lane].front() {
                let Some((direction, bytes)) = direction(&op) else { break };
                match self.group.admit(&self.member, direction, bytes, now) {
                    Ok(()) => {
                        self.waiting[lane].pop_front();
                        self.group.count(
                            direction,
                            bytes,
                            now.saturating_duration_since(came).max(Duration::from_nanos(1)),
                        );
                        self.forward(tag, op);
                        released = true;
                    }
                    Err(Refusal::Wait(wait)) => {
                        next = Some(next.map_or(wait, |n| n.min(wait)));
                        break;
                    }
                    Err(Refusal::Turn) => break,
                }
            }
        }
        if let Some(wait) = next {
            self.arm(now, wait);
        }
        released
    }

    /// Arms the timer to expire `wait` after `now`, unless it already
    /// expires sooner (it wakes the owner, which asks the group again).
    fn arm(&mut self, now: Instant, wait: Duration) {
        // At least a microsecond: a zero duration would disarm it.
        let wait = wait.max(Duration::from_micros(1));
        if self.armed.is_some_and(|at| at <= now + wait) {
            return;
        }
        match self.timer.reset(wait, None) {
            Ok(()) => self.armed = Some(now + wait),
            Err(e) => log::error!("throttle: cannot arm the timer, requests wait for the next completion: {e}"),
        }
    }

    /// Reads what woke the owner: the timer's expiry count and the child's
    /// readiness, without blocking on either.
    fn consume_wakeups(&mut self) {
        let mut events = [EpollEvent::default(); 3];
        let ready = self.epoll.wait(0, &mut events).unwrap_or(0);
        for event in &events[..ready] {
            match event.data() {
                TOKEN_TIMER => {
                    let _ = self.timer.wait();
                    self.armed = None;
                }
                TOKEN_TURN => self.member.consume(),
                _ => self.inner.rearm(),
            }
        }
    }

    fn waiting(&self) -> bool {
        self.waiting.iter().any(|lane| !lane.is_empty())
    }
}

impl IoQueue for ThrottleQueue {
    unsafe fn push(&mut self, tag: u32, op: IoOp) {
        if self.group.limited()
            && let Some((direction, bytes)) = direction(&op)
        {
            return self.admit(tag, op, direction, bytes);
        }
        // Without limits the request only passes through: kept apart from
        // the admission above, this path needs no stack frame of its own.
        self.forward(tag, op)
    }

    fn submit(&mut self) -> io::Result<()> {
        self.inner.submit()
    }

    fn reap(&mut self, out: &mut Vec<Completion>) {
        if self.waiting()
            && self.release()
            && let Err(e) = self.inner.submit()
        {
            log::error!("throttle: cannot submit released requests: {e}");
        }
        let before = out.len();
        self.inner.reap(out);
        self.dirty.completed(&out[before..]);
        self.forwarded -= out.len() - before;
    }

    fn wait(&mut self) -> io::Result<()> {
        if self.forwarded > 0 || !self.waiting() {
            return self.inner.wait();
        }
        // Nothing in flight below: the next completion needs the timer or
        // the queue's turn.
        let mut events = [EpollEvent::default(); 1];
        self.epoll.wait(-1, &mut events)?;
        Ok(())
    }

    fn notify_fd(&self) -> Option<BorrowedFd<'_>> {
        // SAFETY: the epoll set lives as long as the queue, and the borrow
        // cannot outlive it.
        Some(unsafe { BorrowedFd::borrow_raw(self.epoll.as_raw_fd()) })
    }

    fn rearm(&mut self) {
        self.consume_wakeups();
    }

    fn held(&self) -> usize {
        self.waiting.iter().map(VecDeque::len).sum::<usize>() + self.inner.held()
    }

    vsd_engine::forward_to_inner!(inner: max_batch, kernel_entries);
}

impl Drop for ThrottleQueue {
    fn drop(&mut self) {
        self.group.leave(&self.member);
        // The owner waited for what it knows to be in flight; anything
        // still held here goes without limits, and the child's own drop
        // waits for it, so that no buffer is used after the owner frees it.
        let held: Vec<(u32, IoOp, Instant)> = self.waiting.iter_mut().flat_map(|lane| lane.drain(..)).collect();
        if !held.is_empty() {
            held.into_iter().for_each(|(tag, op, _)| self.forward(tag, op));
            if let Err(e) = self.inner.submit() {
                log::error!("throttle: cannot submit held requests at close: {e}");
            }
        }
    }
}
