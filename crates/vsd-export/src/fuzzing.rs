//! Not part of vsd's API: it exists for fuzzing only. The fuzz target
//! `vhost_user_messages` in `fuzz/` and the regression tests that replay
//! what it found drive one vhost-user connection through it, as the export
//! serves one: a `Session` behind rust-vmm's `BackendReqHandler`, the
//! back-end request channel intercepted before each message, the
//! connection dropped at the first error.
//!
//! [`run`] decodes an input into vhost-user messages and sends them from
//! the front-end's end of a socket pair, with file descriptors attached.
//!
//! Input: two bytes of set-up, then operations until the input ends.
//!
//! | byte | what |
//! |---|---|
//! | 0 | bits 0-1 queues - 1 (one worker thread per two queues); bit 2 writable; bit 3 `poll-us=50` (else 0); bit 4 `call-batch-us=20`; bits 5-7 prefix (below) |
//! | 1 | prefix only: bits 0-3 queue size `2 << (n % 10)`; bit 4 EVENT_IDX off; bits 5-7 requests queued per ring |
//!
//! Prefix 0-3: none. 4: a valid set-up as QEMU sends it (owner, features,
//! protocol features, queue count, memory table with a 256 KiB memfd holding
//! the rings, then per ring its size, addresses, base, call, kick and
//! enable), after which every ring's worker runs. 5: the same with
//! GET_INFLIGHT_FD and SET_INFLIGHT_FD (the region the back-end returned)
//! first. 6: the same without PROTOCOL_FEATURES (rings start enabled, no
//! SET_VRING_ENABLE). 7: as 4 with every message asking for a reply.
//!
//! An operation is a tag byte, then by `tag % 8`:
//!
//! - 0-4, a message: `code` (`< 0xF0`: `code % 45`, every front-end
//!   request and 0; else a `u32` code follows), `shape` (bit 0 NEED_REPLY,
//!   bit 1 REPLY; bit 2: a raw `u32` of flags follows instead; bits 3-4 the
//!   size field: 0 and 3 the body's length, 1 the length plus an `i8` that
//!   follows, 2 a raw `u32` that follows; bits 5-6: 0-3 descriptors), one
//!   descriptor spec per descriptor, a `u16` body length (`& 0x1fff`, so
//!   past the 4 KiB limit too) and the body;
//! - 5, a kick: `n`: write 1 to eventfd `(n & 0x7f) % count` sent so far
//!   (all of them for 0x7f), as a guest kick would; with bit 7, read it and
//!   write the most an eventfd holds instead (a front-end that fills its
//!   call eventfds and never reads them);
//! - 6, raw bytes: a `u8` length and the bytes, written with no framing;
//! - 7, `m`: `m % 4` 0 the node grows by 1 MiB and the front-end is told
//!   (CONFIG_CHANGE_MSG on the back-end channel), 1 a 200 µs pause, 2 the
//!   guest writes its memory (`u32` offset modulo the last memfd's size,
//!   `u8` length, bytes), 3 the front-end closes its copies of what it sent.
//!
//! A descriptor spec is a kind byte, by bits 0-2: 0 a memfd (`u32` size
//! `& 0x3ff_ffff`, then a `u16` length and that many bytes written at its
//! start: the size need not cover what a region claims); 1 an eventfd
//! (non-blocking with bit 3); 2 `/dev/null`; 3 one end of a socket pair
//! (non-blocking); 4 the last descriptor the back-end sent (an inflight
//! region), else `/dev/null`; 5 the last memfd again; 6 the last eventfd
//! again; 7 the front-end's own end of the connection.
//!
//! Messages are written as whole `sendmsg` calls, and handled one at a
//! time: the connection handles the next message once its header and
//! claimed body have arrived (a size that lies makes it read the next
//! message's bytes, or wait for them). Replies, and descriptors in them,
//! are read as they come. The first error ends the connection; otherwise
//! the front-end shuts its side down at the end and the connection reads
//! what is left. Dropping it stops the queue workers.

