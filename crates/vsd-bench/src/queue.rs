//! One virtqueue: blocking request helpers for tests, and the submit/reap
//! primitives the benchmark engine uses.
//!
//! Completion waiting uses `blkioq_do_io()` (`Blkioq::do_io`) with
//! `min_completions >= 1` and a timeout, which libblkio documents as the way
//! to block until requests complete: on interrupt queues it enables the
//! completion fd (used-buffer notifications) and `ppoll`s it, on poll queues
//! it busy-polls the used ring. The completion fd itself is meant for
//! applications that integrate queues into an event loop, which we do not
//! need since each queue is owned by one thread.

use std::ffi::CStr;
use std::mem::MaybeUninit;
use std::time::Duration;

use blkio::{Blkioq, Completion, Errno, ReqFlags};

use crate::buffer::{Buffer, SharedBlkio};
use crate::device::DeviceInfo;
use crate::error::{Error, Op, Result, errno_text};

/// `user_data` of requests submitted by the blocking helpers (one at a
/// time, so the first token of a batch of one).
const BLOCKING_TOKEN: usize = 0;

/// Smallest bounce buffer allocated, so small requests do not remap memory.
const MIN_BOUNCE_LEN: usize = 64 * 1024;

/// A reaped completion: the submitter's token and libblkio's `ret`
/// (0 or a negative errno).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Reaped {
    pub(crate) token: usize,
    pub(crate) ret: i32,
}

/// One request of a batch ([`Queue::run_batch`]); offsets and lengths in
/// bytes.
#[derive(Clone, Copy, Debug)]
pub enum BatchOp<'a> {
    /// Write these bytes at this offset.
    Write(u64, &'a [u8]),
    /// Zero this many bytes at this offset (the device may unmap them).
    WriteZeroes(u64, u64),
    /// Read this many bytes at this offset (the data is not kept).
    Read(u64, u64),
    /// Flush the device's write cache.
    Flush,
}

impl BatchOp<'_> {
    /// The request's kind, offset and length, as errors name them.
    fn describe(&self) -> (Op, u64, u64) {
        match *self {
            BatchOp::Write(offset, src) => (Op::Write, offset, src.len() as u64),
            BatchOp::WriteZeroes(offset, len) => (Op::WriteZeroes, offset, len),
            BatchOp::Read(offset, len) => (Op::Read, offset, len),
            BatchOp::Flush => (Op::Flush, 0, 0),
        }
    }
}

/// A request's status and libblkio's error message.
type Outcome = (i32, Option<String>);

/// One virtqueue of a [`crate::Client`], owned by one thread at a time.
///
/// The blocking helpers submit one request, wait up to [`Queue::timeout`]
/// for its completion and turn a failed status into [`Error::Request`].
/// Offsets and lengths are in bytes; libblkio itself requires multiples of
/// 512, everything else (alignment to the logical block size, ranges beyond
/// the capacity) is checked by the device.
pub struct Queue {
    index: usize,
    blkioq: Blkioq,
    poll: bool,
    timeout: Duration,
    broken: bool,
    completions: Box<[MaybeUninit<Completion>]>,
    reaped: usize,
    bounce: Option<Buffer>,
    blkio: SharedBlkio,
}

impl Queue {
    pub(crate) fn new(
        index: usize,
        blkioq: Blkioq,
        blkio: &SharedBlkio,
        info: &DeviceInfo,
        timeout: Duration,
    ) -> Queue {
        let slots = usize::try_from(info.queue_size).unwrap_or(1).max(1);
        Queue {
            index,
            blkioq,
            poll: info.poll_queues,
            timeout,
            broken: false,
            completions: std::iter::repeat_with(MaybeUninit::uninit).take(slots).collect(),
            reaped: 0,
            bounce: None,
            blkio: SharedBlkio::clone(blkio),
        }
    }

    /// Index of the queue within its client.
    pub fn index(&self) -> usize {
        self.index
    }

    /// Whether this is a libblkio poll queue.
    pub fn is_poll(&self) -> bool {
        self.poll
    }

    /// How long the blocking helpers wait for a completion.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Changes how long the blocking helpers wait for a completion.
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// Whether an earlier timeout or libblkio failure made the queue
    /// unusable.
    pub fn is_broken(&self) -> bool {
        self.broken
    }

