//! The handshake as a state machine over bytes: fixed newstyle
//! negotiation, from the server's greeting to the transmission phase.
//!
//! [`Negotiation::feed`] takes whatever the client sent, in any chunks,
//! and queues what the server answers ([`Negotiation::take_output`]). It
//! stops consuming at the end of the option that ends the handshake, so
//! the bytes after it belong to the transmission phase.
//!
//! Each option type has a bound on its data, from the spec's limits
//! ([`max_len`]: names and queries of at most 4096 bytes, each
//! information request once). An option announced longer cannot be valid:
//! it is answered at once (NBD_REP_ERR_INVALID for an option that takes
//! no data, NBD_REP_ERR_TOO_BIG otherwise, nothing for EXPORT_NAME) and
//! the connection closed, rather than waiting for data a flooding client
//! never sends (the spec allows a hard disconnect when a client breaks a
//! MUST). So memory is bounded whatever the client sends, and no client
//! holds a connection by announcing a long option.
//!
//! A server that requires TLS answers every option but STARTTLS and ABORT
//! with NBD_REP_ERR_TLS_REQD until the client has sent STARTTLS, and
//! closes the connection on EXPORT_NAME, which has no error reply (as
//! QEMU). After STARTTLS, [`Negotiation::feed`] stops consuming until the
//! caller has started the TLS session ([`Negotiation::take_starttls`]);
//! what was agreed before it is forgotten (CVE-2021-3716 was structured
//! replies negotiated in the clear surviving STARTTLS in nbdkit).

use crate::proto::handshake::{FLAG_FIXED_NEWSTYLE, FLAG_NO_ZEROES, IHAVEOPT, NBDMAGIC, REPLY_MAGIC, info, opt, rep};
use crate::proto::{Mode, tx_flag};

/// The most option data kept: NBD_OPT_INFO's and NBD_OPT_GO's bound, the
/// longest.
pub const MAX_OPTION_DATA: u32 = max_len(opt::GO);
/// The longest export name or query (the spec's limit for strings).
const MAX_STRING: u32 = 4096;
/// A length-prefixed string at its longest.
const MAX_PREFIXED: u32 = 4 + MAX_STRING;
/// Metadata context queries of the longest length one option has room
/// for: the spec leaves the number to the server (NBD_REP_ERR_TOO_BIG);
/// an export offers two contexts and one per bitmap.
const MAX_QUERIES: u32 = 16;
/// The data an option vsd does not know may carry, to be refused with
/// NBD_REP_ERR_UNSUP: the spec sets no bound.
const MAX_UNKNOWN: u32 = 64 << 10;
const BASE_ALLOCATION: &str = "base:allocation";
const ALLOCATION_DEPTH: &str = "qemu:allocation-depth";
const DIRTY_BITMAP: &str = "qemu:dirty-bitmap:";

/// A metadata context an export offers to block status.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Context {
    /// `base:allocation`: holes and zeroes.
    BaseAllocation,
    /// `qemu:allocation-depth`: in which layer of the backing chain.
    AllocationDepth,
    /// `qemu:dirty-bitmap:NAME`: the export's bitmap at this index.
    DirtyBitmap(usize),
}

impl Context {
    /// The id replies name it by: its place in the export's offer.
    pub fn id(self) -> u32 {
        match self {
            Context::BaseAllocation => 0,
            Context::AllocationDepth => 1,
            Context::DirtyBitmap(index) => 2 + index as u32,
        }
    }

    fn name(self, info: &ExportInfo) -> String {
        match self {
            Context::BaseAllocation => BASE_ALLOCATION.into(),
            Context::AllocationDepth => ALLOCATION_DEPTH.into(),
            Context::DirtyBitmap(index) => format!("{DIRTY_BITMAP}{}", info.bitmaps[index]),
        }
    }

    /// Every context `info`'s export offers, in id order.
    fn offered(info: &ExportInfo) -> impl Iterator<Item = Context> {
        let depth = info.allocation_depth.then_some(Context::AllocationDepth);
        let bitmaps = (0..info.bitmaps.len()).map(Context::DirtyBitmap);
        std::iter::once(Context::BaseAllocation).chain(depth).chain(bitmaps)
    }
}

/// What a client is told about an export.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportInfo {
    /// The name clients ask for.
    pub name: String,
    /// Free text, sent if asked for and not empty.
    pub description: String,
    /// Size in bytes.
    pub size: u64,
    /// Transmission flags (without SEND_DF, which negotiation adds).
    pub flags: u16,
    /// Minimum, preferred and maximum block sizes.
    pub block_sizes: [u32; 3],
    /// The dirty bitmaps it shows as `qemu:dirty-bitmap:NAME` contexts.
    pub bitmaps: Vec<String>,
    /// It shows `qemu:allocation-depth`.
    pub allocation_depth: bool,
}

/// The exports a server offers.
pub trait Catalog {
    /// What the transmission phase serves.
    type Export;
    /// The export called `name`, with what clients are told about it.
    fn find(&self, name: &str) -> Option<(Self::Export, ExportInfo)>;
    /// Every export's name and description, for NBD_OPT_LIST.
    fn list(&self) -> Vec<(String, String)>;
}

