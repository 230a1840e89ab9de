//! Opening an image: header, tables, and a map of every metadata cluster,
//! checked before the first guest request.

use std::collections::{BTreeSet, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex};

use super::bitmaps::bitmap_clusters;
use super::cache::L2Cache;
use super::overlap::MetadataMap;
use super::rebuild::rebuild;
use super::refcounts::Refcounts;
use super::reuse::{Epochs, Quarantine};
use super::snapshots::SnapshotTable;
use super::{Image, Meta, Options};
use crate::buf::AlignedBuf;
use crate::entry::{self, Layout};
use crate::header::{Header, autoclear, compatible, field};
use crate::refcount::Width;
use crate::{FormatError, SyncIo};

/// Default L2 cache: 32 MiB of tables at most.
const DEFAULT_L2_CACHE_BYTES: u64 = 32 << 20;

/// The most L1 entries QEMU accepts (a 32 MiB table).
pub(super) const MAX_L1_ENTRIES: u64 = (32 << 20) / 8;

/// How many L1 entries an open image keeps in memory: those of the
/// table's clusters, and, when writable, enough for 16 times its size.
fn l1_capacity(header: &Header, writable: bool) -> u64 {
    let in_clusters = (u64::from(header.l1_size) * 8).next_multiple_of(header.cluster_size()) / 8;
    let grown = if writable { header.l1_entries_for(header.size.saturating_mul(16)).min(MAX_L1_ENTRIES) } else { 0 };
    in_clusters.max(grown)
}

/// Bytes of an L2 table loaded and cached at once unless
/// `l2-cache-entry-size` says otherwise, as QEMU loads them; also the unit
/// changed tables are written back in (`Image::chunk_of`), so that a
/// changed entry always lies in a loaded slice.
const DEFAULT_SLICE_BYTES: u64 = 4096;

