//! The NBD protocol's numbers and layouts, shared by vsd's server
//! (`vsd-nbd`) and client (`vsd-nbd-client`). No I/O here.
//!
//! The transmission phase as bytes: request headers and replies, and the
//! rules that decide whether a request may run; [`handshake`] holds the
//! negotiation's numbers.
//!
//! Numbers and layouts are the NBD specification's (`doc/proto.md`), with
//! its extended headers (64-bit lengths).

#![deny(missing_docs)]

pub mod handshake;

mod address;

pub use address::Address;

/// Request magic, compact header (28 bytes).
const REQUEST_MAGIC: u32 = 0x2560_9513;
/// Request magic, extended header (32 bytes).
const EXTENDED_REQUEST_MAGIC: u32 = 0x21e4_1c71;
const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;
const EXTENDED_REPLY_MAGIC: u32 = 0x6e8a_278c;

/// Command flags.
pub mod cmd_flag {
    /// Force unit access: durable before the reply.
    pub const FUA: u16 = 1 << 0;
    /// Write zeroes without punching holes.
    pub const NO_HOLE: u16 = 1 << 1;
    /// Do not fragment a structured read reply.
    pub const DF: u16 = 1 << 2;
    /// One block status extent only.
    pub const REQ_ONE: u16 = 1 << 3;
    /// Fail write-zeroes rather than write zeroes slowly.
    pub const FAST_ZERO: u16 = 1 << 4;
    /// The length is a payload's (extended headers only).
    pub const PAYLOAD_LEN: u16 = 1 << 5;
}

/// Transmission flags, as the export advertises them.
pub mod tx_flag {
    /// Always set: the other flags mean something.
    pub const HAS_FLAGS: u16 = 1 << 0;
    /// Writes are refused.
    pub const READ_ONLY: u16 = 1 << 1;
    /// FLUSH is supported.
    pub const SEND_FLUSH: u16 = 1 << 2;
    /// FUA is supported.
    pub const SEND_FUA: u16 = 1 << 3;
    /// TRIM is supported.
    pub const SEND_TRIM: u16 = 1 << 5;
    /// WRITE_ZEROES is supported.
    pub const SEND_WRITE_ZEROES: u16 = 1 << 6;
    /// The DF flag is supported (structured replies).
    pub const SEND_DF: u16 = 1 << 7;
    /// Flushes and FUA are visible on every connection to the export.
    pub const CAN_MULTI_CONN: u16 = 1 << 8;
    /// CACHE is supported.
    pub const SEND_CACHE: u16 = 1 << 10;
    /// FAST_ZERO is supported.
    pub const SEND_FAST_ZERO: u16 = 1 << 11;
}

/// Error values on the wire (they are Linux's errno numbers).
pub mod errno {
    /// Operation not permitted (writes to a read-only export).
    pub const EPERM: u32 = 1;
    /// I/O error.
    pub const EIO: u32 = 5;
    /// Out of memory.
    pub const ENOMEM: u32 = 12;
    /// Invalid request.
    pub const EINVAL: u32 = 22;
    /// No space left.
    pub const ENOSPC: u32 = 28;
    /// Value too large (DF on a read that cannot be sent whole).
    pub const EOVERFLOW: u32 = 75;
    /// Not supported (FAST_ZERO that would be slow).
    pub const ENOTSUP: u32 = 95;
    /// The server is shutting down.
    pub const ESHUTDOWN: u32 = 108;

    /// The wire value for a host errno: the spec names a few; the rest
    /// are I/O errors, as QEMU maps them.
    pub fn from_host(host: i32) -> u32 {
        match host {
            libc::EPERM | libc::EROFS => EPERM,
            libc::ENOMEM => ENOMEM,
            libc::EINVAL => EINVAL,
            libc::ENOSPC | libc::EFBIG | libc::EDQUOT => ENOSPC,
            libc::EOVERFLOW => EOVERFLOW,
            libc::ENOTSUP => ENOTSUP,
            libc::ESHUTDOWN => ESHUTDOWN,
            _ => EIO,
        }
    }

    /// The host errno for a wire value (a client's view): an unknown value
    /// is an invalid request, as QEMU's client reads it.
    pub fn to_host(wire: u32) -> i32 {
        match wire {
            EPERM => libc::EPERM,
            EIO => libc::EIO,
            ENOMEM => libc::ENOMEM,
            ENOSPC => libc::ENOSPC,
            EOVERFLOW => libc::EOVERFLOW,
            ENOTSUP => libc::ENOTSUP,
            ESHUTDOWN => libc::ESHUTDOWN,
            _ => libc::EINVAL,
        }
    }
}