/// What the handshake agreed on.
#[derive(Debug)]
pub struct Agreement<E> {
    /// The export chosen.
    pub export: E,
    /// What it was advertised as.
    pub info: ExportInfo,
    /// Reply format.
    pub mode: Mode,
    /// The metadata contexts selected for this export, in id order.
    pub contexts: Vec<Context>,
}

/// Why the handshake ended without an agreement.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Closed {
    /// The client sent NBD_OPT_ABORT.
    #[error("the client aborted the handshake")]
    Aborted,
    /// Flags the server does not know.
    #[error("unknown client flags {0:#x}")]
    ClientFlags(u32),
    /// An option header without IHAVEOPT.
    #[error("bad option magic")]
    OptionMagic,
    /// NBD_OPT_EXPORT_NAME for a missing export: that option has no error
    /// reply.
    #[error("NBD_OPT_EXPORT_NAME for an export that cannot be served")]
    ExportName,
    /// An option a TLS server cannot refuse with a reply: EXPORT_NAME
    /// before TLS, or any option from a client without fixed newstyle.
    #[error("Option {0:#x} not permitted before TLS")]
    TlsRequired(u32),
    /// An option announced longer than its type allows (QEMU's words).
    #[error("option {option:#x}: len ({len}) is larger than max len ({max})")]
    TooLong {
        /// The option.
        option: u32,
        /// Its length.
        len: u32,
        /// The most its type may have.
        max: u32,
    },
}

/// Where the connection stands with TLS.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Tls {
    /// The server has no credentials: STARTTLS is refused.
    Off,
    /// Required and not started: options are refused until STARTTLS.
    Required,
    /// STARTTLS acknowledged; the caller has yet to start the session.
    Starting,
    /// The rest of the handshake is encrypted.
    On,
}

enum Phase {
    ClientFlags,
    OptionHeader,
    OptionData { option: u32, len: usize },
    Finished,
}

/// One client's handshake.
pub struct Negotiation<C: Catalog> {
    catalog: C,
    phase: Phase,
    input: Vec<u8>,
    output: Vec<u8>,
    no_zeroes: bool,
    fixed: bool,
    tls: Tls,
    mode: Mode,
    /// The contexts SET_META_CONTEXT selected, and for which export name.
    contexts: Option<(String, Vec<Context>)>,
    outcome: Option<Result<Agreement<C::Export>, Closed>>,
}

