//! Refcounts and cluster allocation.
//!
//! Refcount changes stay in memory until [`Image::flush`] writes them
//! (increments before the tables that use the clusters, decrements after
//! the tables that stopped using them). Structural changes are written at
//! once, each made durable before anything points at it: a new refcount
//! block before the table entry naming it, a new refcount table before the
//! header names it.
//!
//! [`Image::flush`]: super::Image::flush

use std::collections::{BTreeSet, HashMap};
use std::io;

use super::writeback::{Copy, RefcountCopy};
use super::{Meta, MissingTable};
use crate::SyncIo;
use crate::buf::AlignedBuf;
use crate::header::field;
use crate::refcount::Width;

/// The refcount table and the blocks read so far.
pub(super) struct Refcounts {
    /// Refcount block offsets (0: no block yet).
    pub(super) table: Vec<u64>,
    pub(super) table_offset: u64,
    blocks: HashMap<u64, AlignedBuf>,
    width: Width,
    cluster_bits: u32,
    /// Allocation scans from here; it moves back to clusters freed while
    /// the image is open once they leave quarantine (see `reuse`).
    hint: u64,
    /// Clusters up to here may hold something: the file's initial length,
    /// then past every cluster handed out since. Clusters from here on
    /// were never written, and read as zeroes.
    file_end: u64,
    /// Chunks of blocks changed in memory only: (block index, byte offset).
    dirty: BTreeSet<(u64, usize)>,
    /// Blocks kept in memory at most; blocks with unwritten changes are
    /// never dropped.
    capacity: usize,
    /// Advanced whenever block chunks are written to the file: a block read
    /// without the metadata mutex ([`BlockLoad`]) is current only if this
    /// did not change meanwhile.
    written: u64,
    /// Whether a block (or table slice) the cache lacks may be read here,
    /// under the metadata mutex; if not, [`NeedsLoad`] names it.
    pub(super) may_load: bool,
}

/// A change of metadata needs a table slice or refcount block the cache
/// lacks (asked not to read one under the metadata mutex): load it
/// ([`Image::start_load`]) and try again.
///
/// [`Image::start_load`]: super::Image::start_load
#[derive(Debug, thiserror::Error)]
#[error("a table a change of metadata needs is not cached")]
pub struct NeedsLoad(pub(super) MissingTable);

impl NeedsLoad {
    /// The block `e` names, if it is this error.
    pub fn of(e: &io::Error) -> Option<MissingTable> {
        e.get_ref()?.downcast_ref::<NeedsLoad>().map(|needs| needs.0)
    }
}

/// Refcount blocks the cache lacks, read without the metadata mutex and
/// put in the cache under it ([`Refcounts::insert_loaded`]).
pub(super) struct BlockLoad {
    /// (block index, where it is in the file).
    blocks: Vec<(u64, u64)>,
    written: u64,
    cluster_size: u64,
}

impl BlockLoad {
    /// Reads its blocks (without the metadata mutex).
    pub(super) fn read(&self, io: &mut dyn SyncIo) -> io::Result<Vec<(u64, AlignedBuf)>> {
        let read = |&(index, offset): &(u64, u64)| {
            let mut buf = AlignedBuf::zeroed(self.cluster_size as usize);
            io.read_at(&mut buf, offset).map(|()| (index, buf))
        };
        self.blocks.iter().map(read).collect()
    }
}

impl Refcounts {
    pub(super) fn new(
        table: Vec<u64>,
        table_offset: u64,
        width: Width,
        cluster_bits: u32,
        file_len: u64,
        capacity: usize,
    ) -> Self {
        let file_end = file_len.div_ceil(1 << cluster_bits);
        Self {
            table,
            table_offset,
            blocks: HashMap::new(),
            width,
            cluster_bits,
            hint: 0,
            file_end,
            dirty: BTreeSet::new(),
            capacity: capacity.max(2),
            written: 0,
            may_load: true,
        }
    }

    fn cluster_size(&self) -> u64 {
        1 << self.cluster_bits
    }

    /// Refcount entries per block.
    fn per_block(&self) -> u64 {
        self.width.entries(self.cluster_size())
    }

