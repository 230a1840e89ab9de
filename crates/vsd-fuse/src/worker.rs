//! One reader of the FUSE connection: a thread with a descriptor of its
//! own (the mount's, or a clone of it), a queue of its own on the node,
//! and [`SLOTS`] requests in flight at most, read without blocking while
//! earlier ones are still on the engine.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use vsd_block::{BlockNode, IoOp, IoQueue, IoVecs};
use vsd_trace::{Clock, OpKind, QueueStats};

use crate::proto::{self, Pod, fopen, init, op};
use crate::{MAX_IO, Shared};

/// Requests one reader keeps in flight: the kernel's default for
/// background requests is 12, raised to [`MAX_BACKGROUND`] in `FUSE_INIT`.
pub(crate) const SLOTS: usize = 16;
/// The kernel's limit on asynchronous requests (direct I/O from io_uring
/// or AIO) in flight on the connection.
const MAX_BACKGROUND: u16 = 64;
/// Room before a read's data in a slot's buffer: the request itself, and
/// the rest of a page, so that the data starts page-aligned.
const HEAD_ROOM: usize = 8192;

/// One request's place: its buffer (the request as read, then a read's
/// data) and what its completion answers.
struct Slot {
    buf: Vec<u8>,
    unique: u64,
    reply: Reply,
    kind: Option<OpKind>,
    /// The bytes it moves, for the statistics.
    bytes: u64,
    started: u64,
    iov: libc::iovec,
}

/// What a request on the engine answers when it completes.
#[derive(Clone, Copy)]
enum Reply {
    Empty,
    Read { len: usize },
    Written { len: u32 },
}

pub(crate) struct Worker {
    fd: OwnedFd,
    shared: Arc<Shared>,
    /// The node served, of the generation `generation`, and a queue on it.
    node: Arc<dyn BlockNode>,
    generation: u64,
    queue: Box<dyn IoQueue>,
    slots: Vec<Slot>,
    free: Vec<usize>,
    in_flight: usize,
    pushed: usize,
    /// No more requests are read: the export stops, or the file was
    /// unmounted.
    closing: bool,
    stats: Arc<QueueStats>,
    clock: Clock,
}

