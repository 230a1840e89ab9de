//! The thread that owns a node's connection: it sends the commands the
//! node's queues hand it, reads the replies, and posts each completion to
//! the mailbox of the queue that sent it.
//!
//! One connection per node, as QEMU's client keeps: a flush then covers
//! every write of the node whatever the server says about multi-conn. The
//! socket is non-blocking and the thread waits on it and on the queues'
//! wake-up descriptor together, so a server that stops reading can never
//! stop replies from being read (the classic NBD deadlock of a client
//! blocked writing while the server is blocked writing to it).
//!
//! With structured replies (negotiated when the server has them, for block
//! status), a read's data may come in chunks: each goes straight from the
//! input buffer to the request's buffers, a hole chunk zero-fills its part,
//! and a chunk that does not fit the request (or that vsd does not know)
//! fails the request with EIO, never writing outside its buffers.
//!
//! When the connection breaks, the commands on the wire go back to the
//! front of the line and the thread dials again; commands wait up to
//! `reconnect-delay` for a new connection, then fail with EIO, as do the
//! commands sent while no connection has come back after the delay.

use std::collections::VecDeque;
use std::io::{self, IoSlice};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};
use vsd_engine::{Completion, IoVecs, Mailbox};
use vsd_nbd_proto::{BadMagic, ChunkHeader, ReplyStart, Request, SimpleReply, chunk, cmd, errno};

use vsd_net::Wire;

use crate::handshake::Export;
use crate::{Config, ConnectError};

/// Bytes of encoded commands kept unsent before the thread stops taking
/// more from the queues' line (one command may exceed it).
const OUT_HIGH: usize = 256 << 10;
/// Where replies are read to before their data is copied out.
const IN_BUFFER: usize = 256 << 10;
/// The first and the longest pause between two attempts to dial again.
const FIRST_RETRY: Duration = Duration::from_millis(50);
const LONGEST_RETRY: Duration = Duration::from_secs(1);

/// One NBD command, as a queue hands it to the thread.
pub(crate) struct Command {
    /// Where its completion goes.
    pub mailbox: Arc<Mailbox>,
    /// The queue's tag for the request this command is (part of).
    pub tag: u32,
    /// The header, but for the cookie, which the thread chooses.
    pub kind: u16,
    pub flags: u16,
    pub offset: u64,
    pub len: u32,
    /// A read's destination or a write's source.
    pub data: Data,
    /// A durable write to a server without FUA: a flush follows it.
    pub then_flush: bool,
}

/// Where a command's payload is.
pub(crate) enum Data {
    None,
    /// Bytes `pos..pos + len` of a request's buffers.
    Buffers {
        iov: IoVecs,
        pos: u64,
    },
    /// Zeroes (WRITE_ZEROES for a server without it).
    Zeroes,
    /// Where a BLOCK_STATUS puts the first `base:allocation` extent the
    /// server gives: its length and flags.
    Status(Arc<Mutex<Option<(u32, u32)>>>),
}

/// A reply's payload being consumed: read data going to the command's
/// buffers from `at` (bytes from the command's offset), or bytes skipped;
/// `last` if the reply ends with it.
#[derive(Clone, Copy)]
enum Payload {
    Data { cookie: usize, at: u64, left: u32, last: bool },
    Skip { cookie: usize, left: u32, last: bool },
}

/// What the chunks of a command's reply have said so far.
#[derive(Clone, Copy, Default)]
struct Progress {
    /// The first error.
    errno: i32,
    /// Bytes of a read filled (data and holes).
    got: u64,
}

/// The bytes of a chunk's payload read before the chunk is handled (the
/// rest is data or skipped): at most 12.
fn chunk_prefix(kind: u16) -> u32 {
    match kind {
        chunk::OFFSET_DATA => 8,
        chunk::OFFSET_HOLE | chunk::BLOCK_STATUS => 12,
        kind if kind & chunk::ERROR_BIT != 0 => 4,
        _ => 0,
    }
}

fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}

/// What the node, its queues and the thread share.
pub(crate) struct Shared {
    pub export: Export,
    line: Mutex<Vec<Command>>,
    wake: EventFd,
    /// The node and its queues: the thread ends when none is left.
    users: AtomicUsize,
}

impl Shared {
    pub(crate) fn new(export: Export) -> io::Result<Self> {
        Ok(Self { export, line: Mutex::new(Vec::new()), wake: EventFd::new(EFD_NONBLOCK)?, users: AtomicUsize::new(1) })
    }