    /// The bytes written for one metadata update: a 4 KiB page, or the
    /// whole cluster if smaller, so O_DIRECT alignment always holds.
    fn chunk(&self) -> usize {
        self.cluster_size().min(4096) as usize
    }

    fn block(&mut self, io: &mut dyn SyncIo, index: u64) -> io::Result<Option<&mut AlignedBuf>> {
        let Some(&offset) = self.table.get(index as usize).filter(|&&o| o != 0) else {
            return Ok(None);
        };
        if !self.blocks.contains_key(&index) {
            if !self.may_load {
                return Err(io::Error::other(NeedsLoad(MissingTable::refcount_block(offset, index))));
            }
            let mut buf = AlignedBuf::zeroed(self.cluster_size() as usize);
            io.read_at(&mut buf, offset)?;
            self.cache(index, buf);
        }
        Ok(self.blocks.get_mut(&index))
    }

    /// Keeps block `index`, dropping a clean one if the cache is full.
    fn cache(&mut self, index: u64, block: AlignedBuf) {
        if self.blocks.len() >= self.capacity {
            let clean = self.blocks.keys().copied().find(|&i| !self.block_dirty(i));
            if let Some(victim) = clean {
                self.blocks.remove(&victim);
            }
        }
        self.blocks.insert(index, block);
    }

    /// How many times block chunks were written so far (see `written`).
    pub(super) fn written(&self) -> u64 {
        self.written
    }

    /// Caches block `index`, read from the file since [`Refcounts::written`]
    /// said `epoch`, unless blocks were written meanwhile (what was read may
    /// be stale). Whether the block is cached now.
    pub(super) fn insert_block(&mut self, index: u64, block: AlignedBuf, epoch: u64) -> bool {
        if self.blocks.contains_key(&index) {
            return true;
        }
        if epoch != self.written {
            return false;
        }
        self.cache(index, block);
        true
    }

    /// The blocks that hold the refcounts of `clusters` and the cache lacks.
    pub(super) fn missing(&self, clusters: impl Iterator<Item = u64>) -> BlockLoad {
        let per_block = self.per_block();
        let indexes: BTreeSet<u64> = clusters.map(|c| c / per_block).collect();
        let blocks = indexes
            .into_iter()
            .filter(|index| !self.blocks.contains_key(index))
            .filter_map(|index| Some((index, *self.table.get(index as usize).filter(|&&o| o != 0)?)))
            .collect();
        BlockLoad { blocks, written: self.written, cluster_size: self.cluster_size() }
    }

    /// Caches the blocks `load` read, unless blocks were written since it
    /// was made (what it read may be stale) or the cache has them already.
    pub(super) fn insert_loaded(&mut self, load: &BlockLoad, blocks: Vec<(u64, AlignedBuf)>) {
        if load.written != self.written {
            return;
        }
        for (index, block) in blocks {
            if !self.blocks.contains_key(&index) {
                self.cache(index, block);
            }
        }
    }

    /// The refcount of `cluster` (0 where no block covers it).
    pub(super) fn get(&mut self, io: &mut dyn SyncIo, cluster: u64) -> io::Result<u64> {
        let (index, slot) = (cluster / self.per_block(), cluster % self.per_block());
        let width = self.width;
        Ok(self.block(io, index)?.map_or(0, |block| width.get(block, slot)))
    }

    /// The highest refcount the width holds.
    pub(super) fn max(&self) -> u64 {
        self.width.max()
    }

    /// Sets the refcount of `cluster`, whose block must exist, in memory.
    pub(super) fn set(&mut self, io: &mut dyn SyncIo, cluster: u64, value: u64) -> io::Result<()> {
        let (index, slot) = (cluster / self.per_block(), cluster % self.per_block());
        let (width, chunk) = (self.width, self.chunk());
        let block = self.block(io, index)?.expect("callers cover the cluster with a block first");
        width.set(block, slot, value);
        self.dirty.insert((index, width.byte_range(slot).start / chunk * chunk));
        Ok(())
    }

