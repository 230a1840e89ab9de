//! The transmission phase of one connection, on its own thread.
//!
//! The thread owns the socket (non-blocking), an [`IoQueue`] it opened on
//! the node, and [`SLOTS`] request slots with their buffers. Per round it
//! reads what the socket has (several requests per `read`), parses every
//! whole request while a slot is free, pushes them to the queue and
//! submits them at once, reaps what completed, and writes every reply
//! ready with one `writev`. A slot is free again once its reply is sent,
//! so a client that sends without reading replies stops being read.
//!
//! Memory is bounded whatever the client sends: the input buffer is fixed,
//! each slot's buffer holds at most one request's payload or data (at
//! most [`MAX_PAYLOAD`]), buffers above [`KEEP`] are freed after use, and
//! all of a connection's buffers together stay under [`BUDGET`]: a request
//! that would pass it waits for earlier ones to finish. A payload larger
//! than the maximum gets an error and the connection is closed.
//!
//! A connection cannot be stopped from outside, so it stops itself: at
//! the start of each round it compares the export's epoch with the one it
//! has caught up with (one atomic load). When the export changes (its
//! connections held stopped by a job's switch, released, moved onto a new
//! node), it takes no more requests, lets those in flight complete, then
//! follows the change; held, it reads nothing until released: the
//! client's next requests wait in the socket or the connection's buffers.
//!
//! The socket is a [`Wire`] type parameter: a TLS connection reads and
//! writes through rustls' bounded buffers (`vsd_net::TlsStream`), a plain one
//! straight through the socket, with no TLS branch compiled in.
//!
//! Spliced reads. On a plain socket, a read of [`SPLICE_MIN`] bytes or
//! more whose node names the host file holding them
//! ([`BlockNode::host_file`]: a page-cached file, or a raw window over
//! one) and whose pages are all in the page cache (`cachestat(2)`) is not
//! read into the slot's buffer: its reply is queued at once, and when it
//! is its turn to go out the file's pages are spliced into the
//! connection's pipe (by reference), the reply's header written, and the
//! pipe spliced to the socket: the data is never copied by the server.
//! Uncached pages would make the splice wait for the disk on the
//! connection's thread: those reads take the queue, as do reads too long
//! for the pipe. The pages are referenced, not copied: what the client
//! receives is what the file holds when the kernel sends it, so a write
//! landing on those pages after the reply was queued (from another
//! connection, say) may show in it, as with any read that overlaps a
//! write in flight.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{self, IoSlice};
use std::os::fd::{AsFd, AsRawFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vsd_block::dirty::DirtyRecorder;
use vsd_block::{Allocation, BlockNode, Completion, IoOp, IoQueue, IoVecs};
use vsd_qcow2::buf::AlignedBuf;
use vsd_sys::Pipe;
use vsd_trace::{Clock, OpKind, QueueStats};

use crate::negotiate::{Agreement, Context};
use vsd_net::{Stream, TlsStream, Wire};

use crate::proto::{self, Command, Limits, Mode, Refusal, ReplyHeader, Request, errno, state};
use crate::server::{Export, Orders};

/// A spliced read found no pipe or no socket to splice to: a bug.
fn no_pipe() -> io::Error {
    io::Error::other("a spliced read on a connection without a pipe")
}

/// Requests in flight per connection, as QEMU's server allows.
const SLOTS: usize = 16;
/// The largest read or write payload (QEMU's `NBD_MAX_BUFFER_SIZE`).
pub(crate) const MAX_PAYLOAD: u64 = 32 << 20;
/// Slot buffers up to this size stay allocated between requests.
const KEEP: usize = 1 << 20;
/// All of a connection's slot buffers together.
const BUDGET: usize = 2 * MAX_PAYLOAD as usize;
/// Bytes read from the socket at once.
const INPUT: usize = 64 << 10;
/// The most block status descriptors in one reply.
const MAX_EXTENTS: usize = 8192;
/// The most buffers one `writev` sends.
const MAX_IOV: usize = 64;

/// The shortest read that is spliced: below it, the system calls a
/// splice takes (cachestat, two splices) cost more than the copy saves.
const SPLICE_MIN: u64 = 16 << 10;
/// The pipe capacity asked for: the longest read spliced, if granted.
const PIPE_CAPACITY: usize = 1 << 20;

const TOKEN_SOCKET: u64 = 0;
const TOKEN_ENGINE: u64 = 1;
/// The export changed ([`Export::changed`], edge-triggered).
const TOKEN_CHANGED: u64 = 2;

struct Slot {
    request: Request,
    verdict: Result<Command, Refusal>,
    /// Payload bytes taken off the socket so far.
    received: usize,
    buf: AlignedBuf,
    /// The engine's view of `buf`; stays put while the request is in flight.
    iov: libc::iovec,
    reply: ReplyHeader,
    /// How many bytes of `buf` follow the reply header.
    data_len: usize,
    /// FUA on a discard or zeroing: a flush follows it.
    then_flush: bool,
    /// The round the request was parsed in, in clock ticks.
    started: u64,
    /// A spliced read: the host file and offset its bytes come from; its
    /// `data_len` is 0, the bytes follow the header from the pipe.
    splice: Option<(Arc<File>, u64)>,
}

/// The connection's pipe for spliced reads, made at the first one.
struct Splicer {
    pipe: Pipe,
    /// What the pipe holds at most, in bytes (pages of the file).
    capacity: u64,
    /// Bytes of the first reply in the pipe, not yet sent.
    piped: usize,
    /// The reply whose bytes are in the pipe (the first spliced one).
    staged: Option<usize>,
}

/// Whether reads may be spliced, and with what.
enum Splicing {
    /// Not tried yet: the pipe is made at the first candidate.
    Untried,
    Ready(Splicer),
    /// Never on this connection: TLS, no pipe, or no `cachestat` (Linux
    /// before 6.5).
    Off,
}

/// One connection in the transmission phase. The queue is declared before
/// the slots: dropping it waits for requests in flight, whose buffers the
/// slots own.
struct Transmission<W: Wire> {
    queue: Box<dyn IoQueue>,
    /// The node `queue` is open on, and which of the export's nodes it is.
    node: Arc<dyn BlockNode>,
    generation: u64,
    /// The connection's place in the export, and the export's epoch it has
    /// caught up with ([`Transmission::follow_export`]).
    seat: u64,
    epoch: u64,
    /// No request is taken: the export changed and the requests in flight
    /// are not done yet, or the export holds its connections stopped.
    /// Bytes the client sends meanwhile wait in the socket.
    paused: bool,
    /// The queue is uncounted: the connection counts its requests, and
    /// records its writes in the node's dirty bitmaps.
    dirty: DirtyRecorder,
    slots: Vec<Slot>,
    free: Vec<usize>,
    stream: W,
    export: Arc<Export>,
    limits: Limits,
    /// The metadata contexts block status reports, in id order.
    contexts: Vec<Context>,
    writethrough: bool,
    input: Box<[u8]>,
    start: usize,
    end: usize,
    /// The slot whose payload is being read.
    receiving: Option<usize>,
    replies: VecDeque<usize>,
    /// Bytes of the first reply already sent.
    sent: usize,
    completions: Vec<Completion>,
    pushed: usize,
    in_flight: usize,
    /// Capacity of all slot buffers.
    buffered: usize,
    /// No more requests are read (DISC, end of input, a fatal error).
    closing: bool,
    epoll: Epoll,
    stats: Arc<QueueStats>,
    clock: Clock,
    now: u64,
    splicing: Splicing,
}

/// Serves a connection that negotiated `agreement`, over `tls` if the
/// client started it; `early` holds bytes the client sent right after the
/// handshake (decrypted). `client_gone` is set once the client is, before
/// the connection's own requests are finished.
pub(crate) fn serve(
    stream: Stream,
    tls: Option<rustls::ServerConnection>,
    agreement: Agreement<Arc<Export>>,
    early: &[u8],
    client_gone: &AtomicBool,
) -> io::Result<()> {
    stream.set_nonblocking()?;
    match tls {
        None => serve_on(stream, agreement, early, client_gone),
        Some(tls) => serve_on(TlsStream::new(tls, stream), agreement, early, client_gone),
    }
}

fn serve_on<W: Wire>(
    stream: W,
    agreement: Agreement<Arc<Export>>,
    early: &[u8],
    client_gone: &AtomicBool,
) -> io::Result<()> {
    let export = agreement.export;
    let limits = Limits {
        size: agreement.info.size,
        read_only: !export.config.writable,
        mode: agreement.mode,
        block_status: !agreement.contexts.is_empty(),
        max_payload: MAX_PAYLOAD,
    };
    let contexts = agreement.contexts;
    let clock = Clock::get();
    let stats = Arc::new(QueueStats::timed_by(clock));
    export.attach_stats(stats.clone());
    let (seat, orders) = export.join();
    let result = Transmission::new(stream, export.clone(), (seat, orders), limits, contexts, stats.clone(), early)
        .and_then(|mut t| {
            let served = t.run();
            t.stream.close();
            client_gone.store(true, Ordering::Release);
            served
        });
    // Its requests are done (dropping the queue waited for them).
    export.leave(seat);
    export.detach_stats(&stats);
    result
}

impl<W: Wire> Transmission<W> {
    fn new(
        stream: W,
        export: Arc<Export>,
        (seat, orders): (u64, Orders),
        limits: Limits,
        contexts: Vec<Context>,
        stats: Arc<QueueStats>,
        early: &[u8],
    ) -> io::Result<Self> {
        // The process's clock, which timed `stats`.
        let clock = Clock::get();
        let node = orders.node;
        let queue = node.open_uncounted_queue(SLOTS as u16)?;
        let dirty = DirtyRecorder::for_node(&*node);
        let epoll = Epoll::new()?;
        let edge = EventSet::IN | EventSet::OUT | EventSet::EDGE_TRIGGERED;
        epoll.ctl(ControlOperation::Add, stream.as_raw_fd(), EpollEvent::new(edge, TOKEN_SOCKET))?;
        let changed = EventSet::IN | EventSet::EDGE_TRIGGERED;
        epoll.ctl(ControlOperation::Add, export.changed.as_raw_fd(), EpollEvent::new(changed, TOKEN_CHANGED))?;
        if let Some(fd) = queue.notify_fd() {
            epoll.ctl(ControlOperation::Add, fd.as_raw_fd(), EpollEvent::new(EventSet::IN, TOKEN_ENGINE))?;
        }
        let slots = (0..SLOTS)
            .map(|_| Slot {
                request: Request::default(),
                verdict: Err(Refusal { errno: errno::EINVAL, fatal: false }),
                received: 0,
                buf: AlignedBuf::zeroed(0),
                iov: libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 },
                reply: ReplyHeader::default(),
                data_len: 0,
                then_flush: false,
                started: 0,
                splice: None,
            })
            .collect();
        let mut input = vec![0u8; INPUT].into_boxed_slice();
        input[..early.len()].copy_from_slice(early);
        let splicing = if stream.splice_fd().is_some() { Splicing::Untried } else { Splicing::Off };
        Ok(Self {
            queue,
            node,
            generation: orders.generation,
            seat,
            epoch: orders.epoch,
            paused: orders.held,
            dirty,
            slots,
            free: (0..SLOTS).rev().collect(),
            stream,
            writethrough: export.config.writethrough,
            export,
            limits,
            contexts,
            input,
            start: 0,
            end: early.len(),
            receiving: None,
            replies: VecDeque::with_capacity(SLOTS),
            sent: 0,
            completions: Vec::with_capacity(SLOTS),
            pushed: 0,
            in_flight: 0,
            buffered: 0,
            closing: false,
            epoll,
            stats,
            clock,
            now: clock.now(),
            splicing,
        })
    }

    fn run(&mut self) -> io::Result<()> {
        loop {
            self.now = self.clock.now();
            self.follow_export()?;
            let mut progress = self.receive()?;
            progress |= self.submit_and_reap()?;
            progress |= self.send()?;
            let done = self.closing && self.in_flight == 0 && self.replies.is_empty() && self.receiving.is_none();
            if done && !self.stream.holds_back() {
                return Ok(());
            }
            if !progress {
                self.wait()?;
            }
        }
    }

    /// Catches up with the export's changes (stopped, resumed, a new node)
    /// once the requests in flight are done. Its cost while nothing changes
    /// is one atomic load per round, and a round takes a batch of requests:
    /// the hot path is not slowed.
    fn follow_export(&mut self) -> io::Result<()> {
        if self.export.epoch() == self.epoch {
            return Ok(());
        }
        // The next requests wait until those in flight are done.
        self.paused = true;
        if self.in_flight > 0 {
            return Ok(());
        }
        let orders = self.export.orders();
        if orders.generation != self.generation {
            self.open_queue(orders.node, orders.generation)?;
        }
        self.paused = orders.held;
        self.epoch = orders.epoch;
        self.export.caught_up(self.seat, orders.epoch);
        Ok(())
    }

    /// Serves `node`, the export's `generation`th, with no request in flight.
    fn open_queue(&mut self, node: Arc<dyn BlockNode>, generation: u64) -> io::Result<()> {
        let queue = node.open_uncounted_queue(SLOTS as u16)?;
        if let Some(fd) = self.queue.notify_fd() {
            self.epoll.ctl(ControlOperation::Delete, fd.as_raw_fd(), EpollEvent::default())?;
        }
        if let Some(fd) = queue.notify_fd() {
            self.epoll.ctl(ControlOperation::Add, fd.as_raw_fd(), EpollEvent::new(EventSet::IN, TOKEN_ENGINE))?;
        }
        self.queue = queue;
        self.dirty = DirtyRecorder::for_node(&*node);
        self.node = node;
        self.generation = generation;
        Ok(())
    }

    /// Reads and parses requests while slots are free; true if it did any.
    fn receive(&mut self) -> io::Result<bool> {
        let mut progress = false;
        loop {
            if self.closing || self.paused {
                return Ok(progress);
            }
            if let Some(slot) = self.receiving {
                match self.read_payload(slot)? {
                    true => progress = true,
                    false => return Ok(progress),
                }
                continue;
            }
            if self.parse_requests()? {
                progress = true;
                continue;
            }
            // Parsing stopped: for want of bytes, or of a slot or buffer room.
            let header = self.limits.mode.request_size();
            if self.free.is_empty() || self.end - self.start >= header {
                return Ok(progress);
            }
            match self.fill_input()? {
                true => progress = true,
                false => return Ok(progress),
            }
        }
    }

    /// Reads more requests into the input buffer; false if none came.
    fn fill_input(&mut self) -> io::Result<bool> {
        if self.start > 0 {
            self.input.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        match self.stream.read(&mut self.input[self.end..]) {
            Ok(0) => {
                self.closing = true;
                Ok(true)
            }
            Ok(n) => {
                self.end += n;
                Ok(true)
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(false),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(true),
            Err(e) => Err(e),
        }
    }

    /// Reads the rest of a payload straight into its slot; false if nothing came.
    fn read_payload(&mut self, index: usize) -> io::Result<bool> {
        let slot = &mut self.slots[index];
        let (filled, len) = (slot.received, slot.request.len as usize);
        match self.stream.read(&mut slot.buf[filled..len]) {
            Ok(0) => {
                // The payload stopped half-way: nothing to reply to.
                self.receiving = None;
                self.release(index);
                self.closing = true;
                Ok(true)
            }
            Ok(n) if filled + n < len => {
                slot.received = filled + n;
                Ok(true)
            }
            Ok(_) => {
                self.receiving = None;
                self.dispatch(index);
                Ok(true)
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(false),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(true),
            Err(e) => Err(e),
        }
    }

    /// Takes every whole request in the input buffer that a slot can hold;
    /// true if it took any.
    fn parse_requests(&mut self) -> io::Result<bool> {
        let mut took = false;
        while !self.closing && self.receiving.is_none() {
            let Some(&index) = self.free.last() else { break };
            let mode = self.limits.mode;
            let request = match Request::parse(&self.input[self.start..self.end], mode) {
                Ok(Some(request)) => request,
                Ok(None) => break,
                Err(e) => return Err(io::Error::new(io::ErrorKind::InvalidData, e)),
            };
            let verdict = request.check(&self.limits);
            let payload = request.payload_len(mode) as usize;
            let room = match verdict {
                _ if payload > 0 => payload,
                Ok(Command::Read { len, .. }) => len as usize,
                Ok(Command::BlockStatus { .. }) => {
                    MAX_EXTENTS * proto::extent_size(mode) + self.contexts.len() * proto::MAX_REPLY_HEADER
                }
                _ => 0,
            };
            let fatal = matches!(verdict, Err(Refusal { fatal: true, .. }));
            if !fatal && !self.make_room(index, room) {
                break;
            }
            self.free.pop();
            took = true;
            self.start += mode.request_size();
            let slot = &mut self.slots[index];
            (slot.request, slot.verdict, slot.started, slot.then_flush) = (request, verdict, self.now, false);
            self.stats.requests.add(1);
            if fatal {
                // The payload cannot be taken: answer, then stop reading.
                self.closing = true;
                let errno = verdict.err().map_or(errno::EINVAL, |r| r.errno);
                self.reply_error(index, errno);
                break;
            }
            let n = payload.min(self.end - self.start);
            self.slots[index].buf[..n].copy_from_slice(&self.input[self.start..self.start + n]);
            self.start += n;
            if n < payload {
                self.slots[index].received = n;
                self.receiving = Some(index);
            } else {
                self.dispatch(index);
            }
        }
        Ok(took)
    }

    /// Gives slot `index` a buffer of at least `len` bytes, if the
    /// connection's budget allows it now.
    fn make_room(&mut self, index: usize, len: usize) -> bool {
        let have = self.slots[index].buf.len();
        if len <= have {
            return true;
        }
        let size = len.next_power_of_two().max(4096);
        if self.buffered - have + size > BUDGET {
            return false;
        }
        self.buffered = self.buffered - have + size;
        let slot = &mut self.slots[index];
        slot.buf = AlignedBuf::zeroed(size);
        slot.iov = libc::iovec { iov_base: slot.buf.as_mut_ptr().cast(), iov_len: size };
        true
    }

    /// Runs a request whose header (and payload) are in its slot.
    fn dispatch(&mut self, index: usize) {
        let command = match self.slots[index].verdict {
            Ok(command) => command,
            Err(refusal) => {
                self.stats.invalid.add(1);
                return self.reply_error(index, refusal.errno);
            }
        };
        let durable = self.writethrough;
        let op = match command {
            Command::Disconnect => {
                self.closing = true;
                return self.release(index);
            }
            // An inactive node's image is another process's (allow-inactive):
            // it may be read and flushed, nothing else, as in QEMU.
            Command::Write { .. }
            | Command::Trim { .. }
            | Command::WriteZeroes { .. }
            | Command::BlockStatus { .. }
                if !self.node.active() =>
            {
                return self.reply_error(index, errno::EPERM);
            }
            Command::Read { len: 0, .. } | Command::Write { len: 0, .. } | Command::Cache => {
                return self.reply_done(index);
            }
            Command::Trim { len: 0, .. } | Command::WriteZeroes { len: 0, .. } => return self.reply_done(index),
            // Zeroing here may fall back to writing zeroes: not fast.
            Command::BlockStatus { offset, len, one } => return self.block_status(index, offset, len, one),
            Command::Read { offset, len, .. } => {
                if let Some(host) = self.splice_source(offset, len) {
                    return self.reply_spliced(index, len, host);
                }
                IoOp::Read { offset, len, iov: self.iovecs(index, len) }
            }
            Command::Write { offset, len, fua } => {
                IoOp::Write { offset, len, iov: self.iovecs(index, len), durable: fua || durable }
            }
            Command::Flush => IoOp::Flush,
            Command::Trim { offset, len, fua } => {
                self.slots[index].then_flush = fua || durable;
                IoOp::Discard { offset, len }
            }
            Command::WriteZeroes { offset, len, fua, may_unmap, fast } => {
                self.slots[index].then_flush = fua || durable;
                IoOp::WriteZeroes { offset, len, may_unmap, fast }
            }
        };
        self.push(index, op);
    }

    fn iovecs(&mut self, index: usize, len: u64) -> IoVecs {
        let slot = &mut self.slots[index];
        slot.iov.iov_len = len as usize;
        // SAFETY: the iovec names the first `len` bytes of the slot's
        // buffer (make_room sized it); the slot keeps both, untouched,
        // until the request's completion is reaped, and the queue is
        // dropped (waiting for requests in flight) before the slots.
        unsafe { IoVecs::new(&slot.iov, 1) }
    }

    fn push(&mut self, index: usize, op: IoOp) {
        self.dirty.record(index as u32, &op);
        // SAFETY: as in `iovecs`: the buffers stay valid until the
        // completion tagged `index` is reaped.
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
            // What the engine could not hand over stays queued for its next
            // submit, as in the vhost-user workers.
            log::error!("NBD export '{}': submitting I/O failed: {e}", self.export.config.id);
        }
        self.pushed = 0;
        self.stats.batches.add(1);
        self.stats.kernel_entries.set(self.queue.kernel_entries());
    }

    /// Submits what was pushed and turns completions into replies.
    fn submit_and_reap(&mut self) -> io::Result<bool> {
        self.submit();
        if self.in_flight == 0 {
            return Ok(false);
        }
        self.queue.reap(&mut self.completions);
        self.dirty.completed(&self.completions);
        let reaped = !self.completions.is_empty();
        if reaped {
            // Completion time, once per round: requests served inline
            // completed after this round's stamp was taken.
            self.now = self.clock.now();
        }
        let mut completions = std::mem::take(&mut self.completions);
        for completion in completions.drain(..) {
            self.in_flight -= 1;
            self.complete(completion.tag as usize, completion.errno);
        }
        self.completions = completions;
        self.stats.in_flight.set(self.in_flight as u64);
        // A flush that follows a FUA discard or zeroing was pushed just now.
        self.submit();
        Ok(reaped)
    }

    fn complete(&mut self, index: usize, host_errno: i32) {
        let slot = &mut self.slots[index];
        if host_errno != 0 {
            return self.reply_error(index, errno::from_host(host_errno));
        }
        if std::mem::take(&mut slot.then_flush) {
            return self.push(index, IoOp::Flush);
        }
        match slot.verdict {
            Ok(Command::Read { len, whole, .. }) => self.reply_read(index, len as usize, whole),
            _ => self.reply_done(index),
        }
    }

    fn reply_read(&mut self, index: usize, len: usize, whole: bool) {
        let mode = self.limits.mode;
        let slot = &mut self.slots[index];
        // Zeroes go as a hole, unless the client asked for one data chunk.
        if mode != Mode::Simple && !whole && slot.buf[..len].iter().all(|&b| b == 0) {
            slot.reply = ReplyHeader::read_hole(mode, &slot.request, len as u64);
        } else {
            slot.reply = ReplyHeader::read_data(mode, &slot.request, len as u64);
            slot.data_len = len;
        }
        self.queue_reply(index, 0);
    }

    /// Where a read's bytes can be spliced from, if they can: see the
    /// module's comment.
    fn splice_source(&mut self, offset: u64, len: u64) -> Option<(Arc<File>, u64)> {
        let too_long = |splicer: &Splicer| len > splicer.capacity;
        match &self.splicing {
            _ if len < SPLICE_MIN => return None,
            Splicing::Off => return None,
            Splicing::Ready(splicer) if too_long(splicer) => return None,
            _ => {}
        }
        let (file, at) = self.node.host_file(offset, len)?;
        match vsd_sys::fully_cached(file.as_fd(), at, len) {
            Ok(true) => {}
            Ok(false) => return None,
            // ENOSYS before Linux 6.5, EPERM for a file vsd cannot write on
            // kernels that say so: the connection's file would answer the
            // same every time, so it stops asking. (It answered before the
            // pipe was made, if there is one: never an error then.)
            Err(_) => {
                if matches!(self.splicing, Splicing::Untried) {
                    self.splicing = Splicing::Off;
                }
                return None;
            }
        }
        let splicer = self.splicer()?;
        // The pipe holds one page of the file per slot, whatever the bytes
        // used of it: the pages the range spans must fit.
        let page = vsd_sys::page_size();
        if (at % page + len).div_ceil(page) * page > splicer.capacity {
            return None;
        }
        Some((file, at))
    }

    /// The connection's pipe, made the first time; `None` if it cannot be.
    fn splicer(&mut self) -> Option<&mut Splicer> {
        if matches!(self.splicing, Splicing::Untried) {
            let made = Pipe::new().and_then(|pipe| Ok((pipe.set_capacity(PIPE_CAPACITY)?, pipe)));
            self.splicing = match made {
                Ok((capacity, pipe)) => {
                    Splicing::Ready(Splicer { pipe, capacity: capacity as u64, piped: 0, staged: None })
                }
                Err(e) => {
                    log::warn!("NBD export '{}': no pipe for spliced reads: {e}", self.export.config.id);
                    Splicing::Off
                }
            };
        }
        match &mut self.splicing {
            Splicing::Ready(splicer) => Some(splicer),
            _ => None,
        }
    }

    /// Answers a read that [`Self::splice_source`] found a host file for:
    /// its reply goes in line now (counted as any read), its bytes are
    /// spliced when it goes out. Always one data chunk: the bytes are never
    /// looked at, so zeroes are not told apart as a hole.
    fn reply_spliced(&mut self, index: usize, len: u64, host: (Arc<File>, u64)) {
        let slot = &mut self.slots[index];
        slot.reply = ReplyHeader::read_data(self.limits.mode, &slot.request, len);
        slot.data_len = 0;
        slot.splice = Some(host);
        self.queue_reply(index, 0);
    }

    fn reply_done(&mut self, index: usize) {
        let slot = &mut self.slots[index];
        slot.reply = ReplyHeader::done(self.limits.mode, &slot.request);
        self.queue_reply(index, 0);
    }

    fn reply_error(&mut self, index: usize, errno: u32) {
        let slot = &mut self.slots[index];
        slot.reply = ReplyHeader::error(self.limits.mode, &slot.request, errno);
        self.queue_reply(index, errno);
    }

    /// Answers block status, one chunk per selected context, synchronously:
    /// the first chunk's header is the slot's reply, the others' headers
    /// and every chunk's descriptors follow in its buffer.
    fn block_status(&mut self, index: usize, offset: u64, len: u64, one: bool) {
        let mode = self.limits.mode;
        let size = proto::extent_size(mode);
        // The contexts share the room one context would have.
        let max = if one { 1 } else { MAX_EXTENTS / self.contexts.len() };
        let mut used = 0;
        for (n, &context) in self.contexts.iter().enumerate() {
            let header_at = used;
            if n > 0 {
                used += proto::MAX_REPLY_HEADER; // room for the header, moved down below
            }
            let (mut pos, end, mut count) = (offset, offset + len, 0);
            while pos < end && count < max {
                let (n, flags) = match self.status(context, pos, (end - pos).min(proto::max_extent(mode))) {
                    Ok(status) => status,
                    Err(e) => {
                        log::warn!("NBD export '{}': block status failed: {e}", self.export.config.id);
                        return self.reply_error(index, errno::EIO);
                    }
                };
                let at = used + count * size;
                proto::encode_extent(mode, n, flags, &mut self.slots[index].buf[at..at + size]);
                (pos, count) = (pos + n, count + 1);
            }
            let last = n + 1 == self.contexts.len();
            let slot = &mut self.slots[index];
            let header = ReplyHeader::block_status(mode, &slot.request, context.id(), count, last);
            let body = count * size;
            if n == 0 {
                slot.reply = header;
            } else {
                let bytes = header.as_bytes();
                slot.buf.copy_within(used..used + body, header_at + bytes.len());
                slot.buf[header_at..header_at + bytes.len()].copy_from_slice(bytes);
                used = header_at + bytes.len();
            }
            used += body;
        }
        self.slots[index].data_len = used;
        self.queue_reply(index, 0);
    }

    /// How the bytes from `offset` are in `context`, and for how many of
    /// them (1 to `len`): an extent's length and flags.
    fn status(&self, context: Context, offset: u64, len: u64) -> io::Result<(u64, u32)> {
        Ok(match context {
            Context::BaseAllocation => match self.node.block_status(offset, len)? {
                (Allocation::Data, n) => (n, 0),
                (Allocation::Hole, n) => (n, state::HOLE | state::ZERO),
            },
            Context::AllocationDepth => {
                let (depth, n) = self.node.allocation_depth(offset, len)?;
                (n, depth)
            }
            Context::DirtyBitmap(i) => {
                let (dirty, n) = self.export.bitmaps[i].bitmap().status(offset, len);
                (n, if dirty { state::DIRTY } else { 0 })
            }
        })
    }

    fn queue_reply(&mut self, index: usize, errno: u32) {
        let slot = &self.slots[index];
        self.replies.push_back(index);
        let kind = match slot.request.kind {
            proto::cmd::READ => Some(OpKind::Read),
            proto::cmd::WRITE | proto::cmd::WRITE_ZEROES => Some(OpKind::Write),
            proto::cmd::FLUSH => Some(OpKind::Flush),
            proto::cmd::TRIM => Some(OpKind::Unmap),
            _ => None,
        };
        if let Some(kind) = kind {
            let op = self.stats.op(kind);
            op.ops.add(1);
            if errno != 0 {
                op.failed.add(1);
            } else if matches!(kind, OpKind::Read | OpKind::Write | OpKind::Unmap) {
                op.bytes.add(slot.request.len);
            }
            op.latency.record(self.now.saturating_sub(slot.started));
        }
    }

    /// Writes the replies ready, as many as one `writev` takes; true if
    /// any byte went out.
    ///
    /// A spliced read ends the `writev` at its header: its bytes are in the
    /// pipe by then ([`Self::stage`]), and go out from there, all of them
    /// before any byte of a later reply.
    fn send(&mut self) -> io::Result<bool> {
        let Some(&front) = self.replies.front() else {
            // A TLS wire may still hold records of replies it took.
            return self.stream.flush_held();
        };
        if self.slots[front].splice.is_some() && self.sent == self.slots[front].reply.as_bytes().len() {
            return self.drain_pipe(front);
        }
        let window = self.replies.len().min(MAX_IOV / 2);
        for at in 0..window {
            let index = self.replies[at];
            // Staging may turn the reply into a buffered one: then the next.
            if self.slots[index].splice.is_some() && self.stage(index)? {
                break;
            }
        }
        let mut iov = [IoSlice::new(&[]); MAX_IOV];
        let mut count = 0;
        let mut skip = self.sent;
        for &index in self.replies.iter().take(window) {
            let slot = &self.slots[index];
            for part in [slot.reply.as_bytes(), &slot.buf[..slot.data_len]] {
                let from = skip.min(part.len());
                skip -= from;
                if from < part.len() {
                    iov[count] = IoSlice::new(&part[from..]);
                    count += 1;
                }
            }
            if slot.splice.is_some() {
                break;
            }
        }
        let mut n = match self.stream.write_vectored(&iov[..count]) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => return Ok(true),
            Err(e) => return Err(e),
        };
        while let Some(&index) = self.replies.front() {
            let slot = &self.slots[index];
            let header = slot.reply.as_bytes().len();
            let left = header + slot.data_len - self.sent;
            if n < left {
                self.sent += n;
                break;
            }
            n -= left;
            if slot.splice.is_some() {
                // Its header is out: its bytes follow from the pipe.
                self.sent = header;
                return self.drain_pipe(index).map(|_| true);
            }
            self.sent = 0;
            self.replies.pop_front();
            self.release(index);
        }
        Ok(true)
    }

    /// Puts the bytes of spliced read `index`, the first spliced reply in
    /// line, into the pipe, unless they are there already: before its
    /// header goes out, so that a failure can still be answered. True if
    /// the reply stays spliced; an error (the pipe could not be read back,
    /// which should not happen) ends the connection.
    ///
    /// If the pipe takes less than the whole range, the reply becomes a
    /// buffered one: what the pipe took, then the rest read from the file
    /// on this thread (rare: the pages left the cache or the pipe holds
    /// fewer than it should), zeroes past the end of a file made shorter
    /// by another process (as the queue's reads), or, if the file cannot
    /// be read, an error reply.
    fn stage(&mut self, index: usize) -> io::Result<bool> {
        let Splicing::Ready(splicer) = &mut self.splicing else { return Err(no_pipe()) };
        if splicer.staged.is_some() {
            debug_assert_eq!(splicer.staged, Some(index));
            return Ok(true);
        }
        debug_assert_eq!(splicer.piped, 0);
        let slot = &mut self.slots[index];
        let Some((file, at)) = &slot.splice else { return Ok(false) };
        let (at, len) = (*at, slot.request.len as usize);
        let mut filled = 0;
        while filled < len {
            match splicer.pipe.fill_from(file.as_fd(), at + filled as u64, len - filled) {
                Ok(0) => break,
                Ok(n) => filled += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    log::debug!("NBD export '{}': splicing a read: {e}", self.export.config.id);
                    break;
                }
            }
        }
        if filled == len {
            (splicer.piped, splicer.staged) = (len, Some(index));
            return Ok(true);
        }
        // The pipe is emptied into the buffer, which the file fills up.
        let mut taken = 0;
        while taken < filled {
            match splicer.pipe.read(&mut slot.buf[taken..filled]) {
                Ok(n) => taken += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(io::Error::other(format!("a pipe holding {} bytes: {e}", filled - taken))),
            }
        }
        let read = loop {
            match std::os::unix::fs::FileExt::read_at(&**file, &mut slot.buf[filled..len], at + filled as u64) {
                Ok(0) => break Ok(()),
                Ok(n) => filled += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => break Err(e),
            }
            if filled == len {
                break Ok(());
            }
        };
        slot.splice = None;
        match read {
            Ok(()) => {
                slot.buf[filled..len].fill(0);
                slot.data_len = len;
            }
            Err(e) => {
                log::warn!("NBD export '{}': a read failed: {e}", self.export.config.id);
                let code = errno::from_host(e.raw_os_error().unwrap_or(libc::EIO));
                slot.reply = ReplyHeader::error(self.limits.mode, &slot.request, code);
                // Counted as a failed read, not as bytes read.
                let op = self.stats.op(OpKind::Read);
                op.failed.add(1);
                op.bytes.add((len as u64).wrapping_neg());
            }
        }
        Ok(false)
    }

    /// Sends what the pipe holds of spliced read `index`, whose header is
    /// out; the slot is free once all of it is. True if any byte went out.
    fn drain_pipe(&mut self, index: usize) -> io::Result<bool> {
        let (Splicing::Ready(splicer), Some(socket)) = (&mut self.splicing, self.stream.splice_fd()) else {
            return Err(no_pipe());
        };
        let mut progress = false;
        while splicer.piped > 0 {
            match splicer.pipe.drain_to(socket, splicer.piped) {
                Ok(0) => return Err(io::Error::new(io::ErrorKind::WriteZero, "the socket took no bytes")),
                Ok(n) => {
                    splicer.piped -= n;
                    progress = true;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(progress),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        splicer.staged = None;
        self.sent = 0;
        self.replies.pop_front();
        self.release(index);
        Ok(true)
    }

    /// Frees a slot; a large buffer goes back to the allocator.
    fn release(&mut self, index: usize) {
        let slot = &mut self.slots[index];
        slot.data_len = 0;
        slot.splice = None;
        if slot.buf.len() > KEEP {
            self.buffered -= slot.buf.len();
            slot.buf = AlignedBuf::zeroed(0);
        }
        self.free.push(index);
    }

    /// Sleeps until the socket or the engine has something.
    fn wait(&mut self) -> io::Result<()> {
        let mut events = [EpollEvent::default(); 2];
        // An engine without a descriptor completes within submit or reap:
        // look again soon rather than sleep while requests are in flight.
        let timeout = if self.in_flight > 0 && self.queue.notify_fd().is_none() { 1 } else { -1 };
        let n = match self.epoll.wait(timeout, &mut events) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => return Ok(()),
            Err(e) => return Err(e),
        };
        self.stats.wakeups.add(1);
        if events[..n].iter().any(|e| e.data() == TOKEN_ENGINE) {
            self.queue.rearm();
        }
        Ok(())
    }
}
