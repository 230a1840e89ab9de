//! Internal snapshots: the snapshot table (qcow2 spec, "Snapshots"), and
//! taking or deleting a snapshot of the open image, as QEMU's
//! `blockdev-snapshot-internal-sync` and
//! `blockdev-snapshot-delete-internal-sync` do.
//!
//! A snapshot is a copy of the active L1 table: every cluster the table
//! reaches (L2 tables, data) gets one more reference, and loses the COPIED
//! flag in the active tables, so that the next write to it copies it
//! (`allocate`, `write`). The order on disk keeps the image consistent
//! wherever a crash cuts it: the new references first, then the active
//! tables without COPIED, then the snapshot's L1 copy and the new table,
//! and only then the header naming the table (one write). Before that
//! write the snapshot does not exist and its clusters leak, no more.
//! Deleting goes the other way: the header first names a table without
//! the snapshot, then its references are dropped and COPIED is set again
//! where a cluster is this image's alone.
//!
//! Between the refcounts and the COPIED flags there is a window neither
//! order closes (they live in different clusters): a crash there leaves a
//! cluster whose refcount and COPIED flag disagree (`qemu-img check` says
//! `OFLAG_COPIED`). Either way it is harmless: a shared cluster is never
//! flagged COPIED, so it is never written in place, and QEMU has the same
//! window.

use std::io;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::cache::L2Table;
use super::open::read_table;
use super::{Image, ImageIo, Meta};
use crate::buf::AlignedBuf;
use crate::entry::{self, COPIED, L2Entry};
use crate::header::Header;
use crate::{FormatError, SyncIo};

/// QEMU's limit on internal snapshots.
const MAX_SNAPSHOTS: usize = 65536;
/// Bytes of a table entry before its extra data.
const FIXED: usize = 40;
/// Bytes of extra data QEMU writes: the large VM state size, the disk
/// size, the instruction count.
const EXTRA: usize = 24;
/// QEMU's limit on the extra data it reads.
const MAX_EXTRA: u64 = 1024;
/// `nb_snapshots` (u32) followed by `snapshots_offset` (u64) in the
/// header: one write switches the table.
const HEADER_FIELDS: usize = 60;
/// An instruction count QEMU did not record.
const NO_ICOUNT: u64 = u64::MAX;

/// An internal snapshot, as `qemu-img snapshot -l` and QMP's SnapshotInfo
/// show it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SnapshotInfo {
    /// Its unique id (QEMU numbers them: one past the highest).
    pub id: String,
    /// Its name.
    pub name: String,
    /// When it was taken: seconds since the epoch.
    pub date_sec: u32,
    /// And nanoseconds.
    pub date_nsec: u32,
    /// The guest's clock then.
    pub vm_clock_nsec: u64,
    /// Bytes of VM state saved with it (0 for a disk-only snapshot).
    pub vm_state_size: u64,
    /// The virtual disk size then.
    pub disk_size: u64,
    /// The instruction count then, if recorded.
    pub icount: Option<u64>,
}

/// A snapshot's entry in the table.
#[derive(Clone, Debug)]
struct Entry {
    l1_offset: u64,
    l1_size: u32,
    info: SnapshotInfo,
    /// Extra data past what vsd knows, kept as found (QEMU keeps it).
    unknown_extra: Vec<u8>,
}

/// The snapshot table: its entries and where it is.
#[derive(Clone, Debug, Default)]
pub(super) struct SnapshotTable {
    entries: Vec<Entry>,
    offset: u64,
    len: u64,
}

impl SnapshotTable {
    /// Reads the table the header names, checking each entry against the
    /// file.
    pub(super) fn read(io: &mut dyn SyncIo, header: &Header, file_len: u64) -> Result<Self, FormatError> {
        if header.nb_snapshots as usize > MAX_SNAPSHOTS {
            return Err(FormatError::Corrupt(format!("{} snapshots (at most {MAX_SNAPSHOTS})", header.nb_snapshots)));
        }
        let mut table = SnapshotTable { entries: Vec::new(), offset: header.snapshots_offset, len: 0 };
        let mut at = header.snapshots_offset;
        for i in 0..header.nb_snapshots {
            let (entry, next) = read_entry(io, at, header, file_len)
                .map_err(|e| FormatError::Corrupt(format!("snapshot {i}: {e}")))?
                .ok_or_else(|| FormatError::Corrupt(format!("snapshot {i}: the snapshot table entry is invalid")))?;
            table.entries.push(entry);
            at = next;
        }
        table.len = at - header.snapshots_offset;
        Ok(table)
    }