    /// Writes every chunk changed in memory.
    pub(super) fn write_dirty(&mut self, io: &mut dyn SyncIo) -> io::Result<()> {
        let chunk = self.chunk();
        for &(index, start) in &self.dirty {
            let block = &self.blocks[&index];
            io.write_at(&block[start..start + chunk], self.table[index as usize] + start as u64)?;
        }
        self.dirty.clear();
        self.written += 1;
        Ok(())
    }

    /// Copies of the chunks changed in memory, to write without the
    /// metadata mutex.
    pub(super) fn copy_dirty(&self) -> Vec<RefcountCopy> {
        let chunk = self.chunk();
        let copy = |&(index, start): &(u64, usize)| {
            let bytes = AlignedBuf::copy_of(&self.blocks[&index][start..start + chunk]);
            Copy { key: (index, start), at: self.table[index as usize] + start as u64, bytes }
        };
        self.dirty.iter().map(copy).collect()
    }

    /// Marks clean the chunks written from `copies` that still hold what
    /// was written.
    pub(super) fn forget_written(&mut self, copies: &[RefcountCopy]) {
        self.written += 1;
        for Copy { key: (index, start), bytes, .. } in copies {
            if self.blocks[index][*start..*start + bytes.len()] == bytes[..] {
                self.dirty.remove(&(*index, *start));
            }
        }
    }

    pub(super) fn is_dirty(&self) -> bool {
        !self.dirty.is_empty()
    }

    fn block_dirty(&self, index: u64) -> bool {
        self.dirty.range((index, 0)..=(index, usize::MAX)).next().is_some()
    }

    /// Drops every block without unwritten changes (cache cleaning).
    pub(super) fn drop_clean(&mut self) {
        let dirty: BTreeSet<u64> = self.dirty.iter().map(|&(i, _)| i).collect();
        self.blocks.retain(|i, _| dirty.contains(i));
    }

    /// Writes table entry `index` (already set in memory).
    fn write_table_entry(&self, io: &mut dyn SyncIo, index: u64) -> io::Result<()> {
        let chunk = self.chunk();
        let start = (index as usize * 8) / chunk * chunk;
        let mut buf = AlignedBuf::zeroed(chunk);
        for (i, out) in buf.chunks_exact_mut(8).enumerate() {
            out.copy_from_slice(&self.table.get(start / 8 + i).copied().unwrap_or(0).to_be_bytes());
        }
        io.write_at(&buf, self.table_offset + start as u64)
    }
}

/// Rounds of new refcount metadata one allocation may need: a block, then
/// a table growth, then blocks for the grown table, with room to spare.
const ALLOC_ROUNDS: usize = 16;

/// A corruption found while allocating: an error for the request that
/// says so (the image is left as it is).
fn corrupt(what: String) -> io::Error {
    crate::CorruptMetadata(format!("corrupt refcounts: {what}")).into()
}

impl Meta {
    /// Allocates `n` contiguous clusters with refcount 1; returns the first
    /// one's byte offset.
    pub(super) fn alloc(&mut self, io: &mut dyn SyncIo, n: u64) -> io::Result<u64> {
        self.reuse_freed();
        // Each round that adds metadata grows the covered area; an image
        // needing more rounds than this has refcounts that lie.
        for _ in 0..ALLOC_ROUNDS {
            let start = self.free_run(io, n)?;
            if self.cover(io, start, n)? {
                continue; // new metadata may sit inside the run: look again
            }
            for cluster in start..start + n {
                self.refcounts.set(io, cluster, 1)?;
            }
            let rc = &mut self.refcounts;
            rc.hint = start + n;
            rc.file_end = rc.file_end.max(start + n);
            return Ok(start << rc.cluster_bits);
        }
        Err(corrupt(format!(
            "allocating {n} clusters did not settle after {ALLOC_ROUNDS} rounds of new refcount metadata"
        )))
    }