use std::fs::File;
use std::io::{self, Write};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::FileExt;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use vhost::vhost_user::message::{VhostUserProtocolFeatures, VhostUserVirtioFeatures};
use vhost::vhost_user::{BackendReqHandler, Error as ProtocolError};
use virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX;
use vmm_sys_util::sock_ctrl_msg::ScmSocket;
use vsd_block::options::OptionMap;
use vsd_block::{BlockGraph, BlockNode};

use crate::channel::{self, BackendChannel, Intercepted};
use crate::config::ExportConfig;
use crate::device::BlkDevice;
use crate::inflight::queue_region_len;
use crate::session::Session;

/// Bytes in a vhost-user message header.
pub const HEADER_LEN: usize = 12;
/// The largest body vhost-user accepts.
const MAX_BODY: usize = 0x1000;
/// Messages one input may send (each may start and stop worker threads).
const MAX_MESSAGES: usize = 512;
/// Pauses one input may take.
const MAX_PAUSES: usize = 8;

/// One front-end connection served as the export serves it.
pub struct Connection {
    handler: BackendReqHandler<Mutex<Session>>,
    session: Arc<Mutex<Session>>,
    /// Second handle on the socket, to peek at messages.
    peek: UnixStream,
    channel: Option<BackendChannel>,
    device: Arc<BlkDevice>,
}

impl Connection {
    /// Serves `stream` for an export of `node` configured as `config`.
    pub fn new(stream: UnixStream, config: ExportConfig, node: Arc<dyn BlockNode>) -> io::Result<Self> {
        let peek = stream.try_clone()?;
        let device = Arc::new(BlkDevice::new(config, node, Vec::new()));
        let session = Arc::new(Mutex::new(Session::new(device.clone())));
        let handler = BackendReqHandler::from_stream(stream, session.clone());
        Ok(Self { handler, session, peek, channel: None, device })
    }

    /// Handles the next message as the export's connection loop does: keeps
    /// a copy of a back-end channel it hands over, then lets the handler
    /// read and answer it. It blocks until the message has arrived.
    pub fn handle_next(&mut self) -> Result<(), ProtocolError> {
        match channel::intercept(&self.peek, &self.session) {
            Ok(Intercepted::Channel(channel)) => self.channel = Some(channel),
            Ok(Intercepted::Taken) => return Ok(()),
            Ok(Intercepted::Nothing) => {}
            Err(e) => return Err(ProtocolError::ReqHandlerError(e)),
        }
        self.handler.handle_request()
    }

    /// Bytes sent to the back-end and not read yet.
    pub fn unread(&self) -> io::Result<usize> {
        let mut n: libc::c_int = 0;
        // SAFETY: FIONREAD writes one int into `n`, a live local.
        let ret = unsafe { libc::ioctl(self.peek.as_raw_fd(), libc::FIONREAD, &mut n) };
        if ret < 0 { Err(io::Error::last_os_error()) } else { Ok(n.max(0) as usize) }
    }

    /// Copies the start of what is unread into `buf` without consuming
    /// it; returns how many bytes it copied (fewer at descriptors).
    pub fn peek(&self, buf: &mut [u8]) -> io::Result<usize> {
        vsd_sys::peek(self.peek.as_fd(), buf, false).map(|(n, _)| n)
    }

    /// The node was resized: as `VhostUserBlkExport::capacity_changed`,
    /// takes the new size and tells the front-end on the back-end channel.
    pub fn capacity_changed(&mut self) -> io::Result<u64> {
        let capacity = self.device.refresh_capacity();
        if let Some(channel) = &mut self.channel {
            channel.config_changed()?;
        }
        Ok(capacity)
    }
}