impl Image {
    /// Opens the image whose file is `io`, `file_len` bytes long.
    pub fn open(io: &mut dyn SyncIo, file_len: u64, opts: Options) -> Result<Self, FormatError> {
        let header_buf = read_header(io)?;
        let header = Header::parse(&header_buf, file_len)?;
        let cs = header.cluster_size();
        let layout = Layout {
            cluster_bits: header.cluster_bits,
            extended: header.extended_l2(),
            data_file: header.has_data_file(),
        };

        let l1_raw = read_table(io, header.l1_offset, u64::from(header.l1_size))?;
        // Header, L1 tables and snapshot table: everything but refcounts
        // and L2 tables.
        let mut structures = vec![(0, cs), (header.l1_offset, u64::from(header.l1_size) * 8)];
        let (snapshots, snapshot_l1s) = read_snapshots(io, &header, file_len, &mut structures)?;
        // Bitmaps matter only if they are kept: otherwise opening writable
        // drops them (and their clusters leak, as with QEMU).
        let kept_bitmaps = header.bitmaps.filter(|_| opts.writable && opts.keep_bitmaps);
        let bitmap_clusters = match kept_bitmaps {
            Some(ext) => bitmap_clusters(io, ext, header.cluster_bits, file_len)?,
            None => BTreeSet::new(),
        };

        let mut header_chunk = AlignedBuf::zeroed(cs.min(4096) as usize);
        let chunk_len = header_chunk.len();
        header_chunk.copy_from_slice(&header_buf[..chunk_len]);
        let (rt_raw, rt_offset, file_len) = if opts.writable && header.dirty() {
            let l1s: Vec<&[u64]> = std::iter::once(&l1_raw).chain(&snapshot_l1s).map(Vec::as_slice).collect();
            let bitmaps = bitmap_clusters.iter().map(|&c| (c * cs, cs));
            let counted: Vec<_> = structures.iter().copied().chain(bitmaps).collect();
            let new = rebuild(io, &header, &layout, &counted, &l1s, file_len, &mut header_chunk)?;
            let end = new.table_offset + (new.table.len() as u64 * 8).next_multiple_of(cs);
            (new.table, new.table_offset, end)
        } else {
            let clusters = u64::from(header.refcount_table_clusters);
            (read_table(io, header.refcount_table_offset, clusters * cs / 8)?, header.refcount_table_offset, file_len)
        };
        for (i, &block) in rt_raw.iter().enumerate() {
            if block % cs != 0 || block >= file_len {
                return Err(FormatError::Corrupt(format!("refcount table entry {i} ({block:#x}) is invalid")));
            }
        }

        let mut metadata = BTreeSet::new();
        let mut add = |offset: u64, len: u64| metadata.extend(offset / cs..(offset + len).div_ceil(cs));
        structures.iter().for_each(|&(offset, len)| add(offset, len));
        add(rt_offset, (rt_raw.len() as u64 * 8).max(1));
        rt_raw.iter().filter(|&&b| b != 0).for_each(|&b| add(b, cs));
        // Bitmap clusters are freed when bitmaps are stored: one that is
        // also other metadata would be freed in use.
        if let Some(c) = bitmap_clusters.iter().find(|&&c| !metadata.insert(c)) {
            return Err(FormatError::Corrupt(format!("bitmap cluster {:#x} is also other metadata", c * cs)));
        }
        let non_l2 = metadata.clone();
        for (name, table) in std::iter::once(("active", &l1_raw)).chain(snapshot_l1s.iter().map(|t| ("snapshot", t))) {
            for (i, &e) in table.iter().enumerate() {
                let l2 = match entry::l1(e, cs) {
                    Ok(Some((l2, _))) => l2,
                    Ok(None) => continue,
                    Err(err) => return Err(FormatError::Corrupt(format!("{name} L1 entry {i}: {err}"))),
                };
                if l2 >= file_len || non_l2.contains(&(l2 / cs)) {
                    return Err(FormatError::Corrupt(format!(
                        "{name} L1 entry {i} points to {l2:#x}, past the end of the file or into other metadata"
                    )));
                }
                metadata.insert(l2 / cs);
            }
        }

        let cache_bytes = opts.l2_cache_bytes.unwrap_or(DEFAULT_L2_CACHE_BYTES.min(header.l1_entries_needed() * cs));
        let slice = match opts.l2_cache_entry_bytes {
            Some(entry) if !entry.is_power_of_two() || !(512..=cs).contains(&entry) => {
                return Err(FormatError::Option(format!(
                    "L2 cache entry size must be a power of two between 512 and the cluster size ({cs})"
                )));
            }
            entry => entry.unwrap_or(DEFAULT_SLICE_BYTES).clamp(DEFAULT_SLICE_BYTES.min(cs), cs),
        };
        let refcount_cache_bytes = opts.refcount_cache_bytes.unwrap_or((cache_bytes / 4).max(4 * cs));
        let metadata = Arc::new(MetadataMap::new(metadata));
        let epochs = Arc::new(Epochs::default());
        let mut meta = Meta {
            refcounts: Refcounts::new(
                rt_raw,
                rt_offset,
                Width::new(header.refcount_order),
                header.cluster_bits,
                file_len,
                (refcount_cache_bytes / cs) as usize,
            ),
            metadata: metadata.clone(),
            header_chunk,
            dirty_bit: false,
            dirty_l2: Default::default(),
            dirty_l1: Default::default(),
            decrements: Vec::new(),
            allocating: HashSet::new(),
            waiters: Vec::new(),
            epochs: epochs.clone(),
            quarantine: Quarantine::default(),
            bitmaps: if opts.writable { kept_bitmaps } else { header.bitmaps },
            packed: 0,
            snapshots,
        };
        if header.has_bitmaps && header.bitmaps.is_none() {
            log::warn!("qcow2: the image's bitmaps are stale (another program changed it): they are ignored");
        } else if header.bitmaps.is_some() && opts.writable && !opts.keep_bitmaps {
            log::warn!("qcow2: the image's persistent bitmaps are dropped: they are not kept up to date");
        }
        if opts.writable {
            prepare_for_writing(io, &header, &opts, &mut meta)?;
        }

        let lazy = opts.lazy_refcounts.unwrap_or(header.compatible & compatible::LAZY_REFCOUNTS != 0);
        if lazy && header.version < 3 {
            return Err(FormatError::Unsupported("lazy refcounts need a version 3 (compat=1.1) image".into()));
        }
        Ok(Image {
            // At least two whole tables.
            l2: L2Cache::new((cache_bytes / slice) as usize, 2 * (cs / slice) as usize),
            slice_bytes: slice as usize,
            // Room (zero) for the entries the table's clusters hold past
            // l1_size, and for a disk grown to 16 times its size, so that
            // growing never moves the entries in memory.
            l1: (0..l1_capacity(&header, opts.writable))
                .map(|i| AtomicU64::new(l1_raw.get(i as usize).copied().unwrap_or(0)))
                .collect(),
            size: AtomicU64::new(header.size),
            layout,
            l2_bits: header.l2_entries().trailing_zeros(),
            has_backing: AtomicBool::new(opts.has_backing.unwrap_or(header.backing_file.is_some())),
            opts,
            header,
            metadata,
            meta: Mutex::new(meta),
            epochs,
            writeback: Mutex::default(),
            dirty: Default::default(),
            lazy,
            finished: AtomicU64::new(0),
            tables_written: AtomicU64::new(0),
        })
    }
}