impl<C: Catalog> Negotiation<C> {
    /// A handshake whose greeting is ready to send; with `tls_required`,
    /// the client must send STARTTLS before anything else.
    pub fn new(catalog: C, tls_required: bool) -> Self {
        let mut output = Vec::with_capacity(64);
        output.extend(NBDMAGIC.to_be_bytes());
        output.extend(IHAVEOPT.to_be_bytes());
        output.extend((FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
        Self {
            catalog,
            phase: Phase::ClientFlags,
            input: Vec::new(),
            output,
            no_zeroes: false,
            fixed: false,
            tls: if tls_required { Tls::Required } else { Tls::Off },
            mode: Mode::Simple,
            contexts: None,
            outcome: None,
        }
    }

    /// What to send the client now.
    pub fn take_output(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.output)
    }

    /// The end of the handshake, once reached: the agreement, or why the
    /// connection is to be closed (after sending the output).
    pub fn outcome(&mut self) -> Option<Result<Agreement<C::Export>, Closed>> {
        self.outcome.take()
    }

    /// Whether the client's STARTTLS was just acknowledged: the caller
    /// sends the output, then starts TLS, feeding the session the bytes
    /// [`Negotiation::feed`] left; the options that follow are encrypted.
    pub fn take_starttls(&mut self) -> bool {
        if self.tls != Tls::Starting {
            return false;
        }
        self.tls = Tls::On;
        true
    }

    /// Whether the handshake has ended.
    pub fn finished(&self) -> bool {
        matches!(self.phase, Phase::Finished)
    }

    /// Consumes client bytes; returns how many were taken (fewer than
    /// given only once the handshake has ended).
    pub fn feed(&mut self, mut bytes: &[u8]) -> usize {
        let given = bytes.len();
        loop {
            if self.tls == Tls::Starting {
                break;
            }
            let need = match self.phase {
                Phase::Finished => break,
                Phase::ClientFlags => 4,
                Phase::OptionHeader => 16,
                Phase::OptionData { len, .. } => len,
            };
            // No more than the option's data: not the doubling of growth.
            self.input.reserve_exact(need - self.input.len());
            let n = (need - self.input.len()).min(bytes.len());
            self.input.extend_from_slice(&bytes[..n]);
            bytes = &bytes[n..];
            if self.input.len() < need {
                break;
            }
            let input = std::mem::take(&mut self.input);
            self.step(&input);
            self.input = input;
            self.input.clear();
        }
        given - bytes.len()
    }

    fn step(&mut self, input: &[u8]) {
        match self.phase {
            Phase::ClientFlags => {
                let flags = u32::from_be_bytes(input[..4].try_into().unwrap_or_default());
                let known = u32::from(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES);
                if flags & !known != 0 {
                    return self.close(Closed::ClientFlags(flags));
                }
                self.no_zeroes = flags & u32::from(FLAG_NO_ZEROES) != 0;
                self.fixed = flags & u32::from(FLAG_FIXED_NEWSTYLE) != 0;
                self.phase = Phase::OptionHeader;
            }
            Phase::OptionHeader => {
                let (magic, option, len) = (be64(input), be32(&input[8..]), be32(&input[12..]));
                if magic != IHAVEOPT {
                    return self.close(Closed::OptionMagic);
                }
                let max = max_len(option);
                // ABORT's data, which the spec says to ignore, is not waited for.
                if len == 0 || option == opt::ABORT {
                    self.option(option, &[]);
                } else if len > max {
                    self.too_long(option, len, max);
                } else {
                    self.phase = Phase::OptionData { option, len: len as usize };
                }
            }
            Phase::OptionData { option, .. } => self.option(option, input),
            Phase::Finished => unreachable!("no input is gathered once finished"),
        }
    }

    /// An option longer than its type allows: told at once where the
    /// client can be told (fixed newstyle, an option with error replies),
    /// then the end.
    fn too_long(&mut self, option: u32, len: u32, max: u32) {
        let why = Closed::TooLong { option, len, max };
        if self.fixed && option != opt::EXPORT_NAME {
            // The spec's answer to data where none belongs.
            let kind = if max == 0 { rep::ERR_INVALID } else { rep::ERR_TOO_BIG };
            self.error(option, kind, &why.to_string());
        }
        self.close(why);
    }

    fn close(&mut self, why: Closed) {
        self.phase = Phase::Finished;
        self.outcome = Some(Err(why));
    }

    /// Handles one whole option; the next phase is an option header unless
    /// the option ends the handshake.
    fn option(&mut self, option: u32, data: &[u8]) {
        self.phase = Phase::OptionHeader;
        if self.tls == Tls::Required {
            return self.before_tls(option);
        }
        match option {
            opt::EXPORT_NAME => self.export_name(data),
            opt::ABORT => {
                self.reply(option, rep::ACK, &[]);
                self.close(Closed::Aborted);
            }
            opt::LIST => {
                for (name, description) in self.catalog.list() {
                    let mut entry = Vec::with_capacity(4 + name.len() + description.len());
                    entry.extend((name.len() as u32).to_be_bytes());
                    entry.extend(name.as_bytes());
                    entry.extend(description.as_bytes());
                    self.reply(option, rep::SERVER, &entry);
                }
                self.reply(option, rep::ACK, &[]);
            }
            opt::STARTTLS if self.tls == Tls::Off => self.error(option, rep::ERR_POLICY, "TLS not configured"),
            opt::STARTTLS => self.error(option, rep::ERR_INVALID, "TLS already enabled"),
            opt::INFO | opt::GO => self.info_or_go(option, data),
            opt::STRUCTURED_REPLY | opt::EXTENDED_HEADERS => self.reply_format(option),
            opt::LIST_META_CONTEXT | opt::SET_META_CONTEXT => self.meta_context(option, data),
            _ => self.error(option, rep::ERR_UNSUP, "option not supported"),
        }
    }

    /// An option on a connection that must start TLS first.
    fn before_tls(&mut self, option: u32) {
        // Without fixed newstyle the client cannot be told why.
        if !self.fixed {
            return self.close(Closed::TlsRequired(option));
        }
        match option {
            opt::STARTTLS => {
                self.reply(option, rep::ACK, &[]);
                // Nothing agreed in the clear may outlive it.
                (self.mode, self.contexts, self.tls) = (Mode::Simple, None, Tls::Starting);
            }
            opt::EXPORT_NAME => self.close(Closed::TlsRequired(option)),
            opt::ABORT => {
                self.reply(option, rep::ACK, &[]);
                self.close(Closed::Aborted);
            }
            _ => self.error(option, rep::ERR_TLS_REQD, &format!("Option {option:#x} not permitted before TLS")),
        }
    }

    fn export_name(&mut self, data: &[u8]) {
        let found = std::str::from_utf8(data).ok().and_then(|name| self.catalog.find(name));
        let Some((export, info)) = found else { return self.close(Closed::ExportName) };
        let flags = self.advertised_flags(&info);
        self.output.extend(info.size.to_be_bytes());
        self.output.extend(flags.to_be_bytes());
        if !self.no_zeroes {
            self.output.extend([0u8; 124]);
        }
        self.agree(export, info);
    }

    fn agree(&mut self, export: C::Export, info: ExportInfo) {
        let contexts = match self.contexts.take() {
            Some((name, contexts)) if name == info.name => contexts,
            _ => Vec::new(),
        };
        self.phase = Phase::Finished;
        self.outcome = Some(Ok(Agreement { export, info, mode: self.mode, contexts }));
    }

    fn advertised_flags(&self, info: &ExportInfo) -> u16 {
        if self.mode >= Mode::Structured { info.flags | tx_flag::SEND_DF } else { info.flags }
    }

    fn info_or_go(&mut self, option: u32, data: &[u8]) {
        let mut reader = Reader(data);
        let parsed = (|| {
            let name = reader.string()?;
            let count = reader.u16()?;
            let requests: Vec<u16> = (0..count).map(|_| reader.u16()).collect::<Option<_>>()?;
            reader.0.is_empty().then_some((name, requests))
        })();
        let Some((name, requests)) = parsed else {
            return self.error(option, rep::ERR_INVALID, "malformed export name or information requests");
        };
        let Some((export, info)) = self.catalog.find(&name) else {
            return self.error(option, rep::ERR_UNKNOWN, "export not found");
        };
        let mut export_info = Vec::with_capacity(12);
        export_info.extend(info::EXPORT.to_be_bytes());
        export_info.extend(info.size.to_be_bytes());
        export_info.extend(self.advertised_flags(&info).to_be_bytes());
        self.reply(option, rep::INFO, &export_info);
        if requests.contains(&info::NAME) {
            self.reply(option, rep::INFO, &[&info::NAME.to_be_bytes()[..], info.name.as_bytes()].concat());
        }
        if requests.contains(&info::DESCRIPTION) && !info.description.is_empty() {
            let text = &info.description;
            self.reply(option, rep::INFO, &[&info::DESCRIPTION.to_be_bytes()[..], text.as_bytes()].concat());
        }
        let mut sizes = info::BLOCK_SIZE.to_be_bytes().to_vec();
        for size in info.block_sizes {
            sizes.extend(size.to_be_bytes());
        }
        self.reply(option, rep::INFO, &sizes);
        self.reply(option, rep::ACK, &[]);
        if option == opt::GO {
            self.agree(export, info);
        }
    }

    fn reply_format(&mut self, option: u32) {
        let want = if option == opt::EXTENDED_HEADERS { Mode::Extended } else { Mode::Structured };
        if self.mode == Mode::Extended && want == Mode::Structured {
            self.error(option, rep::ERR_EXT_HEADER_REQD, "extended headers already negotiated");
        } else if self.mode == want {
            self.error(option, rep::ERR_INVALID, "already negotiated");
        } else {
            self.mode = want;
            self.reply(option, rep::ACK, &[]);
        }
    }

    fn meta_context(&mut self, option: u32, data: &[u8]) {
        let set = option == opt::SET_META_CONTEXT;
        if set && self.mode == Mode::Simple {
            return self.error(option, rep::ERR_INVALID, "structured replies not negotiated");
        }
        let mut reader = Reader(data);
        let parsed = (|| {
            let name = reader.string()?;
            let count = reader.u32()?;
            let queries: Vec<String> = (0..count).map(|_| reader.string()).collect::<Option<_>>()?;
            reader.0.is_empty().then_some((name, queries))
        })();
        let Some((name, queries)) = parsed else {
            return self.error(option, rep::ERR_INVALID, "malformed metadata context request");
        };
        let Some((_, info)) = self.catalog.find(&name) else {
            return self.error(option, rep::ERR_UNKNOWN, "export not found");
        };
        // SET takes whole names; LIST also namespaces ("base:", "qemu:",
        // "qemu:dirty-bitmap:"), and lists everything for no query.
        let matches = |context: &str| {
            queries.iter().any(|q| q == context || (!set && q.ends_with(':') && context.starts_with(q.as_str())))
        };
        let chosen: Vec<Context> =
            Context::offered(&info).filter(|c| (!set && queries.is_empty()) || matches(&c.name(&info))).collect();
        for context in &chosen {
            let reply = [&context.id().to_be_bytes()[..], context.name(&info).as_bytes()].concat();
            self.reply(option, rep::META_CONTEXT, &reply);
        }
        if set {
            self.contexts = Some((name, chosen));
        }
        self.reply(option, rep::ACK, &[]);
    }

    fn reply(&mut self, option: u32, kind: u32, data: &[u8]) {
        self.output.extend(REPLY_MAGIC.to_be_bytes());
        self.output.extend(option.to_be_bytes());
        self.output.extend(kind.to_be_bytes());
        self.output.extend((data.len() as u32).to_be_bytes());
        self.output.extend(data);
    }

    fn error(&mut self, option: u32, kind: u32, message: &str) {
        self.reply(option, kind, message.as_bytes());
    }
}

/// The longest data an option of this type can validly carry.
pub const fn max_len(option: u32) -> u32 {
    match option {
        opt::EXPORT_NAME => MAX_STRING,
        opt::ABORT | opt::LIST | opt::STARTTLS | opt::STRUCTURED_REPLY | opt::EXTENDED_HEADERS => 0,
        // A name, a count, and each information request at most once.
        opt::INFO | opt::GO => MAX_PREFIXED + 2 + 2 * u16::MAX as u32,
        // A name, a count, and the queries.
        opt::LIST_META_CONTEXT | opt::SET_META_CONTEXT => MAX_PREFIXED + 4 + MAX_QUERIES * MAX_PREFIXED,
        _ => MAX_UNKNOWN,
    }
}

fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}
fn be64(b: &[u8]) -> u64 {
    u64::from_be_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]])
}