/// What one input did, for checks and to see how deep inputs get.
#[derive(Debug, Default)]
pub struct Outcome {
    /// Messages sent (prefix included).
    pub sent: usize,
    /// Messages the handler took without an error.
    pub handled: usize,
    /// The request codes of those, in order.
    pub codes: Vec<u32>,
    /// The error that ended the connection: the handler's, or at the end
    /// of the input the front-end going away (disconnected, or a partial
    /// message).
    pub error: Option<String>,
    /// Requests the queue workers took from the rings (counted once they
    /// have stopped).
    pub requests: u64,
    /// Descriptors the back-end sent the front-end.
    pub fds_received: usize,
}

/// Decodes `input` and plays it against a fresh connection to a 1 MiB
/// null-co node. Panics only where the harness itself cannot work.
pub fn run(input: &[u8]) -> Outcome {
    let mut input = Reader { data: input, at: 0 };
    let (Some(setup), prefix_byte) = (input.u8(), input.u8().unwrap_or(0)) else { return Outcome::default() };
    let num_queues = u16::from(setup & 3) + 1;
    let config = ExportConfig {
        id: "fuzz".into(),
        node_name: "n".into(),
        addr: crate::config::Address::Unix(PathBuf::new()),
        writable: setup & 4 != 0,
        writethrough: false,
        num_queues,
        // Two queues to a thread, so that shared threads are exercised too.
        num_threads: num_queues.div_ceil(2),
        iothreads: Vec::new(),
        queue_threads: Vec::new(),
        logical_block_size: 512,
        serial: "fuzz-serial".into(),
        trace: true,
        poll_us: if setup & 8 != 0 { 50 } else { 0 },
        call_batch_us: if setup & 16 != 0 { 20 } else { 0 },
        cpu_affinity: Vec::new(),
        socket_mode: 0o600,
        socket_owner: None,
        socket_group: None,
        allow_inactive: false,
    };
    let node = BlockGraph::new()
        .add(OptionMap::parse("--blockdev", "driver=null-co,node-name=n,size=1M,read-zeroes=on").expect("options"))
        .expect("null-co node");
    let (front, back) = UnixStream::pair().expect("socket pair");
    front.set_nonblocking(true).expect("non-blocking");
    let queues = config.num_queues;
    let connection = Connection::new(back, config, node.clone()).expect("connection");
    let features = connection.device.features();
    let mut player =
        Player { front: FrontEnd::new(front), connection, node, outcome: Outcome::default(), ended: false, pauses: 0 };
    let prefix = setup >> 5;
    if prefix >= 4 {
        player.prefix(prefix, prefix_byte, features, queues);
    }
    while !player.ended && player.outcome.sent < MAX_MESSAGES {
        let Some(tag) = input.u8() else { break };
        if player.operation(tag, &mut input).is_none() {
            break;
        }
    }
    player.finish()
}

struct Player {
    front: FrontEnd,
    connection: Connection,
    node: Arc<dyn BlockNode>,
    outcome: Outcome,
    /// The connection is gone, or the front-end cannot send any more.
    ended: bool,
    pauses: usize,
}

/// A message as it goes on the wire.
struct Message {
    code: u32,
    flags: u32,
    size: u32,
    body: Vec<u8>,
    fds: Vec<OwnedFd>,
}

/// Version 1, as every message carries.
const VERSION_1: u32 = 1;
const NEED_REPLY: u32 = 0x8;
const REPLY: u32 = 0x4;

impl Message {
    fn new(code: u32, body: Vec<u8>) -> Self {
        Self { code, flags: VERSION_1, size: body.len() as u32, body, fds: Vec::new() }
    }

    fn with_fd(mut self, fd: OwnedFd) -> Self {
        self.fds.push(fd);
        self
    }
}

