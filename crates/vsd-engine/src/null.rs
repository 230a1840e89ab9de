//! The null engine (`null-co`): completes every request without I/O,
//! optionally after a fixed latency, to measure everything but the device.

use std::collections::VecDeque;
use std::io;
use std::os::fd::BorrowedFd;
use std::time::{Duration, Instant};

use vmm_sys_util::timerfd::TimerFd;

use crate::{Completion, IoOp, IoQueue};

/// A queue whose requests succeed at once, or after `latency`.
pub struct NullQueue {
    read_zeroes: bool,
    latency: Duration,
    ready: Vec<Completion>,
    /// Requests waiting out the latency, in order of their deadline (the
    /// latency is the same for all, so that is the order of arrival).
    delayed: VecDeque<(Instant, Completion)>,
    timer: Option<TimerFd>,
}

impl NullQueue {
    /// A queue for at most `depth` requests in flight.
    pub fn new(depth: u16, read_zeroes: bool, latency: Duration) -> io::Result<Self> {
        let depth = usize::from(depth.max(1));
        let timer = if latency.is_zero() { None } else { Some(TimerFd::new()?) };
        Ok(Self {
            read_zeroes,
            latency,
            ready: Vec::with_capacity(depth),
            delayed: VecDeque::with_capacity(depth),
            timer,
        })
    }

    fn arm_timer(&mut self) {
        let (Some(timer), Some((due, _))) = (&mut self.timer, self.delayed.front()) else {
            return;
        };
        // A zero duration would disarm the timer: round up to 1 ns.
        let wait = due.saturating_duration_since(Instant::now()).max(Duration::from_nanos(1));
        if let Err(e) = timer.reset(wait, None) {
            log::warn!("null-co timer: {e}");
        }
    }
}

impl IoQueue for NullQueue {
    unsafe fn push(&mut self, tag: u32, op: IoOp) {
        let errno = match op {
            IoOp::Read { iov, .. } if self.read_zeroes => {
                // SAFETY: IoQueue's contract: the buffers are valid and
                // writable until the completion is reaped.
                unsafe { iov.zero_from(0) };
                0
            }
            // QEMU's null-co has no compressed write either.
            IoOp::WriteCompressed { .. } => libc::ENOTSUP,
            _ => 0,
        };
        let done = Completion { tag, errno };
        if self.timer.is_none() {
            self.ready.push(done);
            return;
        }
        let was_idle = self.delayed.is_empty();
        self.delayed.push_back((Instant::now() + self.latency, done));
        if was_idle {
            self.arm_timer();
        }
    }

    fn submit(&mut self) -> io::Result<()> {
        Ok(())
    }

    fn reap(&mut self, out: &mut Vec<Completion>) {
        out.append(&mut self.ready);
        let now = Instant::now();
        let before = self.delayed.len();
        while let Some(&(due, done)) = self.delayed.front() {
            if due > now {
                break;
            }
            self.delayed.pop_front();
            out.push(done);
        }
        if self.delayed.len() != before {
            self.arm_timer();
        }
    }

    fn wait(&mut self) -> io::Result<()> {
        if let Some(&(due, _)) = self.delayed.front() {
            std::thread::sleep(due.saturating_duration_since(Instant::now()));
        }
        Ok(())
    }

    fn notify_fd(&self) -> Option<BorrowedFd<'_>> {
        self.timer.as_ref().map(crate::borrow_fd)
    }
}
