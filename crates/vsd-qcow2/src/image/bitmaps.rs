//! Persistent dirty bitmaps: loading them, marking them in use, and
//! storing them back as QEMU does at a clean close.
//!
//! Bitmaps are replaced, never changed in place: new data clusters, tables
//! and directory are written and their refcounts made durable first, then
//! one header write switches to them (extension and autoclear bit 0
//! together), and only then are the old clusters freed. A crash at any
//! point leaves the old bitmaps or the new ones, and at worst leaked
//! clusters.

use std::collections::BTreeSet;
use std::io;

use super::open::read_table;
use super::{Image, ImageIo, Meta};
use crate::bitmap::{self, DirEntry, StoredBitmap, TableEntry};
use crate::buf::AlignedBuf;
use crate::header::{self, BitmapsExtension};
use crate::{FormatError, SyncIo};

/// Reads and checks the bitmap directory `ext` names.
fn read_directory(io: &mut dyn SyncIo, ext: BitmapsExtension, cluster_size: u64) -> Result<Vec<DirEntry>, FormatError> {
    // The header checked the size (at most 64 MiB) and that it is in the file.
    let mut raw = AlignedBuf::zeroed(ext.directory_size.next_multiple_of(512) as usize);
    io.read_at(&mut raw, ext.directory_offset)?;
    let entries = bitmap::parse_directory(&raw[..ext.directory_size as usize], ext.count, cluster_size)?;
    check_tables_apart(ext, &entries, cluster_size)?;
    Ok(entries)
}

/// Tables shared between bitmaps (or with the directory) are corrupt, and
/// would let a small file load the same huge bitmap many times over.
fn check_tables_apart(ext: BitmapsExtension, entries: &[DirEntry], cluster_size: u64) -> Result<(), FormatError> {
    let span = |at: u64, len: u64| (at / cluster_size, (at + len).div_ceil(cluster_size));
    let mut spans: Vec<_> = entries.iter().map(|e| span(e.table_offset, u64::from(e.table_size) * 8)).collect();
    spans.push(span(ext.directory_offset, ext.directory_size));
    spans.sort_unstable();
    match spans.windows(2).find(|w| w[1].0 < w[0].1) {
        Some(w) => Err(FormatError::Corrupt(format!("bitmap tables overlap at {:#x}", w[1].0 * cluster_size))),
        None => Ok(()),
    }
}

/// Reads a bitmap's table, every entry checked and inside the file.
fn read_bitmap_table(
    io: &mut dyn SyncIo,
    e: &DirEntry,
    cluster_size: u64,
    file_end: u64,
) -> Result<Vec<TableEntry>, FormatError> {
    let bad = |what: String| FormatError::Corrupt(format!("bitmap '{}': {what}", e.name));
    let len = u64::from(e.table_size) * 8;
    if e.table_offset.saturating_add(len) > file_end {
        return Err(bad(format!("its table at {:#x} lies past the end of the file", e.table_offset)));
    }
    let raw = read_table(io, e.table_offset, u64::from(e.table_size))?;
    raw.into_iter()
        .map(|raw| match bitmap::table_entry(raw, cluster_size).map_err(bad)? {
            TableEntry::Data(at) if at >= file_end => Err(bad(format!("data at {at:#x}, past the end of the file"))),
            entry => Ok(entry),
        })
        .collect()
}

/// Every cluster the bitmaps `ext` names use: the directory, the tables
/// and the data clusters. A cluster used twice is an error, found as soon
/// as it is met, so that bitmaps sharing one table cannot make the list
/// grow beyond the clusters the file holds.
pub(super) fn bitmap_clusters(
    io: &mut dyn SyncIo,
    ext: BitmapsExtension,
    cluster_bits: u32,
    file_end: u64,
) -> Result<BTreeSet<u64>, FormatError> {
    let mut clusters = BTreeSet::new();
    let mut add = |ranges: &[(u64, u64)]| match clusters_of(ranges, cluster_bits).find(|&c| !clusters.insert(c)) {
        Some(c) => Err(FormatError::Corrupt(format!("bitmap cluster {:#x} is used twice", c << cluster_bits))),
        None => Ok(()),
    };
    add(&[(ext.directory_offset, ext.directory_size)])?;
    for e in read_directory(io, ext, 1 << cluster_bits)? {
        add(&entry_clusters(io, &e, 1 << cluster_bits, file_end)?)?;
    }
    Ok(clusters)
}