impl Player {
    /// Plays one operation; `None` once the input runs out mid-way.
    fn operation(&mut self, tag: u8, input: &mut Reader<'_>) -> Option<()> {
        match tag % 8 {
            0..=4 => {
                let message = self.decode_message(input)?;
                self.send(message);
            }
            5 => {
                let n = input.u8()?;
                self.front.kick(n);
            }
            6 => {
                let len = input.u8()?;
                let bytes = input.take(usize::from(len)).to_vec();
                self.write_raw(&bytes);
            }
            _ => match input.u8()? % 4 {
                0 => {
                    let _ = self.node.resize(self.node.size() + (1 << 20));
                    let _ = self.connection.capacity_changed();
                }
                1 => {
                    if self.pauses < MAX_PAUSES {
                        self.pauses += 1;
                        std::thread::sleep(Duration::from_micros(200));
                    }
                }
                2 => {
                    let offset = input.u32()?;
                    let len = input.u8()?;
                    let bytes = input.take(usize::from(len)).to_vec();
                    self.front.poke(u64::from(offset), &bytes);
                }
                _ => self.front.forget(),
            },
        }
        Some(())
    }

    fn decode_message(&mut self, input: &mut Reader<'_>) -> Option<Message> {
        let code = match input.u8()? {
            c @ 0..0xF0 => u32::from(c % 45),
            _ => input.u32()?,
        };
        let shape = input.u8()?;
        let mut flags = VERSION_1;
        if shape & 1 != 0 {
            flags |= NEED_REPLY;
        }
        if shape & 2 != 0 {
            flags |= REPLY;
        }
        if shape & 4 != 0 {
            flags = input.u32()?;
        }
        let size_mode = (shape >> 3) & 3;
        let delta = if size_mode == 1 { input.u8()? as i8 } else { 0 };
        let raw_size = if size_mode == 2 { Some(input.u32()?) } else { None };
        let mut fds = Vec::new();
        for _ in 0..(shape >> 5) & 3 {
            fds.push(self.front.descriptor(input)?);
        }
        let len = usize::from(input.u16()? & 0x1fff);
        let body = input.take(len).to_vec();
        let size = raw_size.unwrap_or_else(|| (body.len() as u32).wrapping_add_signed(i32::from(delta)));
        Some(Message { code, flags, size, body, fds })
    }

    /// Sends a message, then lets the connection handle what has arrived.
    fn send(&mut self, message: Message) {
        if self.ended {
            return;
        }
        let mut bytes = Vec::with_capacity(HEADER_LEN + message.body.len());
        bytes.extend_from_slice(&message.code.to_le_bytes());
        bytes.extend_from_slice(&message.flags.to_le_bytes());
        bytes.extend_from_slice(&message.size.to_le_bytes());
        bytes.extend_from_slice(&message.body);
        let fds: Vec<RawFd> = message.fds.iter().map(|fd| fd.as_raw_fd()).collect();
        self.outcome.sent += 1;
        match self.front.sock.send_with_fds(&[&bytes[..]], &fds) {
            Ok(n) => {
                if n < bytes.len() {
                    // The socket is full: the front-end stops here.
                    self.ended = true;
                }
            }
            Err(_) => self.ended = true,
        }
        // The front-end's copies are closed now; the message carries its own.
        drop(message);
        self.serve(false);
    }

    fn write_raw(&mut self, bytes: &[u8]) {
        if self.ended {
            return;
        }
        match (&self.front.sock).write(bytes) {
            Ok(n) => self.ended |= n < bytes.len(),
            Err(_) => self.ended = true,
        }
        self.serve(false);
    }