    /// Each snapshot's L1 table: where it is and its entries.
    pub(super) fn l1_tables(&self) -> impl Iterator<Item = (u64, u32)> + '_ {
        self.entries.iter().map(|e| (e.l1_offset, e.l1_size))
    }

    /// Where the table is and its length in bytes, if there is one.
    pub(super) fn extent(&self) -> Option<(u64, u64)> {
        (!self.entries.is_empty()).then_some((self.offset, self.len))
    }

    pub(super) fn len(&self) -> usize {
        self.entries.len()
    }

    /// QEMU's id for a new snapshot: one past the highest numeric id.
    fn next_id(&self) -> String {
        let numeric =
            |id: &str| id.bytes().take_while(u8::is_ascii_digit).fold(0u64, |n, d| n * 10 + u64::from(d - b'0'));
        (self.entries.iter().map(|e| numeric(&e.info.id)).max().unwrap_or(0) + 1).to_string()
    }

    /// The entry with this id and name, either, as QEMU looks them up.
    fn find(&self, id: Option<&str>, name: Option<&str>) -> Option<usize> {
        self.entries.iter().position(|e| {
            id.is_none_or(|id| e.info.id == id)
                && name.is_none_or(|name| e.info.name == name)
                && (id, name) != (None, None)
        })
    }

    /// The table as written to disk: each entry padded to 8 bytes.
    fn bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        for e in &self.entries {
            let extra_len = EXTRA + e.unknown_extra.len();
            out.extend_from_slice(&e.l1_offset.to_be_bytes());
            out.extend_from_slice(&e.l1_size.to_be_bytes());
            out.extend_from_slice(&(e.info.id.len() as u16).to_be_bytes());
            out.extend_from_slice(&(e.info.name.len() as u16).to_be_bytes());
            out.extend_from_slice(&e.info.date_sec.to_be_bytes());
            out.extend_from_slice(&e.info.date_nsec.to_be_bytes());
            out.extend_from_slice(&e.info.vm_clock_nsec.to_be_bytes());
            // The small field holds what fits; the extra data all of it.
            out.extend_from_slice(&(e.info.vm_state_size as u32).to_be_bytes());
            out.extend_from_slice(&(extra_len as u32).to_be_bytes());
            out.extend_from_slice(&e.info.vm_state_size.to_be_bytes());
            out.extend_from_slice(&e.info.disk_size.to_be_bytes());
            out.extend_from_slice(&e.info.icount.unwrap_or(NO_ICOUNT).to_be_bytes());
            out.extend_from_slice(&e.unknown_extra);
            out.extend_from_slice(e.info.id.as_bytes());
            out.extend_from_slice(e.info.name.as_bytes());
            out.resize(out.len().next_multiple_of(8), 0);
        }
        out
    }
}

/// The entry at `at` and where the next one starts; None if it runs past
/// the file or names an L1 table that cannot be.
fn read_entry(
    io: &mut dyn SyncIo,
    at: u64,
    header: &Header,
    file_len: u64,
) -> Result<Option<(Entry, u64)>, FormatError> {
    let fixed = read_bytes(io, at, FIXED as u64)?;
    let be16 = |o: usize| u16::from_be_bytes([fixed[o], fixed[o + 1]]);
    let be32 = |o: usize| u32::from_be_bytes(fixed[o..o + 4].try_into().unwrap());
    let be64 = |o: usize| u64::from_be_bytes(fixed[o..o + 8].try_into().unwrap());
    let (l1_offset, l1_size) = (be64(0), be32(8));
    let (id_len, name_len, extra_len) = (u64::from(be16(12)), u64::from(be16(14)), u64::from(be32(36)));
    let l1_len = u64::from(l1_size) * 8;
    if !l1_offset.is_multiple_of(header.cluster_size())
        || l1_len > 32 << 20
        || l1_offset.saturating_add(l1_len) > file_len
    {
        return Err(FormatError::Corrupt(format!(
            "L1 table at {l1_offset:#x} ({l1_size} entries) is unaligned, too large or past the end of the file"
        )));
    }
    let variable = extra_len + id_len + name_len;
    if extra_len > MAX_EXTRA || at.saturating_add(FIXED as u64 + variable) > file_len {
        return Ok(None);
    }
    let rest = read_bytes(io, at + FIXED as u64, variable)?;
    let (extra, strings) = rest.split_at(extra_len as usize);
    let word = |i: usize| extra.get(i * 8..i * 8 + 8).map(|w| u64::from_be_bytes(w.try_into().unwrap()));
    let text = |bytes: &[u8]| String::from_utf8_lossy(bytes).into_owned();
    let info = SnapshotInfo {
        id: text(&strings[..id_len as usize]),
        name: text(&strings[id_len as usize..]),
        date_sec: be32(16),
        date_nsec: be32(20),
        vm_clock_nsec: be64(24),
        vm_state_size: word(0).unwrap_or(u64::from(be32(32))),
        disk_size: word(1).unwrap_or(header.size),
        icount: word(2).filter(|&n| n != NO_ICOUNT),
    };
    let unknown_extra = extra.get(EXTRA..).unwrap_or_default().to_vec();
    let next = (at + FIXED as u64 + variable).next_multiple_of(8);
    Ok(Some((Entry { l1_offset, l1_size, info, unknown_extra }, next)))
}

