//! I/O engines: how a block node's requests reach the host.
//!
//! ```text
//!   export queue worker ──push/submit/reap──▶ dyn IoQueue
//!                                              ├── AlignedQueue (O_DIRECT of any alignment, over one below)
//!                                              ├── UringQueue  (one io_uring per queue)
//!                                              ├── PoolQueue   (shared worker threads)
//!                                              ├── (vsd-rbd's RbdQueue: librbd, through a Mailbox)
//!                                              └── NullQueue   (completes without I/O)
//! ```
//!
//! An [`IoQueue`] belongs to exactly one thread (one virtqueue worker): it
//! takes requests tagged with a small integer, submits them in batches and
//! hands back completions. Tags are the caller's slot indices, so no engine
//! allocates per request.

#![deny(missing_docs)]

mod aligned;
mod inline;
mod mailbox;
mod null;
mod pool;
mod uring;

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

pub use aligned::{AlignedQueue, Alignment, EdgeLeases};
pub use mailbox::Mailbox;
pub use null::NullQueue;
pub use pool::{PoolQueue, ThreadPool};
pub use uring::{DIRECT_BATCH, UringQueue};

/// One request, as an engine sees it: byte offsets into the target.
#[derive(Clone, Copy, Debug)]
pub enum IoOp {
    /// Read `len` bytes at `offset` into the buffers of `iov`.
    Read {
        /// Byte offset.
        offset: u64,
        /// Total length of the buffers.
        len: u64,
        /// The scatter list.
        iov: IoVecs,
    },
    /// Write `len` bytes at `offset` from the buffers of `iov`.
    Write {
        /// Byte offset.
        offset: u64,
        /// Total length of the buffers.
        len: u64,
        /// The gather list.
        iov: IoVecs,
        /// Complete only once the data is on stable storage (writethrough).
        durable: bool,
    },
    /// Write `len` bytes at `offset` compressed, a backup's `compress`:
    /// whole clusters, which only a qcow2 node stores so; every other
    /// driver and engine fails it with ENOTSUP.
    WriteCompressed {
        /// Byte offset.
        offset: u64,
        /// Total length of the buffers.
        len: u64,
        /// The gather list.
        iov: IoVecs,
    },
    /// Make every completed write durable.
    Flush,
    /// Drop the data of a range; reads of it may then return anything.
    Discard {
        /// Byte offset.
        offset: u64,
        /// Length in bytes.
        len: u64,
    },
    /// Make a range read back as zeroes.
    WriteZeroes {
        /// Byte offset.
        offset: u64,
        /// Length in bytes.
        len: u64,
        /// The range may be deallocated rather than written.
        may_unmap: bool,
        /// Fail with EOPNOTSUPP rather than write zeroes the slow way
        /// (NBD's FAST_ZERO, QEMU's BDRV_REQ_NO_FALLBACK).
        fast: bool,
    },
}

impl IoOp {
    /// The byte range the request touches (offset, length), if any.
    pub fn extent(&self) -> Option<(u64, u64)> {
        match *self {
            IoOp::Read { offset, len, .. }
            | IoOp::Write { offset, len, .. }
            | IoOp::WriteCompressed { offset, len, .. }
            | IoOp::Discard { offset, len }
            | IoOp::WriteZeroes { offset, len, .. } => Some((offset, len)),
            IoOp::Flush => None,
        }
    }
}

/// A borrowed scatter/gather list: a pointer to `count` iovecs.
///
/// It is a raw pointer because the list outlives any borrow the caller
/// could express: it must stay valid until the request completes.
#[derive(Clone, Copy, Debug)]
pub struct IoVecs {
    ptr: *const libc::iovec,
    count: usize,
}

impl IoVecs {
    /// Wraps `count` iovecs at `ptr`.
    ///
    /// # Safety
    /// `ptr` must point to `count` initialised iovecs, and they and the
    /// buffers they name must stay valid until the request using them
    /// completes.
    pub unsafe fn new(ptr: *const libc::iovec, count: usize) -> Self {
        Self { ptr, count }
    }

    /// The iovecs themselves.
    pub fn as_slice(&self) -> &[libc::iovec] {
        if self.count == 0 {
            return &[];
        }
        // SAFETY: `new`'s contract: ptr names `count` live iovecs until the
        // request completes, and requests never outlive their engine call.
        unsafe { std::slice::from_raw_parts(self.ptr, self.count) }
    }