/// The byte ranges of one bitmap's table and data clusters.
fn entry_clusters(
    io: &mut dyn SyncIo,
    e: &DirEntry,
    cluster_size: u64,
    file_end: u64,
) -> Result<Vec<(u64, u64)>, FormatError> {
    let mut ranges = vec![(e.table_offset, u64::from(e.table_size) * 8)];
    for entry in read_bitmap_table(io, e, cluster_size, file_end)? {
        if let TableEntry::Data(at) = entry {
            ranges.push((at, cluster_size));
        }
    }
    Ok(ranges)
}

/// Cluster indices of byte ranges.
fn clusters_of(ranges: &[(u64, u64)], cluster_bits: u32) -> impl Iterator<Item = u64> + '_ {
    ranges.iter().flat_map(move |&(at, len)| (at >> cluster_bits)..(at + len).div_ceil(1 << cluster_bits))
}

impl Image {
    /// The image's persistent bitmaps: none if the image has no bitmaps
    /// extension, or if autoclear bit 0 is clear (another program changed
    /// the image since they were stored, so they are stale: like QEMU, vsd
    /// ignores them, and storing bitmaps later replaces them, leaking their
    /// clusters). Bitmaps flagged in use are listed without their data.
    pub fn load_bitmaps(&self, io: &mut ImageIo) -> Result<Vec<StoredBitmap>, FormatError> {
        let meta = self.lock();
        let Some(ext) = meta.bitmaps else { return Ok(Vec::new()) };
        let file_end = meta.fresh_from();
        let entries = read_directory(io.meta, ext, self.cluster_size())?;
        entries.iter().map(|e| self.load_bitmap(io.meta, e, file_end)).collect()
    }

    fn load_bitmap(&self, io: &mut dyn SyncIo, e: &DirEntry, file_end: u64) -> Result<StoredBitmap, FormatError> {
        let granularity = 1u64 << e.granularity_bits;
        let mut loaded =
            StoredBitmap { name: e.name.clone(), granularity, in_use: e.in_use, enabled: e.enabled, words: Vec::new() };
        if e.in_use {
            return Ok(loaded); // inconsistent: its data means nothing
        }
        e.check_size(self.cluster_size(), self.size())?;
        let table = read_bitmap_table(io, e, self.cluster_size(), file_end)?;
        // The table matches the disk and QEMU's limits: this is at most
        // 512 MiB of bitmap data.
        loaded.words = vec![0; StoredBitmap::words_for(self.size(), granularity)];
        let per_cluster = bitmap::words_per_cluster(self.cluster_size());
        let mut buf = AlignedBuf::zeroed(self.cluster_size() as usize);
        for (words, entry) in loaded.words.chunks_mut(per_cluster).zip(table) {
            match entry {
                TableEntry::Zeroes => {}
                TableEntry::Ones => words.fill(u64::MAX),
                TableEntry::Data(at) => {
                    io.read_at(&mut buf, at)?;
                    bitmap::words_from_bytes(words, &buf);
                }
            }
        }
        bitmap::clear_tail(&mut loaded.words, self.size(), granularity);
        Ok(loaded)
    }