impl Worker {
    /// A reader on `fd`, with a queue on the node opened on the calling
    /// thread (engines may bind to their creator).
    pub(crate) fn new(fd: OwnedFd, shared: Arc<Shared>, stats: Arc<QueueStats>) -> io::Result<Self> {
        let (node, generation) = shared.current_node();
        let queue = node.open_uncounted_queue(SLOTS as u16)?;
        let slots = (0..SLOTS)
            .map(|_| Slot {
                // Zeroed allocations this large are mapped lazily: pages
                // are only touched by the requests that need them.
                buf: vec![0; MAX_IO + HEAD_ROOM],
                unique: 0,
                reply: Reply::Empty,
                kind: None,
                bytes: 0,
                started: 0,
                iov: libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 },
            })
            .collect();
        let free = (0..SLOTS).rev().collect();
        let clock = Clock::get();
        shared.reader_started();
        let (in_flight, pushed, closing) = (0, 0, false);
        Ok(Self { fd, shared, node, generation, queue, slots, free, in_flight, pushed, closing, stats, clock })
    }

    /// Serves until the export stops or the file is unmounted; requests
    /// in flight complete first. Asked to stop for a while, it reads no
    /// more, completes what is in flight, and parks.
    pub(crate) fn run(mut self) {
        loop {
            let pausing = self.shared.pausing.load(Ordering::Acquire);
            let received = if self.closing || pausing { false } else { self.receive() };
            let reaped = self.submit_and_reap();
            if self.closing && self.in_flight == 0 {
                return self.shared.reader_ended();
            }
            if pausing && self.in_flight == 0 {
                self.park();
            } else if !received && !reaped {
                self.wait(pausing);
            }
        }
    }

    /// Waits until the readers may go on, with a queue on the node changed
    /// meanwhile, if it was.
    fn park(&mut self) {
        let (node, generation) = self.shared.park();
        if generation == self.generation {
            return;
        }
        match node.open_uncounted_queue(SLOTS as u16) {
            Ok(queue) => (self.node, self.generation, self.queue) = (node, generation, queue),
            Err(e) => {
                log::error!(
                    "FUSE export '{}': cannot open a queue on node '{}': {e}",
                    self.shared.config.id,
                    node.name()
                );
                self.closing = true;
            }
        }
    }

    /// Reads and handles requests while slots are free; true if any came.
    fn receive(&mut self) -> bool {
        let mut any = false;
        while let Some(&index) = self.free.last() {
            let buf = &mut self.slots[index].buf;
            // SAFETY: buf is a live buffer of its length.
            let n = unsafe { libc::read(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
            if n < 0 {
                match io::Error::last_os_error().raw_os_error() {
                    Some(libc::EAGAIN) => break,
                    // Interrupted before it was read: gone.
                    Some(libc::EINTR | libc::ENOENT) => continue,
                    // Every reader sees it; one says it.
                    Some(libc::ENODEV) => {
                        if self.shared.connected.swap(false, Ordering::Relaxed) {
                            log::warn!("FUSE export '{}': the file was unmounted", self.shared.config.id);
                        }
                    }
                    _ => log::error!("FUSE export '{}': {}", self.shared.config.id, io::Error::last_os_error()),
                }
                self.closing = true;
                break;
            }
            self.free.pop();
            any = true;
            self.stats.requests.add(1);
            self.dispatch(index, n as usize);
        }
        any
    }

    fn dispatch(&mut self, index: usize, len: usize) {
        let slot = &mut self.slots[index];
        let Some(header) = proto::InHeader::read(&slot.buf[..len]) else { return self.release(index) };
        slot.unique = header.unique;
        slot.started = self.clock.now();
        slot.kind = None;
        slot.bytes = 0;
        let body_end = len.min(header.len as usize);
        let at = size_of::<proto::InHeader>().min(body_end);
        let body = &slot.buf[at..body_end];
        let (shared, node) = (&*self.shared, &*self.node);
        match header.opcode {
            op::INIT => match proto::InitIn::read(body) {
                Some(init) => self.reply_with(index, init_reply(&init)),
                None => self.reply_error(index, libc::EINVAL),
            },
            op::GETATTR => self.reply_with(index, shared.attr_out(node)),
            op::SETATTR => match proto::SetattrIn::read(body).map(|set| shared.setattr(node, &set)) {
                Some(Ok(())) => self.reply_with(index, shared.attr_out(node)),
                Some(Err(errno)) => self.reply_error(index, errno),
                None => self.reply_error(index, libc::EINVAL),
            },
            // The file is the mount's root: nothing is below it.
            op::LOOKUP => self.reply_error(index, libc::ENOENT),
            op::OPEN => {
                // No page cache: a VM writing the node through another export
                // never leaves a reader of the file with stale pages.
                let flags = fopen::DIRECT_IO | fopen::PARALLEL_DIRECT_WRITES;
                self.reply_with(index, proto::OpenOut { fh: 0, open_flags: flags, padding: 0 })
            }
            op::RELEASE | op::DESTROY => self.reply_error(index, 0),
            op::STATFS => self.reply_with(index, proto::StatfsOut { bsize: 512, namelen: 255, ..Default::default() }),
            op::READ => match proto::IoIn::read(body) {
                Some(read) => self.read(index, read.offset, read.size),
                None => self.reply_error(index, libc::EINVAL),
            },
            op::WRITE => match proto::IoIn::read(body) {
                Some(write) => self.write(index, write.offset, write.size, at + size_of::<proto::IoIn>()),
                None => self.reply_error(index, libc::EINVAL),
            },
            // As QEMU: a close flushes too.
            op::FSYNC | op::FLUSH => {
                self.slots[index].kind = Some(OpKind::Flush);
                self.push(index, IoOp::Flush, Reply::Empty)
            }
            op::FALLOCATE => match proto::FallocateIn::read(body) {
                Some(f) => self.fallocate(index, f.offset, f.length, f.mode),
                None => self.reply_error(index, libc::EINVAL),
            },
            op::LSEEK => match proto::LseekIn::read(body).map(|s| shared.seek(node, s.offset, s.whence)) {
                Some(Ok(offset)) => self.reply_with(index, proto::LseekOut { offset }),
                Some(Err(errno)) => self.reply_error(index, errno),
                None => self.reply_error(index, libc::EINVAL),
            },
            // Nothing to answer: no inode is ever looked up, and a request
            // being interrupted completes when its I/O does.
            op::FORGET | op::BATCH_FORGET | op::INTERRUPT => self.release(index),
            _ => self.reply_error(index, libc::ENOSYS),
        }
    }

    /// A read, ending at the end of the node.
    fn read(&mut self, index: usize, offset: u64, size: u32) {
        self.slots[index].kind = Some(OpKind::Read);
        let len = self.node.size().saturating_sub(offset).min(u64::from(size).min(MAX_IO as u64)) as usize;
        if len == 0 {
            return self.reply_data(index, 0);
        }
        let slot = &mut self.slots[index];
        let start = HEAD_ROOM - (slot.buf.as_ptr() as usize + HEAD_ROOM) % 4096;
        slot.iov = libc::iovec { iov_base: slot.buf[start..].as_mut_ptr().cast(), iov_len: len };
        slot.bytes = len as u64;
        self.push(index, IoOp::Read { offset, len: len as u64, iov: self.iovecs(index) }, Reply::Read { len })
    }

    /// A write, whose data lies at `data` in the slot's buffer: it ends at
    /// the end of the node unless the export is growable, as in QEMU; a
    /// write starting there fails with EIO.
    fn write(&mut self, index: usize, offset: u64, size: u32, data: usize) {
        self.slots[index].kind = Some(OpKind::Write);
        if !self.shared.config.writable {
            return self.reply_error(index, libc::EACCES);
        }
        let end = offset.saturating_add(u64::from(size));
        if self.shared.config.growable
            && let Err(errno) = self.shared.grow_to(&*self.node, end)
        {
            return self.reply_error(index, errno);
        }
        let len = self.node.size().saturating_sub(offset).min(u64::from(size)) as u32;
        if len == 0 || data + len as usize > self.slots[index].buf.len() {
            return self.reply_error(index, libc::EIO);
        }
        let slot = &mut self.slots[index];
        slot.iov = libc::iovec { iov_base: slot.buf[data..].as_mut_ptr().cast(), iov_len: len as usize };
        slot.bytes = u64::from(len);
        let op = IoOp::Write {
            offset,
            len: u64::from(len),
            iov: self.iovecs(index),
            durable: self.shared.config.writethrough,
        };
        self.push(index, op, Reply::Written { len })
    }

    /// fallocate(2) as QEMU's export takes it: punching a hole writes
    /// zeroes that may unmap (never the slow way), zeroing a range writes
    /// zeroes, growing the file unless told to keep its size; plain
    /// allocation only grows the file from its end.
    fn fallocate(&mut self, index: usize, offset: u64, length: u64, mode: u32) {
        const KEEP_SIZE: u32 = libc::FALLOC_FL_KEEP_SIZE as u32;
        const PUNCH_HOLE: u32 = libc::FALLOC_FL_PUNCH_HOLE as u32;
        const ZERO_RANGE: u32 = libc::FALLOC_FL_ZERO_RANGE as u32;
        self.slots[index].kind = Some(OpKind::Unmap);
        if !self.shared.config.writable {
            return self.reply_error(index, libc::EACCES);
        }
        let mut end = offset.saturating_add(length);
        let size = self.node.size();
        let (may_unmap, fast) = match mode {
            0 if offset < size => return self.reply_error(index, libc::EOPNOTSUPP),
            0 => return self.reply_result(index, self.shared.resize(&*self.node, end)),
            m if m & PUNCH_HOLE != 0 && m & KEEP_SIZE == 0 => return self.reply_error(index, libc::EINVAL),
            m if m & PUNCH_HOLE != 0 => (true, true),
            m if m & ZERO_RANGE != 0 => (false, false),
            _ => return self.reply_error(index, libc::EOPNOTSUPP),
        };
        if mode & KEEP_SIZE != 0 {
            end = end.min(size);
        } else if let Err(errno) = self.shared.grow_to(&*self.node, end) {
            return self.reply_error(index, errno);
        }
        let len = end.saturating_sub(offset);
        if len == 0 {
            return self.reply_error(index, 0);
        }
        self.slots[index].bytes = len;
        self.push(index, IoOp::WriteZeroes { offset, len, may_unmap, fast }, Reply::Empty)
    }

    fn iovecs(&self, index: usize) -> IoVecs {
        // SAFETY: the slot's iovec and buffer live until the queue, which
        // is dropped before the slots (the worker waits for its requests
        // in flight before it returns), has completed the request.
        unsafe { IoVecs::new(&self.slots[index].iov, 1) }
    }

    fn push(&mut self, index: usize, op: IoOp, reply: Reply) {
        self.slots[index].reply = reply;
        // SAFETY: as in `iovecs`.
        unsafe { self.queue.push(index as u32, op) };
        self.in_flight += 1;
        self.pushed += 1;
        self.stats.in_flight.set(self.in_flight as u64);
        if self.pushed >= self.queue.max_batch() {
            self.submit();
        }
    }

    fn submit(&mut self) {
        if self.pushed == 0 {
            return;
        }
        if let Err(e) = self.queue.submit() {
            log::error!("FUSE export '{}': submitting I/O failed: {e}", self.shared.config.id);
        }
        self.pushed = 0;
        self.stats.batches.add(1);
        self.stats.kernel_entries.set(self.queue.kernel_entries());
    }

    /// Submits what was pushed and answers what completed; true if any did.
    fn submit_and_reap(&mut self) -> bool {
        self.submit();
        if self.in_flight == 0 {
            return false;
        }
        let mut completions = Vec::new();
        self.queue.reap(&mut completions);
        for c in &completions {
            self.in_flight -= 1;
            let index = c.tag as usize;
            match (c.errno, self.slots[index].reply) {
                (0, Reply::Read { len }) => self.reply_data(index, len),
                (0, Reply::Written { len }) => self.reply_with(index, proto::WriteOut { size: len, padding: 0 }),
                (errno, _) => self.reply_error(index, errno),
            }
        }
        self.stats.in_flight.set(self.in_flight as u64);
        !completions.is_empty()
    }

    fn reply_data(&mut self, index: usize, len: usize) {
        let slot = &self.slots[index];
        let data = match len {
            0 => &[][..],
            // SAFETY: a read's iovec names `len` bytes of the slot's
            // buffer, filled by the engine.
            _ => unsafe { std::slice::from_raw_parts(slot.iov.iov_base.cast(), len) },
        };
        self.send(index, 0, data)
    }

    fn reply_with<T: Pod>(&mut self, index: usize, out: T) {
        self.send(index, 0, out.bytes())
    }

    fn reply_result(&mut self, index: usize, result: Result<(), i32>) {
        self.reply_error(index, result.err().unwrap_or(0))
    }

    /// Answers with `errno` (0: success without data).
    fn reply_error(&mut self, index: usize, errno: i32) {
        self.send(index, errno, &[])
    }

    /// Writes one reply, header and payload in one `writev` as the kernel
    /// wants them, and frees the slot.
    fn send(&mut self, index: usize, errno: i32, payload: &[u8]) {
        let slot = &self.slots[index];
        let len = (size_of::<proto::OutHeader>() + payload.len()) as u32;
        let header = proto::OutHeader { len, error: -errno, unique: slot.unique };
        let iov = [
            libc::iovec { iov_base: header.bytes().as_ptr().cast_mut().cast(), iov_len: size_of_val(&header) },
            libc::iovec { iov_base: payload.as_ptr().cast_mut().cast(), iov_len: payload.len() },
        ];
        // SAFETY: both iovecs name live buffers of their lengths.
        let ret = unsafe { libc::writev(self.fd.as_raw_fd(), iov.as_ptr(), 2) };
        // ENOENT: the request was aborted meanwhile; ENODEV: unmounted.
        if ret < 0 && !matches!(io::Error::last_os_error().raw_os_error(), Some(libc::ENOENT | libc::ENODEV)) {
            log::warn!("FUSE export '{}': replying: {}", self.shared.config.id, io::Error::last_os_error());
        }
        if let Some(kind) = slot.kind {
            let op = self.stats.op(kind);
            op.ops.add(1);
            match errno {
                0 => op.bytes.add(slot.bytes),
                _ => op.failed.add(1),
            }
            op.latency.record(self.clock.now().saturating_sub(slot.started));
        }
        self.release(index);
    }

    fn release(&mut self, index: usize) {
        self.free.push(index);
    }

    /// Sleeps until the connection, the engine, the export's stop or a
    /// request to pause (unless `pausing` already) has something.
    fn wait(&mut self, pausing: bool) {
        let listen = if self.free.is_empty() || self.closing || pausing { 0 } else { libc::POLLIN };
        let engine = self.queue.notify_fd().map_or(-1, |fd| fd.as_raw_fd());
        let mut fds = [
            libc::pollfd { fd: self.fd.as_raw_fd(), events: listen, revents: 0 },
            libc::pollfd { fd: engine, events: libc::POLLIN, revents: 0 },
            libc::pollfd { fd: self.shared.stop.as_raw_fd(), events: libc::POLLIN, revents: 0 },
            libc::pollfd {
                fd: self.shared.pause.as_raw_fd(),
                events: if pausing { 0 } else { libc::POLLIN },
                revents: 0,
            },
        ];
        // An engine without a descriptor completes within submit or reap:
        // look again soon rather than sleep while requests are in flight.
        let timeout = if self.in_flight > 0 && engine < 0 { 1 } else { -1 };
        // SAFETY: fds is a live array of its length.
        if unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout) } < 0 {
            return;
        }
        self.stats.wakeups.add(1);
        if fds[1].revents != 0 {
            self.queue.rearm();
        }
        // The stop counter stays signalled, for every reader to see.
        if fds[2].revents != 0 {
            self.closing = true;
        }
    }
}