    /// Allocates `size` bytes (less than a cluster) for a compressed
    /// cluster, as QEMU's `qcow2_alloc_bytes` does: right after the last
    /// ones, running on into the next cluster if that one is free, else
    /// from the start of a new cluster. Each cluster the bytes touch
    /// counts them once more. Returns their byte offset.
    pub(super) fn alloc_bytes(&mut self, io: &mut dyn SyncIo, size: u64) -> io::Result<u64> {
        let cb = self.refcounts.cluster_bits;
        let cs = 1u64 << cb;
        let mut offset = self.packed;
        if offset != 0 && self.refcounts.get(io, offset >> cb)? == self.refcounts.width.max() {
            offset = 0;
        }
        let room = if offset == 0 { 0 } else { cs - (offset & (cs - 1)) };
        if room < size {
            let fresh = self.alloc(io, 1)?;
            if offset == 0 || offset.next_multiple_of(cs) != fresh {
                offset = fresh;
            } else {
                self.increment(io, offset >> cb)?;
            }
        } else {
            self.increment(io, offset >> cb)?;
        }
        // A cluster filled to its end leaves nothing to run on from.
        self.packed = if (offset + size).is_multiple_of(cs) { 0 } else { offset + size };
        Ok(offset)
    }

    /// One more reference to `cluster`, which has some already.
    fn increment(&mut self, io: &mut dyn SyncIo, cluster: u64) -> io::Result<()> {
        let count = self.refcounts.get(io, cluster)?;
        if count == 0 {
            return Err(corrupt(format!("cluster {cluster} that compressed data fills in part has refcount 0")));
        }
        self.refcounts.set(io, cluster, count + 1)
    }

    /// Lets allocation take again the freed clusters no request in flight
    /// may still use.
    fn reuse_freed(&mut self) {
        if self.quarantine.is_empty() {
            return;
        }
        if let Some(lowest) = self.quarantine.release(self.epochs.oldest_in_use()) {
            self.refcounts.hint = self.refcounts.hint.min(lowest);
        }
    }

    /// The first cluster (byte offset) that may never have been written:
    /// every cluster from there on reads as zeroes until allocated.
    pub(super) fn fresh_from(&self) -> u64 {
        self.refcounts.file_end << self.refcounts.cluster_bits
    }

    /// The first run of `n` free clusters from the hint.
    fn free_run(&mut self, io: &mut dyn SyncIo, n: u64) -> io::Result<u64> {
        let rc = &mut self.refcounts;
        let (mut start, mut cluster) = (rc.hint.max(1), rc.hint.max(1));
        while cluster < start + n {
            // A metadata cluster with refcount 0 is corruption: never
            // hand it out.
            if rc.get(io, cluster)? != 0 || self.metadata.contains(cluster) || self.quarantine.holds(cluster) {
                start = cluster + 1;
            }
            cluster += 1;
        }
        Ok(start)
    }