    /// Replaces every bitmap in the image with `bitmaps`, as QEMU does at a
    /// clean close: new tables and directory written, the header switched
    /// to them, the old clusters freed (see the module docs for the order).
    /// A bitmap stored `in_use` keeps the table of the image's bitmap of
    /// that name if it is in use too (its data is inconsistent anyway), and
    /// otherwise gets an empty one. An empty `bitmaps` removes the
    /// extension and clears autoclear bit 0.
    pub fn store_bitmaps(&self, io: &mut ImageIo, bitmaps: &[StoredBitmap]) -> io::Result<()> {
        self.check_writable()?;
        bitmap::check_for_store(bitmaps, self.size(), self.cluster_size())?;
        if !bitmaps.is_empty() && self.header.version < 3 {
            return Err(FormatError::Unsupported("bitmaps need a version 3 (compat=1.1) image".into()).into());
        }
        let _writeback = self.writeback();
        if bitmaps.is_empty() && self.lock().bitmaps.is_none() {
            return Ok(()); // nothing stored, nothing to remove
        }
        self.write_back(io)?;
        let mut meta = self.lock();
        let old = self.current_directory(&meta, io.meta)?;
        let mut old_clusters = BTreeSet::new();
        for e in &old {
            if !bitmaps.iter().any(|b| b.in_use && e.in_use && b.name == e.name) {
                let ranges = entry_clusters(io.meta, e, self.cluster_size(), meta.fresh_from())?;
                old_clusters.extend(clusters_of(&ranges, self.header.cluster_bits));
            }
        }
        self.replace_directory(&mut meta, io.meta, old_clusters, |image, meta, io, fresh| {
            let mut entries = Vec::with_capacity(bitmaps.len());
            for b in bitmaps {
                let kept = old.iter().find(|e| b.in_use && e.in_use && e.name == b.name);
                let (table_offset, table_size) = match kept {
                    Some(e) => (e.table_offset, e.table_size),
                    None => image.write_bitmap(meta, io, b, fresh)?,
                };
                let granularity_bits = b.granularity.trailing_zeros();
                let (in_use, enabled, name) = (b.in_use, b.enabled, b.name.clone());
                entries.push(DirEntry { table_offset, table_size, in_use, enabled, granularity_bits, name });
            }
            Ok(entries)
        })
    }

    /// Flags every stored bitmap in use, as QEMU does when it opens an
    /// image writable: until they are stored back, a crash leaves them
    /// marked inconsistent.
    pub fn mark_bitmaps_in_use(&self, io: &mut ImageIo) -> io::Result<()> {
        self.check_writable()?;
        // The directory changes only under the writeback lock.
        let _writeback = self.writeback();
        let mut entries = self.current_directory(&self.lock(), io.meta)?;
        if entries.iter().all(|e| e.in_use) {
            return Ok(());
        }
        entries.iter_mut().for_each(|e| e.in_use = true);
        self.write_back(io)?;
        let mut meta = self.lock();
        self.replace_directory(&mut meta, io.meta, BTreeSet::new(), |_, _, _, _| Ok(entries))
    }

    /// The entries of the directory the header names now.
    fn current_directory(&self, meta: &Meta, io: &mut dyn SyncIo) -> Result<Vec<DirEntry>, FormatError> {
        match meta.bitmaps {
            Some(ext) => read_directory(io, ext, self.cluster_size()),
            None => Ok(Vec::new()),
        }
    }

    /// Writes the directory of the entries `build` returns (having written
    /// what they point to, its clusters listed in `fresh`), switches the
    /// header to it, then frees `old_clusters` and the old directory. If
    /// anything fails before the header write, the new clusters are given
    /// back; after it, they are left (leaked at worst). The caller holds
    /// the writeback lock: refcount chunks are written here.
    fn replace_directory(
        &self,
        meta: &mut Meta,
        io: &mut dyn SyncIo,
        mut old_clusters: BTreeSet<u64>,
        build: impl FnOnce(&Self, &mut Meta, &mut dyn SyncIo, &mut Vec<u64>) -> io::Result<Vec<DirEntry>>,
    ) -> io::Result<()> {
        let cb = self.header.cluster_bits;
        if let Some(ext) = meta.bitmaps {
            old_clusters.extend(clusters_of(&[(ext.directory_offset, ext.directory_size)], cb));
        }
        let mut fresh = Vec::new();
        let prepared = build(self, meta, io, &mut fresh).and_then(|entries| {
            let ext =
                if entries.is_empty() { None } else { Some(self.write_directory(meta, io, &entries, &mut fresh)?) };
            let mut chunk = meta.header_chunk.to_vec();
            header::set_bitmaps_extension(&mut chunk, ext)?;
            Ok((ext, chunk))
        });
        let (ext, chunk) = match prepared {
            Ok(prepared) => prepared,
            Err(e) => {
                fresh.into_iter().for_each(|c| meta.decref(c, false));
                self.note_dirty(meta);
                return Err(e);
            }
        };
        // The new clusters and their refcounts are durable before the
        // header names them.
        meta.refcounts.write_dirty(io)?;
        io.flush()?;
        meta.header_chunk.copy_from_slice(&chunk);
        io.write_at(&meta.header_chunk, 0)?;
        io.flush()?;
        meta.bitmaps = ext;
        // No table names the old clusters: freed now, not at a flush.
        for cluster in old_clusters {
            meta.decrement(io, cluster, self.opts.pass_discard)?;
        }
        meta.refcounts.write_dirty(io)?;
        self.note_dirty(meta);
        io.flush()
    }