    /// Allocates a zeroed buffer of `len` bytes mapped into the back-end.
    pub fn alloc_buffer(&self, len: usize) -> Result<Buffer> {
        Buffer::alloc(&self.blkio, len)
    }

    /// Reads `dst.len()` bytes at `offset` into `dst`.
    pub fn read_at(&mut self, offset: u64, dst: &mut [u8]) -> Result<()> {
        let len = dst.len();
        let mut bounce = self.take_bounce(len)?;
        let ptr = bounce.as_mut_ptr();
        let result =
            self.run(Op::Read, offset, len as u64, |q| q.read(offset, ptr, len, BLOCKING_TOKEN, ReqFlags::empty()));
        if result.is_ok() {
            dst.copy_from_slice(&bounce[..len]);
        }
        self.return_bounce(bounce);
        result
    }

    /// Writes `src` at `offset`.
    pub fn write_at(&mut self, offset: u64, src: &[u8]) -> Result<()> {
        self.write_with_flags(offset, src, ReqFlags::empty())
    }

    /// Writes `src` at `offset` with FUA semantics (libblkio emulates FUA on
    /// virtio-blk by following the write with a flush).
    pub fn write_at_fua(&mut self, offset: u64, src: &[u8]) -> Result<()> {
        self.write_with_flags(offset, src, ReqFlags::FUA)
    }

    /// Reads `buf.len()` bytes at `offset` straight into `buf` (zero-copy).
    pub fn read_buf(&mut self, offset: u64, buf: &mut Buffer) -> Result<()> {
        let (ptr, len) = (buf.as_mut_ptr(), buf.len());
        self.run(Op::Read, offset, len as u64, |q| q.read(offset, ptr, len, BLOCKING_TOKEN, ReqFlags::empty()))
    }

    /// Writes all of `buf` at `offset` (zero-copy).
    pub fn write_buf(&mut self, offset: u64, buf: &Buffer) -> Result<()> {
        let (ptr, len) = (buf.as_ptr(), buf.len());
        self.run(Op::Write, offset, len as u64, |q| q.write(offset, ptr, len, BLOCKING_TOKEN, ReqFlags::empty()))
    }

    /// Flushes the device's write cache (completes immediately, without a
    /// request, if the device does not offer `VIRTIO_BLK_F_FLUSH`).
    pub fn flush(&mut self) -> Result<()> {
        self.run(Op::Flush, 0, 0, |q| q.flush(BLOCKING_TOKEN, ReqFlags::empty()))
    }

    /// Discards `len` bytes at `offset`.
    pub fn discard(&mut self, offset: u64, len: u64) -> Result<()> {
        self.run(Op::Discard, offset, len, |q| q.discard(offset, len, BLOCKING_TOKEN, ReqFlags::empty()))
    }

    /// Zeroes `len` bytes at `offset`; with `no_unmap` the device must keep
    /// the range allocated (the virtio-blk `UNMAP` flag is cleared).
    pub fn write_zeroes(&mut self, offset: u64, len: u64, no_unmap: bool) -> Result<()> {
        let flags = if no_unmap { ReqFlags::NO_UNMAP } else { ReqFlags::empty() };
        self.run(Op::WriteZeroes, offset, len, |q| q.write_zeroes(offset, len, BLOCKING_TOKEN, flags))
    }

    fn write_with_flags(&mut self, offset: u64, src: &[u8], flags: ReqFlags) -> Result<()> {
        let len = src.len();
        let mut bounce = self.take_bounce(len)?;
        bounce[..len].copy_from_slice(src);
        let ptr = bounce.as_ptr();
        let result = self.run(Op::Write, offset, len as u64, |q| q.write(offset, ptr, len, BLOCKING_TOKEN, flags));
        self.return_bounce(bounce);
        result
    }