    /// Lets the connection handle every message that has fully arrived
    /// (with `eof`, everything: the front-end has shut its side down, so a
    /// read never waits).
    fn serve(&mut self, eof: bool) {
        let mut rounds = 0;
        while self.outcome.error.is_none() && rounds < 4 * MAX_MESSAGES {
            rounds += 1;
            self.front.read_replies(&mut self.outcome);
            let Ok(unread) = self.connection.unread() else { break };
            if unread == 0 && !eof {
                break;
            }
            let mut header = [0u8; HEADER_LEN];
            let peeked = if unread == 0 { 0 } else { self.connection.peek(&mut header).unwrap_or(0) };
            let size = u32::from_le_bytes(header[8..12].try_into().expect("4 bytes")) as usize;
            // A handler reads the header until it has all of it, then a
            // claimed body of up to 4 KiB with one blocking read: wait until
            // all of it is there. (A peek stops short of 12 bytes only at
            // descriptors, where the size is not known yet: wait for the most
            // a body can be.)
            let needed = match peeked {
                HEADER_LEN if size <= MAX_BODY => HEADER_LEN + size,
                HEADER_LEN => HEADER_LEN,
                _ => HEADER_LEN + MAX_BODY,
            };
            if !eof && unread < needed {
                break;
            }
            let code = u32::from_le_bytes(header[..4].try_into().expect("4 bytes"));
            match self.connection.handle_next() {
                Ok(()) => {
                    self.outcome.handled += 1;
                    self.outcome.codes.push(code);
                }
                Err(e) => {
                    self.outcome.error = Some(e.to_string());
                    self.ended = true;
                }
            }
        }
        self.front.read_replies(&mut self.outcome);
    }

    fn finish(mut self) -> Outcome {
        if self.outcome.error.is_none() {
            let _ = self.front.sock.shutdown(std::net::Shutdown::Write);
            self.serve(true);
        }
        // As the export does: the connection goes (its workers finish their
        // requests and stop), then the front-end.
        let device = self.connection.device.clone();
        drop(self.connection);
        drop(self.front);
        self.outcome.requests = device.snapshot().queues.iter().map(|q| q.events.requests).sum();
        self.outcome
    }

    /// The set-up a front-end such as QEMU sends, so that inputs start
    /// with running rings.
    fn prefix(&mut self, prefix: u8, shape: u8, features: u64, queues: u16) {
        let legacy = prefix == 6;
        let flags = if prefix == 7 { VERSION_1 | NEED_REPLY } else { VERSION_1 };
        let send = |player: &mut Self, mut message: Message| {
            message.flags = flags;
            player.send(message);
        };
        let size = 2u16 << ((shape & 0x0f) % 10);
        let mut features = features;
        if legacy {
            features &= !VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
        }
        if shape & 0x10 != 0 {
            features &= !(1 << VIRTIO_RING_F_EVENT_IDX);
        }
        let protocol = VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::REPLY_ACK
            | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS
            | VhostUserProtocolFeatures::BACKEND_REQ
            | VhostUserProtocolFeatures::INFLIGHT_SHMFD;
        send(self, Message::new(codes::GET_FEATURES, Vec::new()));
        if !legacy {
            send(self, Message::new(codes::GET_PROTOCOL_FEATURES, Vec::new()));
            send(self, Message::new(codes::SET_PROTOCOL_FEATURES, u64s(&[protocol.bits()])));
            send(self, Message::new(codes::GET_QUEUE_NUM, Vec::new()));
            send(self, Message::new(codes::GET_MAX_MEM_SLOTS, Vec::new()));
        }
        send(self, Message::new(codes::SET_OWNER, Vec::new()));
        send(self, Message::new(codes::SET_FEATURES, u64s(&[features])));
        if prefix == 5 {
            let mut body = u64s(&[0, 0]);
            body.extend_from_slice(&queues.to_le_bytes());
            body.extend_from_slice(&size.to_le_bytes());
            body.extend_from_slice(&[0; 4]);
            send(self, Message::new(codes::GET_INFLIGHT_FD, body.clone()));
            let mmap_size = (queue_region_len(size) * usize::from(queues)) as u64;
            body[..8].copy_from_slice(&mmap_size.to_le_bytes());
            let fd = self.front.received.as_ref().and_then(|fd| fd.try_clone().ok());
            let fd = fd.unwrap_or_else(|| self.front.open_null());
            send(self, Message::new(codes::SET_INFLIGHT_FD, body).with_fd(fd));
        }
        let requests = usize::from(shape >> 5);
        let image = guest_image(queues, size, requests);
        let memfd = self.front.memfd(GUEST_SIZE, &image);
        let mut body = u32s(&[1, 0]);
        body.extend(u64s(&[0, GUEST_SIZE, USER_BASE, 0]));
        send(self, Message::new(codes::SET_MEM_TABLE, body).with_fd(memfd));
        for q in 0..u32::from(queues) {
            let [desc, avail, used] = ring_addresses(q);
            send(self, Message::new(codes::SET_VRING_NUM, u32s(&[q, u32::from(size)])));
            let mut body = u32s(&[q, 0]);
            body.extend(u64s(&[USER_BASE + desc, USER_BASE + used, USER_BASE + avail, 0]));
            send(self, Message::new(codes::SET_VRING_ADDR, body));
            send(self, Message::new(codes::SET_VRING_BASE, u32s(&[q, 0])));
            let call = self.front.eventfd(true);
            send(self, Message::new(codes::SET_VRING_CALL, u64s(&[u64::from(q)])).with_fd(call));
            let kick = self.front.eventfd(true);
            send(self, Message::new(codes::SET_VRING_KICK, u64s(&[u64::from(q)])).with_fd(kick));
            if !legacy {
                send(self, Message::new(codes::SET_VRING_ENABLE, u32s(&[q, 1])));
            }
        }
    }
}

