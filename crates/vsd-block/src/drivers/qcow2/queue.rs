//! One thread's queue on a qcow2 node.
//!
//! Reads and in-place writes are split by [`Image::map`] into extents and
//! sent to the child queues asynchronously; zero and unallocated extents
//! are filled here. Whatever changes metadata (allocating writes,
//! write-zeroes, discard) runs synchronously through the image's metadata
//! path and is answered at once.

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::Arc;

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vsd_engine::{Completion, IoOp, IoQueue, IoVecs};
use vsd_qcow2::buf::AlignedBuf;
use vsd_qcow2::{Image, ImageIo, MapMemo, Mapping};

use crate::drivers::child::ChildQueue;

/// Which child a request goes to.
#[derive(Clone, Copy)]
enum Target {
    /// The image file.
    File,
    /// Where guest data lives: the external data file, else the image file.
    Data,
    /// The backing file.
    Backing,
}

/// A guest request and the child requests it still waits for.
#[derive(Clone, Copy, Default)]
struct Parent {
    remaining: u32,
    errno: i32,
}

/// A child request that found no free tag; sent from `reap`.
struct Deferred {
    parent: u32,
    target: Target,
    op: IoOp,
    iov: Vec<libc::iovec>,
}

pub(crate) struct Qcow2Queue {
    image: Arc<Image>,
    file: ChildQueue,
    data: Option<ChildQueue>,
    backing: Option<ChildQueue>,
    /// Watches the children's completion descriptors: ours is readable
    /// while any of theirs is.
    epoll: Epoll,
    parents: Vec<Parent>,
    /// For each child tag: its parent and, for split requests, the slice
    /// of the parent's buffers it covers.
    children: Vec<(u32, Vec<libc::iovec>)>,
    free: Vec<u32>,
    deferred: VecDeque<Deferred>,
    answered: Vec<Completion>,
    reaped: Vec<Completion>,
    /// The last compressed cluster decompressed: (host offset, contents).
    compressed: Option<(u64, AlignedBuf)>,
    /// Extents of the write being routed.
    extents: Vec<(u64, u64, u64)>,
    memo: MapMemo,
}

impl Qcow2Queue {
    pub(crate) fn new(
        image: Arc<Image>,
        file: ChildQueue,
        data: Option<ChildQueue>,
        backing: Option<ChildQueue>,
        depth: u16,
        child_depth: u16,
    ) -> io::Result<Self> {
        let epoll = Epoll::new()?;
        for child in [Some(&file), data.as_ref(), backing.as_ref()].into_iter().flatten() {
            if let Some(fd) = child.notify_fd() {
                epoll.ctl(ControlOperation::Add, fd.as_raw_fd(), EpollEvent::new(EventSet::IN, 0))?;
            }
        }
        Ok(Self {
            image,
            file,
            data,
            backing,
            epoll,
            parents: vec![Parent::default(); usize::from(depth)],
            children: (0..child_depth).map(|_| (0, Vec::new())).collect(),
            free: (0..u32::from(child_depth)).rev().collect(),
            deferred: VecDeque::new(),
            answered: Vec::with_capacity(usize::from(depth)),
            reaped: Vec::with_capacity(usize::from(child_depth)),
            compressed: None,
            extents: Vec::new(),
            memo: MapMemo::default(),
        })
    }

    fn children(&self) -> impl Iterator<Item = &ChildQueue> {
        [Some(&self.file), self.data.as_ref(), self.backing.as_ref()].into_iter().flatten()
    }

    fn child(&mut self, target: Target) -> &mut ChildQueue {
        match target {
            Target::File => &mut self.file,
            Target::Data => self.data.as_mut().unwrap_or(&mut self.file),
            Target::Backing => self.backing.as_mut().expect("backing requests need a backing child"),
        }
    }

    fn fail(&mut self, parent: u32, errno: i32) {
        let p = &mut self.parents[parent as usize];
        if p.errno == 0 {
            p.errno = errno;
        }
    }