    /// Submits every request of `batch` at once and waits for them all, so
    /// that they are in flight together (as a guest's are at depth); fails
    /// naming the first one that failed, in `batch` order. Returns the
    /// requests' indexes in `batch` in the order they completed.
    pub fn run_batch(&mut self, batch: &[BatchOp<'_>]) -> Result<Vec<usize>> {
        let bytes = |op: &BatchOp<'_>| match *op {
            BatchOp::Write(_, src) => src.len(),
            BatchOp::Read(_, len) => len as usize,
            _ => 0,
        };
        let mut bounce = self.take_bounce(batch.iter().map(bytes).sum())?;
        let mut at = 0;
        for (token, op) in batch.iter().enumerate() {
            match *op {
                BatchOp::Write(offset, src) => {
                    bounce[at..at + src.len()].copy_from_slice(src);
                    self.blkioq.write(offset, bounce[at..].as_ptr(), src.len(), token, ReqFlags::empty());
                }
                BatchOp::WriteZeroes(offset, len) => self.blkioq.write_zeroes(offset, len, token, ReqFlags::empty()),
                BatchOp::Read(offset, len) => {
                    self.blkioq.read(offset, bounce[at..].as_mut_ptr(), len as usize, token, ReqFlags::empty());
                }
                BatchOp::Flush => self.blkioq.flush(token, ReqFlags::empty()),
            }
            at += bytes(op);
        }
        let outcome = self.wait_in_order(Op::Write, batch.len());
        self.return_bounce(bounce);
        let (done, order) = outcome?;
        for (op, (ret, message)) in batch.iter().zip(done) {
            let (kind, offset, len) = op.describe();
            completion_result(kind, offset, len, ret, message)?;
        }
        Ok(order)
    }

    /// Reads each `(offset, buffer)` of `reads`, all submitted at once so
    /// that they are in flight together; fails naming the first that
    /// failed, in `reads` order.
    pub fn read_batch(&mut self, reads: &mut [(u64, &mut [u8])]) -> Result<()> {
        let mut bounce = self.take_bounce(reads.iter().map(|(_, dst)| dst.len()).sum())?;
        let mut at = 0;
        for (token, (offset, dst)) in reads.iter().enumerate() {
            self.blkioq.read(*offset, bounce[at..].as_mut_ptr(), dst.len(), token, ReqFlags::empty());
            at += dst.len();
        }
        let outcome = self.wait_for(Op::Read, reads.len());
        let mut at = 0;
        for (_, dst) in reads.iter_mut() {
            dst.copy_from_slice(&bounce[at..at + dst.len()]);
            at += dst.len();
        }
        self.return_bounce(bounce);
        for ((offset, dst), (ret, message)) in reads.iter().zip(outcome?) {
            completion_result(Op::Read, *offset, dst.len() as u64, ret, message)?;
        }
        Ok(())
    }

    /// Submits one request with `submit`, waits for it and maps its status.
    fn run(&mut self, op: Op, offset: u64, len: u64, submit: impl FnOnce(&mut Blkioq)) -> Result<()> {
        self.ensure_usable()?;
        submit(&mut self.blkioq);
        let (ret, message) = self.wait_for(op, 1)?.remove(0);
        completion_result(op, offset, len, ret, message)
    }

    /// Waits for the `n` requests submitted with tokens `0..n` (`op` names
    /// them in errors); returns each one's `ret` and libblkio's message, by
    /// token. Any failure to wait leaves the queue broken.
    fn wait_for(&mut self, op: Op, n: usize) -> Result<Vec<Outcome>> {
        self.wait_in_order(op, n).map(|(done, _)| done)
    }

    /// [`Queue::wait_for`], and the tokens in the order they completed.
    fn wait_in_order(&mut self, op: Op, n: usize) -> Result<(Vec<Outcome>, Vec<usize>)> {
        let mut done = vec![None; n];
        let mut order = Vec::with_capacity(n);
        let mut pending = n;
        while pending > 0 {
            let reaped = match self.reap(1, Some(self.timeout)) {
                Ok(reaped) => reaped,
                Err(e) => {
                    self.broken = true;
                    return Err(match e.errno() {
                        Errno::TIME => Error::Timeout { op, queue: self.index, timeout: self.timeout },
                        _ => Error::setup(format!("waiting for a {op} on queue {}", self.index), &e),
                    });
                }
            };
            for i in 0..reaped {
                let Some(Reaped { token, ret }) = self.completion(i) else { continue };
                match done.get_mut(token) {
                    Some(slot @ None) => {
                        *slot = Some((ret, self.error_message(i)));
                        order.push(token);
                    }
                    // A completion nobody waits for: the ring cannot be trusted.
                    _ => {
                        self.broken = true;
                        return Err(Error::QueueBroken(self.index));
                    }
                }
                pending -= 1;
            }
        }
        Ok((done.into_iter().flatten().collect(), order))
    }

