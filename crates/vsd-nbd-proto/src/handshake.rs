//! The handshake's numbers: fixed newstyle negotiation, from the server's
//! greeting to the option that starts the transmission phase.

/// The greeting's first word ("NBDMAGIC").
pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
/// The greeting's second word, and the start of every option ("IHAVEOPT").
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
/// The start of every option reply.
pub const REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;

/// Handshake flags: fixed newstyle.
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
/// Handshake flags: no 124 zero bytes after EXPORT_NAME.
pub const FLAG_NO_ZEROES: u16 = 1 << 1;

/// Option types.
pub mod opt {
    /// Selects an export and ends the handshake, without an error reply.
    pub const EXPORT_NAME: u32 = 1;
    /// Ends the handshake without an export.
    pub const ABORT: u32 = 2;
    /// Lists the exports.
    pub const LIST: u32 = 3;
    /// Starts TLS.
    pub const STARTTLS: u32 = 5;
    /// Describes an export.
    pub const INFO: u32 = 6;
    /// Describes an export and ends the handshake.
    pub const GO: u32 = 7;
    /// Replies in chunks.
    pub const STRUCTURED_REPLY: u32 = 8;
    /// Lists metadata contexts.
    pub const LIST_META_CONTEXT: u32 = 9;
    /// Selects metadata contexts.
    pub const SET_META_CONTEXT: u32 = 10;
    /// 64-bit lengths.
    pub const EXTENDED_HEADERS: u32 = 11;
}

/// Option reply types.
pub mod rep {
    /// The option is done.
    pub const ACK: u32 = 1;
    /// One export of a LIST.
    pub const SERVER: u32 = 2;
    /// One piece of information about the export.
    pub const INFO: u32 = 3;
    /// One metadata context.
    pub const META_CONTEXT: u32 = 4;
    /// Error replies have this bit set.
    pub const ERR: u32 = 1 << 31;
    /// The option is not known.
    pub const ERR_UNSUP: u32 = ERR + 1;
    /// Forbidden by the server's policy.
    pub const ERR_POLICY: u32 = ERR + 2;
    /// Syntactically or semantically invalid.
    pub const ERR_INVALID: u32 = ERR + 3;
    /// TLS must be started first.
    pub const ERR_TLS_REQD: u32 = ERR + 5;
    /// No such export.
    pub const ERR_UNKNOWN: u32 = ERR + 6;
    /// A request or reply would be too large.
    pub const ERR_TOO_BIG: u32 = ERR + 9;
    /// Extended headers must be negotiated first.
    pub const ERR_EXT_HEADER_REQD: u32 = ERR + 11;
}

/// Information types of INFO and GO.
pub mod info {
    /// Size and transmission flags.
    pub const EXPORT: u16 = 0;
    /// The export's name.
    pub const NAME: u16 = 1;
    /// The export's description.
    pub const DESCRIPTION: u16 = 2;
    /// Minimum, preferred and maximum block sizes.
    pub const BLOCK_SIZE: u16 = 3;
}
