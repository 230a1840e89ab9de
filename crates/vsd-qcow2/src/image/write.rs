//! Requests that change metadata: allocating writes (with copy-on-write
//! from the backing file, compressed clusters and snapshot-shared
//! clusters), write-zeroes and discard. A write holds the metadata mutex
//! to plan and to link, not across its data I/O; write-zeroes and discard
//! change only metadata, under it (the tables they lack are read without
//! it, see `change`). All fail with [`super::Busy`] if a
//! cluster they touch has an allocation in flight (see `allocate.rs`).

use std::collections::BTreeSet;
use std::io;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::cache::L2Table;
use super::{Allocation, Image, ImageIo, Meta, Piece};
use crate::buf::AlignedBuf;
use crate::entry::{self, COPIED, L2Entry};

/// Copies the request's bytes from offset `at` (relative to the range
/// given) into a buffer.
pub type Fill<'a> = &'a mut dyn FnMut(u64, &mut [u8]);

fn eio(e: impl std::fmt::Display) -> io::Error {
    log::error!("qcow2: {e}");
    io::Error::from_raw_os_error(libc::EIO)
}

impl Image {
    pub(super) fn check_writable(&self) -> io::Result<()> {
        if self.opts.writable { Ok(()) } else { Err(io::Error::from_raw_os_error(libc::EROFS)) }
    }

    /// Writes `len` guest bytes at `offset`, allocating clusters as needed,
    /// in blocking steps: the metadata mutex is held to plan the write
    /// ([`Image::start_write`]) and to link what it allocated, not while
    /// data is read or written. `fill` supplies the bytes. For ranges that
    /// [`Image::map`] reports as in-place data, writing to the host
    /// directly is cheaper.
    pub fn write(&self, io: &mut ImageIo, offset: u64, len: u64, fill: Fill) -> io::Result<()> {
        let mut result = Ok(());
        for piece in self.start_write(io, offset, len)? {
            match piece {
                Piece::InPlace { pos, host, len } if result.is_ok() => {
                    let mut bytes = AlignedBuf::zeroed(len as usize);
                    fill(pos, &mut bytes);
                    result = io.data().write_at(&bytes, host);
                }
                Piece::InPlace { .. } => {}
                Piece::Allocate(mut a) => {
                    let base = a.request_bytes().0 - offset;
                    let written = result.is_ok() && {
                        result = self.fill_and_write(io, &mut a, &mut |at, buf| fill(base + at, buf));
                        result.is_ok()
                    };
                    let linked = self.finish_allocation(io.meta, a, written);
                    result = result.and(linked);
                }
            }
        }
        result
    }

    /// Makes a range read as zeroes, with metadata where it can and by
    /// writing zeroes where it cannot (partial subclusters, version 2
    /// images, raw external data files); with `fast`, where it cannot it
    /// fails with EOPNOTSUPP instead, having changed nothing.
    pub fn write_zeroes(&self, io: &mut ImageIo, offset: u64, len: u64, may_unmap: bool, fast: bool) -> io::Result<()> {
        self.check_writable()?;
        // Checked for the whole range first, so that a busy cluster in the
        // middle does not leave the head done and the rest not.
        self.check_idle(&self.lock(), offset, len)?;
        let zeroes: Fill = &mut |_, buf| buf.fill(0);
        let slow = || io::Error::from_raw_os_error(libc::EOPNOTSUPP);
        if (self.header.version < 3 && !self.layout.extended) || self.raw_data_file() {
            return if fast { Err(slow()) } else { self.write(io, offset, len, zeroes) };
        }
        let unit = 1u64 << self.layout.subcluster_bits();
        let end = offset + len;
        let head_end = offset.next_multiple_of(unit).min(end);
        let tail_start = if end == self.size() { end } else { (end & !(unit - 1)).max(head_end) };
        if fast && (head_end > offset || end > tail_start) {
            return Err(slow());
        }
        if head_end > offset {
            self.write(io, offset, head_end - offset, zeroes)?;
        }
        if tail_start > head_end {
            let mut rewrite = Vec::new();
            self.change(io, head_end, tail_start - head_end, |image, meta, io, cluster, within, n| {
                image.zero_in_cluster(meta, io, (cluster, within, n), may_unmap, &mut rewrite)
            })?;
            // A change made again (see `change`) names its parts again.
            rewrite.sort_unstable();
            rewrite.dedup();
            for (at, n) in rewrite {
                self.write(io, at, n, zeroes)?;
            }
        }
        if end > tail_start { self.write(io, tail_start, end - tail_start, zeroes) } else { Ok(()) }
    }

