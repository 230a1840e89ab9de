//! Where completions made on other threads (a thread pool's, a network
//! library's) wait for the queue that owns the requests.

use std::io;
use std::os::fd::BorrowedFd;
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};

use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

use crate::Completion;

/// One queue's completions, posted by any thread and taken by the owner,
/// who waits on [`Mailbox::notify_fd`] or in [`Mailbox::wait`].
pub struct Mailbox {
    list: Mutex<Vec<Completion>>,
    posted: Condvar,
    notify: EventFd,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panicking poster cannot leave the list inconsistent: each update is
    // a single push or drain.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Mailbox {
    /// A mailbox with room for `depth` completions before it allocates.
    pub fn new(depth: usize) -> io::Result<Self> {
        Ok(Self {
            list: Mutex::new(Vec::with_capacity(depth)),
            posted: Condvar::new(),
            notify: EventFd::new(EFD_NONBLOCK)?,
        })
    }

    /// Hands a completion to the owner. Only the first of a batch signals
    /// the descriptor: the owner takes the whole list after each wake-up.
    pub fn post(&self, done: Completion) {
        let mut list = lock(&self.list);
        let first = list.is_empty();
        list.push(done);
        drop(list);
        if first {
            self.posted.notify_one();
            if let Err(e) = self.notify.write(1) {
                log::warn!("cannot signal a completion: {e}");
            }
        }
    }

    /// Moves every posted completion to `out`; returns how many.
    pub fn take(&self, out: &mut Vec<Completion>) -> usize {
        let mut list = lock(&self.list);
        let n = list.len();
        out.append(&mut list);
        n
    }

    /// Blocks until a completion is posted (returns at once if one is).
    pub fn wait(&self) {
        let list = lock(&self.list);
        drop(self.posted.wait_while(list, |list| list.is_empty()).unwrap_or_else(PoisonError::into_inner));
    }

    /// Readable once a completion is posted after the last [`IoQueue::rearm`].
    ///
    /// [`IoQueue::rearm`]: crate::IoQueue::rearm
    pub fn notify_fd(&self) -> BorrowedFd<'_> {
        crate::borrow_fd(&self.notify)
    }
}
