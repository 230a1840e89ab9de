//! The client's side of the handshake, blocking: fixed newstyle, then
//! NBD_OPT_STARTTLS and the TLS handshake if the node has credentials,
//! then NBD_OPT_GO, or NBD_OPT_EXPORT_NAME with a server that predates GO.
//!
//! Before GO, structured replies and the `base:allocation` metadata
//! context are asked for, as QEMU's client does, so that block status can
//! be asked; a server without them is read and written all the same, and
//! all its bytes are data.

use std::io::{self, Read, Write};

use vsd_net::{Stream, TlsStream, Wire};

use vsd_nbd_proto::handshake::{FLAG_FIXED_NEWSTYLE, FLAG_NO_ZEROES, IHAVEOPT, NBDMAGIC, REPLY_MAGIC, info, opt, rep};
use vsd_nbd_proto::tx_flag;

use crate::Tls;

/// The most option reply data read: more than any reply the client asks for.
const MAX_REPLY_DATA: u32 = 64 << 10;
/// The longest export name the spec allows.
const MAX_NAME: usize = 4096;
/// The old-style greeting's second word, which vsd does not speak.
const OLDSTYLE_MAGIC: u64 = 0x0000_4202_8186_1253;

/// What the server said about the export.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Export {
    /// Size in bytes.
    pub size: u64,
    /// Transmission flags (`tx_flag`).
    pub flags: u16,
    /// The smallest block requests must be aligned to (1 if not said).
    pub min_block: u32,
    /// The largest read or write payload the server takes.
    pub max_payload: u32,
    /// Structured replies were negotiated: reads may come in chunks.
    pub structured: bool,
    /// The id the server gave `base:allocation`, if it did.
    pub allocation_context: Option<u32>,
}

impl Export {
    /// Whether the server announces transmission flag `flag`.
    pub fn has(&self, flag: u16) -> bool {
        self.flags & flag != 0
    }
}

/// Why the handshake failed.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    /// The socket failed or closed.
    #[error("{0}")]
    Io(#[from] io::Error),
    /// Not a server vsd can talk to.
    #[error("{0}")]
    Protocol(String),
    /// The server refused the export (NBD_REP_ERR_UNKNOWN), in QEMU's words.
    #[error("Requested export not available{}", detail(.0))]
    Unknown(String),
    /// The server requires TLS (NBD_REP_ERR_TLS_REQD).
    #[error("Server requires TLS: give tls-creds{}", detail(.0))]
    TlsRequired(String),
    /// The server does not do TLS, or the TLS handshake failed.
    #[error("TLS with the server failed: {0}")]
    Tls(String),
    /// Another refusal.
    #[error("Server refused the export (error {code:#x}){}", detail(.message))]
    Refused {
        /// The reply type.
        code: u32,
        /// The server's message.
        message: String,
    },
}

fn detail(message: &str) -> String {
    if message.is_empty() { String::new() } else { format!(": {message}") }
}

fn protocol(what: impl Into<String>) -> HandshakeError {
    HandshakeError::Protocol(what.into())
}

/// Negotiates `export` on a connected, blocking `stream`, over TLS with
/// `tls`; returns the connection's wire (the socket, or TLS over it) and
/// what the server said about the export.
pub fn negotiate(stream: Stream, export: &str, tls: Option<&Tls>) -> Result<(Box<dyn Wire>, Export), HandshakeError> {
    if export.len() > MAX_NAME {
        return Err(protocol(format!("an export name of {} bytes is longer than NBD allows", export.len())));
    }
    let mut greeting = [0u8; 18];
    (&stream).read_exact(&mut greeting)?;
    if be64(&greeting[..8]) != NBDMAGIC {
        return Err(protocol("not an NBD server (bad greeting)"));
    }
    if be64(&greeting[8..16]) == OLDSTYLE_MAGIC {
        return Err(protocol("the server speaks old-style negotiation, which vsd does not"));
    }
    let flags = u16::from_be_bytes([greeting[16], greeting[17]]);
    if be64(&greeting[8..16]) != IHAVEOPT || flags & FLAG_FIXED_NEWSTYLE == 0 {
        return Err(protocol("the server does not speak fixed newstyle negotiation"));
    }
    let no_zeroes = flags & FLAG_NO_ZEROES != 0;
    let client_flags = FLAG_FIXED_NEWSTYLE | if no_zeroes { FLAG_NO_ZEROES } else { 0 };
    (&stream).write_all(&u32::from(client_flags).to_be_bytes())?;
    // O_NONBLOCK belongs to the socket, which this handle shares: the
    // transmission phase is non-blocking.
    let handle = stream.try_clone()?;
    let Some(tls) = tls else {
        let found = select(&mut &stream, export, no_zeroes)?;
        handle.set_nonblocking()?;
        return Ok((Box::new(stream), found));
    };
    send_option(&mut &stream, opt::STARTTLS, &[])?;
    match read_reply(&mut &stream, opt::STARTTLS)? {
        (rep::ACK, _) => {}
        (_, data) => {
            return Err(HandshakeError::Tls(format!("the server refused STARTTLS{}", detail(&message(&data)))));
        }
    }
    let session = tls.creds.connect(tls.hostname.as_deref()).map_err(|e| HandshakeError::Tls(e.to_string()))?;
    let mut wire = TlsStream::new(session, stream);
    wire.handshake().map_err(|e| HandshakeError::Tls(e.to_string()))?;
    // TLS 1.3 servers refuse a client's certificate (or its absence) after
    // the client thinks the handshake done: the alert comes with the reply,
    // or the server is gone before the client's first option is sent.
    let found = match select(&mut wire, export, no_zeroes) {
        Ok(found) => found,
        Err(HandshakeError::Io(e)) => return Err(HandshakeError::Tls(refusal(&mut wire, e))),
        Err(e) => return Err(e),
    };
    handle.set_nonblocking()?;
    Ok((Box::new(wire), found))
}