    /// Discards the whole clusters of a range as QEMU does for a guest
    /// discard: they read as zeroes afterwards (or, in version 2 images
    /// without a backing file, become unallocated) and, unless
    /// `discard-no-unref` is set, are freed.
    pub fn discard(&self, io: &mut ImageIo, offset: u64, len: u64) -> io::Result<()> {
        self.check_writable()?;
        let cs = self.cluster_size();
        let start = offset.next_multiple_of(cs);
        let end = if offset + len == self.size() { offset + len } else { (offset + len) & !(cs - 1) };
        if end <= start {
            return Ok(());
        }
        if self.raw_data_file() {
            // The data file must stay a valid raw image: what now reads as
            // zeroes is zeroes there too.
            return self.write(io, start, end - start, &mut |_, buf| buf.fill(0));
        }
        self.change(io, start, end - start, |image, meta, io, cluster, _, _| image.discard_cluster(meta, io, cluster))
    }

    /// Changes the metadata of each cluster of a range with `f(self, meta,
    /// io, cluster, offset within it, length)`, under the metadata mutex.
    /// A table slice or refcount block the change needs and the cache
    /// lacks is read without the mutex, and the change made again (each
    /// cluster's is idempotent): a few times, then loading under the mutex,
    /// so that other writers evicting what this one loads cannot keep it
    /// from progressing.
    fn change(
        &self,
        io: &mut ImageIo,
        offset: u64,
        len: u64,
        mut f: impl FnMut(&Self, &mut Meta, &mut ImageIo, u64, u64, u64) -> io::Result<()>,
    ) -> io::Result<()> {
        self.loading_apart(io, |io, may_load| {
            let mut meta = self.lock();
            self.check_idle(&meta, offset, len)?;
            self.prepare_change(&mut meta, io)?;
            meta.refcounts.may_load = may_load;
            let result = self
                .for_each_cluster(offset, len, |image, cluster, within, n| f(image, &mut meta, io, cluster, within, n));
            meta.refcounts.may_load = true;
            self.note_dirty(&meta);
            result
        })
    }

    /// Calls `f(self, cluster, offset within it, length)` for each cluster
    /// of a range.
    pub(super) fn for_each_cluster(
        &self,
        offset: u64,
        len: u64,
        mut f: impl FnMut(&Self, u64, u64, u64) -> io::Result<()>,
    ) -> io::Result<()> {
        let cs = self.cluster_size();
        let mut pos = offset;
        while pos < offset + len {
            let cluster = pos & !(cs - 1);
            let end = (cluster + cs).min(offset + len);
            f(self, cluster, pos - cluster, end - pos)?;
            pos = end;
        }
        Ok(())
    }

    /// The external data file is a raw image in its own right, which every
    /// change must keep true.
    pub(super) fn raw_data_file(&self) -> bool {
        self.header.autoclear & crate::header::autoclear::DATA_FILE_RAW != 0
    }

    /// Subclusters `within..within + n` of a cluster, as a bitmask.
    pub(super) fn touched(&self, within: u64, n: u64) -> u32 {
        let scb = self.layout.subcluster_bits();
        let (first, last) = (within >> scb, (within + n - 1) >> scb);
        let bits = (last - first + 1) as u32;
        (if bits == 32 { u32::MAX } else { (1 << bits) - 1 }) << first
    }

    pub(super) fn all_subclusters(&self) -> u32 {
        if self.layout.extended { u32::MAX } else { 1 }
    }

    /// An allocation's new contents (old bytes read, the request's put
    /// in), written at its host cluster.
    fn fill_and_write(&self, io: &mut ImageIo, a: &mut Allocation, fill: Fill) -> io::Result<()> {
        self.read_old_bytes(io, a)?;
        a.put_request_bytes(fill);
        match a.to_write() {
            Some((bytes, host)) => io.data().write_at(bytes, host),
            None => {
                let (_, host, n) = a.request_bytes();
                let mut bytes = AlignedBuf::zeroed(n as usize);
                fill(0, &mut bytes);
                io.data().write_at(&bytes, host)
            }
        }
    }