    /// The iovecs covering bytes `pos..pos + len` of the buffers (fewer if
    /// the buffers end first).
    pub fn range(&self, pos: u64, len: u64) -> impl Iterator<Item = libc::iovec> + '_ {
        let (mut skip, mut left) = (pos, len);
        self.as_slice().iter().filter_map(move |v| {
            let iov_len = v.iov_len as u64;
            if skip >= iov_len {
                skip -= iov_len;
                return None;
            }
            let n = (iov_len - skip).min(left);
            if n == 0 {
                return None;
            }
            let out = libc::iovec { iov_base: v.iov_base.wrapping_byte_add(skip as usize), iov_len: n as usize };
            skip = 0;
            left -= n;
            Some(out)
        })
    }

    /// Fills bytes `pos..pos + len` of the buffers from `src` (which holds
    /// `len` bytes), or with zeroes.
    ///
    /// # Safety
    /// The buffers must be valid for writes and not accessed concurrently.
    pub unsafe fn fill(&self, pos: u64, len: u64, src: Option<&[u8]>) {
        let mut done = 0;
        for v in self.range(pos, len) {
            let dst = v.iov_base.cast::<u8>();
            // SAFETY: the caller guarantees the buffers are writable for
            // the lengths the iovecs give; `src` holds `len` bytes.
            unsafe {
                match src {
                    Some(src) => std::ptr::copy_nonoverlapping(src[done..].as_ptr(), dst, v.iov_len),
                    None => std::ptr::write_bytes(dst, 0, v.iov_len),
                }
            }
            done += v.iov_len;
        }
    }

    /// Fills the bytes from `start` to the end of the buffers with zeroes
    /// (the tail of a read that hit the end of the file).
    ///
    /// # Safety
    /// As [`IoVecs::fill`].
    pub unsafe fn zero_from(&self, start: usize) {
        // SAFETY: the caller's guarantee.
        unsafe { self.fill(start as u64, u64::MAX, None) }
    }

    /// Copies bytes `pos..pos + buf.len()` of the buffers into `buf`.
    ///
    /// # Safety
    /// The buffers must be valid for reads until this returns.
    pub unsafe fn copy_out(&self, pos: u64, buf: &mut [u8]) {
        let mut done = 0;
        for v in self.range(pos, buf.len() as u64) {
            // SAFETY: the caller guarantees the buffers are readable for
            // the lengths the iovecs give; `buf` has room for them.
            unsafe { std::ptr::copy_nonoverlapping(v.iov_base.cast::<u8>(), buf[done..].as_mut_ptr(), v.iov_len) };
            done += v.iov_len;
        }
    }
}

impl Default for IoVecs {
    /// No buffers, for requests that carry no data.
    fn default() -> Self {
        Self { ptr: std::ptr::null(), count: 0 }
    }
}

// SAFETY: IoVecs is only a description of buffers; the caller of
// `IoVecs::new` guarantees they stay valid for the request's lifetime,
// whichever thread performs it.
unsafe impl Send for IoVecs {}

/// The outcome of one request: `Ok` or the errno it failed with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Completion {
    /// The tag the request was pushed with.
    pub tag: u32,
    /// 0 on success, else a positive errno.
    pub errno: i32,
}

/// A per-thread channel to an I/O engine.
///
/// Contract: the owner pushes at most `depth` requests (the depth given when
/// the queue was created) that have not been reaped yet, each with a tag
/// below `depth` that is not in flight. Pushed requests may wait until
/// [`IoQueue::submit`]; completions are collected with [`IoQueue::reap`].
/// Dropping a queue waits for the requests in flight.
pub trait IoQueue: Send {
    /// Queues one request.
    ///
    /// # Safety
    /// For reads and writes, the buffers `op` names must stay valid until
    /// the completion with `tag` has been reaped (see [`IoVecs::new`]).
    unsafe fn push(&mut self, tag: u32, op: IoOp);

    /// Hands every pushed request to the engine, with one system call at most.
    fn submit(&mut self) -> io::Result<()>;

    /// Appends the completions that are ready to `out` without blocking.
    fn reap(&mut self, out: &mut Vec<Completion>);

    /// Blocks until at least one completion may be ready.
    fn wait(&mut self) -> io::Result<()>;

    /// A descriptor that becomes readable when completions may be ready, if
    /// the engine completes asynchronously. [`IoQueue::rearm`] makes it
    /// unreadable again.
    ///
    /// Requests that complete within [`IoQueue::submit`] (inline, on the
    /// caller's thread) do not make it readable: after a submit, reap
    /// before waiting on it. A queue stacked on others that submits to
    /// them inside its own `reap` reaps them again before it returns.
    fn notify_fd(&self) -> Option<BorrowedFd<'_>>;

    /// Consumes the readiness of [`IoQueue::notify_fd`] after it woke the
    /// owner. By default it reads the descriptor's 8-byte counter (an
    /// eventfd or timerfd); queues stacked on other queues re-arm those.
    fn rearm(&mut self) {
        if let Some(fd) = self.notify_fd()
            && let Err(e) = vsd_sys::read_counter(fd)
        {
            log::warn!("cannot read an I/O completion counter: {e}");
        }
    }