/// Command types.
pub mod cmd {
    /// Read.
    pub const READ: u16 = 0;
    /// Write, with a payload.
    pub const WRITE: u16 = 1;
    /// Disconnect.
    pub const DISC: u16 = 2;
    /// Flush.
    pub const FLUSH: u16 = 3;
    /// Discard.
    pub const TRIM: u16 = 4;
    /// Prefetch.
    pub const CACHE: u16 = 5;
    /// Write zeroes.
    pub const WRITE_ZEROES: u16 = 6;
    /// Allocation status of a range.
    pub const BLOCK_STATUS: u16 = 7;
}

/// Structured reply chunk types.
pub mod chunk {
    /// No payload: ends a reply (with [`FLAG_DONE`]).
    pub const NONE: u16 = 0;
    /// A read's data at an offset.
    pub const OFFSET_DATA: u16 = 1;
    /// A read's zeroes at an offset.
    pub const OFFSET_HOLE: u16 = 2;
    /// A block status: a context id and extents.
    pub const BLOCK_STATUS: u16 = 5;
    /// A block status with 64-bit extents (extended headers).
    pub const BLOCK_STATUS_EXT: u16 = 6;
    /// Error chunks have this bit set.
    pub const ERROR_BIT: u16 = 1 << 15;
    /// An error: errno and message.
    pub const ERROR: u16 = ERROR_BIT + 1;
    /// An error at an offset: errno, message and offset.
    pub const ERROR_OFFSET: u16 = ERROR_BIT + 2;
    /// The last chunk of a reply.
    pub const FLAG_DONE: u16 = 1;
}

/// `base:allocation` descriptor flags.
pub mod state {
    /// Unallocated.
    pub const HOLE: u32 = 1 << 0;
    /// Reads as zeroes.
    pub const ZERO: u32 = 1 << 1;
    /// Dirty, in a `qemu:dirty-bitmap:` context.
    pub const DIRTY: u32 = 1 << 0;
}

/// What replies look like on a connection, as negotiated.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Mode {
    /// Simple replies only.
    Simple,
    /// `NBD_OPT_STRUCTURED_REPLY`: chunks with 20-byte headers.
    Structured,
    /// `NBD_OPT_EXTENDED_HEADERS`: 32-byte headers both ways, 64-bit lengths.
    Extended,
}

impl Mode {
    /// The size of a request header.
    pub fn request_size(self) -> usize {
        if self == Mode::Extended { 32 } else { 28 }
    }
}

/// A request header as received.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Request {
    /// Command flags.
    pub flags: u16,
    /// Command type.
    pub kind: u16,
    /// The client's identifier, echoed in replies.
    pub cookie: u64,
    /// Byte offset.
    pub offset: u64,
    /// Byte length (32 bits unless extended).
    pub len: u64,
}

/// A header whose magic is wrong: the stream cannot be trusted any more.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("bad magic {0:#010x}")]
pub struct BadMagic(pub u32);

fn be16(b: &[u8]) -> u16 {
    u16::from_be_bytes([b[0], b[1]])
}
fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}
fn be64(b: &[u8]) -> u64 {
    u64::from_be_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]])
}

impl Request {
    /// Parses the header at the start of `buf`; `None` if `buf` holds less
    /// than a whole header. A wrong magic is reported as soon as it is there.
    pub fn parse(buf: &[u8], mode: Mode) -> Result<Option<Request>, BadMagic> {
        let want = if mode == Mode::Extended { EXTENDED_REQUEST_MAGIC } else { REQUEST_MAGIC };
        if buf.len() >= 4 && be32(buf) != want {
            return Err(BadMagic(be32(buf)));
        }
        if buf.len() < mode.request_size() {
            return Ok(None);
        }
        let (flags, kind, cookie, offset) = (be16(&buf[4..]), be16(&buf[6..]), be64(&buf[8..]), be64(&buf[16..]));
        let len = if mode == Mode::Extended { be64(&buf[24..]) } else { u64::from(be32(&buf[24..])) };
        Ok(Some(Request { flags, kind, cookie, offset, len }))
    }