    /// Drops the references an entry held, after the table stopped naming
    /// them.
    pub(super) fn release(&self, meta: &mut Meta, old: &L2Entry) {
        self.unreference(meta, old, self.opts.pass_discard);
    }

    /// Drops the references entry `old` holds; clusters left free are
    /// discarded in the file if `discard` says so.
    pub(super) fn unreference(&self, meta: &mut Meta, old: &L2Entry, discard: bool) {
        let cb = self.header.cluster_bits;
        if let Some((host, len)) = old.compressed {
            for cluster in (host >> cb)..=((host + len - 1) >> cb) {
                meta.decref(cluster, discard);
            }
        } else if let Some(host) = old.host
            && !self.layout.data_file
        {
            meta.decref(host >> cb, discard);
        }
    }

    /// Makes bytes `within..within + n` of guest `cluster` read as zeroes
    /// with metadata. Part of a compressed cluster cannot be: its guest
    /// range goes to `rewrite`, for the caller to write zeroes to once the
    /// metadata mutex is dropped (the cluster is decompressed into one of
    /// its own, which is I/O).
    fn zero_in_cluster(
        &self,
        meta: &mut Meta,
        io: &mut ImageIo,
        (cluster, within, n): (u64, u64, u64),
        may_unmap: bool,
        rewrite: &mut Vec<(u64, u64)>,
    ) -> io::Result<()> {
        let (table, index, old) = self.entry_for_write(meta, io, cluster)?;
        let touched = self.touched(within, n);
        let whole = touched == self.all_subclusters();
        let owned = old.host.is_some() && old.copied;
        // `discard-no-unref` keeps the cluster of an unmapping zeroing, as
        // it does a discard's.
        let keep = self.opts.discard_no_unref && old.host.is_some();
        let new = if whole && (may_unmap || !owned) && !keep {
            L2Entry { zero: touched, ..L2Entry::UNALLOCATED }
        } else if old.compressed.is_some() {
            rewrite.push((cluster + within, n));
            return Ok(());
        } else {
            // Keep the allocation (or the other subclusters' state).
            L2Entry { alloc: old.alloc & !touched, zero: old.zero | touched, ..old }
        };
        if new != old {
            self.set_l2(meta, &table, index, &new)?;
        }
        if new.host != old.host || new.compressed != old.compressed {
            self.release(meta, &old);
        } else if keep && whole && may_unmap {
            self.discard_kept(io, &old);
        }
        Ok(())
    }

    /// Drops from the file the data of a cluster `discard-no-unref` keeps,
    /// if `pass-discard-request` asks, unless a snapshot shares the cluster
    /// (its bytes are the snapshot's too).
    fn discard_kept(&self, io: &mut ImageIo, old: &L2Entry) {
        if let Some(host) = old.host.filter(|_| self.opts.pass_discard && old.copied) {
            let _ = io.data().discard(host, self.cluster_size());
        }
    }

    fn discard_cluster(&self, meta: &mut Meta, io: &mut ImageIo, cluster: u64) -> io::Result<()> {
        let (table, index, old) = self.entry_for_write(meta, io, cluster)?;
        let keep = self.opts.discard_no_unref && self.header.version >= 3 && old.compressed.is_none();
        let allocated = old.host.is_some() || old.compressed.is_some();
        let new = if (self.has_backing() || allocated) && (self.header.version >= 3 || self.layout.extended) {
            let (host, copied) = if keep { (old.host, old.copied) } else { (None, false) };
            L2Entry { host, copied, compressed: None, alloc: 0, zero: self.all_subclusters() }
        } else {
            L2Entry::UNALLOCATED
        };
        if new != old {
            self.set_l2(meta, &table, index, &new)?;
        }
        match old.host {
            Some(_) if keep => {
                self.discard_kept(io, &old);
                Ok(())
            }
            _ => {
                self.release(meta, &old);
                Ok(())
            }
        }
    }