    /// Makes sure refcount blocks cover `n` clusters from `start`; returns
    /// whether it had to allocate metadata to do so.
    fn cover(&mut self, io: &mut dyn SyncIo, start: u64, n: u64) -> io::Result<bool> {
        let per_block = self.refcounts.per_block();
        for index in start / per_block..=(start + n - 1) / per_block {
            if index as usize >= self.refcounts.table.len() {
                self.grow_table(io, index)?;
                return Ok(true);
            }
            if self.refcounts.table[index as usize] == 0 {
                self.add_block(io, index)?;
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Creates refcount block `index` in the first cluster it covers (free,
    /// since no block counted it), counting itself.
    fn add_block(&mut self, io: &mut dyn SyncIo, index: u64) -> io::Result<()> {
        let rc = &mut self.refcounts;
        let cluster = index * rc.per_block();
        let offset = cluster << rc.cluster_bits;
        let mut block = AlignedBuf::zeroed(rc.cluster_size() as usize);
        rc.width.set(&mut block, 0, 1);
        io.write_at(&block, offset)?;
        io.flush()?;
        rc.blocks.insert(index, block);
        rc.table[index as usize] = offset;
        rc.write_table_entry(io, index)?;
        rc.file_end = rc.file_end.max(cluster + 1);
        self.metadata.insert(cluster);
        Ok(())
    }

    /// Moves the refcount table to the end of the image, grown to have an
    /// entry `index`, together with new blocks that cover the new table and
    /// themselves (the fixed point QEMU's refcount area also computes).
    fn grow_table(&mut self, io: &mut dyn SyncIo, index: u64) -> io::Result<()> {
        let rc = &mut self.refcounts;
        let (cs, per_block, old_len) = (rc.cluster_size(), rc.per_block(), rc.table.len() as u64);
        let area = rc.file_end.max(old_len * per_block);
        // Entries E; new blocks B = E - old_len at `area`, then the table.
        let mut entries = (index + 1).max(old_len * 2);
        let (blocks, table_clusters) = loop {
            let table_clusters = (entries * 8).div_ceil(cs);
            let blocks = entries - old_len;
            let needed = (area + blocks + table_clusters).div_ceil(per_block);
            if needed <= entries {
                break (blocks, table_clusters);
            }
            entries = needed;
        };
        let area_end = area + blocks + table_clusters;

        let mut table = rc.table.clone();
        for k in 0..blocks {
            let first = (old_len + k) * per_block;
            let mut block = AlignedBuf::zeroed(cs as usize);
            for cluster in area.max(first)..area_end.min(first + per_block) {
                rc.width.set(&mut block, cluster - first, 1);
            }
            let offset = (area + k) << rc.cluster_bits;
            io.write_at(&block, offset)?;
            rc.blocks.insert(old_len + k, block);
            table.push(offset);
        }
        let table_offset = (area + blocks) << rc.cluster_bits;
        let mut raw = AlignedBuf::zeroed((table_clusters * cs) as usize);
        for (out, entry) in raw.chunks_exact_mut(8).zip(&table) {
            out.copy_from_slice(&entry.to_be_bytes());
        }
        io.write_at(&raw, table_offset)?;
        io.flush()?;

        // Switch the header over in one write, then free the old table.
        let old_offset = rc.table_offset;
        let old_clusters = (old_len * 8).div_ceil(cs);
        let at = field::REFCOUNT_TABLE as usize;
        self.header_chunk[at..at + 8].copy_from_slice(&table_offset.to_be_bytes());
        self.header_chunk[at + 8..at + 12].copy_from_slice(&(table_clusters as u32).to_be_bytes());
        io.write_at(&self.header_chunk, 0)?;
        let rc = &mut self.refcounts;
        rc.table = table;
        rc.table_offset = table_offset;
        rc.file_end = rc.file_end.max(area_end);
        (area..area_end).for_each(|c| self.metadata.insert(c));
        for cluster in 0..old_clusters {
            self.decref((old_offset >> self.refcounts.cluster_bits) + cluster, false);
        }
        Ok(())
    }

    /// Drops one reference to `cluster` once the tables that stopped
    /// naming it are durable (at the next flush); once free, the cluster is
    /// discarded in the file if `discard` says so.
    pub(super) fn decref(&mut self, cluster: u64, discard: bool) {
        self.decrements.push((cluster, discard));
    }

    /// Applies, in memory, the first `n` decrements queued by
    /// [`Meta::decref`]; `io` serves the refcount blocks not cached.
    pub(super) fn apply_decrements(&mut self, io: &mut dyn SyncIo, n: usize) -> io::Result<()> {
        for (cluster, discard) in self.decrements.drain(..n).collect::<Vec<_>>() {
            self.decrement(io, cluster, discard)?;
        }
        Ok(())
    }

    /// Drops one reference to `cluster` now, in memory.
    pub(super) fn decrement(&mut self, io: &mut dyn SyncIo, cluster: u64, discard: bool) -> io::Result<()> {
        let count = self.refcounts.get(io, cluster)?;
        if count == 0 {
            log::error!("qcow2: refcount of cluster {cluster} would drop below zero");
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        self.refcounts.set(io, cluster, count - 1)?;
        if count == 1 {
            // Requests that start from now on cannot reach it; those in
            // flight may, until they are done. A discard is sent once the
            // metadata mutex is dropped (see `writeback`).
            let epoch = self.epochs.current();
            match discard {
                true => self.quarantine.hold_for_discard(epoch, cluster),
                false => self.quarantine.hold(epoch, cluster),
            }
            self.epochs.advance();
            self.metadata.remove(cluster);
            if self.packed >> self.refcounts.cluster_bits == cluster {
                self.packed = 0;
            }
        }
        Ok(())
    }
}