/// The header's cluster (at least 4 KiB, zero-filled past the file's end).
fn read_header(io: &mut dyn SyncIo) -> Result<AlignedBuf, FormatError> {
    let mut first = AlignedBuf::zeroed(4096);
    io.read_at(&mut first, 0)?;
    let cluster_bits = u32::from_be_bytes(first[20..24].try_into().unwrap());
    if !(13..=21).contains(&cluster_bits) {
        return Ok(first); // 4 KiB or smaller clusters, or a header parse will refuse
    }
    let mut whole = AlignedBuf::zeroed(1 << cluster_bits);
    io.read_at(&mut whole, 0)?;
    Ok(whole)
}

/// Reads `entries` big-endian u64s at `offset`.
pub(super) fn read_table(io: &mut dyn SyncIo, offset: u64, entries: u64) -> Result<Vec<u64>, FormatError> {
    let mut raw = AlignedBuf::zeroed((entries * 8).next_multiple_of(512) as usize);
    io.read_at(&mut raw, offset)?;
    Ok(raw.chunks_exact(8).take(entries as usize).map(|w| u64::from_be_bytes(w.try_into().unwrap())).collect())
}

/// Reads the snapshot table, adding its byte range and each snapshot's
/// L1 table to `structures`; returns it and the snapshots' L1 tables.
fn read_snapshots(
    io: &mut dyn SyncIo,
    header: &Header,
    file_len: u64,
    structures: &mut Vec<(u64, u64)>,
) -> Result<(SnapshotTable, Vec<Vec<u64>>), FormatError> {
    let table = SnapshotTable::read(io, header, file_len)?;
    let mut l1s = Vec::new();
    for (l1_offset, l1_size) in table.l1_tables() {
        structures.push((l1_offset, u64::from(l1_size) * 8));
        l1s.push(read_table(io, l1_offset, u64::from(l1_size))?);
    }
    structures.extend(table.extent());
    Ok((table, l1s))
}

/// What QEMU does before writing to an image: clear the autoclear bits
/// of features vsd does not keep up to date (bitmaps, unless the caller
/// keeps them).
fn prepare_for_writing(
    io: &mut dyn SyncIo,
    header: &Header,
    opts: &Options,
    meta: &mut Meta,
) -> Result<(), FormatError> {
    let kept_bits = if opts.keep_bitmaps { autoclear::KEPT | autoclear::BITMAPS } else { autoclear::KEPT };
    let kept = header.autoclear & kept_bits;
    if kept != header.autoclear {
        let at = field::AUTOCLEAR as usize;
        meta.header_chunk[at..at + 8].copy_from_slice(&kept.to_be_bytes());
        io.write_at(&meta.header_chunk, 0)?;
        // Durable before any guest write may be: a write that lands while
        // the bit is lost would leave the bitmaps looking consistent.
        io.flush()?;
    }
    Ok(())
}