    /// Writes the compact header (what a client sends without extended
    /// headers) to `out`; a length over 32 bits is cut, so clients split
    /// longer requests.
    pub fn encode(&self, out: &mut [u8; 28]) {
        out[..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        out[4..6].copy_from_slice(&self.flags.to_be_bytes());
        out[6..8].copy_from_slice(&self.kind.to_be_bytes());
        out[8..16].copy_from_slice(&self.cookie.to_be_bytes());
        out[16..24].copy_from_slice(&self.offset.to_be_bytes());
        out[24..28].copy_from_slice(&(self.len as u32).to_be_bytes());
    }

    /// How many payload bytes follow the header: a write's data, or what
    /// an extended header announces with `PAYLOAD_LEN`. They must be read
    /// (or the connection closed) whatever is decided about the request.
    pub fn payload_len(&self, mode: Mode) -> u64 {
        let announced = mode == Mode::Extended && self.flags & cmd_flag::PAYLOAD_LEN != 0;
        if self.kind == cmd::WRITE || announced { self.len } else { 0 }
    }
}

/// A simple reply's header, as a client reads it: 16 bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SimpleReply {
    /// 0, or the wire errno the request failed with.
    pub error: u32,
    /// The request's cookie.
    pub cookie: u64,
}

impl SimpleReply {
    /// The size of the header.
    pub const SIZE: usize = 16;

    /// Parses the header at the start of `buf` (at least [`Self::SIZE`]
    /// bytes); any other magic is a stream the client cannot follow.
    pub fn parse(buf: &[u8]) -> Result<Self, BadMagic> {
        match be32(buf) {
            SIMPLE_REPLY_MAGIC => Ok(Self { error: be32(&buf[4..]), cookie: be64(&buf[8..]) }),
            magic => Err(BadMagic(magic)),
        }
    }
}

/// A structured reply chunk's header, as a client reads it: 20 bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkHeader {
    /// Chunk flags ([`chunk::FLAG_DONE`]).
    pub flags: u16,
    /// Chunk type ([`chunk`]).
    pub kind: u16,
    /// The request's cookie.
    pub cookie: u64,
    /// The payload's length.
    pub len: u32,
}

impl ChunkHeader {
    /// The size of the header.
    pub const SIZE: usize = 20;
}

/// A reply's header as a client reads it, simple or a chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReplyStart {
    /// A simple reply.
    Simple(SimpleReply),
    /// A structured reply's chunk.
    Chunk(ChunkHeader),
}

impl ReplyStart {
    /// Parses the reply header at the start of `buf`: `None` if `buf` holds
    /// less than a whole header. Chunks are taken only if `structured`
    /// replies were negotiated; another magic is a stream the client
    /// cannot follow.
    pub fn parse(buf: &[u8], structured: bool) -> Result<Option<Self>, BadMagic> {
        if buf.len() < 4 {
            return Ok(None);
        }
        match be32(buf) {
            SIMPLE_REPLY_MAGIC if buf.len() >= SimpleReply::SIZE => Ok(Some(Self::Simple(SimpleReply::parse(buf)?))),
            STRUCTURED_REPLY_MAGIC if structured && buf.len() >= ChunkHeader::SIZE => {
                Ok(Some(Self::Chunk(ChunkHeader {
                    flags: be16(&buf[4..]),
                    kind: be16(&buf[6..]),
                    cookie: be64(&buf[8..]),
                    len: be32(&buf[16..]),
                })))
            }
            SIMPLE_REPLY_MAGIC => Ok(None),
            STRUCTURED_REPLY_MAGIC if structured => Ok(None),
            magic => Err(BadMagic(magic)),
        }
    }
}

/// What the connection agreed on and the export allows: what a request is
/// checked against.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// The export's size in bytes.
    pub size: u64,
    /// Writes are refused.
    pub read_only: bool,
    /// Reply format.
    pub mode: Mode,
    /// A metadata context was selected (block status allowed).
    pub block_status: bool,
    /// The largest read or write payload.
    pub max_payload: u64,
}

/// A request that may run. Offsets and lengths are in bytes, inside the
/// export.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Command {
    /// Read a range.
    Read {
        /// Where.
        offset: u64,
        /// How much (at most the maximum payload).
        len: u64,
        /// DF: the reply must be one data chunk.
        whole: bool,
    },
    /// Write the payload.
    Write {
        /// Where.
        offset: u64,
        /// The payload's length.
        len: u64,
        /// FUA: durable before the reply.
        fua: bool,
    },
    /// Flush everything written.
    Flush,
    /// Discard a range.
    Trim {
        /// Where.
        offset: u64,
        /// How much.
        len: u64,
        /// FUA: durable before the reply.
        fua: bool,
    },
    /// Zero a range.
    WriteZeroes {
        /// Where.
        offset: u64,
        /// How much.
        len: u64,
        /// FUA: durable before the reply.
        fua: bool,
        /// The range may be deallocated (no NO_HOLE).
        may_unmap: bool,
        /// FAST_ZERO: fail rather than be slow.
        fast: bool,
    },
    /// Prefetch (advisory: nothing to do).
    Cache,
    /// `base:allocation` of a range.
    BlockStatus {
        /// Where.
        offset: u64,
        /// How much.
        len: u64,
        /// REQ_ONE: a single extent.
        one: bool,
    },
    /// Finish and close.
    Disconnect,
}

