//! Completing requests on the queue's own thread, where that cannot block
//! for long, instead of handing them to another thread.
//!
//! A hand-off costs wake-ups across threads, 25-30 µs each on small VMs:
//! far more than a read or write of data already in memory. Which requests
//! qualify depends on where the file's data lives:
//! - **in memory** (tmpfs, ramfs, hugetlbfs): every read and plain write.
//!   These file systems do not take `RWF_NOWAIT` (io_uring then sends each
//!   request to a kernel worker thread), but they never wait for a device;
//! - **a disk, buffered**: reads and plain writes tried with `RWF_NOWAIT`,
//!   which fails with EAGAIN where the call would block (uncached data,
//!   locks, block allocation): only those are handed over;
//! - **O_DIRECT**: none, as every transfer waits for the device.
//!
//! io_uring makes the `RWF_NOWAIT` attempt itself, inside `io_uring_enter`,
//! on file systems that take it: its engine completes inline only the
//! requests of in-memory files.
//!
//! Durable (writethrough) writes, flushes, discards and zeroing always go
//! to the engine.

use std::io;
use std::os::fd::BorrowedFd;

use vsd_sys::Residence;

use crate::{IoOp, run_sync};

/// How one kind of transfer is tried inline.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Never,
    /// With `RWF_NOWAIT`, falling back to the engine.
    NoWait,
    /// With a plain (blocking) call, whose outcome is final.
    Always,
}

/// Which requests of one file are completed inline.
#[derive(Debug)]
pub(crate) struct Inline {
    reads: Mode,
    writes: Mode,
}

impl Inline {
    /// The policy of a thread-pool engine on a file living at `place`.
    pub(crate) fn for_threads(place: Residence) -> Self {
        Self::for_file(place, Mode::NoWait)
    }

    /// The policy of an io_uring engine on a file living at `place`.
    pub(crate) fn for_ring(place: Residence) -> Self {
        Self::for_file(place, Mode::Never)
    }

    /// The policy for a file living at `place`; `buffered` is the mode for
    /// files in the page cache of a disk.
    fn for_file(place: Residence, buffered: Mode) -> Self {
        let mode = match place {
            _ if place.direct => Mode::Never,
            _ if place.in_memory => Mode::Always,
            _ => buffered,
        };
        Self { reads: mode, writes: mode }
    }

    /// Whether `op` is of a kind that may complete inline.
    pub(crate) fn may_take(&self, op: &IoOp) -> bool {
        match op {
            IoOp::Read { .. } => self.reads != Mode::Never,
            IoOp::Write { durable: false, .. } => self.writes != Mode::Never,
            // A file stores nothing compressed: refused here, never queued.
            IoOp::WriteCompressed { .. } => true,
            _ => false,
        }
    }

    /// Whether any request may complete inline.
    pub(crate) fn enabled(&self) -> bool {
        self.reads != Mode::Never || self.writes != Mode::Never
    }

    /// Completes `op` on `fd` if it qualifies: its errno (0 for success),
    /// or `None` if it is the engine's to do.
    pub(crate) fn complete(&mut self, fd: BorrowedFd<'_>, op: IoOp) -> Option<i32> {
        let mode = match op {
            IoOp::Read { .. } => &mut self.reads,
            IoOp::Write { durable: false, .. } => &mut self.writes,
            IoOp::WriteCompressed { .. } => return Some(libc::ENOTSUP),
            _ => return None,
        };
        match *mode {
            Mode::Never => None,
            Mode::Always => Some(run_sync(fd, op).err().map_or(0, |e| e.raw_os_error().unwrap_or(libc::EIO))),
            Mode::NoWait => match transfer_whole_nowait(fd, op) {
                Ok(true) => Some(0),
                Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => {
                    *mode = Mode::Never;
                    None
                }
                // EAGAIN, a short transfer (uncached pages, the end of the
                // file) or an error: the engine redoes the whole request
                // and has the last word.
                _ => None,
            },
        }
    }
}

/// One `RWF_NOWAIT` read or write of `op`: whether it moved all its bytes.
fn transfer_whole_nowait(fd: BorrowedFd<'_>, op: IoOp) -> io::Result<bool> {
    let flags = libc::RWF_NOWAIT;
    let (moved, len) = match op {
        IoOp::Read { offset, len, iov } => {
            // SAFETY: IoOp's contract: the buffers stay valid and writable
            // until the request completes, which it has not yet.
            (unsafe { vsd_sys::preadv2(fd, iov.as_slice(), offset, flags) }?, len)
        }
        IoOp::Write { offset, len, iov, .. } => {
            // SAFETY: IoOp's contract: the buffers stay valid until the
            // request completes, which it has not yet.
            (unsafe { vsd_sys::pwritev2(fd, iov.as_slice(), offset, flags) }?, len)
        }
        _ => return Ok(false),
    };
    Ok(moved as u64 == len)
}