    /// Writes one bitmap's data clusters (all-zero ones are left out) and
    /// table; returns the table's offset and size.
    fn write_bitmap(
        &self,
        meta: &mut Meta,
        io: &mut dyn SyncIo,
        b: &StoredBitmap,
        fresh: &mut Vec<u64>,
    ) -> io::Result<(u64, u32)> {
        let cs = self.cluster_size();
        let size = bitmap::table_size_for(self.size(), b.granularity.trailing_zeros(), cs);
        let mut table = vec![0u64; size as usize];
        let mut buf = AlignedBuf::zeroed(cs as usize);
        let words = if b.in_use { &[][..] } else { &b.words[..] };
        let per_cluster = bitmap::words_per_cluster(cs);
        for (index, chunk) in words.chunks(per_cluster).enumerate() {
            let mut chunk = chunk.to_vec();
            if (index + 1) * per_cluster >= words.len() {
                // Chunks start at whole words: the tail is the bitmap's.
                bitmap::clear_tail(&mut chunk, self.size(), b.granularity);
            }
            if chunk.iter().all(|&w| w == 0) {
                continue;
            }
            buf.fill(0);
            bitmap::words_to_bytes(&chunk, &mut buf);
            table[index] = self.alloc_bitmap_clusters(meta, io, 1, fresh)?;
            io.write_at(&buf, table[index])?;
        }
        let mut raw = AlignedBuf::zeroed((size * 8).next_multiple_of(cs) as usize);
        for (out, entry) in raw.chunks_exact_mut(8).zip(&table) {
            out.copy_from_slice(&entry.to_be_bytes());
        }
        let at = self.alloc_bitmap_clusters(meta, io, raw.len() as u64 / cs, fresh)?;
        io.write_at(&raw, at)?;
        Ok((at, size as u32))
    }

    fn write_directory(
        &self,
        meta: &mut Meta,
        io: &mut dyn SyncIo,
        entries: &[DirEntry],
        fresh: &mut Vec<u64>,
    ) -> io::Result<BitmapsExtension> {
        let cs = self.cluster_size();
        let bytes = bitmap::serialize_directory(entries);
        let mut raw = AlignedBuf::zeroed((bytes.len() as u64).next_multiple_of(cs) as usize);
        raw[..bytes.len()].copy_from_slice(&bytes);
        let at = self.alloc_bitmap_clusters(meta, io, raw.len() as u64 / cs, fresh)?;
        io.write_at(&raw, at)?;
        Ok(BitmapsExtension { count: entries.len() as u32, directory_size: bytes.len() as u64, directory_offset: at })
    }

    /// Allocates `n` contiguous clusters for bitmap metadata, recorded in
    /// `fresh` and in the metadata map (data writes must never land there).
    fn alloc_bitmap_clusters(
        &self,
        meta: &mut Meta,
        io: &mut dyn SyncIo,
        n: u64,
        fresh: &mut Vec<u64>,
    ) -> io::Result<u64> {
        let at = meta.alloc(io, n)?;
        let first = at >> self.header.cluster_bits;
        for cluster in first..first + n {
            meta.metadata.insert(cluster);
            fresh.push(cluster);
        }
        Ok(at)
    }
}