/// Reads `len` bytes at an unaligned `offset`.
fn read_bytes(io: &mut dyn SyncIo, offset: u64, len: u64) -> Result<Vec<u8>, FormatError> {
    let start = offset & !511;
    let end = (offset + len).next_multiple_of(512);
    let mut raw = AlignedBuf::zeroed((end - start) as usize);
    io.read_at(&mut raw, start)?;
    Ok(raw[(offset - start) as usize..(offset - start + len) as usize].to_vec())
}

fn errno(code: i32) -> io::Error {
    io::Error::from_raw_os_error(code)
}

fn corrupt(what: String) -> io::Error {
    crate::CorruptMetadata(what).into()
}

impl Image {
    /// The image's internal snapshots, in table order.
    pub fn snapshots(&self) -> Vec<SnapshotInfo> {
        self.lock().snapshots.entries.iter().map(|e| e.info.clone()).collect()
    }

    /// Takes an internal snapshot named `name` of the disk as it is now,
    /// dated `date` (seconds, nanoseconds); no request may be in flight.
    /// Fails with EEXIST if the name is taken, EFBIG past QEMU's limit of
    /// snapshots, ENOTSUP with an external data file (whose clusters have
    /// no refcounts). A failure leaves the image as it was, or with leaked
    /// clusters once it got to writing.
    pub fn create_snapshot(&self, io: &mut ImageIo, name: &str, date: (u32, u32)) -> io::Result<SnapshotInfo> {
        self.check_writable()?;
        if self.layout.data_file {
            return Err(errno(libc::ENOTSUP));
        }
        self.flush(io)?;
        let _writeback = self.writeback();
        let mut meta = self.lock();
        if meta.snapshots.entries.iter().any(|e| e.info.name == name) {
            return Err(errno(libc::EEXIST));
        }
        if meta.snapshots.len() >= MAX_SNAPSHOTS {
            return Err(errno(libc::EFBIG));
        }
        self.prepare_change(&mut meta, io)?;
        let info = SnapshotInfo {
            id: meta.snapshots.next_id(),
            name: name.to_string(),
            date_sec: date.0,
            date_nsec: date.1,
            vm_clock_nsec: 0,
            vm_state_size: 0,
            disk_size: self.size(),
            icount: None,
        };
        let result = self.take_snapshot(&mut meta, io, info);
        self.note_dirty(&meta);
        drop(meta);
        drop(_writeback);
        let info = result?;
        // The old table's clusters, freed.
        self.flush(io)?;
        Ok(info)
    }

    fn take_snapshot(&self, meta: &mut Meta, io: &mut ImageIo, info: SnapshotInfo) -> io::Result<SnapshotInfo> {
        let cs = self.cluster_size();
        let l1_size = meta.l1_size();
        let tables = self.active_tables(meta, io)?;
        let references = self.references(&tables)?;
        let mut table = meta.snapshots.clone();
        table.entries.push(Entry {
            l1_offset: 0,
            l1_size: l1_size as u32,
            info: info.clone(),
            unknown_extra: Vec::new(),
        });
        let l1_clusters = (l1_size * 8).div_ceil(cs).max(1);
        let l1_offset = self.alloc_metadata(meta, io.meta, l1_clusters)?;
        table.entries.last_mut().expect("just pushed").l1_offset = l1_offset;
        let bytes = table.bytes();
        let table_clusters = (bytes.len() as u64).div_ceil(cs);
        let table_offset = match self.alloc_metadata(meta, io.meta, table_clusters) {
            Ok(offset) => offset,
            Err(e) => {
                self.drop_clusters(meta, io.meta, l1_offset, l1_clusters);
                return Err(e);
            }
        };
        if let Err(e) = self.add_references(meta, io.meta, &references) {
            self.drop_clusters(meta, io.meta, l1_offset, l1_clusters);
            self.drop_clusters(meta, io.meta, table_offset, table_clusters);
            return Err(e);
        }
        self.clear_copied(meta, &tables)?;
        // References, then the active tables without COPIED, durable.
        self.write_back_held(meta, io.meta)?;
        self.write_l1_snapshot(io.meta, l1_offset, l1_size, l1_clusters)?;
        write_padded(io.meta, &bytes, table_offset, table_clusters * cs)?;
        table.offset = table_offset;
        table.len = bytes.len() as u64;
        self.switch_table(meta, io.meta, table)?;
        Ok(info)
    }

    /// Deletes the snapshot with this id and name (either may be left
    /// out, not both), freeing what only it used; no request may be in
    /// flight. ENOENT if there is none. Returns what it was.
    pub fn delete_snapshot(&self, io: &mut ImageIo, id: Option<&str>, name: Option<&str>) -> io::Result<SnapshotInfo> {
        self.check_writable()?;
        if self.layout.data_file {
            return Err(errno(libc::ENOTSUP));
        }
        self.flush(io)?;
        let _writeback = self.writeback();
        let mut meta = self.lock();
        let index = meta.snapshots.find(id, name).ok_or_else(|| errno(libc::ENOENT))?;
        self.prepare_change(&mut meta, io)?;
        let result = self.drop_snapshot(&mut meta, io, index);
        self.note_dirty(&meta);
        drop(meta);
        drop(_writeback);
        let info = result?;
        // Freed clusters' refcounts and the COPIED flags set again.
        self.flush(io)?;
        Ok(info)
    }