    /// The most requests the owner should push between two submits. No
    /// limit by default (one submit per batch); an engine whose device
    /// serves long bursts slower asks for less (see [`crate::UringQueue`]).
    fn max_batch(&self) -> usize {
        usize::MAX
    }

    /// How many pushed requests the queue holds back on purpose (a
    /// throttle's, waiting for their turn): no engine works on them, so
    /// they give the owner no reason not to poll.
    fn held(&self) -> usize {
        0
    }

    /// How many times the queue has entered the kernel to submit or wait
    /// (`io_uring_enter`), for the events-per-I/O statistics.
    fn kernel_entries(&self) -> u64 {
        0
    }
}

/// Implements, inside an `impl IoQueue` of a queue that wraps another in
/// its field `$inner`, the methods it passes on unchanged:
/// `forward_to_inner!(inner: notify_fd, rearm, max_batch, held, kernel_entries);`
#[macro_export]
macro_rules! forward_to_inner {
    ($inner:ident: $($method:ident),+ $(,)?) => {
        $($crate::forward_to_inner!(@ $inner $method);)+
    };
    (@ $inner:ident submit) => {
        fn submit(&mut self) -> ::std::io::Result<()> {
            self.$inner.submit()
        }
    };
    (@ $inner:ident reap) => {
        fn reap(&mut self, out: &mut ::std::vec::Vec<$crate::Completion>) {
            self.$inner.reap(out)
        }
    };
    (@ $inner:ident wait) => {
        fn wait(&mut self) -> ::std::io::Result<()> {
            self.$inner.wait()
        }
    };
    (@ $inner:ident notify_fd) => {
        fn notify_fd(&self) -> Option<::std::os::fd::BorrowedFd<'_>> {
            self.$inner.notify_fd()
        }
    };
    (@ $inner:ident rearm) => {
        fn rearm(&mut self) {
            self.$inner.rearm()
        }
    };
    (@ $inner:ident max_batch) => {
        fn max_batch(&self) -> usize {
            self.$inner.max_batch()
        }
    };
    (@ $inner:ident held) => {
        fn held(&self) -> usize {
            self.$inner.held()
        }
    };
    (@ $inner:ident kernel_entries) => {
        fn kernel_entries(&self) -> u64 {
            self.$inner.kernel_entries()
        }
    };
}

/// Waits for every request `queue` has in flight and reaps it, as an
/// engine does before it drops: the kernel or the engine's threads may
/// still write into their buffers, which the owner frees next.
pub fn drain<Q: IoQueue>(queue: &mut Q, in_flight: impl Fn(&Q) -> usize) {
    let mut sink = Vec::new();
    while in_flight(queue) > 0 {
        if queue.wait().is_err() {
            break;
        }
        queue.reap(&mut sink);
        sink.clear();
    }
}

/// Borrows the descriptor of an owner that keeps it open (vmm-sys-util's
/// EventFd and TimerFd implement `AsRawFd` but not `AsFd`).
fn borrow_fd<T: AsRawFd>(owner: &T) -> BorrowedFd<'_> {
    // SAFETY: the owner holds the descriptor open for as long as it lives,
    // and the borrow cannot outlive the owner.
    unsafe { BorrowedFd::borrow_raw(owner.as_raw_fd()) }
}

/// Whether `[offset, offset + len)` lies inside a target of `size` bytes.
pub fn range_ok(offset: u64, len: u64, size: u64) -> bool {
    offset.checked_add(len).is_some_and(|end| end <= size)
}

/// Runs one request synchronously on `fd`: the thread pool's worker body,
/// and the fallback chain for zeroing that io_uring cannot express alone.
fn run_sync(fd: std::os::fd::BorrowedFd<'_>, op: IoOp) -> io::Result<()> {
    use vsd_sys::falloc;
    match op {
        IoOp::Read { offset, len, iov } => {
            let done = transfer(iov, len, |done, rest| {
                // SAFETY: IoOp's contract: the buffers stay valid and
                // writable until this request completes.
                unsafe { vsd_sys::preadv2(fd, rest, offset + done, 0) }
            })?;
            // SAFETY: as above; the tail past the end of file reads as zeroes.
            unsafe { iov.zero_from(done as usize) };
            Ok(())
        }
        IoOp::Write { offset, len, iov, durable } => {
            let flags = if durable { libc::RWF_DSYNC } else { 0 };
            let done = transfer(iov, len, |done, rest| {
                // SAFETY: IoOp's contract: the buffers stay valid until this
                // request completes.
                unsafe { vsd_sys::pwritev2(fd, rest, offset + done, flags) }
            })?;
            if done < len { Err(io::Error::from_raw_os_error(libc::ENOSPC)) } else { Ok(()) }
        }
        IoOp::WriteCompressed { .. } => Err(io::Error::from_raw_os_error(libc::ENOTSUP)),
        IoOp::Flush => vsd_sys::fdatasync(fd),
        IoOp::Discard { offset, len } => vsd_sys::fallocate(fd, falloc::PUNCH_HOLE, offset, len),
        IoOp::WriteZeroes { offset, len, may_unmap, fast } => zero_range(fd, offset, len, may_unmap, fast),
    }
}