    /// Hands `commands` to the thread.
    pub(crate) fn send(&self, commands: &mut Vec<Command>) {
        self.line.lock().unwrap_or_else(PoisonError::into_inner).append(commands);
        self.signal();
    }

    pub(crate) fn join(&self) {
        self.users.fetch_add(1, Ordering::Relaxed);
    }

    /// A user goes away; the last one ends the thread.
    pub(crate) fn leave(&self) {
        self.users.fetch_sub(1, Ordering::Release);
        self.signal();
    }

    fn signal(&self) {
        if let Err(e) = self.wake.write(1) {
            log::warn!("cannot wake an NBD connection's thread: {e}");
        }
    }
}

/// The thread's state.
pub(crate) struct Link {
    shared: Arc<Shared>,
    config: Config,
    socket: Option<Box<dyn Wire>>,
    /// Taken from the line, not on the wire yet.
    waiting: VecDeque<Command>,
    /// On the wire, by cookie, with what their replies said so far;
    /// `free` lists the unused cookies.
    sent: Vec<Option<Command>>,
    progress: Vec<Progress>,
    free: Vec<usize>,
    /// This connection's structured replies and `base:allocation` id.
    structured: bool,
    context: Option<u32>,
    out: Vec<u8>,
    out_pos: usize,
    input: Box<[u8]>,
    in_start: usize,
    in_end: usize,
    /// The reply payload being consumed.
    payload: Option<Payload>,
    /// When the connection broke, until a reply shows a new one works.
    lost: Option<Instant>,
    next_dial: Instant,
    retry: Duration,
}

impl Link {
    pub(crate) fn new(shared: Arc<Shared>, config: Config, socket: Box<dyn Wire>) -> Self {
        let Export { structured, allocation_context: context, .. } = shared.export;
        Self {
            shared,
            config,
            socket: Some(socket),
            waiting: VecDeque::new(),
            sent: Vec::new(),
            progress: Vec::new(),
            free: Vec::new(),
            structured,
            context,
            out: Vec::new(),
            out_pos: 0,
            input: vec![0; IN_BUFFER].into_boxed_slice(),
            in_start: 0,
            in_end: 0,
            payload: None,
            lost: None,
            next_dial: Instant::now(),
            retry: FIRST_RETRY,
        }
    }

    pub(crate) fn run(mut self) {
        loop {
            // Non-blocking: the wake-up may have been for the socket.
            let _ = self.shared.wake.read();
            let mut line = std::mem::take(&mut *self.shared.line.lock().unwrap_or_else(PoisonError::into_inner));
            self.waiting.extend(line.drain(..));
            if self.socket.is_none() {
                self.dial_again();
            }
            if self.socket.is_some()
                && let Err(e) = self.exchange()
            {
                // At once to dialling (when it is time) and sending again.
                self.lose(e);
                continue;
            }
            if self.shared.users.load(Ordering::Acquire) == 0 {
                break;
            }
            self.wait();
        }
        self.disconnect();
    }

