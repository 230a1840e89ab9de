//! One thread's queue of requests to an image.
//!
//! librbd completes requests on its own threads and calls a function
//! there. That function only stores the result and posts the request's tag
//! to this queue's [`Mailbox`], whose descriptor the queue's worker already
//! waits on: the worker submits and finishes every request itself, as it
//! does with io_uring. (librbd's own notification descriptor,
//! `rbd_set_image_notification`, is one per image handle and cannot tell
//! the queues sharing the handle apart.)

use std::ffi::{c_int, c_void};
use std::io;
use std::os::fd::BorrowedFd;
use std::ptr;
use std::sync::Arc;
use std::sync::atomic::{AtomicIsize, Ordering};

use vsd_engine::{Completion, IoOp, IoQueue, Mailbox};

use crate::Image;
use crate::ffi::{self, AioCompletion};
use crate::image::check;

/// What librbd's thread sees of one request slot.
struct Ticket {
    api: &'static ffi::Api,
    mailbox: Arc<Mailbox>,
    tag: u32,
    /// librbd's return value: bytes read, or a negative errno.
    result: AtomicIsize,
}

/// Where a request is: a durable write is a write, then a flush.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Step {
    Main,
    FlushAfterWrite,
}

/// A queue of at most `depth` requests to an [`Image`], for one thread.
pub struct RbdQueue {
    image: Arc<Image>,
    mailbox: Arc<Mailbox>,
    /// One per tag, at addresses that never move: librbd holds pointers.
    tickets: Box<[Ticket]>,
    ops: Vec<(IoOp, Step)>,
    /// Pushed, not yet handed to librbd.
    pushed: Vec<u32>,
    /// Finished without librbd (or refused by it), not reaped yet.
    answered: Vec<Completion>,
    /// Tags librbd has finished, not looked at yet.
    posted: Vec<Completion>,
    /// Handed to librbd and not finished.
    with_librbd: usize,
    /// Pushed and not reaped.
    in_flight: usize,
}

/// librbd's completion callback, on one of its threads.
unsafe extern "C" fn finished(completion: AioCompletion, arg: *mut c_void) {
    // SAFETY: `arg` is the request's ticket, which lives as long as its
    // queue, and the queue waits for every request before it drops.
    let ticket = unsafe { &*arg.cast::<Ticket>() };
    let api = ticket.api;
    // SAFETY: librbd hands over its live completion, released once here.
    let result = unsafe {
        let result = (api.rbd_aio_get_return_value)(completion);
        (api.rbd_aio_release)(completion);
        result
    };
    ticket.result.store(result, Ordering::Relaxed);
    // Once the completion is in the list, the owner may reap it and drop
    // the queue, tickets and mailbox with it, while `post` still signals:
    // this thread keeps the mailbox alive itself.
    let mailbox = ticket.mailbox.clone();
    // The mailbox's lock orders the store before the owner's load.
    mailbox.post(Completion { tag: ticket.tag, errno: 0 });
}

impl RbdQueue {
    /// A queue for at most `depth` requests in flight on `image`.
    pub fn new(image: Arc<Image>, depth: u16) -> io::Result<Self> {
        let depth = usize::from(depth.max(1));
        let mailbox = Arc::new(Mailbox::new(depth)?);
        let tickets = (0..depth as u32)
            .map(|tag| Ticket { api: image.api, mailbox: mailbox.clone(), tag, result: AtomicIsize::new(0) })
            .collect();
        Ok(Self {
            image,
            mailbox,
            tickets,
            ops: vec![(IoOp::Flush, Step::Main); depth],
            pushed: Vec::with_capacity(depth),
            answered: Vec::with_capacity(depth),
            posted: Vec::with_capacity(depth),
            with_librbd: 0,
            in_flight: 0,
        })
    }

    /// Hands request `tag`'s current step to librbd, or answers it.
    fn issue(&mut self, tag: u32) {
        let (op, step) = self.ops[tag as usize];
        let started = match (op, step) {
            (IoOp::Read { offset, iov, .. }, _) if offset >= self.image.size() => {
                // Past the end reads as zeroes, as a file does (librbd refuses it).
                // SAFETY: IoQueue's contract keeps the buffers valid and ours.
                unsafe { iov.zero_from(0) };
                Err(0)
            }
            (IoOp::Write { offset, len, .. }, Step::Main) if offset.saturating_add(len) > self.image.size() => {
                match self.image.grow_to(offset.saturating_add(len)) {
                    Ok(()) => self.start(tag, op, step),
                    Err(e) => Err(e.raw_os_error().unwrap_or(libc::EIO)),
                }
            }
            // librbd may write the zeroes: not fast, as QEMU's rbd driver says.
            (IoOp::WriteZeroes { fast: true, .. }, _) => Err(libc::EOPNOTSUPP),
            _ => self.start(tag, op, step),
        };
        match started {
            Ok(()) => self.with_librbd += 1,
            Err(errno) => self.answered.push(Completion { tag, errno }),
        }
    }