/// The request codes the prefix sends.
mod codes {
    pub(super) const GET_FEATURES: u32 = 1;
    pub(super) const SET_FEATURES: u32 = 2;
    pub(super) const SET_OWNER: u32 = 3;
    pub(super) const SET_MEM_TABLE: u32 = 5;
    pub(super) const SET_VRING_NUM: u32 = 8;
    pub(super) const SET_VRING_ADDR: u32 = 9;
    pub(super) const SET_VRING_BASE: u32 = 10;
    pub(super) const SET_VRING_KICK: u32 = 12;
    pub(super) const SET_VRING_CALL: u32 = 13;
    pub(super) const GET_PROTOCOL_FEATURES: u32 = 15;
    pub(super) const SET_PROTOCOL_FEATURES: u32 = 16;
    pub(super) const GET_QUEUE_NUM: u32 = 17;
    pub(super) const SET_VRING_ENABLE: u32 = 18;
    pub(super) const GET_INFLIGHT_FD: u32 = 31;
    pub(super) const SET_INFLIGHT_FD: u32 = 32;
    pub(super) const GET_MAX_MEM_SLOTS: u32 = 36;
}

/// The prefix's guest memory: 256 KiB at guest address 0, which the
/// front-end says it has at [`USER_BASE`].
pub const GUEST_SIZE: u64 = 0x40000;
/// Where the prefix's front-end claims to have guest memory mapped.
pub const USER_BASE: u64 = 0x7f00_0000_0000;

/// Queue `q`'s descriptor table, available and used rings (guest
/// addresses), room for 1,024 entries each.
pub fn ring_addresses(q: u32) -> [u64; 3] {
    let base = 0x10000 + 0x8000 * u64::from(q);
    [base, base + 0x4000, base + 0x5000]
}