/// Why a request is refused, and whether the connection survives it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Refusal {
    /// The error to reply with.
    pub errno: u32,
    /// Close after replying: the payload cannot be taken.
    pub fatal: bool,
}

fn refuse(errno: u32) -> Refusal {
    Refusal { errno, fatal: false }
}

impl Request {
    /// Applies the spec's rules: flags each command takes, negotiated
    /// features, ranges inside the export, payload sizes, read-only.
    pub fn check(&self, limits: &Limits) -> Result<Command, Refusal> {
        use cmd_flag::*;
        let (offset, len, f) = (self.offset, self.len, self.flags);
        let extended = limits.mode == Mode::Extended;
        // PAYLOAD_LEN is only a framing flag, and only with extended headers.
        let framing = if extended { PAYLOAD_LEN } else { 0 };
        let payload = self.payload_len(limits.mode);
        if payload > limits.max_payload {
            return Err(Refusal { errno: errno::EINVAL, fatal: true });
        }
        let allowed = framing
            | match self.kind {
                cmd::READ if limits.mode >= Mode::Structured => DF,
                cmd::WRITE | cmd::TRIM => FUA,
                cmd::WRITE_ZEROES => FUA | NO_HOLE | FAST_ZERO,
                cmd::BLOCK_STATUS => REQ_ONE,
                _ => 0,
            };
        if f & !allowed != 0 || (payload != 0 && self.kind != cmd::WRITE) {
            return Err(refuse(errno::EINVAL));
        }
        let in_range = offset.checked_add(len).is_some_and(|end| end <= limits.size);
        let writes = matches!(self.kind, cmd::WRITE | cmd::TRIM | cmd::WRITE_ZEROES);
        match self.kind {
            cmd::DISC => return Ok(Command::Disconnect),
            cmd::FLUSH => return Ok(Command::Flush),
            cmd::READ | cmd::WRITE | cmd::TRIM | cmd::WRITE_ZEROES | cmd::CACHE | cmd::BLOCK_STATUS => {}
            _ => return Err(refuse(errno::EINVAL)),
        }
        if writes && limits.read_only {
            return Err(refuse(errno::EPERM));
        }
        if !in_range {
            return Err(refuse(errno::EINVAL));
        }
        let fua = f & FUA != 0;
        Ok(match self.kind {
            cmd::READ if len > limits.max_payload => return Err(refuse(errno::EINVAL)),
            cmd::READ => Command::Read { offset, len, whole: f & DF != 0 },
            cmd::WRITE => Command::Write { offset, len, fua },
            cmd::TRIM => Command::Trim { offset, len, fua },
            cmd::WRITE_ZEROES => {
                Command::WriteZeroes { offset, len, fua, may_unmap: f & NO_HOLE == 0, fast: f & FAST_ZERO != 0 }
            }
            cmd::CACHE => Command::Cache,
            _ if !limits.block_status || len == 0 => return Err(refuse(errno::EINVAL)),
            _ => Command::BlockStatus { offset, len, one: f & REQ_ONE != 0 },
        })
    }
}

/// The most bytes any reply header (with its fixed payload fields) takes.
pub const MAX_REPLY_HEADER: usize = 48;

/// A reply header being built: the bytes that go before a reply's data.
/// The default is empty.
#[derive(Clone, Copy)]
pub struct ReplyHeader {
    bytes: [u8; MAX_REPLY_HEADER],
    len: usize,
}

impl Default for ReplyHeader {
    fn default() -> Self {
        Self { bytes: [0; MAX_REPLY_HEADER], len: 0 }
    }
}

impl ReplyHeader {
    fn put(&mut self, data: &[u8]) {
        self.bytes[self.len..self.len + data.len()].copy_from_slice(data);
        self.len += data.len();
    }

