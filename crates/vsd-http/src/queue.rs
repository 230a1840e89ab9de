//! One thread's channel to an image's workers: reads go to them, the
//! rest is answered here (the image is read-only, a flush has nothing to do).

use std::io;
use std::os::fd::BorrowedFd;
use std::sync::{Arc, mpsc};

use vsd_engine::{Completion, IoOp, IoQueue, Mailbox};

use crate::Job;

pub struct HttpQueue {
    jobs: mpsc::Sender<Job>,
    size: u64,
    done: Arc<Mailbox>,
    batch: Vec<Job>,
    /// Answered here, not reaped yet.
    ready: Vec<Completion>,
    in_flight: usize,
    /// Of those, the ones the workers have.
    sent: usize,
    depth: usize,
}

impl HttpQueue {
    pub(crate) fn new(jobs: mpsc::Sender<Job>, size: u64, depth: u16) -> io::Result<Self> {
        let depth = usize::from(depth.max(1));
        Ok(Self {
            jobs,
            size,
            done: Arc::new(Mailbox::new(depth)?),
            batch: Vec::with_capacity(depth),
            ready: Vec::with_capacity(depth),
            in_flight: 0,
            sent: 0,
            depth,
        })
    }
}

/// The errno for a request that is not a read inside the image.
fn answer(op: &IoOp) -> i32 {
    match op {
        IoOp::Read { .. } => libc::EIO,
        IoOp::Flush => 0,
        IoOp::WriteCompressed { .. } => libc::ENOTSUP,
        IoOp::Write { .. } | IoOp::Discard { .. } | IoOp::WriteZeroes { .. } => libc::EPERM,
    }
}

impl IoQueue for HttpQueue {
    unsafe fn push(&mut self, tag: u32, op: IoOp) {
        assert!(self.in_flight < self.depth, "more requests than the queue depth");
        self.in_flight += 1;
        match op {
            IoOp::Read { offset, len, iov } if vsd_engine::range_ok(offset, len, self.size) => {
                self.batch.push(Job { tag, offset, len, iov, done: self.done.clone() });
            }
            op => self.ready.push(Completion { tag, errno: answer(&op) }),
        }
    }

    fn submit(&mut self) -> io::Result<()> {
        for job in self.batch.drain(..) {
            match self.jobs.send(job) {
                Ok(()) => self.sent += 1,
                // No worker left (none could start): fail the read.
                Err(mpsc::SendError(job)) => self.ready.push(Completion { tag: job.tag, errno: libc::EIO }),
            }
        }
        Ok(())
    }

    fn reap(&mut self, out: &mut Vec<Completion>) {
        self.in_flight -= self.ready.len();
        out.append(&mut self.ready);
        if self.sent > 0 {
            let taken = self.done.take(out);
            self.in_flight -= taken;
            self.sent -= taken;
        }
    }

    fn wait(&mut self) -> io::Result<()> {
        self.submit()?;
        if self.ready.is_empty() && self.sent > 0 {
            self.done.wait();
        }
        Ok(())
    }

    fn notify_fd(&self) -> Option<BorrowedFd<'_>> {
        Some(self.done.notify_fd())
    }
}

impl Drop for HttpQueue {
    fn drop(&mut self) {
        vsd_engine::drain(self, |queue| queue.in_flight);
    }
}