/// What an I/O error `e` right after the TLS handshake says: the server's
/// alert if it sent one (a write that found the server gone has not read
/// it yet), else that the server left.
fn refusal<S: Read>(wire: &mut S, e: io::Error) -> String {
    if e.kind() == io::ErrorKind::InvalidData {
        return e.to_string();
    }
    match wire.read(&mut [0u8; 1]) {
        Err(alert) if alert.kind() == io::ErrorKind::InvalidData => alert.to_string(),
        _ => format!("the server closed the connection after the handshake ({e}); does it want a client certificate?"),
    }
}

/// Selects the export: GO, or EXPORT_NAME with a server without GO.
fn select<S: Read + Write>(stream: &mut S, export: &str, no_zeroes: bool) -> Result<Export, HandshakeError> {
    let structured = structured_replies(stream)?;
    let allocation_context = if structured { allocation_context(stream, export)? } else { None };
    let mut found = match go(stream, export)? {
        Some(found) => found,
        None => export_name(stream, export, no_zeroes)?,
    };
    stream.flush()?;
    (found.structured, found.allocation_context) = (structured, allocation_context);
    Ok(found)
}

/// NBD_OPT_STRUCTURED_REPLY: whether the server agreed.
fn structured_replies<S: Read + Write>(stream: &mut S) -> Result<bool, HandshakeError> {
    send_option(stream, opt::STRUCTURED_REPLY, &[])?;
    match read_reply(stream, opt::STRUCTURED_REPLY)? {
        (rep::ACK, _) => Ok(true),
        (rep::ERR_TLS_REQD, data) => Err(HandshakeError::TlsRequired(message(&data))),
        (code, _) if code & rep::ERR != 0 => Ok(false),
        (code, _) => Err(protocol(format!("the server answered NBD_OPT_STRUCTURED_REPLY with reply {code:#x}"))),
    }
}

/// NBD_OPT_SET_META_CONTEXT with `base:allocation`: the id the server gave
/// it, `None` if it gave none or refused the option.
fn allocation_context<S: Read + Write>(stream: &mut S, export: &str) -> Result<Option<u32>, HandshakeError> {
    const CONTEXT: &str = "base:allocation";
    let mut data = Vec::with_capacity(12 + export.len() + CONTEXT.len());
    data.extend_from_slice(&(export.len() as u32).to_be_bytes());
    data.extend_from_slice(export.as_bytes());
    data.extend_from_slice(&1u32.to_be_bytes());
    data.extend_from_slice(&(CONTEXT.len() as u32).to_be_bytes());
    data.extend_from_slice(CONTEXT.as_bytes());
    send_option(stream, opt::SET_META_CONTEXT, &data)?;
    let mut id = None;
    loop {
        match read_reply(stream, opt::SET_META_CONTEXT)? {
            (rep::ACK, _) => return Ok(id),
            (rep::META_CONTEXT, data) if data.len() > 4 && &data[4..] == CONTEXT.as_bytes() => {
                id = Some(be32(&data[..4]));
            }
            // Another context than asked for: not one block status reads.
            (rep::META_CONTEXT, _) => {}
            (rep::ERR_TLS_REQD, data) => return Err(HandshakeError::TlsRequired(message(&data))),
            (code, _) if code & rep::ERR != 0 => return Ok(None),
            (code, _) => {
                return Err(protocol(format!("the server answered NBD_OPT_SET_META_CONTEXT with reply {code:#x}")));
            }
        }
    }
}