    fn drop_snapshot(&self, meta: &mut Meta, io: &mut ImageIo, index: usize) -> io::Result<SnapshotInfo> {
        let cs = self.cluster_size();
        let gone = meta.snapshots.entries[index].clone();
        let references = self.snapshot_references(io.meta, &gone)?;
        let mut table = meta.snapshots.clone();
        table.entries.remove(index);
        let bytes = table.bytes();
        let table_clusters = (bytes.len() as u64).div_ceil(cs);
        if table_clusters > 0 {
            table.offset = self.alloc_metadata(meta, io.meta, table_clusters)?;
            // Its refcounts durable before the header names it.
            let written = self
                .write_back_held(meta, io.meta)
                .and_then(|()| write_padded(io.meta, &bytes, table.offset, table_clusters * cs));
            if let Err(e) = written {
                self.drop_clusters(meta, io.meta, table.offset, table_clusters);
                return Err(e);
            }
        } else {
            table.offset = 0;
        }
        table.len = bytes.len() as u64;
        let new_offset = table.offset;
        if let Err(e) = self.switch_table(meta, io.meta, table) {
            if table_clusters > 0 {
                self.drop_clusters(meta, io.meta, new_offset, table_clusters);
            }
            return Err(e);
        }
        // The snapshot is gone on disk: from here on a failure leaks.
        for &cluster in &references {
            meta.decrement(io.meta, cluster, true)?;
        }
        let l1_clusters = (u64::from(gone.l1_size) * 8).div_ceil(cs);
        self.drop_clusters(meta, io.meta, gone.l1_offset, l1_clusters);
        self.set_copied(meta, io)?;
        Ok(gone.info)
    }

    /// Every table of the active L1, wholly loaded, with its L1 index.
    fn active_tables(&self, meta: &mut Meta, io: &mut ImageIo) -> io::Result<Vec<(usize, Arc<L2Table>)>> {
        let cs = self.cluster_size();
        let mut tables = Vec::new();
        for index in 0..meta.l1_size() as usize {
            let l1_entry = self.l1[index].load(Ordering::Acquire);
            match entry::l1(l1_entry, cs) {
                Ok(Some((offset, _))) => tables.push((index, self.load_l2(meta, io.meta, offset, self.all_slices())?)),
                Ok(None) => {}
                Err(e) => return Err(corrupt(format!("active L1 entry {index}: {e}"))),
            }
        }
        Ok(tables)
    }

    /// The clusters `tables` reference, once per reference: each table
    /// and every cluster its entries name.
    fn references(&self, tables: &[(usize, Arc<L2Table>)]) -> io::Result<Vec<u64>> {
        let mut clusters = Vec::new();
        for (_, table) in tables {
            clusters.push(table.offset >> self.header.cluster_bits);
            for index in 0..self.header.l2_entries() as usize {
                let e = self.entry(table, index).ok_or_else(super::unloaded_slice)?;
                let e = e.map_err(|e| corrupt(format!("L2 table at {:#x}, entry {index}: {e}", table.offset)))?;
                self.clusters_of(&e, &mut clusters);
            }
        }
        Ok(clusters)
    }

    /// The host clusters entry `e` holds a reference to.
    fn clusters_of(&self, e: &L2Entry, out: &mut Vec<u64>) {
        let cb = self.header.cluster_bits;
        if let Some((host, len)) = e.compressed {
            out.extend((host >> cb)..=((host + len - 1) >> cb));
        } else if let Some(host) = e.host.filter(|_| !self.layout.data_file) {
            out.push(host >> cb);
        }
    }

    /// The clusters snapshot `gone` references, read from its tables on
    /// disk (current: everything was flushed), checked not to be metadata
    /// other than its own tables.
    fn snapshot_references(&self, file: &mut dyn SyncIo, gone: &Entry) -> io::Result<Vec<u64>> {
        let cs = self.cluster_size();
        let l1 = read_table(file, gone.l1_offset, u64::from(gone.l1_size)).map_err(io::Error::from)?;
        let mut clusters = Vec::new();
        let mut raw = AlignedBuf::zeroed(cs as usize);
        for (i, &l1_entry) in l1.iter().enumerate() {
            let l2 = match entry::l1(l1_entry, cs) {
                Ok(Some((l2, _))) => l2,
                Ok(None) => continue,
                Err(e) => return Err(corrupt(format!("snapshot '{}' L1 entry {i}: {e}", gone.info.id))),
            };
            clusters.push(l2 / cs);
            file.read_at(&mut raw, l2)?;
            let table = L2Table::parse(l2, &raw, cs as usize);
            for index in 0..self.header.l2_entries() as usize {
                let e = table.decode(&self.layout, index).ok_or_else(super::unloaded_slice)?;
                let e = e.map_err(|e| corrupt(format!("snapshot L2 table at {l2:#x}, entry {index}: {e}")))?;
                let first = clusters.len();
                self.clusters_of(&e, &mut clusters);
                if let Some(&c) = clusters[first..].iter().find(|&&c| self.metadata.contains(c)) {
                    return Err(corrupt(format!("snapshot L2 table at {l2:#x} points into metadata at {:#x}", c * cs)));
                }
            }
        }
        Ok(clusters)
    }