    /// The encoded bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len]
    }

    /// A chunk header: structured (20 bytes) or extended (32 bytes), for a
    /// payload of `payload` bytes.
    fn chunk(mode: Mode, request: &Request, kind: u16, payload: u64) -> Self {
        let mut h = Self::default();
        let magic = if mode == Mode::Extended { EXTENDED_REPLY_MAGIC } else { STRUCTURED_REPLY_MAGIC };
        h.put(&magic.to_be_bytes());
        h.put(&chunk::FLAG_DONE.to_be_bytes());
        h.put(&kind.to_be_bytes());
        h.put(&request.cookie.to_be_bytes());
        if mode == Mode::Extended {
            h.put(&request.offset.to_be_bytes());
            h.put(&payload.to_be_bytes());
        } else {
            // Chunk payloads here are bounded by the maximum payload (32 MiB).
            h.put(&(payload as u32).to_be_bytes());
        }
        h
    }

    /// The reply to a request that succeeded and returns no data.
    pub fn done(mode: Mode, request: &Request) -> Self {
        match mode {
            Mode::Simple => Self::simple(request, 0),
            _ => Self::chunk(mode, request, chunk::NONE, 0),
        }
    }

    /// The reply to a request that failed.
    pub fn error(mode: Mode, request: &Request, errno: u32) -> Self {
        if mode == Mode::Simple {
            return Self::simple(request, errno);
        }
        // An error chunk: the error and an empty message.
        let mut h = Self::chunk(mode, request, chunk::ERROR, 6);
        h.put(&errno.to_be_bytes());
        h.put(&0u16.to_be_bytes());
        h
    }

    fn simple(request: &Request, errno: u32) -> Self {
        let mut h = Self::default();
        h.put(&SIMPLE_REPLY_MAGIC.to_be_bytes());
        h.put(&errno.to_be_bytes());
        h.put(&request.cookie.to_be_bytes());
        h
    }

    /// What goes before the `len` bytes a successful read returns: a
    /// simple reply, or one data chunk.
    pub fn read_data(mode: Mode, request: &Request, len: u64) -> Self {
        if mode == Mode::Simple {
            return Self::simple(request, 0);
        }
        let mut h = Self::chunk(mode, request, chunk::OFFSET_DATA, 8 + len);
        h.put(&request.offset.to_be_bytes());
        h
    }

    /// A successful read whose bytes are all zero, as one hole chunk
    /// (structured modes only; the hole is at most the maximum payload).
    pub fn read_hole(mode: Mode, request: &Request, len: u64) -> Self {
        debug_assert!(mode != Mode::Simple);
        let mut h = Self::chunk(mode, request, chunk::OFFSET_HOLE, 12);
        h.put(&request.offset.to_be_bytes());
        h.put(&(len as u32).to_be_bytes());
        h
    }

    /// What goes before `count` block status descriptors (encoded by
    /// [`encode_extent`]) for context `context`; all but the `last` chunk
    /// of a reply leave the DONE flag off.
    pub fn block_status(mode: Mode, request: &Request, context: u32, count: usize, last: bool) -> Self {
        let extended = mode == Mode::Extended;
        let (kind, fixed, each) = if extended { (chunk::BLOCK_STATUS_EXT, 8, 16) } else { (chunk::BLOCK_STATUS, 4, 8) };
        let mut h = Self::chunk(mode, request, kind, fixed + each * count as u64);
        if !last {
            h.bytes[4..6].copy_from_slice(&0u16.to_be_bytes());
        }
        h.put(&context.to_be_bytes());
        if extended {
            h.put(&(count as u32).to_be_bytes());
        }
        h
    }
}

/// The size of one block status descriptor.
pub fn extent_size(mode: Mode) -> usize {
    if mode == Mode::Extended { 16 } else { 8 }
}

/// Writes one block status descriptor into `out` (of [`extent_size`]
/// bytes). Compact descriptors hold at most 4 GiB - 1: the caller splits.
pub fn encode_extent(mode: Mode, len: u64, flags: u32, out: &mut [u8]) {
    if mode == Mode::Extended {
        out[..8].copy_from_slice(&len.to_be_bytes());
        out[8..16].copy_from_slice(&u64::from(flags).to_be_bytes());
    } else {
        debug_assert!(len <= u64::from(u32::MAX));
        out[..4].copy_from_slice(&(len as u32).to_be_bytes());
        out[4..8].copy_from_slice(&flags.to_be_bytes());
    }
}

