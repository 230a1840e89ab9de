//! A format driver's channel to a child node: asynchronous requests for
//! guest data, and blocking ones for metadata on the same ring.

use std::io;
use std::os::fd::BorrowedFd;

use vsd_engine::{Completion, IoOp, IoQueue, IoVecs};
use vsd_qcow2::SyncIo;

/// A child's queue with one tag kept back for blocking requests.
///
/// Blocking requests share the ring with asynchronous ones (a second ring
/// per child would double the rings of every level of a backing chain);
/// completions of asynchronous requests that arrive while a blocking one
/// waits are kept for the next [`ChildQueue::reap`].
pub(crate) struct ChildQueue {
    inner: Box<dyn IoQueue>,
    sync_tag: u32,
    stash: Vec<Completion>,
    /// Reads from here on return zeroes without I/O (a backing file
    /// shorter than its overlay).
    end: u64,
}

impl ChildQueue {
    /// Opens `depth` asynchronous tags (0..depth) on `node`, plus one for
    /// blocking requests.
    pub(crate) fn open(node: &dyn crate::BlockNode, depth: u16, end: u64) -> io::Result<Self> {
        let inner = node.open_queue(depth.checked_add(1).ok_or_else(|| io::Error::from_raw_os_error(libc::EINVAL))?)?;
        Ok(Self { inner, sync_tag: u32::from(depth), stash: Vec::new(), end })
    }

    /// Where reads stop returning the child's bytes.
    pub(crate) fn end(&self) -> u64 {
        self.end
    }

    /// Queues an asynchronous request.
    ///
    /// # Safety
    /// As [`IoQueue::push`]; `tag` must be below the depth given to `open`.
    pub(crate) unsafe fn push(&mut self, tag: u32, op: IoOp) {
        debug_assert!(tag < self.sync_tag);
        // SAFETY: the caller's guarantee.
        unsafe { self.inner.push(tag, op) }
    }

    pub(crate) fn submit(&mut self) -> io::Result<()> {
        self.inner.submit()
    }

    pub(crate) fn reap(&mut self, out: &mut Vec<Completion>) {
        out.append(&mut self.stash);
        self.inner.reap(out);
    }

    /// Whether completions wait in the stash: they arrived while a
    /// blocking request waited, and the next [`ChildQueue::reap`] returns
    /// them without the notify descriptor saying so.
    pub(crate) fn has_stash(&self) -> bool {
        !self.stash.is_empty()
    }

    pub(crate) fn notify_fd(&self) -> Option<BorrowedFd<'_>> {
        self.inner.notify_fd()
    }

    pub(crate) fn rearm(&mut self) {
        self.inner.rearm()
    }

    pub(crate) fn max_batch(&self) -> usize {
        self.inner.max_batch()
    }

    pub(crate) fn kernel_entries(&self) -> u64 {
        self.inner.kernel_entries()
    }

    /// Zeroes `len` bytes at `offset` with the host allocating them, or
    /// fails (no fallback to writing zeroes): a filter preallocating.
    pub(crate) fn allocate_zeroes(&mut self, offset: u64, len: u64) -> io::Result<()> {
        self.run(IoOp::WriteZeroes { offset, len, may_unmap: false, fast: true })
    }

    /// Runs one request to completion.
    fn run(&mut self, op: IoOp) -> io::Result<()> {
        // SAFETY: the buffers `op` names belong to our caller, who waits
        // here until the request completes.
        unsafe { self.inner.push(self.sync_tag, op) };
        self.inner.submit()?;
        let mut done = Vec::new();
        loop {
            self.inner.reap(&mut done);
            let mine = done.iter().position(|c| c.tag == self.sync_tag).map(|i| done.swap_remove(i));
            self.stash.append(&mut done);
            match mine {
                Some(c) if c.errno == 0 => return Ok(()),
                Some(c) => return Err(io::Error::from_raw_os_error(c.errno)),
                None => self.inner.wait()?,
            }
        }
    }

    /// Writes zeroes over `len` bytes at `offset`, waiting for it (a
    /// copy that keeps holes sparse).
    pub(crate) fn write_zeroes(&mut self, offset: u64, len: u64) -> io::Result<()> {
        self.run(IoOp::WriteZeroes { offset, len, may_unmap: false, fast: false })
    }

    fn transfer(&mut self, buf: *mut u8, len: usize, offset: u64, write: bool) -> io::Result<()> {
        let iov = [libc::iovec { iov_base: buf.cast(), iov_len: len }];
        // SAFETY: `iov` and the buffer it names outlive `run`, which
        // returns only once the request has completed.
        let iov = unsafe { IoVecs::new(iov.as_ptr(), 1) };
        let len = len as u64;
        self.run(if write { IoOp::Write { offset, len, iov, durable: false } } else { IoOp::Read { offset, len, iov } })
    }
}

impl SyncIo for ChildQueue {
    fn read_at(&mut self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let inside = self.end.saturating_sub(offset).min(buf.len() as u64) as usize;
        buf[inside..].fill(0);
        if inside == 0 {
            return Ok(());
        }
        self.transfer(buf.as_mut_ptr(), inside, offset, false)
    }

    fn write_at(&mut self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.transfer(buf.as_ptr().cast_mut(), buf.len(), offset, true)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.run(IoOp::Flush)
    }

    fn discard(&mut self, offset: u64, len: u64) -> io::Result<()> {
        self.run(IoOp::Discard { offset, len })
    }
}