    /// Allocates `n` clusters for a table of the image's own metadata.
    fn alloc_metadata(&self, meta: &mut Meta, file: &mut dyn SyncIo, n: u64) -> io::Result<u64> {
        let offset = meta.alloc(file, n)?;
        let first = offset >> self.header.cluster_bits;
        (first..first + n).for_each(|c| meta.metadata.insert(c));
        Ok(offset)
    }

    /// Drops the reference to `n` clusters from `offset` now, in memory
    /// (a failure to read a refcount block leaks them).
    fn drop_clusters(&self, meta: &mut Meta, file: &mut dyn SyncIo, offset: u64, n: u64) {
        let first = offset >> self.header.cluster_bits;
        for cluster in first..first + n {
            if let Err(e) = meta.decrement(file, cluster, false) {
                log::warn!("qcow2: cluster {cluster:#x} leaks: {e}");
            }
        }
    }

    /// One more reference to each of `clusters`; on failure (a refcount
    /// at its width's maximum, an unreadable block) none.
    fn add_references(&self, meta: &mut Meta, file: &mut dyn SyncIo, clusters: &[u64]) -> io::Result<()> {
        for (done, &cluster) in clusters.iter().enumerate() {
            if let Err(e) = meta.add_reference(file, cluster) {
                // The blocks of those done are cached and dirty: undoing
                // them reads nothing.
                for &undo in &clusters[..done] {
                    let _ = meta.decrement(file, undo, false);
                }
                return Err(e);
            }
        }
        Ok(())
    }

    /// Clears COPIED in the active L1 and L2 entries: everything they name
    /// is shared with the new snapshot now.
    fn clear_copied(&self, meta: &mut Meta, tables: &[(usize, Arc<L2Table>)]) -> io::Result<()> {
        for (l1_index, table) in tables {
            for index in 0..self.header.l2_entries() as usize {
                let e =
                    self.entry(table, index).ok_or_else(super::unloaded_slice)?.map_err(|e| corrupt(e.to_string()))?;
                if e.copied {
                    self.set_l2(meta, table, index, &L2Entry { copied: false, ..e })?;
                }
            }
            self.set_l1(meta, *l1_index, table.offset);
        }
        Ok(())
    }

    /// Sets COPIED again in the active L1 and L2 entries whose cluster this
    /// image alone references now, as QEMU does after a deletion. Tables
    /// still shared are left: what they name is shared too.
    fn set_copied(&self, meta: &mut Meta, io: &mut ImageIo) -> io::Result<()> {
        let cs = self.cluster_size();
        for l1_index in 0..meta.l1_size() as usize {
            let l1_entry = self.l1[l1_index].load(Ordering::Acquire);
            let Ok(Some((offset, copied))) = entry::l1(l1_entry, cs) else { continue };
            if meta.refcounts.get(io.meta, offset / cs)? != 1 {
                continue;
            }
            if !copied {
                self.set_l1(meta, l1_index, offset | COPIED);
            }
            let table = self.load_l2(meta, io.meta, offset, self.all_slices())?;
            for index in 0..self.header.l2_entries() as usize {
                let e =
                    self.entry(&table, index).ok_or_else(super::unloaded_slice)?.map_err(|e| corrupt(e.to_string()))?;
                let Some(host) = e.host.filter(|_| !e.copied) else { continue };
                if meta.refcounts.get(io.meta, host / cs)? == 1 {
                    self.set_l2(meta, &table, index, &L2Entry { copied: true, ..e })?;
                }
            }
        }
        Ok(())
    }

    /// Writes the snapshot's copy of the active L1 table (its first
    /// `entries`, as they are now) to `clusters` clusters at `offset`.
    fn write_l1_snapshot(&self, file: &mut dyn SyncIo, offset: u64, entries: u64, clusters: u64) -> io::Result<()> {
        let mut raw = AlignedBuf::zeroed((clusters * self.cluster_size()) as usize);
        for (out, entry) in raw.chunks_exact_mut(8).zip(self.l1.iter().take(entries as usize)) {
            out.copy_from_slice(&entry.load(Ordering::Acquire).to_be_bytes());
        }
        file.write_at(&raw, offset)?;
        file.flush()
    }