    /// Starts one librbd call; the errno if librbd refused it.
    fn start(&self, tag: u32, op: IoOp, step: Step) -> Result<(), i32> {
        let api = self.image.api;
        let image = self.image.handle;
        let ticket = ptr::from_ref(&self.tickets[tag as usize]).cast_mut().cast::<c_void>();
        let mut completion = ptr::null_mut();
        // SAFETY: `ticket` outlives the request (see `finished`).
        check(unsafe { (api.rbd_aio_create_completion)(ticket, finished, &mut completion) }).map_err(errno)?;
        let iovecs = |iov: vsd_engine::IoVecs| {
            let list = iov.as_slice();
            (list.as_ptr(), c_int::try_from(list.len()).unwrap_or(c_int::MAX))
        };
        // SAFETY: a live image and completion; the iovecs and their buffers
        // stay valid until the completion is reaped (IoQueue's contract).
        let ret = unsafe {
            match (op, step) {
                (IoOp::Read { offset, iov, .. }, _) => {
                    let (list, count) = iovecs(iov);
                    (api.rbd_aio_readv)(image, list, count, offset, completion)
                }
                (IoOp::Write { offset, iov, .. }, Step::Main) => {
                    let (list, count) = iovecs(iov);
                    (api.rbd_aio_writev)(image, list, count, offset, completion)
                }
                (IoOp::Write { .. } | IoOp::Flush, _) => (api.rbd_aio_flush)(image, completion),
                (IoOp::Discard { offset, len }, _) => (api.rbd_aio_discard)(image, offset, len, completion),
                (IoOp::WriteZeroes { offset, len, may_unmap, .. }, _) => {
                    // Not unmapped unless allowed, as QEMU asks librbd.
                    let flags = if may_unmap { 0 } else { ffi::WRITE_ZEROES_THICK };
                    let len = usize::try_from(len).unwrap_or(usize::MAX);
                    (api.rbd_aio_write_zeroes)(image, offset, len, completion, flags, 0)
                }
                // librbd has no compressed write (nor has QEMU's rbd driver).
                (IoOp::WriteCompressed { .. }, _) => -libc::ENOTSUP,
            }
        };
        check(ret).map_err(|e| {
            // SAFETY: librbd refused the request and will not complete it.
            unsafe { (api.rbd_aio_release)(completion) };
            errno(e)
        })
    }

    /// What librbd's result means for request `tag`: its completion, or
    /// `None` if its next step was issued.
    fn finish(&mut self, tag: u32) -> Option<Completion> {
        self.with_librbd -= 1;
        let result = self.tickets[tag as usize].result.load(Ordering::Relaxed);
        if result < 0 {
            let errno = i32::try_from(-result).unwrap_or(libc::EIO);
            // A guest sees only EIO: the log keeps what librbd said.
            log::warn!("rbd: {:?} failed: {}", self.ops[tag as usize].0, io::Error::from_raw_os_error(errno));
            return Some(Completion { tag, errno });
        }
        match self.ops[tag as usize] {
            (IoOp::Read { len, iov, .. }, _) if (result as u64) < len => {
                // librbd clips reads at the end of the image: the rest reads as zeroes.
                // SAFETY: IoQueue's contract keeps the buffers valid and ours.
                unsafe { iov.zero_from(result as usize) };
            }
            (IoOp::Write { durable: true, .. }, Step::Main) => {
                self.ops[tag as usize].1 = Step::FlushAfterWrite;
                self.issue(tag);
                return None;
            }
            _ => {}
        }
        Some(Completion { tag, errno: 0 })
    }
}

fn errno(e: io::Error) -> i32 {
    e.raw_os_error().unwrap_or(libc::EIO)
}

impl IoQueue for RbdQueue {
    unsafe fn push(&mut self, tag: u32, op: IoOp) {
        assert!(self.in_flight < self.tickets.len(), "more requests than the queue depth");
        self.in_flight += 1;
        self.ops[tag as usize] = (op, Step::Main);
        self.pushed.push(tag);
    }

    fn submit(&mut self) -> io::Result<()> {
        let mut pushed = std::mem::take(&mut self.pushed);
        for tag in pushed.drain(..) {
            self.issue(tag);
        }
        self.pushed = pushed;
        Ok(())
    }

    fn reap(&mut self, out: &mut Vec<Completion>) {
        self.in_flight -= self.answered.len();
        out.append(&mut self.answered);
        let mut posted = std::mem::take(&mut self.posted);
        self.mailbox.take(&mut posted);
        for done in posted.drain(..) {
            if let Some(completion) = self.finish(done.tag) {
                self.in_flight -= 1;
                out.push(completion);
            }
        }
        self.posted = posted;
        // A durable write's flush that librbd refused is answered already.
        self.in_flight -= self.answered.len();
        out.append(&mut self.answered);
    }

    fn wait(&mut self) -> io::Result<()> {
        self.submit()?;
        if self.answered.is_empty() && self.with_librbd > 0 {
            self.mailbox.wait();
        }
        Ok(())
    }

    fn notify_fd(&self) -> Option<BorrowedFd<'_>> {
        Some(self.mailbox.notify_fd())
    }
}

impl Drop for RbdQueue {
    fn drop(&mut self) {
        // librbd may still write into the buffers, and holds the tickets.
        vsd_engine::drain(self, |queue| queue.in_flight);
    }
}
