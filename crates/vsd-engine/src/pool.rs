//! The thread-pool engine (`aio=threads`): blocking system calls on a
//! shared pool of threads, for hosts where io_uring is unavailable.
//!
//! A request handed to the pool takes a lock and two wake-ups across
//! threads (a pool thread, then the queue's thread), so what can complete
//! without blocking completes on the queue's thread first ([`Inline`]);
//! QEMU's pool hands every request over.

use std::collections::VecDeque;
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};

use crate::inline::Inline;
use crate::{Completion, IoOp, IoQueue, Mailbox, run_sync};

/// Threads are started on demand up to this many, as QEMU's pool does.
const MAX_THREADS: usize = 64;

struct Job {
    file: Arc<File>,
    tag: u32,
    op: IoOp,
    done: Arc<Mailbox>,
}

#[derive(Default)]
struct Jobs {
    waiting: VecDeque<Job>,
    threads: usize,
    idle: usize,
    shutdown: bool,
}

#[derive(Default)]
struct Shared {
    jobs: Mutex<Jobs>,
    wake: Condvar,
}

/// A pool of threads shared by all queues of one node.
#[derive(Default)]
pub struct ThreadPool {
    shared: Arc<Shared>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panicking job cannot leave these lists inconsistent: each update is
    // a single push or pop.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl ThreadPool {
    /// An empty pool; threads start with the first jobs.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    fn enqueue(&self, batch: &mut Vec<Job>) {
        let mut jobs = lock(&self.shared.jobs);
        // Wake as many idle threads as there are jobs, not all of them.
        let woken = batch.len().min(jobs.idle);
        let wanted = batch.len() - woken;
        jobs.waiting.extend(batch.drain(..));
        for _ in 0..wanted {
            if jobs.threads >= MAX_THREADS {
                break;
            }
            let shared = self.shared.clone();
            match std::thread::Builder::new().name("vsd-pool".into()).spawn(move || work(&shared)) {
                Ok(_) => jobs.threads += 1,
                Err(e) => log::warn!("cannot start a pool thread: {e}"),
            }
        }
        drop(jobs);
        for _ in 0..woken {
            self.shared.wake.notify_one();
        }
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        lock(&self.shared.jobs).shutdown = true;
        self.shared.wake.notify_all();
    }
}

fn work(shared: &Shared) {
    loop {
        let job = {
            let mut jobs = lock(&shared.jobs);
            loop {
                if let Some(job) = jobs.waiting.pop_front() {
                    break job;
                }
                if jobs.shutdown {
                    jobs.threads -= 1;
                    return;
                }
                jobs.idle += 1;
                jobs = shared.wake.wait(jobs).unwrap_or_else(PoisonError::into_inner);
                jobs.idle -= 1;
            }
        };
        let errno = match run_sync(job.file.as_fd(), job.op) {
            Ok(()) => 0,
            Err(e) => e.raw_os_error().unwrap_or(libc::EIO),
        };
        job.done.post(Completion { tag: job.tag, errno });
    }
}

/// One queue's channel to a [`ThreadPool`].
pub struct PoolQueue {
    pool: Arc<ThreadPool>,
    file: Arc<File>,
    done: Arc<Mailbox>,
    batch: Vec<Job>,
    in_flight: usize,
    /// Of those, the ones handed to the pool.
    pooled: usize,
    /// Requests handed to the pool since the queue was made.
    handed_off: u64,
    depth: usize,
    /// Completed on this thread, not reaped yet.
    ready: Vec<Completion>,
    inline: Inline,
}

impl PoolQueue {
    /// A queue for at most `depth` requests in flight on `file`.
    pub fn new(pool: Arc<ThreadPool>, file: Arc<File>, depth: u16) -> io::Result<Self> {
        let depth = usize::from(depth.max(1));
        let done = Arc::new(Mailbox::new(depth)?);
        let inline = Inline::for_threads(vsd_sys::residence(&file)?);
        Ok(Self {
            pool,
            file,
            done,
            batch: Vec::with_capacity(depth),
            in_flight: 0,
            pooled: 0,
            handed_off: 0,
            depth,
            ready: Vec::with_capacity(depth),
            inline,
        })
    }

    /// How many requests this queue has handed to the pool's threads; the
    /// others completed on the caller's thread, within their submit.
    pub fn handed_off(&self) -> u64 {
        self.handed_off
    }

    /// Completes on this thread the batch's requests that need not block;
    /// leaves the others in the batch.
    fn complete_inline(&mut self) {
        let (fd, inline, ready) = (self.file.as_fd(), &mut self.inline, &mut self.ready);
        self.batch.retain(|job| match inline.complete(fd, job.op) {
            Some(errno) => {
                ready.push(Completion { tag: job.tag, errno });
                false
            }
            None => true,
        });
    }
}

impl IoQueue for PoolQueue {
    unsafe fn push(&mut self, tag: u32, op: IoOp) {
        assert!(self.in_flight < self.depth, "more requests than the queue depth");
        self.in_flight += 1;
        let (file, done) = (self.file.clone(), self.done.clone());
        self.batch.push(Job { file, tag, op, done });
    }

    fn submit(&mut self) -> io::Result<()> {
        if self.inline.enabled() {
            self.complete_inline();
        }
        if !self.batch.is_empty() {
            self.pooled += self.batch.len();
            self.handed_off += self.batch.len() as u64;
            self.pool.enqueue(&mut self.batch);
        }
        Ok(())
    }

    fn reap(&mut self, out: &mut Vec<Completion>) {
        self.in_flight -= self.ready.len();
        out.append(&mut self.ready);
        if self.pooled == 0 {
            return;
        }
        let taken = self.done.take(out);
        self.in_flight -= taken;
        self.pooled -= taken;
    }

    fn wait(&mut self) -> io::Result<()> {
        self.submit()?;
        if !self.ready.is_empty() {
            return Ok(());
        }
        if self.pooled > 0 {
            self.done.wait();
        }
        Ok(())
    }

    fn notify_fd(&self) -> Option<BorrowedFd<'_>> {
        Some(self.done.notify_fd())
    }
}

impl Drop for PoolQueue {
    fn drop(&mut self) {
        crate::drain(self, |queue| queue.in_flight);
    }
}
