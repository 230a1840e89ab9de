//! The qcow2 image format: on-disk structures, guest-to-host mapping,
//! cluster allocation and refcounts.
//!
//! # Why in-house
//! vsd's format driver is written here rather than built on a crate. The
//! closest one, imago 0.2, refuses lazy refcounts (the dirty bit), zstd
//! compression and extended L2 entries, all required; it is also built on
//! async futures, while vsd's queues are per-thread completion rings. The
//! qcow2 crates of Cloud Hypervisor and crosvm serialise every request on a
//! global mutex.
//!
//! # Design
//! ```text
//!   guest request ─▶ Image::map_cached ─▶ L1 (atomics) ─▶ L2 cache (RwLock, Arc'd tables of atomics)
//!                       │                                    └─ miss: the caller reads a 4 KiB slice (TableLoad)
//!                       └▶ allocation, COW, zeroing, discard ─▶ metadata mutex (refcounts, tables)
//! ```
//! Reads and in-place writes of allocated clusters only take the L2 cache's
//! read lock for a lookup, never a lock held across I/O. Tables are cached
//! in slices of 4 KiB, as QEMU does: a slice the cache lacks is read by the
//! caller like any other request, beside its others, and put in the cache
//! under the metadata mutex for no I/O ([`Image::finish_load`]). Everything that
//! changes metadata runs under one mutex, through [`SyncIo`], except the
//! data of a new cluster: [`Image::start_write`] allocates clusters and
//! says which old bytes they keep, the caller reads those and writes the
//! new contents asynchronously, and
//! [`Image::finish_allocation`] links each into its table once written, so
//! that allocating writes overlap on the device like any others. Changed
//! refcounts and table entries stay in memory until a
//! flush (a guest FLUSH, a writethrough write, or the daemon stopping),
//! which writes them in dependency order with a file flush between steps:
//! data and refcount increments, L2 tables, L1 entries, then refcount
//! decrements. A flush copies the changed chunks under the metadata mutex
//! and writes the copies without it: other queues go on allocating and
//! linking while it waits for the disk. A crash or power loss at any point
//! leaves at worst leaked clusters, never a table pointing at an
//! unreferenced cluster; what was flushed survives.
//!
//! Compressed clusters, a backup's `compress`, are written as QEMU writes
//! them ([`Image::write_compressed`]): packed back to back in host
//! clusters, each counting the compressed clusters that touch it, in the
//! same order of writes as any allocation.
//!
//! Clusters freed while the image is open (discard, copy-on-write, tables
//! that moved) are handed out again once no request that may still use
//! them is in flight: each queue tells the image which epoch its oldest
//! request started in ([`EpochPin`]).
//!
//! Persistent dirty bitmaps ([`bitmap`]) are kept in memory by the block
//! driver, not here: the image loads them at open, marks them in use, and
//! stores them back whole ([`Image::store_bitmaps`]), as QEMU does at a
//! clean close. Their clusters are metadata meanwhile, known to the
//! overlap checks and to a refcount rebuild.

#![deny(missing_docs)]

pub mod bitmap;
pub mod buf;
pub mod compress;
pub mod create;
pub mod entry;
pub mod header;
mod image;
#[cfg(any(test, feature = "fuzzing"))]
pub mod mem;
pub mod refcount;

use std::io;

pub use bitmap::StoredBitmap;
pub use image::{
    Allocation, Busy, EpochPin, Extent, Image, ImageIo, MapMemo, Mapping, MissingTable, NeedsLoad, OldBytes, Options,
    Origin, Piece, SnapshotInfo, TableLoad,
};

/// Metadata found corrupt while the image is in use (a table pointing at
/// metadata, refcounts that lie): the request fails with EIO, and the
/// block driver marks the image corrupt.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct CorruptMetadata(pub String);

impl From<CorruptMetadata> for io::Error {
    fn from(corrupt: CorruptMetadata) -> Self {
        io::Error::other(corrupt)
    }
}

impl CorruptMetadata {
    /// What `e` says is corrupt, if it is this error.
    pub fn of(e: &io::Error) -> Option<&str> {
        e.get_ref().and_then(|inner| inner.downcast_ref::<CorruptMetadata>()).map(|c| c.0.as_str())
    }
}

/// Why an image cannot be opened (or a range of it used).
#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    /// The header is malformed.
    #[error("invalid qcow2 header: {0}")]
    Header(String),
    /// A valid image using something vsd does not implement.
    #[error("unsupported qcow2 feature: {0}")]
    Unsupported(String),
    /// Metadata contradicts itself.
    #[error("corrupt qcow2 image: {0}")]
    Corrupt(String),
    /// An option the image cannot take, in QEMU's words.
    #[error("{0}")]
    Option(String),
    /// The host refused a read or write.
    #[error("I/O error on the image: {0}")]
    Io(#[from] io::Error),
}

impl From<FormatError> for io::Error {
    fn from(e: FormatError) -> Self {
        match e {
            FormatError::Io(e) => e,
            other => io::Error::other(other),
        }
    }
}

/// Blocking I/O on one of the image's files. Buffers passed to it are
/// aligned for O_DIRECT (see [`buf::AlignedBuf`]); reads past the end of
/// the file return zeroes.
pub trait SyncIo {
    /// Reads `buf.len()` bytes at `offset`.
    fn read_at(&mut self, buf: &mut [u8], offset: u64) -> io::Result<()>;
    /// Writes `buf` at `offset`, growing the file if needed.
    fn write_at(&mut self, buf: &[u8], offset: u64) -> io::Result<()>;
    /// Makes every completed write durable.
    fn flush(&mut self) -> io::Result<()>;
    /// Drops the data of a range (a hint: errors are the caller's to ignore).
    fn discard(&mut self, offset: u64, len: u64) -> io::Result<()>;
}