    /// Points the header at `table` (count and offset in one write, made
    /// durable) and frees the old table's clusters; on failure the header
    /// in memory stays as it was.
    fn switch_table(&self, meta: &mut Meta, file: &mut dyn SyncIo, table: SnapshotTable) -> io::Result<()> {
        let fields = HEADER_FIELDS..HEADER_FIELDS + 12;
        let before = meta.header_chunk[fields.clone()].to_vec();
        meta.header_chunk[fields.start..fields.start + 4].copy_from_slice(&(table.entries.len() as u32).to_be_bytes());
        meta.header_chunk[fields.start + 4..fields.end].copy_from_slice(&table.offset.to_be_bytes());
        let chunk = AlignedBuf::copy_of(&meta.header_chunk);
        if let Err(e) = file.write_at(&chunk, 0).and_then(|()| file.flush()) {
            meta.header_chunk[fields].copy_from_slice(&before);
            return Err(e);
        }
        let old = std::mem::replace(&mut meta.snapshots, table);
        if let Some((offset, len)) = old.extent() {
            let first = offset >> self.header.cluster_bits;
            (first..(offset + len).div_ceil(self.cluster_size())).for_each(|c| meta.decref(c, false));
        }
        Ok(())
    }
}

/// Writes `bytes` at `offset`, zero-padded to `len`, durably.
fn write_padded(file: &mut dyn SyncIo, bytes: &[u8], offset: u64, len: u64) -> io::Result<()> {
    let mut raw = AlignedBuf::zeroed(len as usize);
    raw[..bytes.len()].copy_from_slice(bytes);
    file.write_at(&raw, offset)?;
    file.flush()
}

impl Meta {
    /// One more reference to `cluster`, which has some: EINVAL for a free
    /// cluster (a table naming it is corrupt), ERANGE at the refcount
    /// width's maximum.
    fn add_reference(&mut self, file: &mut dyn SyncIo, cluster: u64) -> io::Result<()> {
        let count = self.refcounts.get(file, cluster)?;
        if count == 0 {
            return Err(corrupt(format!("cluster {cluster:#x} is referenced but has refcount 0")));
        }
        if count >= self.refcounts.max() {
            return Err(errno(libc::ERANGE));
        }
        self.refcounts.set(file, cluster, count + 1)
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;
    use std::process::Command;

    use super::*;
    use crate::Options;
    use crate::mem::MemFile;

    const KIB: u64 = 1024;
    const SIZE: u64 = 64 << 20;

    fn io(file: &mut dyn SyncIo) -> ImageIo<'_> {
        ImageIo { meta: file, data: None, backing: None }
    }

    fn open(file: &mut MemFile) -> Image {
        let len = file.bytes.len() as u64;
        Image::open(file, len, Options { writable: true, ..Options::default() }).unwrap()
    }

    /// The image's bytes in a file of their own, removed when dropped.
    struct OnDisk(PathBuf);

    impl OnDisk {
        fn new(name: &str, bytes: &[u8]) -> Self {
            let path = std::env::temp_dir().join(format!("vsd-qcow2-snap-{name}-{}.qcow2", std::process::id()));
            std::fs::write(&path, bytes).unwrap();
            OnDisk(path)
        }

        fn run(&self, args: &[&str]) -> (i32, String) {
            let out = Command::new(args[0]).args(&args[1..]).arg(&self.0).output().unwrap();
            (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stdout).into_owned())
        }