    fn ensure_usable(&self) -> Result<()> {
        if self.broken { Err(Error::QueueBroken(self.index)) } else { Ok(()) }
    }

    /// Takes the bounce buffer out of the queue, growing it to `len` bytes.
    fn take_bounce(&mut self, len: usize) -> Result<Buffer> {
        self.ensure_usable()?;
        match self.bounce.take() {
            Some(buf) if buf.len() >= len => Ok(buf),
            _ => Buffer::alloc(&self.blkio, len.max(MIN_BOUNCE_LEN)),
        }
    }

    /// Puts the bounce buffer back unless a request using it may still be in
    /// flight.
    fn return_bounce(&mut self, bounce: Buffer) {
        if self.broken {
            bounce.abandon();
        } else {
            self.bounce = Some(bounce);
        }
    }

    /// Enqueues a read into `buf[..len]`; the memory must stay mapped until
    /// the completion carrying `token` is reaped. Sent on the next `reap`.
    pub(crate) fn submit_read(&mut self, offset: u64, buf: *mut u8, len: usize, token: usize) {
        self.blkioq.read(offset, buf, len, token, ReqFlags::empty());
    }

    /// Enqueues a write from `buf[..len]`; same contract as `submit_read`.
    pub(crate) fn submit_write(&mut self, offset: u64, buf: *const u8, len: usize, token: usize) {
        self.blkioq.write(offset, buf, len, token, ReqFlags::empty());
    }

    /// Submits what was enqueued and reaps completions, waiting for at least
    /// `min` of them for at most `timeout` (`None`: forever). Returns how
    /// many were reaped; read them with [`Queue::completion`]. Retries when a
    /// signal interrupts the wait.
    pub(crate) fn reap(&mut self, min: usize, timeout: Option<Duration>) -> std::result::Result<usize, blkio::Error> {
        self.reaped = 0;
        let mut remaining = timeout;
        loop {
            let result = self.blkioq.do_io(&mut self.completions, min, remaining.as_mut(), None);
            match result {
                Err(e) if e.errno() == Errno::INTR && remaining != Some(Duration::ZERO) => {}
                Ok(n) => {
                    self.reaped = n;
                    return Ok(n);
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// The `i`-th completion of the last [`Queue::reap`].
    pub(crate) fn completion(&self, i: usize) -> Option<Reaped> {
        self.reaped_completion(i).map(|c| Reaped { token: c.user_data, ret: c.ret })
    }

    /// Marks the queue unusable, e.g. after the bench gave up waiting.
    pub(crate) fn mark_broken(&mut self) {
        self.broken = true;
    }

    fn reaped_completion(&self, i: usize) -> Option<&Completion> {
        if i >= self.reaped {
            return None;
        }
        let slot = self.completions.get(i)?;
        // SAFETY: do_io() returned `self.reaped` and initialised that many
        // leading elements of `self.completions`; `i < self.reaped`.
        Some(unsafe { slot.assume_init_ref() })
    }

    /// libblkio's message for the `i`-th completion if it failed the request
    /// locally.
    fn error_message(&self, i: usize) -> Option<String> {
        let ptr = self.reaped_completion(i)?.error_msg;
        if ptr.is_null() {
            return None;
        }
        // SAFETY: libblkio sets `error_msg` either to null or to a
        // NUL-terminated string with static lifetime (`cstr!` literals).
        let msg = unsafe { CStr::from_ptr(ptr) };
        Some(msg.to_string_lossy().into_owned())
    }
}

/// Maps a completion's `ret` to the helpers' result.
fn completion_result(op: Op, offset: u64, len: u64, ret: i32, msg: Option<String>) -> Result<()> {
    if ret >= 0 {
        return Ok(());
    }
    let errno = ret.saturating_neg();
    Err(Error::Request { op, offset, len, errno, message: msg.unwrap_or_else(|| errno_text(errno)) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_completion_status() {
        assert!(completion_result(Op::Read, 0, 512, 0, None).is_ok());
        let err = completion_result(Op::Write, 4096, 512, -libc::EIO, None).expect_err("negative ret is an error");
        assert_eq!(err.errno(), libc::EIO);
        assert!(err.to_string().contains("write at offset 4096"));
        let err = completion_result(Op::Write, 0, 512, -libc::EBADF, Some("device is read-only".into()))
            .expect_err("negative ret is an error");
        assert!(err.to_string().contains("device is read-only"));
    }
}