/// The longest extent one descriptor may carry.
pub fn max_extent(mode: Mode) -> u64 {
    // Compact descriptors: the largest 32-bit multiple of 512 keeps later
    // extents aligned.
    if mode == Mode::Extended { u64::MAX } else { u64::from(u32::MAX) & !511 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_client_header_parses_back_and_a_simple_reply_reads_as_sent() {
        let request = Request { flags: cmd_flag::FUA, kind: cmd::WRITE, cookie: 7 << 40, offset: 1 << 33, len: 65536 };
        let mut out = [0; 28];
        request.encode(&mut out);
        assert_eq!(Request::parse(&out, Mode::Simple), Ok(Some(request)));
        let reply = ReplyHeader::error(Mode::Simple, &request, errno::ENOSPC);
        assert_eq!(SimpleReply::parse(reply.as_bytes()), Ok(SimpleReply { error: errno::ENOSPC, cookie: 7 << 40 }));
        let chunk = ReplyHeader::done(Mode::Structured, &request);
        assert_eq!(SimpleReply::parse(chunk.as_bytes()), Err(BadMagic(STRUCTURED_REPLY_MAGIC)));
        assert_eq!((errno::to_host(errno::ENOSPC), errno::to_host(12345)), (libc::ENOSPC, libc::EINVAL));
    }

    fn header(mode: Mode, flags: u16, kind: u16, offset: u64, len: u64) -> Vec<u8> {
        let mut b = Vec::new();
        let magic = if mode == Mode::Extended { EXTENDED_REQUEST_MAGIC } else { REQUEST_MAGIC };
        b.extend(magic.to_be_bytes());
        b.extend(flags.to_be_bytes());
        b.extend(kind.to_be_bytes());
        b.extend(0x1122_3344_5566_7788u64.to_be_bytes());
        b.extend(offset.to_be_bytes());
        if mode == Mode::Extended {
            b.extend(len.to_be_bytes());
        } else {
            b.extend((len as u32).to_be_bytes());
        }
        b
    }

    fn limits(mode: Mode) -> Limits {
        Limits { size: 1 << 30, read_only: false, mode, block_status: true, max_payload: 32 << 20 }
    }

    fn check(mode: Mode, flags: u16, kind: u16, offset: u64, len: u64, limits: &Limits) -> Result<Command, Refusal> {
        let request = Request::parse(&header(mode, flags, kind, offset, len), mode).unwrap().unwrap();
        request.check(limits)
    }

    #[test]
    fn headers_parse_compact_and_extended() {
        let compact = header(Mode::Structured, 1, cmd::WRITE, 4096, 512);
        assert_eq!(Request::parse(&compact[..27], Mode::Structured), Ok(None));
        let request = Request::parse(&compact, Mode::Structured).unwrap().unwrap();
        assert_eq!(
            request,
            Request { flags: 1, kind: cmd::WRITE, cookie: 0x1122_3344_5566_7788, offset: 4096, len: 512 }
        );
        let extended = header(Mode::Extended, 0, cmd::READ, 0, 5 << 32);
        assert_eq!(Request::parse(&extended[..31], Mode::Extended), Ok(None));
        assert_eq!(Request::parse(&extended, Mode::Extended).unwrap().unwrap().len, 5 << 32);
        assert_eq!(Request::parse(&compact, Mode::Extended), Err(BadMagic(REQUEST_MAGIC)), "compact after extended");
        assert_eq!(Request::parse(&extended, Mode::Simple), Err(BadMagic(EXTENDED_REQUEST_MAGIC)));
    }

    #[test]
    fn offsets_that_wrap_or_pass_the_end_are_invalid() {
        let l = limits(Mode::Structured);
        let einval = Err(refuse(errno::EINVAL));
        assert_eq!(check(Mode::Structured, 0, cmd::READ, u64::MAX - 511, 512, &l), einval);
        assert_eq!(check(Mode::Structured, 0, cmd::TRIM, u64::MAX, 2, &l), einval);
        assert_eq!(check(Mode::Extended, 0, cmd::WRITE_ZEROES, 1, u64::MAX, &limits(Mode::Extended)), einval);
        assert_eq!(check(Mode::Structured, 0, cmd::READ, (1 << 30) - 512, 1024, &l), einval);
        assert_eq!(
            check(Mode::Structured, 0, cmd::READ, (1 << 30) - 512, 512, &l),
            Ok(Command::Read { offset: (1 << 30) - 512, len: 512, whole: false })
        );
    }

    #[test]
    fn lengths_up_to_4_gib_are_ranges_not_payloads() {
        let l = Limits { size: 8 << 30, ..limits(Mode::Structured) };
        let max = u64::from(u32::MAX);
        let zeroes = check(Mode::Structured, 0, cmd::WRITE_ZEROES, 0, max, &l);
        assert_eq!(zeroes, Ok(Command::WriteZeroes { offset: 0, len: max, fua: false, may_unmap: true, fast: false }));
        assert_eq!(
            check(Mode::Structured, 0, cmd::TRIM, 4096, max, &l),
            Ok(Command::Trim { offset: 4096, len: max, fua: false })
        );
        assert_eq!(
            check(Mode::Structured, 0, cmd::BLOCK_STATUS, 0, max, &l),
            Ok(Command::BlockStatus { offset: 0, len: max, one: false })
        );
        // Reads and writes carry their bytes: past the maximum they are refused,
        // and a write's payload cannot be taken, so the connection ends.
        assert_eq!(check(Mode::Structured, 0, cmd::READ, 0, max, &l), Err(refuse(errno::EINVAL)));
        assert_eq!(
            check(Mode::Structured, 0, cmd::WRITE, 0, max, &l),
            Err(Refusal { errno: errno::EINVAL, fatal: true })
        );
        let big = Limits { size: 16 << 30, ..limits(Mode::Extended) };
        assert_eq!(
            check(Mode::Extended, 0, cmd::TRIM, 0, 8 << 30, &big),
            Ok(Command::Trim { offset: 0, len: 8 << 30, fua: false })
        );
    }

    #[test]
    fn block_status_needs_a_context_and_a_length() {
        let without = Limits { block_status: false, ..limits(Mode::Structured) };
        assert_eq!(check(Mode::Structured, 0, cmd::BLOCK_STATUS, 0, 4096, &without), Err(refuse(errno::EINVAL)));
        let with = limits(Mode::Structured);
        assert_eq!(check(Mode::Structured, 0, cmd::BLOCK_STATUS, 0, 0, &with), Err(refuse(errno::EINVAL)));
        let one = check(Mode::Structured, cmd_flag::REQ_ONE, cmd::BLOCK_STATUS, 0, 4096, &with);
        assert_eq!(one, Ok(Command::BlockStatus { offset: 0, len: 4096, one: true }));
    }

    #[test]
    fn read_only_exports_refuse_writes_with_eperm() {
        let l = Limits { read_only: true, ..limits(Mode::Structured) };
        for kind in [cmd::WRITE, cmd::TRIM, cmd::WRITE_ZEROES] {
            assert_eq!(check(Mode::Structured, 0, kind, 0, 4096, &l), Err(refuse(errno::EPERM)), "command {kind}");
        }
        assert!(check(Mode::Structured, 0, cmd::READ, 0, 4096, &l).is_ok());
        assert_eq!(check(Mode::Structured, 0, cmd::FLUSH, 0, 0, &l), Ok(Command::Flush));
    }

    #[test]
    fn flags_must_belong_to_the_command_and_the_mode() {
        let s = limits(Mode::Simple);
        assert_eq!(
            check(Mode::Simple, cmd_flag::DF, cmd::READ, 0, 512, &s),
            Err(refuse(errno::EINVAL)),
            "DF needs structured replies"
        );
        assert!(check(Mode::Structured, cmd_flag::DF, cmd::READ, 0, 512, &limits(Mode::Structured)).is_ok());
        assert_eq!(check(Mode::Simple, cmd_flag::FUA, cmd::READ, 0, 512, &s), Err(refuse(errno::EINVAL)));
        assert_eq!(check(Mode::Simple, cmd_flag::NO_HOLE, cmd::TRIM, 0, 512, &s), Err(refuse(errno::EINVAL)));
        assert_eq!(check(Mode::Simple, 1 << 9, cmd::FLUSH, 0, 0, &s), Err(refuse(errno::EINVAL)));
        let zero =
            check(Mode::Simple, cmd_flag::NO_HOLE | cmd_flag::FAST_ZERO | cmd_flag::FUA, cmd::WRITE_ZEROES, 0, 512, &s);
        assert_eq!(zero, Ok(Command::WriteZeroes { offset: 0, len: 512, fua: true, may_unmap: false, fast: true }));
        // PAYLOAD_LEN only frames extended headers; on a read it announces a
        // payload the read does not take.
        assert_eq!(
            check(Mode::Structured, cmd_flag::PAYLOAD_LEN, cmd::WRITE, 0, 512, &limits(Mode::Structured)),
            Err(refuse(errno::EINVAL))
        );
        let e = limits(Mode::Extended);
        assert!(check(Mode::Extended, cmd_flag::PAYLOAD_LEN, cmd::WRITE, 0, 512, &e).is_ok());
        assert_eq!(check(Mode::Extended, cmd_flag::PAYLOAD_LEN, cmd::READ, 0, 512, &e), Err(refuse(errno::EINVAL)));
    }

    #[test]
    fn payloads_are_announced_by_writes_and_by_payload_len() {
        let write = Request { flags: 0, kind: cmd::WRITE, cookie: 0, offset: 0, len: 4096 };
        assert_eq!(write.payload_len(Mode::Simple), 4096);
        let status = Request { flags: cmd_flag::PAYLOAD_LEN, kind: cmd::BLOCK_STATUS, cookie: 0, offset: 0, len: 64 };
        assert_eq!(status.payload_len(Mode::Extended), 64);
        assert_eq!(status.payload_len(Mode::Structured), 0, "the flag means nothing without extended headers");
        let unknown = Request { flags: cmd_flag::PAYLOAD_LEN, kind: 99, cookie: 0, offset: 0, len: 1 << 40 };
        assert_eq!(unknown.check(&limits(Mode::Extended)), Err(Refusal { errno: errno::EINVAL, fatal: true }));
    }

    #[test]
    fn unknown_commands_are_invalid() {
        assert_eq!(
            check(Mode::Simple, 0, 8, 0, 0, &limits(Mode::Simple)),
            Err(refuse(errno::EINVAL)),
            "RESIZE is not offered"
        );
        assert_eq!(check(Mode::Simple, 0, 0xffff, 0, 0, &limits(Mode::Simple)), Err(refuse(errno::EINVAL)));
        assert_eq!(check(Mode::Simple, 0, cmd::DISC, 0, 0, &limits(Mode::Simple)), Ok(Command::Disconnect));
    }

    #[test]
    fn replies_encode_in_each_mode() {
        let request = Request { flags: 0, kind: cmd::READ, cookie: 7, offset: 4096, len: 512 };
        let simple = ReplyHeader::read_data(Mode::Simple, &request, 512);
        assert_eq!(simple.as_bytes(), [&SIMPLE_REPLY_MAGIC.to_be_bytes()[..], &[0; 4], &7u64.to_be_bytes()].concat());
        let error = ReplyHeader::error(Mode::Simple, &request, errno::EIO);
        assert_eq!(&error.as_bytes()[4..8], &5u32.to_be_bytes());

        let data = ReplyHeader::read_data(Mode::Structured, &request, 512);
        let b = data.as_bytes();
        assert_eq!(
            (b.len(), be32(b), be16(&b[4..]), be16(&b[6..])),
            (28, STRUCTURED_REPLY_MAGIC, chunk::FLAG_DONE, chunk::OFFSET_DATA)
        );
        assert_eq!((be64(&b[8..]), be32(&b[16..]), be64(&b[20..])), (7, 520, 4096));

        let hole = ReplyHeader::read_hole(Mode::Extended, &request, 512);
        let b = hole.as_bytes();
        assert_eq!((b.len(), be32(b), be16(&b[6..])), (44, EXTENDED_REPLY_MAGIC, chunk::OFFSET_HOLE));
        assert_eq!((be64(&b[16..]), be64(&b[24..]), be64(&b[32..]), be32(&b[40..])), (4096, 12, 4096, 512));

        let error = ReplyHeader::error(Mode::Structured, &request, errno::EPERM);
        let b = error.as_bytes();
        assert_eq!(
            (b.len(), be16(&b[6..]), be32(&b[16..]), be32(&b[20..]), be16(&b[24..])),
            (26, chunk::ERROR, 6, 1, 0)
        );

        let done = ReplyHeader::done(Mode::Extended, &request);
        assert_eq!(
            (done.as_bytes().len(), be16(&done.as_bytes()[6..]), be64(&done.as_bytes()[24..])),
            (32, chunk::NONE, 0)
        );
    }

    #[test]
    fn block_status_chunks_count_their_descriptors() {
        let request = Request { flags: 0, kind: cmd::BLOCK_STATUS, cookie: 1, offset: 0, len: 1 << 20 };
        let compact = ReplyHeader::block_status(Mode::Structured, &request, 0, 3, true);
        let b = compact.as_bytes();
        assert_eq!((b.len(), be16(&b[6..]), be32(&b[16..]), be32(&b[20..])), (24, chunk::BLOCK_STATUS, 4 + 24, 0));
        assert_eq!(be16(&b[4..]), chunk::FLAG_DONE, "the last chunk");
        let extended = ReplyHeader::block_status(Mode::Extended, &request, 2, 3, false);
        let b = extended.as_bytes();
        assert_eq!((b.len(), be16(&b[6..]), be64(&b[24..]), be32(&b[32..])), (40, chunk::BLOCK_STATUS_EXT, 8 + 48, 2));
        assert_eq!((be16(&b[4..]), be32(&b[36..])), (0, 3), "more chunks follow");
        let mut out = [0u8; 16];
        encode_extent(Mode::Extended, 5 << 32, state::HOLE | state::ZERO, &mut out);
        assert_eq!((be64(&out), be64(&out[8..])), (5 << 32, 3));
        encode_extent(Mode::Structured, max_extent(Mode::Structured), state::ZERO, &mut out[..8]);
        assert_eq!((be32(&out), be32(&out[4..])), (0xffff_fe00, 2));
    }

    #[test]
    fn host_errors_map_to_the_spec_s_values() {
        assert_eq!(errno::from_host(libc::EROFS), errno::EPERM);
        assert_eq!(errno::from_host(libc::EDQUOT), errno::ENOSPC);
        assert_eq!(errno::from_host(libc::EBADF), errno::EIO);
    }
}