        /// The guest disk, or snapshot `name` of it, as qemu-img reads it.
        fn disk(&self, snapshot: Option<&str>) -> Vec<u8> {
            let raw = self.0.with_extension("raw");
            let mut cmd = Command::new("qemu-img");
            cmd.args(["convert", "-O", "raw"]);
            if let Some(name) = snapshot {
                cmd.arg("-l").arg(format!("snapshot.name={name}"));
            }
            assert!(cmd.arg(&self.0).arg(&raw).status().unwrap().success());
            let bytes = std::fs::read(&raw).unwrap();
            std::fs::remove_file(&raw).unwrap();
            bytes
        }
    }

    impl Drop for OnDisk {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    /// Writes `len` bytes of `byte` at `at` through the image and into
    /// `model`, the disk as it should read.
    fn write(image: &Image, file: &mut MemFile, model: &mut [u8], at: u64, len: u64, byte: u8) {
        image.write(&mut io(file), at, len, &mut |_, buf| buf.fill(byte)).unwrap();
        model[at as usize..(at + len) as usize].fill(byte);
    }

    /// Data in two L2 tables' worth of clusters (512 KiB clusters would
    /// need a larger disk: 4 KiB clusters give 2 MiB per table).
    fn workload_before(image: &Image, file: &mut MemFile, model: &mut [u8]) {
        write(image, file, model, 0, 128 * KIB, 0x11);
        write(image, file, model, 3 << 20, 8 * KIB, 0x22);
        write(image, file, model, 40 << 20, 4 * KIB, 0x33);
    }

    fn workload_after(image: &Image, file: &mut MemFile, model: &mut [u8]) {
        write(image, file, model, 4 * KIB, 4 * KIB, 0x44); // inside a shared cluster: copied
        write(image, file, model, (3 << 20) + 2 * KIB, 8 * KIB, 0x55);
        write(image, file, model, 50 << 20, 4 * KIB, 0x66); // a cluster no one had
        image.discard(&mut io(file), 64 * KIB, 64 * KIB).unwrap();
        model[64 * KIB as usize..128 * KIB as usize].fill(0);
    }

    fn clean(report: &(i32, String)) {
        assert!(report.0 == 0 && report.1.contains("No errors were found"), "qemu-img check: {}", report.1);
    }

    /// A snapshot vsd takes is read back by qemu-img as the disk was; the
    /// writes after it (into shared clusters, new ones, a discard) leave it
    /// so, and the active disk reads as written; deleting it leaves the
    /// image clean, its clusters freed and the shared ones owned again.
    #[test]
    fn a_snapshot_keeps_the_disk_as_it_was_and_deleting_it_frees_what_it_alone_held() {
        let mut file = MemFile::made_by_qemu_img_with("take", &["-o", "cluster_size=4k"], "64M");
        let image = open(&mut file);
        let mut model = vec![0u8; SIZE as usize];
        workload_before(&image, &mut file, &mut model);
        let at_snapshot = model.clone();
        let info = image.create_snapshot(&mut io(&mut file), "s1", (1_700_000_000, 5000)).unwrap();
        assert_eq!((info.id.as_str(), info.disk_size, info.vm_state_size), ("1", SIZE, 0));
        let taken = file.bytes.clone();
        workload_after(&image, &mut file, &mut model);
        image.close(&mut io(&mut file)).unwrap();

        let disk = OnDisk::new("take", &file.bytes);
        clean(&disk.run(&["qemu-img", "check"]));
        let (_, list) = disk.run(&["qemu-img", "snapshot", "-l"]);
        assert!(list.lines().any(|l| l.starts_with("1 ") && l.contains("s1") && l.contains("2023-11-14")), "{list}");
        assert!(disk.disk(Some("s1")) == at_snapshot, "the snapshot reads as the disk was");
        assert!(disk.disk(None) == model, "the active disk reads as written");
        // Right after the snapshot, too.
        let just_taken = OnDisk::new("taken", &taken);
        clean(&just_taken.run(&["qemu-img", "check"]));

        let image = open(&mut file);
        let gone = image.delete_snapshot(&mut io(&mut file), None, Some("s1")).unwrap();
        assert_eq!(gone, info);
        assert!(image.snapshots().is_empty());
        let mut memo = crate::MapMemo::default();
        let mapped = image.map(&mut memo, &mut file.clone(), 0, 4096).unwrap().mapping;
        assert!(matches!(mapped, crate::Mapping::Data { in_place: true, .. }), "owned again: {mapped:?}");
        image.close(&mut io(&mut file)).unwrap();
        let disk = OnDisk::new("deleted", &file.bytes);
        let report = disk.run(&["qemu-img", "check"]);
        clean(&report);
        assert!(disk.run(&["qemu-img", "snapshot", "-l"]).1.is_empty());
        assert!(disk.disk(None) == model);
    }

    /// A snapshot QEMU took is found, listed as QEMU lists it, and deleted
    /// by vsd; one vsd took next to it is deleted by qemu-img.
    #[test]
    fn snapshots_of_qemu_and_vsd_are_deleted_by_the_other() {
        let mut file = MemFile::made_by_qemu_img("mixed", "64M");
        let image = open(&mut file);
        let mut model = vec![0u8; SIZE as usize];
        workload_before(&image, &mut file, &mut model);
        image.close(&mut io(&mut file)).unwrap();
        let disk = OnDisk::new("mixed", &file.bytes);
        assert_eq!(disk.run(&["qemu-img", "snapshot", "-c", "by-qemu"]).0, 0);
        let mut file = MemFile::new(std::fs::read(&disk.0).unwrap(), 256 << 20);
        let image = open(&mut file);
        assert_eq!(image.snapshots().iter().map(|s| s.name.as_str()).collect::<Vec<_>>(), ["by-qemu"]);
        let at_qemu = model.clone();
        write(&image, &mut file, &mut model, 0, 4 * KIB, 0x77);
        let vsd = image.create_snapshot(&mut io(&mut file), "by-vsd", (1, 0)).unwrap();
        assert_eq!(vsd.id, "2", "one past QEMU's");
        let at_vsd = model.clone();
        write(&image, &mut file, &mut model, 0, 4 * KIB, 0x78);
        let errno = |r: io::Result<SnapshotInfo>| r.unwrap_err().raw_os_error();
        assert_eq!(errno(image.create_snapshot(&mut io(&mut file), "by-qemu", (1, 0))), Some(libc::EEXIST));
        assert_eq!(errno(image.delete_snapshot(&mut io(&mut file), Some("1"), Some("by-vsd"))), Some(libc::ENOENT));
        image.delete_snapshot(&mut io(&mut file), Some("1"), None).unwrap();
        image.close(&mut io(&mut file)).unwrap();

        let disk = OnDisk::new("mixed-after", &file.bytes);
        clean(&disk.run(&["qemu-img", "check"]));
        assert!(disk.disk(Some("by-vsd")) == at_vsd && disk.disk(None) == model);
        assert_ne!(at_qemu, at_vsd);
        assert_eq!(disk.run(&["qemu-img", "snapshot", "-d", "by-vsd"]).0, 0);
        clean(&disk.run(&["qemu-img", "check"]));
        assert!(disk.disk(None) == model);
    }

    /// Refusals change nothing: a taken name, an unknown snapshot, a
    /// read-only image, a refcount width that cannot count two users.
    #[test]
    fn refusals_leave_the_image_as_it_was() {
        let mut file = MemFile::made_by_qemu_img_with("refused", &["-o", "refcount_bits=1"], "64M");
        let image = open(&mut file);
        write(&image, &mut file, &mut vec![0; SIZE as usize], 0, 4 * KIB, 1);
        image.flush(&mut io(&mut file)).unwrap();
        let before = file.bytes.clone();
        let err = image.create_snapshot(&mut io(&mut file), "s", (1, 0)).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::ERANGE));
        image.flush(&mut io(&mut file)).unwrap();
        assert!(file.bytes == before, "nothing written");
        assert!(image.snapshots().is_empty());
        assert_eq!(
            image.delete_snapshot(&mut io(&mut file), None, Some("s")).unwrap_err().raw_os_error(),
            Some(libc::ENOENT)
        );

        let len = file.bytes.len() as u64;
        let read_only = Image::open(&mut file, len, Options::default()).unwrap();
        let err = read_only.create_snapshot(&mut io(&mut file.clone()), "s", (1, 0)).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EROFS));
    }

    /// Writes pass until `left` runs out; then the "machine" is gone and
    /// nothing more lands (reads still work, so the call unwinds).
    struct Cut {
        file: MemFile,
        left: usize,
    }

    impl SyncIo for Cut {
        fn read_at(&mut self, buf: &mut [u8], offset: u64) -> io::Result<()> {
            self.file.read_at(buf, offset)
        }
        fn write_at(&mut self, buf: &[u8], offset: u64) -> io::Result<()> {
            if self.left == 0 {
                return Err(errno(libc::EIO));
            }
            self.left -= 1;
            self.file.write_at(buf, offset)
        }
        fn flush(&mut self) -> io::Result<()> {
            if self.left == 0 { Err(errno(libc::EIO)) } else { Ok(()) }
        }
        fn discard(&mut self, _: u64, _: u64) -> io::Result<()> {
            Ok(())
        }
    }

    /// What `qemu-img check` may say of an image cut short: clean, leaks,
    /// or COPIED flags that disagree with refcounts (the window in the
    /// module's docs), never a refcount below its references.
    fn consistent(report: &(i32, String), what: &str) {
        let errors: Vec<&str> = report.1.lines().filter(|l| l.starts_with("ERROR")).collect();
        assert!(
            errors.iter().all(|l| l.starts_with("ERROR OFLAG_COPIED")) && matches!(report.0, 0 | 2 | 3),
            "{what}: {}",
            report.1
        );
    }

    /// A crash after any write of taking or deleting a snapshot leaves a
    /// consistent image: the snapshot whole or absent, the disk intact.
    #[test]
    fn a_crash_at_any_write_leaves_a_consistent_image() {
        let mut file = MemFile::made_by_qemu_img("cut", "64M");
        let image = open(&mut file);
        let mut model = vec![0u8; SIZE as usize];
        workload_before(&image, &mut file, &mut model);
        image.close(&mut io(&mut file)).unwrap();
        let base = file.bytes.clone();
        for (op, name) in [(0, "create"), (1, "delete")] {
            let mut start = MemFile::new(base.clone(), 256 << 20);
            if op == 1 {
                let image = open(&mut start);
                image.create_snapshot(&mut io(&mut start), "s", (1, 0)).unwrap();
                image.close(&mut io(&mut start)).unwrap();
            }
            for left in 0.. {
                let mut cut = Cut { file: start.clone(), left };
                let image = open(&mut cut.file);
                let done = match op {
                    0 => image.create_snapshot(&mut io(&mut cut), "s", (1, 0)).is_ok(),
                    _ => image.delete_snapshot(&mut io(&mut cut), None, Some("s")).is_ok(),
                };
                let disk = OnDisk::new("cut", &cut.file.bytes);
                consistent(&disk.run(&["qemu-img", "check"]), &format!("{name}, cut after {left} writes"));
                assert!(disk.disk(None) == model, "{name}, cut after {left} writes: the disk");
                if disk.run(&["qemu-img", "snapshot", "-l"]).1.contains(" s ") {
                    assert!(disk.disk(Some("s")) == model, "{name}, cut after {left} writes: the snapshot");
                }
                if done {
                    break;
                }
            }
        }
    }
}