/// `FUSE_INIT`'s answer: requests of up to [`MAX_IO`] bytes, asynchronous
/// direct I/O, many requests in flight.
fn init_reply(kernel: &proto::InitIn) -> proto::InitOut {
    let wanted = init::ASYNC_READ | init::BIG_WRITES | init::ASYNC_DIO | init::MAX_PAGES;
    proto::InitOut {
        major: proto::MAJOR,
        minor: proto::MINOR.min(kernel.minor),
        max_readahead: kernel.max_readahead,
        flags: kernel.flags & wanted,
        max_background: MAX_BACKGROUND,
        congestion_threshold: MAX_BACKGROUND * 3 / 4,
        max_write: MAX_IO as u32,
        time_gran: 1,
        max_pages: (MAX_IO / 4096) as u16,
        ..Default::default()
    }
}

/// A descriptor of its own on the connection `fd` serves
/// (`FUSE_DEV_IOC_CLONE`): each reader reads and answers on its own.
pub(crate) fn clone_fd(fd: BorrowedFd<'_>) -> io::Result<OwnedFd> {
    /// `FUSE_DEV_IOC_CLONE`: `_IOR(229, 0, uint32_t)`.
    const FUSE_DEV_IOC_CLONE: libc::c_ulong = 0x8004_e500;
    let clone: OwnedFd = std::fs::File::options().read(true).write(true).open("/dev/fuse")?.into();
    let source = fd.as_raw_fd() as u32;
    // SAFETY: the ioctl reads one u32 from a live variable.
    if unsafe { libc::ioctl(clone.as_raw_fd(), FUSE_DEV_IOC_CLONE, &source) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(clone)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_are_the_kernels() {
        assert_eq!(size_of::<proto::InHeader>(), 40);
        assert_eq!(size_of::<proto::OutHeader>(), 16);
        assert_eq!(size_of::<proto::InitOut>(), 64);
        assert_eq!(size_of::<proto::Attr>(), 88);
        assert_eq!(size_of::<proto::AttrOut>(), 104);
        assert_eq!(size_of::<proto::SetattrIn>(), 88);
        assert_eq!(size_of::<proto::IoIn>(), 40);
        assert_eq!(size_of::<proto::StatfsOut>(), 80);
    }
}
