//! One thread's queue of requests to a remote export.
//!
//! A request becomes one NBD command or several (a read or write longer
//! than the server's largest payload, a zeroing or trim longer than a
//! 32-bit length); the queue counts the parts of each request and
//! completes it when the last part is back, with the first error any part
//! met.

use std::io;
use std::os::fd::BorrowedFd;
use std::sync::Arc;

use vsd_engine::{Completion, IoOp, IoQueue, IoVecs, Mailbox};
use vsd_nbd_proto::{cmd, cmd_flag, tx_flag};

use crate::link::{Command, Data, Shared};

/// The longest trim or zeroing sent as one command: a power of two, so
/// aligned to any block size, below 32 bits.
const MAX_RANGE: u64 = 1 << 31;
/// The longest write of zeroes for a server without WRITE_ZEROES.
const MAX_ZERO_WRITE: u64 = 1 << 20;

/// Per tag: parts not back yet, and the first error.
#[derive(Clone, Copy, Default)]
struct Slot {
    parts: u32,
    errno: i32,
}

/// A queue of at most `depth` requests to a remote export, for one thread.
pub struct NbdQueue {
    shared: Arc<Shared>,
    mailbox: Arc<Mailbox>,
    slots: Box<[Slot]>,
    /// Pushed, not yet handed to the connection's thread.
    staged: Vec<Command>,
    /// Finished without the server, not reaped yet.
    answered: Vec<Completion>,
    posted: Vec<Completion>,
    /// Parts with the server.
    outstanding: usize,
    /// Pushed and not reaped.
    in_flight: usize,
}

impl NbdQueue {
    pub(crate) fn new(shared: Arc<Shared>, depth: u16) -> io::Result<Self> {
        let depth = usize::from(depth.max(1));
        shared.join();
        Ok(Self {
            shared,
            mailbox: Arc::new(Mailbox::new(depth)?),
            slots: vec![Slot::default(); depth].into_boxed_slice(),
            staged: Vec::with_capacity(depth),
            answered: Vec::with_capacity(depth),
            posted: Vec::with_capacity(depth),
            outstanding: 0,
            in_flight: 0,
        })
    }

    /// Splits `[offset, offset + len)` into commands of at most `max` bytes.
    fn split(&mut self, tag: u32, kind: u16, flags: u16, (offset, len): (u64, u64), max: u64, data: Option<IoVecs>) {
        let export = self.shared.export;
        let then_flush = kind == cmd::WRITE && flags & cmd_flag::FUA != 0 && !export.has(tx_flag::SEND_FUA);
        let flags = if then_flush { flags & !cmd_flag::FUA } else { flags };
        let mut pos = 0;
        while pos < len {
            let n = (len - pos).min(max);
            let data = match data {
                Some(iov) => Data::Buffers { iov, pos },
                None if kind == cmd::WRITE => Data::Zeroes,
                None => Data::None,
            };
            let (mailbox, offset, len) = (self.mailbox.clone(), offset + pos, n as u32);
            self.staged.push(Command { mailbox, tag, kind, flags, offset, len, data, then_flush });
            self.slots[tag as usize].parts += 1;
            pos += n;
        }
    }

    /// One command with no range.
    fn whole(&mut self, tag: u32, kind: u16) {
        let mailbox = self.mailbox.clone();
        self.staged.push(Command {
            mailbox,
            tag,
            kind,
            flags: 0,
            offset: 0,
            len: 0,
            data: Data::None,
            then_flush: false,
        });
        self.slots[tag as usize].parts += 1;
    }
}

impl IoQueue for NbdQueue {
    unsafe fn push(&mut self, tag: u32, op: IoOp) {
        assert!(self.in_flight < self.slots.len(), "more requests than the queue depth");
        self.in_flight += 1;
        self.slots[tag as usize] = Slot::default();
        let export = self.shared.export;
        let size = export.size;
        let max_payload = u64::from(export.max_payload);
        let has = |flag| export.has(flag);
        // What the request completes with if it sends no command.
        let mut answer = 0;
        match op {
            IoOp::Read { offset, len, iov } => {
                // Past the end reads as zeroes, as a file does.
                let inside = size.saturating_sub(offset).min(len);
                // SAFETY: the caller keeps the buffers valid and ours.
                unsafe { iov.fill(inside, len - inside, None) };
                self.split(tag, cmd::READ, 0, (offset, inside), max_payload, Some(iov));
            }
            _ if op.extent().is_some_and(|(offset, len)| !vsd_engine::range_ok(offset, len, size)) => {
                answer = libc::EIO
            }
            IoOp::Write { offset, len, iov, durable } => {
                let flags = if durable { cmd_flag::FUA } else { 0 };
                self.split(tag, cmd::WRITE, flags, (offset, len), max_payload, Some(iov));
            }
            IoOp::Flush if has(tx_flag::SEND_FLUSH) => self.whole(tag, cmd::FLUSH),
            IoOp::Discard { offset, len } if has(tx_flag::SEND_TRIM) => {
                self.split(tag, cmd::TRIM, 0, (offset, len), MAX_RANGE, None)
            }
            IoOp::WriteZeroes { fast: true, .. } if !has(tx_flag::SEND_FAST_ZERO) => answer = libc::EOPNOTSUPP,
            IoOp::WriteZeroes { offset, len, may_unmap, fast } if has(tx_flag::SEND_WRITE_ZEROES) => {
                let unmap = if may_unmap { 0 } else { cmd_flag::NO_HOLE };
                let flags = if fast { unmap | cmd_flag::FAST_ZERO } else { unmap };
                self.split(tag, cmd::WRITE_ZEROES, flags, (offset, len), MAX_RANGE, None)
            }
            IoOp::WriteZeroes { offset, len, .. } => {
                self.split(tag, cmd::WRITE, 0, (offset, len), MAX_ZERO_WRITE.min(max_payload), None)
            }
            // A server that cannot flush or trim has nothing to flush, and
            // trims are advisory.
            IoOp::Flush | IoOp::Discard { .. } => {}
            // NBD has no compressed write.
            IoOp::WriteCompressed { .. } => answer = libc::ENOTSUP,
        }
        let slot = &mut self.slots[tag as usize];
        if slot.parts == 0 {
            self.answered.push(Completion { tag, errno: answer });
        }
        self.outstanding += slot.parts as usize;
    }

    fn submit(&mut self) -> io::Result<()> {
        if !self.staged.is_empty() {
            self.shared.send(&mut self.staged);
        }
        Ok(())
    }

    fn reap(&mut self, out: &mut Vec<Completion>) {
        self.in_flight -= self.answered.len();
        out.append(&mut self.answered);
        self.mailbox.take(&mut self.posted);
        for part in self.posted.drain(..) {
            self.outstanding -= 1;
            let slot = &mut self.slots[part.tag as usize];
            if slot.errno == 0 {
                slot.errno = part.errno;
            }
            slot.parts -= 1;
            if slot.parts == 0 {
                self.in_flight -= 1;
                out.push(Completion { tag: part.tag, errno: slot.errno });
            }
        }
    }

    fn wait(&mut self) -> io::Result<()> {
        self.submit()?;
        if self.answered.is_empty() && self.outstanding > 0 {
            self.mailbox.wait();
        }
        Ok(())
    }

    fn notify_fd(&self) -> Option<BorrowedFd<'_>> {
        Some(self.mailbox.notify_fd())
    }
}

impl Drop for NbdQueue {
    fn drop(&mut self) {
        // The connection's thread may still write into the buffers.
        vsd_engine::drain(self, |queue| queue.in_flight);
        self.shared.leave();
    }
}
