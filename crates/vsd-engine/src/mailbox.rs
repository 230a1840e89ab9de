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
    inner: Mutex<Inner>,
    posted: Condvar,
    notify: EventFd,
}

struct Inner {
    list: Vec<Completion>,
    /// The owner sleeps in [`Mailbox::wait`]: only then is the condition
    /// variable worth a wake-up call.
    owner_waits: bool,
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
            inner: Mutex::new(Inner { list: Vec::with_capacity(depth), owner_waits: false }),
            posted: Condvar::new(),
            notify: EventFd::new(EFD_NONBLOCK)?,
        })
    }

    /// Hands a completion to the owner. Only the first of a batch signals
    /// the descriptor: the owner takes the whole list after each wake-up.
    /// The owner may drop the mailbox as soon as it has taken the
    /// completion, before this returns: posters call through an `Arc` of
    /// their own.
    pub fn post(&self, done: Completion) {
        let mut inner = lock(&self.inner);
        let first = inner.list.is_empty();
        inner.list.push(done);
        let owner_waits = inner.owner_waits;
        drop(inner);
        if owner_waits {
            self.posted.notify_one();
        }
        if first && let Err(e) = self.notify.write(1) {
            log::warn!("cannot signal a completion: {e}");
        }
    }

    /// Moves every posted completion to `out`; returns how many.
    pub fn take(&self, out: &mut Vec<Completion>) -> usize {
        let mut inner = lock(&self.inner);
        let n = inner.list.len();
        out.append(&mut inner.list);
        n
    }

    /// Blocks until a completion is posted (returns at once if one is).
    pub fn wait(&self) {
        let mut inner = lock(&self.inner);
        inner.owner_waits = true;
        let mut inner =
            self.posted.wait_while(inner, |inner| inner.list.is_empty()).unwrap_or_else(PoisonError::into_inner);
        inner.owner_waits = false;
    }

    /// Readable once a completion is posted after the last [`IoQueue::rearm`].
    ///
    /// [`IoQueue::rearm`]: crate::IoQueue::rearm
    pub fn notify_fd(&self) -> BorrowedFd<'_> {
        crate::borrow_fd(&self.notify)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    fn done(tag: u32) -> Completion {
        Completion { tag, errno: 0 }
    }

    #[test]
    fn one_signal_per_batch_and_every_completion_taken() {
        let mailbox = Mailbox::new(4).unwrap();
        mailbox.post(done(1));
        mailbox.post(done(2));
        assert_eq!(vsd_sys::read_counter(mailbox.notify_fd()).unwrap(), 1, "the first of a batch signals");
        let mut out = Vec::new();
        assert_eq!(mailbox.take(&mut out), 2);
        mailbox.post(done(3));
        assert_eq!(vsd_sys::read_counter(mailbox.notify_fd()).unwrap(), 1, "an empty list signals again");
        assert_eq!(mailbox.take(&mut out), 1);
        assert_eq!(out.iter().map(|c| c.tag).collect::<Vec<_>>(), [1, 2, 3]);
        assert_eq!(vsd_sys::read_counter(mailbox.notify_fd()).unwrap(), 0);
    }

    #[test]
    fn wait_returns_once_another_thread_posts() {
        let mailbox = Arc::new(Mailbox::new(1).unwrap());
        let poster = mailbox.clone();
        let thread = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(20));
            poster.post(done(7));
        });
        mailbox.wait();
        let mut out = Vec::new();
        assert_eq!(mailbox.take(&mut out), 1);
        thread.join().unwrap();
        mailbox.post(done(8));
        mailbox.wait();
        assert_eq!(mailbox.take(&mut out), 1, "a posted completion ends a wait at once");
    }
}