    fn fail_with(&mut self, parent: u32, e: &io::Error) {
        self.fail(parent, e.raw_os_error().unwrap_or(libc::EIO));
    }

    /// One child request done (or never sent): completes the parent if it
    /// was the last.
    fn settle(&mut self, parent: u32, errno: i32, out: &mut Vec<Completion>) {
        if errno != 0 {
            self.fail(parent, errno);
        }
        let p = &mut self.parents[parent as usize];
        p.remaining -= 1;
        if p.remaining == 0 {
            out.push(Completion { tag: parent, errno: p.errno });
        }
    }

    /// Sends `op` to a child for the parent. With `part: Some(pos)`, its
    /// buffers are the parent's bytes from `pos` on, for the op's length;
    /// with None, all of the parent's buffers.
    fn issue(&mut self, parent: u32, target: Target, op: IoOp, iov: IoVecs, part: Option<u64>) {
        self.parents[parent as usize].remaining += 1;
        let len = op_len(&op);
        let Some(tag) = self.free.pop() else {
            let slice = iov.range(part.unwrap_or(0), len).collect();
            self.deferred.push_back(Deferred { parent, target, op, iov: slice });
            return;
        };
        let (owner, storage) = &mut self.children[tag as usize];
        *owner = parent;
        let iov = if let Some(pos) = part {
            storage.clear();
            storage.extend(iov.range(pos, len));
            // SAFETY: `storage` lives in self and is not touched again
            // until this child request completes; the buffers it names are
            // the parent's, valid until the parent completes.
            unsafe { IoVecs::new(storage.as_ptr(), storage.len()) }
        } else {
            iov
        };
        let op = with_iov(op, iov);
        // SAFETY: as above: the parent's buffers outlive the child request.
        unsafe { self.child(target).push(tag, op) };
    }

    fn send_deferred(&mut self) {
        while !self.free.is_empty() {
            let Some(d) = self.deferred.pop_front() else { return };
            let tag = self.free.pop().expect("checked above");
            let (owner, storage) = &mut self.children[tag as usize];
            *owner = d.parent;
            // Moving the Vec keeps its heap buffer where it is.
            *storage = d.iov;
            // SAFETY: as in `issue`.
            let op = with_iov(d.op, unsafe { IoVecs::new(storage.as_ptr(), storage.len()) });
            // SAFETY: as in `issue`.
            unsafe { self.child(d.target).push(tag, op) };
        }
    }

    fn read(&mut self, tag: u32, offset: u64, len: u64, iov: IoVecs) {
        let mut pos = 0;
        while pos < len {
            let extent = match self.image.map(&mut self.memo, &mut self.file, offset + pos, len - pos) {
                Ok(extent) => extent,
                Err(e) => return self.fail_with(tag, &e),
            };
            let (at, n, whole) = (offset + pos, extent.len, pos == 0 && extent.len == len);
            match extent.mapping {
                Mapping::Data { host, .. } => {
                    let op = IoOp::Read { offset: host, len: n, iov };
                    self.issue(tag, Target::Data, op, iov, (!whole).then_some(pos));
                }
                Mapping::Zero => fill(iov, pos, n, None),
                Mapping::Unallocated => {
                    let below = self.backing.as_ref().map_or(0, |b| b.end().saturating_sub(at).min(n));
                    if below > 0 {
                        let op = IoOp::Read { offset: at, len: below, iov };
                        self.issue(tag, Target::Backing, op, iov, (!whole || below < n).then_some(pos));
                    }
                    fill(iov, pos + below, n - below, None);
                }
                Mapping::Compressed { host, len: compressed_len } => {
                    if let Err(e) = self.decompress(host, compressed_len) {
                        return self.fail_with(tag, &e);
                    }
                    let within = (at % self.image.cluster_size()) as usize;
                    let (_, cluster) = self.compressed.as_ref().expect("just decompressed");
                    fill(iov, pos, n, Some(&cluster[within..within + n as usize]));
                }
                Mapping::Invalid => return self.fail(tag, libc::EIO),
            }
            pos += n;
        }
    }