/// NBD_OPT_GO asking for block sizes; `None` if the server does not know GO.
fn go<S: Read + Write>(stream: &mut S, export: &str) -> Result<Option<Export>, HandshakeError> {
    let mut data = Vec::with_capacity(8 + export.len());
    data.extend_from_slice(&(export.len() as u32).to_be_bytes());
    data.extend_from_slice(export.as_bytes());
    data.extend_from_slice(&1u16.to_be_bytes());
    data.extend_from_slice(&info::BLOCK_SIZE.to_be_bytes());
    send_option(stream, opt::GO, &data)?;
    let mut found =
        Export { size: 0, flags: 0, min_block: 1, max_payload: 32 << 20, structured: false, allocation_context: None };
    let mut described = false;
    loop {
        let (kind, data) = read_reply(stream, opt::GO)?;
        match kind {
            rep::ACK if described => return Ok(Some(found)),
            rep::ACK => return Err(protocol("the server ended NBD_OPT_GO without describing the export")),
            rep::INFO => described |= read_info(&data, &mut found)?,
            rep::ERR_UNSUP => return Ok(None),
            rep::ERR_UNKNOWN => return Err(HandshakeError::Unknown(message(&data))),
            rep::ERR_TLS_REQD => return Err(HandshakeError::TlsRequired(message(&data))),
            code if code & rep::ERR != 0 => return Err(HandshakeError::Refused { code, message: message(&data) }),
            _ => {} // other replies (a description) do not matter here
        }
    }
}

/// One NBD_REP_INFO; whether it was NBD_INFO_EXPORT.
fn read_info(data: &[u8], found: &mut Export) -> Result<bool, HandshakeError> {
    let short = || protocol("a short NBD_REP_INFO reply");
    let kind = u16::from_be_bytes(data.get(..2).ok_or_else(short)?.try_into().unwrap_or_default());
    match kind {
        info::EXPORT => {
            let body = data.get(2..12).ok_or_else(short)?;
            found.size = be64(&body[..8]);
            found.flags = u16::from_be_bytes([body[8], body[9]]);
            if found.flags & tx_flag::HAS_FLAGS == 0 {
                return Err(protocol("the server's transmission flags lack NBD_FLAG_HAS_FLAGS"));
            }
            Ok(true)
        }
        info::BLOCK_SIZE => {
            let body = data.get(2..14).ok_or_else(short)?;
            let (min, max) = (be32(&body[..4]), be32(&body[8..12]));
            if !min.is_power_of_two() || min > 65536 || max < min {
                return Err(protocol(format!("the server's block sizes make no sense (minimum {min}, maximum {max})")));
            }
            found.min_block = min;
            found.max_payload = max;
            Ok(false)
        }
        _ => Ok(false),
    }
}

/// NBD_OPT_EXPORT_NAME: the server answers with the export or closes.
fn export_name<S: Read + Write>(stream: &mut S, export: &str, no_zeroes: bool) -> Result<Export, HandshakeError> {
    send_option(stream, opt::EXPORT_NAME, export.as_bytes())?;
    let mut reply = [0u8; 10 + 124];
    let want = if no_zeroes { 10 } else { reply.len() };
    stream.read_exact(&mut reply[..want]).map_err(|e| match e.kind() {
        io::ErrorKind::UnexpectedEof => HandshakeError::Unknown(String::new()),
        _ => e.into(),
    })?;
    let flags = u16::from_be_bytes([reply[8], reply[9]]);
    Ok(Export {
        size: be64(&reply[..8]),
        flags,
        min_block: 1,
        max_payload: 32 << 20,
        structured: false,
        allocation_context: None,
    })
}

fn send_option<S: Write>(stream: &mut S, option: u32, data: &[u8]) -> io::Result<()> {
    let mut message = Vec::with_capacity(16 + data.len());
    message.extend_from_slice(&IHAVEOPT.to_be_bytes());
    message.extend_from_slice(&option.to_be_bytes());
    message.extend_from_slice(&(data.len() as u32).to_be_bytes());
    message.extend_from_slice(data);
    stream.write_all(&message)
}

/// One option reply to `option`: its type and data.
fn read_reply<S: Read>(stream: &mut S, option: u32) -> Result<(u32, Vec<u8>), HandshakeError> {
    let mut header = [0u8; 20];
    stream.read_exact(&mut header)?;
    if be64(&header[..8]) != REPLY_MAGIC || be32(&header[8..12]) != option {
        return Err(protocol("the server's option reply is not one to the option sent"));
    }
    let len = be32(&header[16..20]);
    if len > MAX_REPLY_DATA {
        return Err(protocol(format!("an option reply of {len} bytes")));
    }
    let mut data = vec![0; len as usize];
    stream.read_exact(&mut data)?;
    Ok((be32(&header[12..16]), data))
}

fn message(data: &[u8]) -> String {
    String::from_utf8_lossy(data).into_owned()
}

fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}

fn be64(b: &[u8]) -> u64 {
    u64::from_be_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]])
}