    /// Sleeps until the queues or the socket have something, or until it
    /// is time to dial again or to give up waiting for a connection.
    fn wait(&self) {
        let mut fds = [libc::pollfd { fd: self.shared.wake.as_raw_fd(), events: libc::POLLIN, revents: 0 }; 2];
        let mut count = 1;
        let mut timeout = -1;
        match &self.socket {
            Some(socket) => {
                let pending = self.out_pos < self.out.len() || socket.holds_back();
                let events = if pending { libc::POLLIN | libc::POLLOUT } else { libc::POLLIN };
                fds[1] = libc::pollfd { fd: socket.as_raw_fd(), events, revents: 0 };
                count = 2;
            }
            None => {
                let now = Instant::now();
                let mut until = self.next_dial;
                if let Some(deadline) = self.give_up_at().filter(|_| !self.waiting.is_empty()) {
                    until = until.min(deadline);
                }
                timeout = until.saturating_duration_since(now).as_millis().min(i32::MAX as u128) as i32;
            }
        }
        // SAFETY: `fds` holds `count` initialised entries naming open
        // descriptors (the wake-up eventfd and our socket).
        let ret = unsafe { libc::poll(fds.as_mut_ptr(), count, timeout) };
        if ret < 0 && io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
            log::warn!("waiting on an NBD connection: {}", io::Error::last_os_error());
            std::thread::sleep(FIRST_RETRY);
        }
    }

    fn give_up_at(&self) -> Option<Instant> {
        self.lost.map(|lost| lost + self.config.reconnect_delay)
    }

    /// Sends what it can, reads what has come.
    fn exchange(&mut self) -> Result<(), LinkError> {
        self.read_replies()?;
        self.encode();
        self.write_out()
    }

    /// Moves commands from `waiting` to the output buffer, each with a cookie.
    fn encode(&mut self) {
        while self.out.len() - self.out_pos < OUT_HIGH
            && let Some(command) = self.waiting.pop_front()
        {
            if command.kind == cmd::BLOCK_STATUS && self.context.is_none() {
                // This connection cannot say: the caller takes it all as data.
                command.mailbox.post(Completion { tag: command.tag, errno: 0 });
                continue;
            }
            if let Data::Status(slot) = &command.data {
                *slot.lock().unwrap_or_else(PoisonError::into_inner) = None;
            }
            let cookie = self.free.pop().unwrap_or_else(|| {
                self.sent.push(None);
                self.progress.push(Progress::default());
                self.sent.len() - 1
            });
            self.progress[cookie] = Progress::default();
            let header = Request {
                flags: command.flags,
                kind: command.kind,
                cookie: cookie as u64,
                offset: command.offset,
                len: u64::from(command.len),
            };
            let mut bytes = [0; 28];
            header.encode(&mut bytes);
            self.out.extend_from_slice(&bytes);
            if command.kind == cmd::WRITE {
                let at = self.out.len();
                self.out.resize(at + command.len as usize, 0);
                if let Data::Buffers { iov, pos } = command.data {
                    // SAFETY: the queue's caller keeps the buffers valid
                    // until the request completes, which is after this.
                    unsafe { iov.copy_out(pos, &mut self.out[at..]) };
                }
            }
            self.sent[cookie] = Some(command);
        }
    }

    fn write_out(&mut self) -> Result<(), LinkError> {
        let Some(socket) = self.socket.as_mut() else { return Ok(()) };
        if socket.holds_back() {
            socket.flush_held().map_err(LinkError::Io)?;
        }
        while self.out_pos < self.out.len() {
            match socket.write_vectored(&[IoSlice::new(&self.out[self.out_pos..])]) {
                Ok(0) => return Err(LinkError::Closed),
                Ok(n) => self.out_pos += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(LinkError::Io(e)),
            }
        }
        self.out.clear();
        self.out_pos = 0;
        if self.out.capacity() > 4 * OUT_HIGH {
            self.out.shrink_to(OUT_HIGH);
        }
        Ok(())
    }

    fn read_replies(&mut self) -> Result<(), LinkError> {
        loop {
            if self.in_start == self.in_end {
                (self.in_start, self.in_end) = (0, 0);
            } else if self.in_end == self.input.len() {
                self.input.copy_within(self.in_start..self.in_end, 0);
                (self.in_start, self.in_end) = (0, self.in_end - self.in_start);
            }
            let Some(socket) = self.socket.as_mut() else { return Ok(()) };
            match socket.read(&mut self.input[self.in_end..]) {
                Ok(0) => return Err(LinkError::Closed),
                Ok(n) => {
                    self.in_end += n;
                    self.parse()?;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(LinkError::Io(e)),
            }
        }
    }

    /// Consumes whole replies and read data from the input buffer.
    fn parse(&mut self) -> Result<(), LinkError> {
        loop {
            if let Some(payload) = self.payload {
                if !self.consume(payload)? {
                    return Ok(());
                }
                continue;
            }
            let available = &self.input[self.in_start..self.in_end];
            let Some(start) = ReplyStart::parse(available, self.structured).map_err(LinkError::Magic)? else {
                return Ok(());
            };
            match start {
                ReplyStart::Simple(reply) => {
                    self.in_start += SimpleReply::SIZE;
                    let cookie = self.on_wire(reply.cookie)?;
                    let len = self.sent[cookie].as_ref().map_or(0, |c| if c.kind == cmd::READ { c.len } else { 0 });
                    if reply.error == 0 && len > 0 {
                        self.payload = Some(Payload::Data { cookie, at: 0, left: len, last: true });
                    } else {
                        self.complete(cookie, if reply.error == 0 { 0 } else { errno::to_host(reply.error) });
                    }
                }
                ReplyStart::Chunk(header) => {
                    let need = chunk_prefix(header.kind).min(header.len) as usize;
                    if available.len() < ChunkHeader::SIZE + need {
                        return Ok(());
                    }
                    let mut prefix = [0u8; 12];
                    prefix[..need].copy_from_slice(&available[ChunkHeader::SIZE..ChunkHeader::SIZE + need]);
                    self.in_start += ChunkHeader::SIZE + need;
                    let cookie = self.on_wire(header.cookie)?;
                    self.payload = Some(self.chunk(cookie, header, &prefix[..need]));
                }
            }
        }
    }

    /// The cookie of a command on the wire, from a reply.
    fn on_wire(&self, cookie: u64) -> Result<usize, LinkError> {
        usize::try_from(cookie)
            .ok()
            .filter(|&c| self.sent.get(c).is_some_and(Option::is_some))
            .ok_or(LinkError::Cookie(cookie))
    }

    /// Handles a chunk of `cookie`'s reply, its header and the first bytes
    /// of its payload: what is left of the payload is data or skipped.
    fn chunk(&mut self, cookie: usize, header: ChunkHeader, prefix: &[u8]) -> Payload {
        let last = header.flags & chunk::FLAG_DONE != 0;
        let rest = header.len - prefix.len() as u32;
        let skip = Payload::Skip { cookie, left: rest, last };
        let Some(command) = self.sent[cookie].as_ref() else { return skip };
        let progress = &mut self.progress[cookie];
        // Where a read chunk at `offset` for `len` bytes lands, if inside.
        let inside = |offset: u64, len: u64| {
            let at = offset.checked_sub(command.offset)?;
            (command.kind == cmd::READ && at.checked_add(len)? <= u64::from(command.len)).then_some(at)
        };
        let mut bad = false;
        match header.kind {
            chunk::NONE => bad = header.len != 0 || !last,
            chunk::OFFSET_DATA if prefix.len() == 8 => {
                let offset = u64::from_be_bytes(prefix.try_into().unwrap_or_default());
                match inside(offset, u64::from(rest)) {
                    Some(at) => return Payload::Data { cookie, at, left: rest, last },
                    None => bad = true,
                }
            }
            chunk::OFFSET_HOLE if header.len == 12 => {
                let offset = u64::from_be_bytes(prefix[..8].try_into().unwrap_or_default());
                let len = be32(&prefix[8..]);
                match (inside(offset, u64::from(len)), &command.data) {
                    (Some(at), Data::Buffers { iov, pos }) => {
                        // SAFETY: the range is inside the command's part of
                        // the request's buffers, valid until it completes.
                        unsafe { iov.fill(pos + at, u64::from(len), None) };
                        progress.got += u64::from(len);
                    }
                    _ => bad = true,
                }
            }
            chunk::BLOCK_STATUS if header.len >= 12 && (header.len - 4).is_multiple_of(8) => match &command.data {
                Data::Status(slot) if Some(be32(prefix)) == self.context => {
                    let mut slot = slot.lock().unwrap_or_else(PoisonError::into_inner);
                    slot.get_or_insert((be32(&prefix[4..]), be32(&prefix[8..])));
                }
                _ => bad = true,
            },
            kind if kind & chunk::ERROR_BIT != 0 => {
                let wire = if prefix.len() == 4 { be32(prefix) } else { 0 };
                if progress.errno == 0 {
                    progress.errno = if wire == 0 { libc::EIO } else { errno::to_host(wire) };
                }
            }
            // An unknown chunk, or a known one that makes no sense.
            _ => bad = true,
        }
        if bad && progress.errno == 0 {
            progress.errno = libc::EIO;
        }
        skip
    }

    /// Consumes what has come of `payload`; whether it is all in.
    fn consume(&mut self, payload: Payload) -> Result<bool, LinkError> {
        let available = (self.in_end - self.in_start) as u32;
        let (cookie, last) = match payload {
            Payload::Data { cookie, at, left, last } => {
                // A read being copied is on the wire until its data is in.
                let Some(command) = self.sent.get(cookie).and_then(Option::as_ref) else {
                    return Err(LinkError::Cookie(cookie as u64));
                };
                let n = left.min(available);
                if let Data::Buffers { iov, pos } = command.data {
                    let bytes = &self.input[self.in_start..self.in_start + n as usize];
                    // SAFETY: the buffers are the request's, valid and
                    // untouched by anyone else until it completes, and the
                    // range was checked to be inside the command's part.
                    unsafe { iov.fill(pos + at, u64::from(n), Some(bytes)) };
                }
                self.in_start += n as usize;
                self.progress[cookie].got += u64::from(n);
                if n < left {
                    self.payload = Some(Payload::Data { cookie, at: at + u64::from(n), left: left - n, last });
                    return Ok(false);
                }
                (cookie, last)
            }
            Payload::Skip { cookie, left, last } => {
                let n = left.min(available);
                self.in_start += n as usize;
                if n < left {
                    self.payload = Some(Payload::Skip { cookie, left: left - n, last });
                    return Ok(false);
                }
                (cookie, last)
            }
        };
        self.payload = None;
        if last {
            let progress = self.progress[cookie];
            let short =
                self.sent[cookie].as_ref().is_some_and(|c| c.kind == cmd::READ && progress.got < u64::from(c.len));
            let errno = if progress.errno == 0 && short { libc::EIO } else { progress.errno };
            self.complete(cookie, errno);
        }
        Ok(true)
    }

    /// Finishes the command on the wire under `cookie`.
    fn complete(&mut self, cookie: usize, errno: i32) {
        let Some(command) = self.sent[cookie].take() else { return };
        self.free.push(cookie);
        // The connection works: a later break waits `reconnect-delay` anew.
        (self.lost, self.retry) = (None, FIRST_RETRY);
        if errno == 0 && command.then_flush {
            let flush = Command {
                kind: cmd::FLUSH,
                flags: 0,
                offset: 0,
                len: 0,
                data: Data::None,
                then_flush: false,
                ..command
            };
            self.waiting.push_front(flush);
            return;
        }
        command.mailbox.post(Completion { tag: command.tag, errno });
    }

    /// The connection broke: what was on the wire waits to be sent again.
    fn lose(&mut self, why: LinkError) {
        log::warn!("NBD connection to {} (export '{}') lost: {why}", self.config.server, self.config.export);
        self.socket = None;
        self.payload = None;
        (self.in_start, self.in_end) = (0, 0);
        self.out.clear();
        self.out_pos = 0;
        let on_wire: Vec<Command> = self.sent.drain(..).flatten().collect();
        for command in on_wire.into_iter().rev() {
            self.waiting.push_front(command);
        }
        self.free.clear();
        self.lost.get_or_insert_with(Instant::now);
        // A server that breaks every connection is dialled less and less often.
        self.next_dial = Instant::now() + self.retry;
        self.retry = (self.retry * 2).min(LONGEST_RETRY);
        self.give_up_if_late();
    }

    /// Dials if it is time to; fails the waiting commands once the delay
    /// for a new connection has passed.
    fn dial_again(&mut self) {
        let now = Instant::now();
        if now >= self.next_dial {
            match crate::dial(&self.config) {
                Ok((socket, export)) if export.size == self.shared.export.size => {
                    log::info!("NBD connection to {} (export '{}') is back", self.config.server, self.config.export);
                    self.socket = Some(socket);
                    (self.structured, self.context) = (export.structured, export.allocation_context);
                    return;
                }
                Ok((_, export)) => log::warn!(
                    "NBD export '{}' on {} came back with {} bytes instead of {}: not used",
                    self.config.export,
                    self.config.server,
                    export.size,
                    self.shared.export.size
                ),
                Err(e) => log::debug!("NBD connection to {}: {e}", self.config.server),
            }
            self.next_dial = now + self.retry;
            self.retry = (self.retry * 2).min(LONGEST_RETRY);
        }
        self.give_up_if_late();
    }

    /// Fails the waiting commands once `reconnect-delay` has passed since
    /// the connection broke (at once without a delay).
    fn give_up_if_late(&mut self) {
        if self.give_up_at().is_some_and(|deadline| Instant::now() >= deadline) {
            for command in self.waiting.drain(..) {
                command.mailbox.post(Completion { tag: command.tag, errno: libc::EIO });
            }
        }
    }

    /// Says goodbye to the server (NBD_CMD_DISC), best effort.
    fn disconnect(&mut self) {
        let Some(socket) = self.socket.as_mut() else { return };
        let mut bytes = [0; 28];
        Request { kind: cmd::DISC, ..Default::default() }.encode(&mut bytes);
        let _ = socket.write_vectored(&[IoSlice::new(&bytes)]);
        socket.close();
    }
}

/// Why a connection broke.
#[derive(Debug, thiserror::Error)]
enum LinkError {
    #[error("{0}")]
    Io(io::Error),
    #[error("the server closed the connection")]
    Closed,
    #[error("the server sent a reply it was not asked for (cookie {0})")]
    Cookie(u64),
    #[error("the server sent a reply vsd cannot read ({0})")]
    Magic(BadMagic),
}

/// Opens the first connection (the node's open fails if it fails) and
/// starts the thread.
pub(crate) fn start(config: Config) -> Result<Arc<Shared>, ConnectError> {
    let (socket, export) = crate::dial(&config)?;
    let shared = Arc::new(Shared::new(export).map_err(ConnectError::Io)?);
    let link = Link::new(shared.clone(), config, socket);
    std::thread::Builder::new().name("nbd-client".into()).spawn(move || link.run()).map_err(ConnectError::Io)?;
    Ok(shared)
}