    fn decompress(&mut self, host: u64, len: u64) -> io::Result<()> {
        if self.compressed.as_ref().is_some_and(|(at, _)| *at == host) {
            return Ok(());
        }
        let mut cluster = match self.compressed.take() {
            Some((_, buf)) => buf,
            None => AlignedBuf::zeroed(self.image.cluster_size() as usize),
        };
        let result = self.image.read_compressed(&mut self.file, host, len, &mut cluster);
        self.compressed = result.is_ok().then_some((host, cluster));
        result
    }

    fn write(&mut self, tag: u32, offset: u64, len: u64, iov: IoVecs, durable: bool) {
        // Fast path: every byte lands on data this image owns.
        self.extents.clear();
        let mut pos = 0;
        while pos < len {
            match self.image.map(&mut self.memo, &mut self.file, offset + pos, len - pos) {
                Ok(e) => match e.mapping {
                    Mapping::Data { host, in_place: true } if self.image.write_hits_metadata(host, e.len) => {
                        log::error!("qcow2: guest offset {:#x} maps onto metadata at {host:#x}", offset + pos);
                        return self.fail(tag, libc::EIO);
                    }
                    Mapping::Data { host, in_place: true } => self.extents.push((host, pos, e.len)),
                    Mapping::Invalid => return self.fail(tag, libc::EIO),
                    _ => break,
                },
                Err(e) => return self.fail_with(tag, &e),
            }
            pos += self.extents.last().map_or(0, |e| e.2);
        }
        // A durable write must not land on a cluster whose allocation is
        // still only in memory: then the metadata path flushes it too.
        if pos == len && !(durable && self.image.metadata_dirty()) {
            for i in 0..self.extents.len() {
                let (host, at, n) = self.extents[i];
                let op = IoOp::Write { offset: host, len: n, iov, durable };
                self.issue(tag, Target::Data, op, iov, (n != len).then_some(at));
            }
            return;
        }
        // Allocation, copy-on-write, zero flags to clear, or a durable write
        // with metadata to flush: the metadata path.
        let result = self.with_io(|image, io| {
            // SAFETY: a request's buffers stay valid until it completes, which
            // is after this synchronous write.
            image.write(io, offset, len, &mut |at, buf| unsafe { iov.copy_out(at, buf) })?;
            if durable { image.flush(io) } else { Ok(()) }
        });
        if let Err(e) = result {
            self.fail_with(tag, &e);
        }
    }

    /// Runs `f` with the image and its files as blocking I/O.
    fn with_io<R>(&mut self, f: impl FnOnce(&Image, &mut ImageIo) -> R) -> R {
        let mut io = ImageIo {
            meta: &mut self.file,
            data: self.data.as_mut().map(|d| d as &mut dyn vsd_qcow2::SyncIo),
            backing: self.backing.as_mut().map(|b| b as &mut dyn vsd_qcow2::SyncIo),
        };
        f(&self.image, &mut io)
    }
}

// SAFETY: the raw pointers held (in iovec slices) describe request
// buffers, which `IoVecs` already allows to cross threads; the queue
// itself is used by one thread at a time.
unsafe impl Send for Qcow2Queue {}

impl IoQueue for Qcow2Queue {
    unsafe fn push(&mut self, tag: u32, op: IoOp) {
        // Held until routing is done, so the parent cannot complete early.
        self.parents[tag as usize] = Parent { remaining: 1, errno: 0 };
        let size = self.image.size();
        if crate::drivers::out_of_bounds(&op, size) {
            self.fail(tag, libc::EIO);
        } else {
            match op {
                IoOp::Read { offset, len, iov } => self.read(tag, offset, len, iov),
                IoOp::Write { offset, len, iov, durable } => self.write(tag, offset, len, iov, durable),
                IoOp::Flush if self.image.metadata_dirty() => {
                    if let Err(e) = self.with_io(|image, io| image.flush(io)) {
                        self.fail_with(tag, &e);
                    }
                }
                IoOp::Flush => {
                    let none = IoVecs::default();
                    self.issue(tag, Target::File, IoOp::Flush, none, None);
                    if self.data.is_some() {
                        self.issue(tag, Target::Data, IoOp::Flush, none, None);
                    }
                }
                IoOp::Discard { offset, len } => {
                    if let Err(e) = self.with_io(|image, io| image.discard(io, offset, len)) {
                        self.fail_with(tag, &e);
                    }
                }
                IoOp::WriteZeroes { offset, len, may_unmap } => {
                    if let Err(e) = self.with_io(|image, io| image.write_zeroes(io, offset, len, may_unmap)) {
                        self.fail_with(tag, &e);
                    }
                }
            }
        }
        let mut answered = std::mem::take(&mut self.answered);
        self.settle(tag, 0, &mut answered);
        self.answered = answered;
    }