    /// The L2 table mapping guest `cluster` (made changeable), the
    /// cluster's index in it, and its current entry.
    pub(super) fn entry_for_write(
        &self,
        meta: &mut Meta,
        io: &mut ImageIo,
        cluster: u64,
    ) -> io::Result<(Arc<L2Table>, usize, L2Entry)> {
        let (table, index) = self.l2_for_write(meta, io, cluster)?;
        let entry = self.entry(&table, index).ok_or_else(super::unloaded_slice)?.map_err(eio)?;
        Ok((table, index, entry))
    }

    /// The L2 table mapping guest `cluster`, allocated or copied so that it
    /// may be changed, and the cluster's index in it.
    fn l2_for_write(&self, meta: &mut Meta, io: &mut ImageIo, cluster: u64) -> io::Result<(Arc<L2Table>, usize)> {
        let cs = self.cluster_size();
        let span_bits = self.header.cluster_bits + self.l2_bits();
        let l1_index = (cluster >> span_bits) as usize;
        let index = ((cluster >> self.header.cluster_bits) & (self.header.l2_entries() - 1)) as usize;
        let l1_entry = self.l1[l1_index].load(Ordering::Acquire);
        let table = match entry::l1(l1_entry, cs).map_err(eio)? {
            Some((offset, true)) => {
                let slice = self.slice_of(index);
                return Ok((self.load_l2(meta, io.meta, offset, slice..slice + 1)?, index));
            }
            Some((offset, false)) => {
                // Shared with a snapshot: copy it, then drop our reference.
                let old = self.load_l2(meta, io.meta, offset, self.all_slices())?;
                let new_offset = meta.alloc(io.meta, 1)?;
                Arc::new(old.copy_to(new_offset).ok_or_else(super::unloaded_slice)?)
            }
            None => Arc::new(L2Table::empty(meta.alloc(io.meta, 1)?, cs as usize, self.slice_bytes)),
        };
        meta.metadata.insert(table.offset / cs);
        // All of it is written by the next flush, before the L1 entry.
        let chunk = self.chunk_of(0..8).len();
        let dirty = &mut meta.dirty_l2.entry(table.offset).or_insert_with(|| (table.clone(), BTreeSet::new())).1;
        dirty.extend((0..table.len()).step_by(chunk));
        self.l2.insert(table.clone());
        self.set_l1(meta, l1_index, table.offset | COPIED);
        if let Ok(Some((old_offset, _))) = entry::l1(l1_entry, cs) {
            self.l2.remove(old_offset);
            meta.decref(old_offset / cs, false);
        }
        self.tables_written();
        Ok((table, index))
    }

    /// The page (or cluster, if smaller) that holds a metadata byte range.
    pub(super) fn chunk_of(&self, range: std::ops::Range<usize>) -> std::ops::Range<usize> {
        let chunk = self.cluster_size().min(4096) as usize;
        let start = range.start / chunk * chunk;
        start..start + chunk
    }

    /// Changes an L2 entry in memory; the next flush writes it.
    pub(super) fn set_l2(&self, meta: &mut Meta, table: &Arc<L2Table>, index: usize, e: &L2Entry) -> io::Result<()> {
        let chunk = self.chunk_of(table.set(&self.layout, index, e).ok_or_else(super::unloaded_slice)?);
        meta.dirty_l2.entry(table.offset).or_insert_with(|| (table.clone(), BTreeSet::new())).1.insert(chunk.start);
        Ok(())
    }

    /// Changes an L1 entry in memory; the next flush writes it.
    pub(super) fn set_l1(&self, meta: &mut Meta, index: usize, value: u64) {
        self.l1[index].store(value, Ordering::Release);
        meta.dirty_l1.insert(self.chunk_of(index * 8..index * 8 + 8).start);
    }

    /// The on-disk bytes of the L1 table chunk starting at `start`.
    pub(super) fn l1_chunk(&self, start: usize) -> AlignedBuf {
        let mut buf = AlignedBuf::zeroed(self.chunk_of(start..start + 8).len());
        for (out, i) in buf.chunks_exact_mut(8).zip(start / 8..) {
            let word = self.l1.get(i).map_or(0, |w| w.load(Ordering::Relaxed));
            out.copy_from_slice(&word.to_be_bytes());
        }
        buf
    }
}