/// Guest memory with `requests` requests queued on each ring (as many as
/// fit): a read, a write, a flush, a GET_ID and an unknown type, in turn.
fn guest_image(queues: u16, size: u16, requests: usize) -> Vec<u8> {
    let mut mem = vec![0u8; 0x30000];
    let mut put = |at: u64, bytes: &[u8]| {
        let at = at as usize;
        mem[at..at + bytes.len()].copy_from_slice(bytes);
    };
    for q in 0..u64::from(queues) {
        let [desc, avail, _] = ring_addresses(q as u32);
        let fit = requests.min(usize::from(size) / 3);
        let mut next = 0u16;
        for i in 0..fit as u64 {
            let n = q * 8 + i;
            let (header, status, data) = (0x1000 + 0x20 * n, 0x3000 + n, 0x4000 + 0x200 * n);
            let kind: u32 = [0, 1, 4, 8, 99][i as usize % 5];
            put(header, &kind.to_le_bytes());
            put(header + 8, &i.to_le_bytes());
            let mut chain = vec![(header, 16u32, 0u16)];
            match kind {
                0 => chain.push((data, 512, 2)),
                1 => chain.push((data, 512, 0)),
                8 => chain.push((data, 20, 2)),
                _ => {}
            }
            chain.push((status, 1, 2));
            put(avail + 4 + 2 * i, &next.to_le_bytes());
            for (j, (addr, len, flags)) in chain.iter().enumerate() {
                let last = j + 1 == chain.len();
                let entry = desc + 16 * u64::from(next);
                put(entry, &addr.to_le_bytes());
                put(entry + 8, &len.to_le_bytes());
                put(entry + 12, &(flags | if last { 0 } else { 1 }).to_le_bytes());
                put(entry + 14, &(if last { 0 } else { next + 1 }).to_le_bytes());
                next += 1;
            }
        }
        put(avail + 2, &(fit as u16).to_le_bytes());
    }
    mem
}