    fn submit(&mut self) -> io::Result<()> {
        self.file.submit()?;
        if let Some(data) = &mut self.data {
            data.submit()?;
        }
        if let Some(backing) = &mut self.backing {
            backing.submit()?;
        }
        Ok(())
    }

    fn reap(&mut self, out: &mut Vec<Completion>) {
        out.append(&mut self.answered);
        let mut reaped = std::mem::take(&mut self.reaped);
        // Until a round finds nothing: settling may run metadata I/O that
        // stashes children's completions, and deferred requests submitted
        // here may complete at once (inline, on tmpfs). Neither makes a
        // child's notify_fd readable, so the owner would sleep on them.
        loop {
            self.file.reap(&mut reaped);
            if let Some(data) = &mut self.data {
                data.reap(&mut reaped);
            }
            if let Some(backing) = &mut self.backing {
                backing.reap(&mut reaped);
            }
            if reaped.is_empty() {
                break;
            }
            for c in reaped.drain(..) {
                let parent = self.children[c.tag as usize].0;
                self.free.push(c.tag);
                self.settle(parent, c.errno, out);
            }
            if !self.deferred.is_empty() {
                self.send_deferred();
                if let Err(e) = self.submit() {
                    log::error!("qcow2: submitting deferred requests failed: {e}");
                }
            }
        }
        self.reaped = reaped;
    }

    fn wait(&mut self) -> io::Result<()> {
        let silent = self.children().any(|c| c.notify_fd().is_none());
        if !self.answered.is_empty() || silent {
            return Ok(());
        }
        let mut events = [EpollEvent::default(); 1];
        match self.epoll.wait(-1, &mut events) {
            Ok(_) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(()),
            Err(e) => Err(e),
        }
    }

    fn notify_fd(&self) -> Option<BorrowedFd<'_>> {
        // SAFETY: the epoll descriptor lives as long as self.
        Some(unsafe { BorrowedFd::borrow_raw(self.epoll.as_raw_fd()) })
    }

    fn rearm(&mut self) {
        self.file.rearm();
        if let Some(data) = &mut self.data {
            data.rearm();
        }
        if let Some(backing) = &mut self.backing {
            backing.rearm();
        }
    }

    fn kernel_entries(&self) -> u64 {
        self.children().map(ChildQueue::kernel_entries).sum()
    }
}

fn op_len(op: &IoOp) -> u64 {
    match *op {
        IoOp::Read { len, .. } | IoOp::Write { len, .. } => len,
        _ => 0,
    }
}

/// `op` with its buffers replaced by `iov`.
fn with_iov(op: IoOp, iov: IoVecs) -> IoOp {
    match op {
        IoOp::Read { offset, len, .. } => IoOp::Read { offset, len, iov },
        IoOp::Write { offset, len, durable, .. } => IoOp::Write { offset, len, iov, durable },
        other => other,
    }
}

/// Fills bytes `pos..pos + len` of a read request's buffers from `src`, or
/// with zeroes.
fn fill(iov: IoVecs, pos: u64, len: u64, src: Option<&[u8]>) {
    // SAFETY: a read request's buffers are writable guest memory, valid and
    // ours alone until the request completes, which is after this.
    unsafe { iov.fill(pos, len, src) }
}