/// Zeroes a range the cheapest way the file system allows, falling back
/// as QEMU's file driver does: ZERO_RANGE, then PUNCH_HOLE (re-allocated if
/// unmapping is not allowed), then, unless `fast`, writing zeroes.
fn zero_range(fd: std::os::fd::BorrowedFd<'_>, offset: u64, len: u64, may_unmap: bool, fast: bool) -> io::Result<()> {
    use vsd_sys::falloc;
    let unsupported = |e: &io::Error| e.raw_os_error() == Some(libc::EOPNOTSUPP);
    match vsd_sys::fallocate(fd, falloc::ZERO_RANGE, offset, len) {
        Err(e) if unsupported(&e) => {}
        other => return other,
    }
    match vsd_sys::fallocate(fd, falloc::PUNCH_HOLE, offset, len) {
        Ok(()) if may_unmap => return Ok(()),
        Ok(()) => return vsd_sys::fallocate(fd, falloc::ALLOCATE, offset, len),
        Err(e) if unsupported(&e) && !fast => {}
        Err(e) => return Err(e),
    }
    write_zeroes_slowly(fd, offset, len)
}

fn write_zeroes_slowly(fd: std::os::fd::BorrowedFd<'_>, offset: u64, len: u64) -> io::Result<()> {
    const CHUNK: usize = 1 << 20;
    let zeroes = vec![0u8; CHUNK.min(len as usize)];
    let mut done = 0;
    while done < len {
        let n = (len - done).min(CHUNK as u64) as usize;
        let iov = [libc::iovec { iov_base: zeroes.as_ptr() as *mut _, iov_len: n }];
        // SAFETY: iov names `zeroes`, a live buffer of at least n bytes.
        let written = unsafe { vsd_sys::pwritev2(fd, &iov, offset + done, 0) }?;
        if written == 0 {
            return Err(io::Error::from_raw_os_error(libc::ENOSPC));
        }
        done += written as u64;
    }
    Ok(())
}

/// Repeats a vectored transfer until `len` bytes moved or the file ended
/// (a 0-byte transfer); returns the bytes moved.
fn transfer(iov: IoVecs, len: u64, mut step: impl FnMut(u64, &[libc::iovec]) -> io::Result<usize>) -> io::Result<u64> {
    let mut done = 0u64;
    // The remaining list is only built after a short transfer, which is rare.
    let mut rest: Option<Vec<libc::iovec>> = None;
    while done < len {
        let list = rest.as_deref().unwrap_or(iov.as_slice());
        match step(done, list) {
            Ok(0) => break,
            Ok(n) => {
                done += n as u64;
                if done < len {
                    rest = Some(iov.range(done, u64::MAX).collect());
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn range_check_catches_overflow_and_end() {
        assert!(range_ok(0, 4096, 4096));
        assert!(!range_ok(1, 4096, 4096));
        assert!(!range_ok(u64::MAX, 2, u64::MAX));
        assert!(range_ok(4096, 0, 4096));
    }

    #[test]
    fn ranges_split_inside_buffers() {
        let mut a = [0u8; 10];
        let mut b = [0u8; 6];
        let list = [
            libc::iovec { iov_base: a.as_mut_ptr().cast(), iov_len: 10 },
            libc::iovec { iov_base: b.as_mut_ptr().cast(), iov_len: 6 },
        ];
        // SAFETY: `list` names `a` and `b`, which outlive `iov`.
        let iov = unsafe { IoVecs::new(list.as_ptr(), 2) };
        let rest: Vec<_> = iov.range(12, u64::MAX).collect();
        assert_eq!(rest.len(), 1);
        assert_eq!(rest[0].iov_len, 4);
        assert_eq!(rest[0].iov_base, b.as_mut_ptr().wrapping_add(2).cast());
        let middle: Vec<_> = iov.range(8, 4).map(|v| v.iov_len).collect();
        assert_eq!(middle, [2, 2]);
        // SAFETY: the buffers are live locals, written by nobody else.
        unsafe { iov.fill(8, 4, Some(&[1, 2, 3, 4])) };
        assert_eq!((&a[8..], &b[..2]), (&[1u8, 2][..], &[3u8, 4][..]));
        let mut out = [0u8; 3];
        // SAFETY: as above.
        unsafe { iov.copy_out(9, &mut out) };
        assert_eq!(out, [2, 3, 4]);
    }
}