fn u32s(values: &[u32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn u64s(values: &[u64]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// The front-end's end of the connection and what it has sent.
struct FrontEnd {
    sock: UnixStream,
    /// Copies of the eventfds sent, to kick with.
    eventfds: Vec<OwnedFd>,
    /// The last memfd made, kept for the guest to write.
    memfd: Option<File>,
    /// The last descriptor the back-end sent.
    received: Option<OwnedFd>,
    /// Our ends of the socket pairs sent.
    sockets: Vec<UnixStream>,
}

impl FrontEnd {
    fn new(sock: UnixStream) -> Self {
        Self { sock, eventfds: Vec::new(), memfd: None, received: None, sockets: Vec::new() }
    }

    /// A descriptor to attach, from its spec.
    fn descriptor(&mut self, input: &mut Reader<'_>) -> Option<OwnedFd> {
        let kind = input.u8()?;
        Some(match kind & 7 {
            0 => {
                let size = u64::from(input.u32()? & 0x3ff_ffff);
                let len = usize::from(input.u16()?);
                let fill = input.take(len).to_vec();
                self.memfd(size, &fill)
            }
            1 => self.eventfd(kind & 8 != 0),
            2 => self.open_null(),
            3 => match UnixStream::pair() {
                Ok((ours, theirs)) => {
                    let _ = ours.set_nonblocking(true);
                    self.sockets.push(ours);
                    OwnedFd::from(theirs)
                }
                Err(_) => self.open_null(),
            },
            4 => self.received.as_ref().and_then(|fd| fd.try_clone().ok()).unwrap_or_else(|| self.open_null()),
            5 => self.memfd.as_ref().and_then(|f| f.try_clone().ok()).map_or_else(|| self.open_null(), OwnedFd::from),
            6 => self.eventfds.last().and_then(|e| e.try_clone().ok()).unwrap_or_else(|| self.open_null()),
            _ => self.sock.try_clone().map_or_else(|_| self.open_null(), OwnedFd::from),
        })
    }

    /// A memfd of `size` bytes starting with `fill` (cut to the size).
    fn memfd(&mut self, size: u64, fill: &[u8]) -> OwnedFd {
        let file = vsd_sys::memfd("vsd-fuzz-guest").expect("memfd");
        file.set_len(size).expect("memfd size");
        let n = fill.len().min(size as usize);
        file.write_all_at(&fill[..n], 0).expect("memfd fill");
        let fd = OwnedFd::from(file.try_clone().expect("memfd clone"));
        self.memfd = Some(file);
        fd
    }

    fn eventfd(&mut self, nonblocking: bool) -> OwnedFd {
        let flags = libc::EFD_CLOEXEC | if nonblocking { libc::EFD_NONBLOCK } else { 0 };
        // SAFETY: eventfd takes no pointers.
        let fd = unsafe { libc::eventfd(0, flags) };
        assert!(fd >= 0, "eventfd: {}", io::Error::last_os_error());
        // SAFETY: eventfd just returned this descriptor; nothing else owns it.
        let event = unsafe { OwnedFd::from_raw_fd(fd) };
        let copy = event.try_clone().expect("eventfd clone");
        self.eventfds.push(event);
        copy
    }

    fn open_null(&self) -> OwnedFd {
        OwnedFd::from(File::open("/dev/null").expect("/dev/null"))
    }

    fn kick(&self, n: u8) {
        if self.eventfds.is_empty() {
            return;
        }
        let which: Vec<&OwnedFd> = if n & 0x7f == 0x7f {
            self.eventfds.iter().collect()
        } else {
            vec![&self.eventfds[usize::from(n & 0x7f) % self.eventfds.len()]]
        };
        // The largest count an eventfd holds: one more blocks the writer.
        let value: u64 = if n & 0x80 != 0 { u64::MAX - 1 } else { 1 };
        for event in which {
            let fd = event.as_raw_fd();
            // The front-end never waits: non-blocking for this write only
            // (the flag belongs to the file, which the back-end shares).
            // SAFETY: F_GETFL and F_SETFL take no pointers.
            let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
            // SAFETY: as above.
            unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) };
            if n & 0x80 != 0 {
                let _ = vsd_sys::read_counter(event.as_fd());
            }
            // SAFETY: write reads 8 bytes from `value`, a live local.
            let _ = unsafe { libc::write(fd, (&raw const value).cast(), 8) };
            // SAFETY: as above.
            unsafe { libc::fcntl(fd, libc::F_SETFL, flags) };
        }
    }

    /// The guest writes its memory (never past the file's end: the file
    /// keeps its size, as QEMU's sealed memfds do).
    fn poke(&self, offset: u64, bytes: &[u8]) {
        let Some(file) = &self.memfd else { return };
        let Ok(len) = file.metadata().map(|m| m.len()) else { return };
        if len == 0 {
            return;
        }
        let at = offset % len;
        let n = bytes.len().min((len - at) as usize);
        let _ = file.write_all_at(&bytes[..n], at);
    }

    /// Closes the front-end's copies of everything it sent.
    fn forget(&mut self) {
        self.eventfds.clear();
        self.memfd = None;
        self.received = None;
        self.sockets.clear();
    }

    /// Reads whatever the back-end has answered so far, keeping the last
    /// descriptor it sent.
    fn read_replies(&mut self, outcome: &mut Outcome) {
        let mut buf = [0u8; 2 * MAX_BODY];
        loop {
            let mut fds = [-1 as RawFd; 4];
            let mut iov = [libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() }];
            // SAFETY: the iovec names `buf`, a live local any bytes may be
            // written to.
            match unsafe { self.sock.recv_with_fds(&mut iov, &mut fds) } {
                Ok((0, _)) | Err(_) => return,
                Ok((_, count)) => {
                    for &fd in &fds[..count] {
                        outcome.fds_received += 1;
                        // SAFETY: the kernel installed this descriptor for
                        // us with the message; nothing else owns it.
                        self.received = Some(unsafe { OwnedFd::from_raw_fd(fd) });
                    }
                }
            }
        }
    }
}

/// The input, read from the front.
struct Reader<'a> {
    data: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> &[u8] {
        let n = n.min(self.data.len() - self.at);
        let bytes = &self.data[self.at..self.at + n];
        self.at += n;
        bytes
    }

    fn array<const N: usize>(&mut self) -> Option<[u8; N]> {
        let bytes = self.take(N);
        bytes.try_into().ok()
    }

    fn u8(&mut self) -> Option<u8> {
        self.array::<1>().map(|[b]| b)
    }

    fn u16(&mut self) -> Option<u16> {
        self.array().map(u16::from_le_bytes)
    }

    fn u32(&mut self) -> Option<u32> {
        self.array().map(u32::from_le_bytes)
    }
}