/// Reads big-endian fields off option data; `None` past its end.
struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Option<&[u8]> {
        let (head, rest) = (self.0.get(..n)?, self.0.get(n..)?);
        self.0 = rest;
        Some(head)
    }
    fn u16(&mut self) -> Option<u16> {
        self.take(2).map(|b| u16::from_be_bytes([b[0], b[1]]))
    }
    fn u32(&mut self) -> Option<u32> {
        self.take(4).map(be32)
    }
    /// A 32-bit length, then that many bytes of UTF-8, at most [`MAX_STRING`].
    fn string(&mut self) -> Option<String> {
        let len = self.u32()?;
        if len > MAX_STRING {
            return None;
        }
        std::str::from_utf8(self.take(len as usize)?).ok().map(str::to_string)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Two;

    impl Catalog for Two {
        type Export = &'static str;
        fn find(&self, name: &str) -> Option<(&'static str, ExportInfo)> {
            let (export, size) = match name {
                "disk" => ("disk", 1 << 20),
                "ro" => ("ro", 4096),
                _ => return None,
            };
            let flags = tx_flag::HAS_FLAGS | if export == "ro" { tx_flag::READ_ONLY } else { 0 };
            let info = ExportInfo {
                name: export.into(),
                description: if export == "disk" { "a disk".into() } else { String::new() },
                size,
                flags,
                block_sizes: [1, 4096, 32 << 20],
                bitmaps: if export == "disk" { vec!["b0".into(), "b1".into()] } else { vec![] },
                allocation_depth: export == "disk",
            };
            Some((export, info))
        }
        fn list(&self) -> Vec<(String, String)> {
            vec![("disk".into(), "a disk".into()), ("ro".into(), String::new())]
        }
    }

    fn option(code: u32, data: &[u8]) -> Vec<u8> {
        [&IHAVEOPT.to_be_bytes()[..], &code.to_be_bytes(), &(data.len() as u32).to_be_bytes(), data].concat()
    }

    fn name_and(name: &str, tail: &[u8]) -> Vec<u8> {
        [&(name.len() as u32).to_be_bytes()[..], name.as_bytes(), tail].concat()
    }

    fn go(name: &str, requests: &[u16]) -> Vec<u8> {
        let mut tail = (requests.len() as u16).to_be_bytes().to_vec();
        requests.iter().for_each(|r| tail.extend(r.to_be_bytes()));
        name_and(name, &tail)
    }

    fn meta(name: &str, queries: &[&str]) -> Vec<u8> {
        let mut tail = (queries.len() as u32).to_be_bytes().to_vec();
        queries.iter().for_each(|q| tail.extend(name_and(q, &[])));
        name_and(name, &tail)
    }

    /// A reply: option, type, data.
    type Reply = (u32, u32, Vec<u8>);

    fn replies(mut out: &[u8]) -> Vec<Reply> {
        let mut all = Vec::new();
        while !out.is_empty() {
            assert_eq!(be64(out), REPLY_MAGIC);
            let len = be32(&out[16..]) as usize;
            all.push((be32(&out[8..]), be32(&out[12..]), out[20..20 + len].to_vec()));
            out = &out[20 + len..];
        }
        all
    }

    /// A negotiation past the greeting and client flags (NO_ZEROES set).
    fn started() -> Negotiation<Two> {
        let mut n = Negotiation::new(Two, false);
        let greeting = n.take_output();
        assert_eq!((be64(&greeting), be64(&greeting[8..]), &greeting[16..]), (NBDMAGIC, IHAVEOPT, &[0u8, 3][..]));
        assert_eq!(n.feed(&3u32.to_be_bytes()), 4);
        n
    }

    fn exchange(n: &mut Negotiation<Two>, code: u32, data: &[u8]) -> Vec<Reply> {
        let bytes = option(code, data);
        assert_eq!(n.feed(&bytes), bytes.len());
        replies(&n.take_output())
    }

    #[test]
    fn go_agrees_on_an_export_and_stops_at_its_end() {
        let mut n = started();
        let mut bytes = option(opt::GO, &go("disk", &[info::NAME, info::DESCRIPTION]));
        let option_len = bytes.len();
        bytes.extend([0x25, 0x60, 0x95, 0x13]); // the first request's magic
        // Byte by byte: chunks may end anywhere.
        let mut taken = 0;
        for byte in bytes.chunks(1) {
            taken += n.feed(byte);
        }
        assert_eq!(taken, option_len, "bytes after GO are the transmission phase's");
        let all = replies(&n.take_output());
        let kinds: Vec<_> = all.iter().map(|r| (r.0, r.1, r.2.get(..2).map(be16))).collect();
        let info = |t| (opt::GO, rep::INFO, Some(t));
        assert_eq!(
            kinds,
            [
                info(info::EXPORT),
                info(info::NAME),
                info(info::DESCRIPTION),
                info(info::BLOCK_SIZE),
                (opt::GO, rep::ACK, None)
            ]
        );
        assert_eq!((be64(&all[0].2[2..]), be16(&all[0].2[10..])), (1 << 20, tx_flag::HAS_FLAGS));
        assert_eq!(&all[2].2[2..], b"a disk");
        assert_eq!((be32(&all[3].2[2..]), be32(&all[3].2[6..]), be32(&all[3].2[10..])), (1, 4096, 32 << 20));
        let agreement = n.outcome().unwrap().unwrap();
        assert_eq!((agreement.export, agreement.mode, agreement.contexts), ("disk", Mode::Simple, vec![]));
    }

    fn be16(b: &[u8]) -> u16 {
        u16::from_be_bytes([b[0], b[1]])
    }

    #[test]
    fn info_keeps_negotiating_and_unknown_exports_are_errors() {
        let mut n = started();
        let all = exchange(&mut n, opt::INFO, &go("ro", &[]));
        assert_eq!(all.last().unwrap().1, rep::ACK);
        assert_eq!(be16(&all[0].2[10..]), tx_flag::HAS_FLAGS | tx_flag::READ_ONLY);
        assert!(n.outcome().is_none());
        assert_eq!(exchange(&mut n, opt::GO, &go("nope", &[]))[0].1, rep::ERR_UNKNOWN);
        let mut bad = go("disk", &[info::NAME]);
        bad.push(0);
        assert_eq!(exchange(&mut n, opt::GO, &bad)[0].1, rep::ERR_INVALID, "trailing byte");
        assert_eq!(
            exchange(&mut n, opt::GO, &[0, 0, 0, 9, b'd'])[0].1,
            rep::ERR_INVALID,
            "name longer than the option"
        );
        assert!(!n.finished());
    }

    #[test]
    fn structured_and_extended_replies_follow_the_spec_s_order() {
        let mut n = started();
        assert_eq!(exchange(&mut n, opt::STRUCTURED_REPLY, &[])[0].1, rep::ACK);
        assert_eq!(exchange(&mut n, opt::STRUCTURED_REPLY, &[])[0].1, rep::ERR_INVALID, "twice");
        assert_eq!(exchange(&mut n, opt::EXTENDED_HEADERS, &[])[0].1, rep::ACK);
        assert_eq!(exchange(&mut n, opt::EXTENDED_HEADERS, &[])[0].1, rep::ERR_INVALID, "twice");
        assert_eq!(exchange(&mut n, opt::STRUCTURED_REPLY, &[])[0].1, rep::ERR_EXT_HEADER_REQD);
        let all = exchange(&mut n, opt::GO, &go("disk", &[]));
        assert_eq!(be16(&all[0].2[10..]), tx_flag::HAS_FLAGS | tx_flag::SEND_DF);
        assert_eq!(n.outcome().unwrap().unwrap().mode, Mode::Extended);
    }

    /// The (id, name) of each context a reply lists.
    fn contexts(replies: &[Reply]) -> Vec<(u32, String)> {
        let listed = replies.iter().filter(|r| r.1 == rep::META_CONTEXT);
        listed.map(|r| (be32(&r.2), String::from_utf8(r.2[4..].to_vec()).unwrap())).collect()
    }

    #[test]
    fn meta_contexts_list_set_and_bind_to_their_export() {
        let mut n = started();
        let set = meta("disk", &[BASE_ALLOCATION]);
        assert_eq!(exchange(&mut n, opt::SET_META_CONTEXT, &set)[0].1, rep::ERR_INVALID, "needs structured replies");
        let all = [
            (0, "base:allocation"),
            (1, "qemu:allocation-depth"),
            (2, "qemu:dirty-bitmap:b0"),
            (3, "qemu:dirty-bitmap:b1"),
        ]
        .map(|(id, name)| (id, name.to_string()));
        let list = |n: &mut Negotiation<Two>, queries: &[&str]| {
            let replies = exchange(n, opt::LIST_META_CONTEXT, &meta("disk", queries));
            assert_eq!(replies.last().unwrap().1, rep::ACK);
            contexts(&replies)
        };
        assert_eq!(list(&mut n, &[]), all, "no query lists everything");
        assert_eq!(list(&mut n, &["base:"]), all[..1]);
        assert_eq!(list(&mut n, &["qemu:"]), all[1..]);
        assert_eq!(list(&mut n, &["qemu:dirty-bitmap:"]), all[2..]);
        assert_eq!(list(&mut n, &["qemu:dirty-bitmap:b1", "qemu:dirty-bitmap:x"]), all[3..]);
        assert_eq!(list(&mut n, &["qemu:dirty-bitmap:b"]), [], "a name is not a namespace");
        assert_eq!(exchange(&mut n, opt::LIST_META_CONTEXT, &meta("gone", &[]))[0].1, rep::ERR_UNKNOWN);
        exchange(&mut n, opt::STRUCTURED_REPLY, &[]);
        let namespace = exchange(&mut n, opt::SET_META_CONTEXT, &meta("disk", &["base:", "qemu:"]));
        assert_eq!(namespace[0].1, rep::ACK, "a namespace selects nothing");
        assert_eq!(contexts(&exchange(&mut n, opt::SET_META_CONTEXT, &set)), all[..1]);
        // Contexts set for another export are not the chosen export's.
        exchange(&mut n, opt::GO, &go("ro", &[]));
        assert_eq!(n.outcome().unwrap().unwrap().contexts, []);

        let mut n = started();
        exchange(&mut n, opt::STRUCTURED_REPLY, &[]);
        let both = meta("disk", &["qemu:dirty-bitmap:b1", BASE_ALLOCATION]);
        assert_eq!(contexts(&exchange(&mut n, opt::SET_META_CONTEXT, &both)), [all[0].clone(), all[3].clone()]);
        exchange(&mut n, opt::GO, &go("disk", &[]));
        let agreed = n.outcome().unwrap().unwrap().contexts;
        assert_eq!(agreed, [Context::BaseAllocation, Context::DirtyBitmap(1)], "in id order");
    }

    #[test]
    fn list_abort_starttls_and_unknown_options() {
        let mut n = started();
        let listed = exchange(&mut n, opt::LIST, &[]);
        assert_eq!(listed.len(), 3);
        assert_eq!((listed[0].1, &listed[0].2[4..]), (rep::SERVER, &b"diska disk"[..]));
        assert_eq!(exchange(&mut n, opt::STARTTLS, &[])[0].1, rep::ERR_POLICY);
        assert_eq!(exchange(&mut n, 4, &[1, 2, 3])[0].1, rep::ERR_UNSUP, "PEEK_EXPORT was withdrawn");
        assert_eq!(exchange(&mut n, 0xdead_beef, &[])[0].1, rep::ERR_UNSUP);
        assert_eq!(exchange(&mut n, opt::ABORT, &[])[0].1, rep::ACK);
        assert_eq!(n.outcome().unwrap().unwrap_err(), Closed::Aborted);
        assert_eq!(n.feed(&option(opt::LIST, &[])), 0, "nothing is read after the end");

        // ABORT's data is not waited for.
        let mut n = started();
        assert_eq!(n.feed(&announced(opt::ABORT, 1 << 31)), 16);
        assert_eq!(replies(&n.take_output())[0].1, rep::ACK);
        assert_eq!(n.outcome().unwrap().unwrap_err(), Closed::Aborted);
    }

    /// An option header announcing `len` bytes of data.
    fn announced(code: u32, len: u32) -> Vec<u8> {
        let mut header = option(code, &[]);
        header[12..16].copy_from_slice(&len.to_be_bytes());
        header
    }

    #[test]
    fn options_longer_than_their_type_allows_are_answered_at_once_and_close() {
        for (code, len, reply) in [
            (0x1234, 1 << 31, Some(rep::ERR_TOO_BIG)),
            (0x1234, MAX_UNKNOWN + 1, Some(rep::ERR_TOO_BIG)),
            (opt::GO, max_len(opt::GO) + 1, Some(rep::ERR_TOO_BIG)),
            (opt::SET_META_CONTEXT, u32::MAX, Some(rep::ERR_TOO_BIG)),
            (opt::LIST, 1, Some(rep::ERR_INVALID)),
            (opt::STRUCTURED_REPLY, 1, Some(rep::ERR_INVALID)),
            (opt::EXPORT_NAME, MAX_STRING + 1, None),
        ] {
            let mut n = started();
            let mut bytes = announced(code, len);
            bytes.extend([0xab; 3]); // the first bytes of its data
            assert_eq!(n.feed(&bytes), 16, "option {code:#x}: only its header is read");
            let answer: Vec<_> = replies(&n.take_output()).iter().map(|r| (r.0, r.1)).collect();
            assert_eq!(answer, Vec::from_iter(reply.map(|kind| (code, kind))), "option {code:#x} of {len}");
            let why = n.outcome().unwrap().unwrap_err();
            assert_eq!(why, Closed::TooLong { option: code, len, max: max_len(code) });
        }
    }

    #[test]
    fn options_at_their_bound_are_read_whole() {
        let mut n = started();
        let unknown = exchange(&mut n, 0x1234, &vec![0; MAX_UNKNOWN as usize]);
        assert_eq!(unknown[0].1, rep::ERR_UNSUP);
        let query = "qemu:".to_string() + &"x".repeat(MAX_STRING as usize - 5);
        let listed = exchange(&mut n, opt::LIST_META_CONTEXT, &meta("disk", &[query.as_str(); MAX_QUERIES as usize]));
        assert_eq!(listed.last().unwrap().1, rep::ACK, "the most queries, each as long as a string may be");
        // Every information request there can be, once.
        let requests: Vec<u16> = (0..u16::MAX).collect();
        let all = exchange(&mut n, opt::GO, &go("disk", &requests));
        assert_eq!(all.last().unwrap().1, rep::ACK);
        assert!(n.outcome().unwrap().is_ok());
        assert!(n.input.capacity() <= MAX_OPTION_DATA as usize);
    }

    #[test]
    fn export_name_ends_the_handshake_or_the_connection() {
        let mut n = Negotiation::new(Two, false);
        n.take_output();
        n.feed(&1u32.to_be_bytes()); // fixed newstyle, zeroes wanted
        n.feed(&option(opt::EXPORT_NAME, b"disk"));
        let out = n.take_output();
        assert_eq!((out.len(), be64(&out), be16(&out[8..])), (8 + 2 + 124, 1 << 20, tx_flag::HAS_FLAGS));
        assert!(n.outcome().unwrap().is_ok());

        let mut n = started();
        n.feed(&option(opt::EXPORT_NAME, b"missing"));
        assert_eq!(n.outcome().unwrap().unwrap_err(), Closed::ExportName);
    }

    /// A TLS-requiring negotiation past the greeting and client flags.
    fn started_tls() -> Negotiation<Two> {
        let mut n = Negotiation::new(Two, true);
        n.take_output();
        n.feed(&3u32.to_be_bytes());
        n
    }

    #[test]
    fn before_starttls_options_are_refused_and_export_name_closes() {
        let mut n = started_tls();
        for (code, data) in [(opt::GO, go("disk", &[])), (opt::LIST, vec![]), (opt::STRUCTURED_REPLY, vec![])] {
            let refused = exchange(&mut n, code, &data);
            assert_eq!((refused.len(), refused[0].1), (1, rep::ERR_TLS_REQD), "option {code}");
            assert_eq!(refused[0].2, format!("Option {code:#x} not permitted before TLS").as_bytes());
        }
        assert!(n.outcome().is_none(), "the client may go on");
        n.feed(&option(opt::EXPORT_NAME, b"disk"));
        assert_eq!(n.outcome().unwrap().unwrap_err(), Closed::TlsRequired(opt::EXPORT_NAME));
        assert!(n.take_output().is_empty(), "EXPORT_NAME has no error reply");

        let mut n = started_tls();
        assert_eq!(exchange(&mut n, opt::ABORT, &[])[0].1, rep::ACK);
        assert_eq!(n.outcome().unwrap().unwrap_err(), Closed::Aborted);

        let mut n = started_tls();
        n.feed(&option(opt::STARTTLS, &[0]));
        assert_eq!(replies(&n.take_output())[0].1, rep::ERR_INVALID, "STARTTLS takes no data");
        assert_eq!(n.outcome().unwrap().unwrap_err(), Closed::TooLong { option: opt::STARTTLS, len: 1, max: 0 });

        // Fixed newstyle only: an old client could not be told why.
        let mut n = Negotiation::new(Two, true);
        n.take_output();
        n.feed(&2u32.to_be_bytes());
        n.feed(&option(opt::LIST, &[]));
        assert_eq!(n.outcome().unwrap().unwrap_err(), Closed::TlsRequired(opt::LIST));
    }

    #[test]
    fn starttls_stops_at_its_end_and_the_session_starts_afresh() {
        let mut n = started_tls();
        let mut bytes = option(opt::STARTTLS, &[]);
        let option_len = bytes.len();
        bytes.extend([0x16, 0x03, 0x01]); // a ClientHello's first bytes
        assert_eq!(n.feed(&bytes), option_len, "TLS records are not options");
        assert_eq!(replies(&n.take_output())[0].1, rep::ACK);
        assert_eq!(n.feed(&option(opt::LIST, &[])), 0, "nothing is read before TLS has started");
        assert!(n.take_starttls());
        assert!(!n.take_starttls(), "once");
        assert_eq!(exchange(&mut n, opt::STARTTLS, &[])[0].1, rep::ERR_INVALID, "TLS already enabled");
        assert_eq!(exchange(&mut n, opt::STRUCTURED_REPLY, &[])[0].1, rep::ACK);
        exchange(&mut n, opt::GO, &go("disk", &[]));
        assert_eq!(n.outcome().unwrap().unwrap().mode, Mode::Structured);

        // Without credentials STARTTLS is refused and nothing waits for it.
        let mut n = started();
        assert_eq!(exchange(&mut n, opt::STARTTLS, &[])[0].1, rep::ERR_POLICY);
        assert!(!n.take_starttls());
    }

    #[test]
    fn bad_flags_and_magic_close_the_connection() {
        let mut n = Negotiation::new(Two, false);
        n.feed(&4u32.to_be_bytes());
        assert_eq!(n.outcome().unwrap().unwrap_err(), Closed::ClientFlags(4));
        let mut n = started();
        n.feed(&[0u8; 16]);
        assert_eq!(n.outcome().unwrap().unwrap_err(), Closed::OptionMagic);
    }
}
