//! Cluster allocation, synchronous or with the data write left to the
//! caller.
//!
//! A write into a cluster this image does not own yet (unallocated, zero,
//! compressed, or shared with a snapshot) gets a new host cluster, filled
//! with the guest's bytes and, around them, what the cluster read as
//! before; once that is written, the L2 entry is switched to it. When the
//! cluster read as zeroes around the write and the new one lies past
//! everything the file ever held (it reads as zeroes already), only the
//! guest's bytes are written, straight from the request's buffers: a
//! fresh image filled by small random writes writes each once, not a
//! whole cluster around each. The synchronous path ([`Image::write`])
//! does it all under the metadata mutex. [`Image::start_write`] only
//! takes the clusters and says where their old bytes are
//! ([`Allocation::kept`]): the caller reads those and writes the new
//! contents asynchronously, as data requests among the others, with the
//! mutex free, so that allocating writes (a fresh image being filled, an
//! overlay copying up from its backing file) keep the device's queue full
//! rather than going one at a time.
//!
//! While an allocation is in flight its table entry is unchanged: reads
//! see what the cluster held before, which is what the new contents hold
//! outside the write's own bytes. Any request that would change the
//! cluster's metadata meanwhile (another allocating write, an overwrite of
//! part of it, write-zeroes, discard) fails with [`Busy`] and is retried
//! once an allocation finishes ([`Image::wake_after`]): otherwise two
//! allocations of one cluster would race, and one write would be lost
//! with its cluster leaked. For the same reason the old bytes stay where
//! [`Allocation::kept`] says until the allocation is finished.

use std::io;
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::Waker;

use super::{Image, ImageIo, Meta};
use crate::SyncIo;
use crate::buf::{ALIGN, AlignedBuf};
use crate::entry::{L2Entry, Subcluster};

use super::write::Fill;

/// A request touched a cluster whose allocation is in flight: retry it
/// after [`Image::wake_after`] says one finished.
#[derive(Debug, thiserror::Error)]
#[error("a cluster of the range is being allocated")]
pub struct Busy;

impl Busy {
    /// Whether `e` is this error.
    pub fn is(e: &io::Error) -> bool {
        e.get_ref().is_some_and(|inner| inner.is::<Busy>())
    }
}

/// Where some of a cluster's old bytes are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    /// In the data file, from this offset.
    Data(u64),
    /// Below this image (the backing file's bytes, zeroes past its end),
    /// from this guest offset.
    Below(u64),
    /// A compressed cluster in the image file: all of the cluster's bytes.
    Compressed {
        /// Where its compressed bytes start.
        host: u64,
        /// How many there are.
        len: u64,
    },
}

impl Origin {
    /// Where the bytes `n` further on are, if they follow these.
    fn advanced(self, n: u64) -> Option<Origin> {
        match self {
            Origin::Data(host) => Some(Origin::Data(host + n)),
            Origin::Below(guest) => Some(Origin::Below(guest + n)),
            Origin::Compressed { .. } => None,
        }
    }
}

/// Bytes `at..at + len` of a new cluster's contents, to be read from
/// `source` (the contents start as zeroes: zero subclusters need nothing).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OldBytes {
    /// Where they go in the contents.
    pub at: u64,
    /// How many there are.
    pub len: u64,
    /// Where they are read from.
    pub source: Origin,
}

/// A part of a write, as [`Image::start_write`] plans it.
pub enum Piece {
    /// Bytes the image owns already, written where they are.
    InPlace {
        /// The first, counted from the request's start.
        pos: u64,
        /// Where it goes in the data file.
        host: u64,
        /// How many there are.
        len: u64,
    },
    /// A cluster, or subclusters of one, being allocated.
    Allocate(Allocation),
}

/// A new host cluster for a guest cluster, or subclusters of a cluster
/// this image owns being allocated, with the new contents; not linked
/// into the L2 table yet.
pub struct Allocation {
    /// The guest cluster (byte offset).
    cluster: u64,
    /// The L2 table mapping it (its offset in the image file; the table
    /// stays owned by this image, but may leave the cache meanwhile).
    table: u64,
    index: usize,
    old: L2Entry,
    new: L2Entry,
    /// Where the cluster is in the data file (the image file unless the
    /// image has an external data file).
    pub host: u64,
    /// Whether `host` is new: the cluster holds a reference to give back
    /// if unused, and the old entry's to drop once linked.
    fresh: bool,
    /// The bytes of the contents to write (at the same offset from
    /// `host`): the whole cluster, or the subclusters being allocated.
    span: Range<u64>,
    /// The cluster's new contents, to write at `host`
    /// ([`Allocation::to_write`]); `None` when only the request's own
    /// bytes need writing ([`Allocation::request_bytes`]).
    /// They start as zeroes: the caller reads [`Allocation::kept`] into
    /// them, then puts the request's bytes in
    /// ([`Allocation::put_request_bytes`]).
    pub contents: Option<AlignedBuf>,
    /// The cluster's old bytes that the new contents keep.
    pub kept: Vec<OldBytes>,
    /// The request's bytes in the cluster: from `within`, `len` of them.
    within: u64,
    len: u64,
}

impl Allocation {
    /// New contents for all of guest `cluster` (found at `index` of `table`,
    /// mapped by `old`), linked as `new` (whose host is where they go; a
    /// new cluster if `fresh`): zeroes, until `kept` is read in and the
    /// caller puts its bytes in.
    pub(super) fn whole_cluster(
        cluster: u64,
        (table, index, old): (u64, usize, L2Entry),
        new: L2Entry,
        fresh: bool,
        kept: Vec<OldBytes>,
        cluster_size: u64,
    ) -> Self {
        let host = new.host.expect("a cluster to write the contents to");
        let contents = Some(AlignedBuf::zeroed(cluster_size as usize));
        let span = 0..cluster_size;
        Allocation { cluster, table, index, old, new, host, fresh, span, contents, kept, within: 0, len: cluster_size }
    }

    /// Compressed bytes, `len` of them at `host`, for all of guest
    /// `cluster` (found at `index` of `table`, mapped by `old`): the caller
    /// writes them.
    pub(super) fn compressed(cluster: u64, (table, index, old): (u64, usize, L2Entry), host: u64, len: u64) -> Self {
        let new = L2Entry { compressed: Some((host, len)), ..L2Entry::UNALLOCATED };
        let (span, contents, kept) = (0..0, None, Vec::new());
        Allocation { cluster, table, index, old, new, host, fresh: true, span, contents, kept, within: 0, len }
    }

    /// The request's bytes this allocation holds: the guest offset of the
    /// first, where it goes in the data file, and how many there are.
    pub fn request_bytes(&self) -> (u64, u64, u64) {
        (self.cluster + self.within, self.host + self.within, self.len)
    }

    /// What of the contents is to be written, and where in the data file.
    pub fn to_write(&self) -> Option<(&[u8], u64)> {
        let contents = self.contents.as_ref()?;
        Some((&contents[self.span.start as usize..self.span.end as usize], self.host + self.span.start))
    }

    /// Copies the request's bytes into the contents, over the old ones:
    /// `fill(0, ..)` supplies the first of them. Nothing to do without
    /// contents.
    pub fn put_request_bytes(&mut self, fill: Fill) {
        if let Some(contents) = &mut self.contents {
            fill(0, &mut contents[self.within as usize..(self.within + self.len) as usize]);
        }
    }
}

impl Image {
    /// Starts a write: its bytes in clusters this image owns go in place
    /// ([`Piece::InPlace`]); each other cluster gets a host cluster (or
    /// its touched subclusters get allocated) and is marked in flight
    /// ([`Piece::Allocate`]). For every allocation the caller reads its
    /// [`Allocation::kept`] bytes into its contents, puts the request's
    /// bytes in ([`Allocation::put_request_bytes`]), writes
    /// [`Allocation::to_write`] (or, without contents, the request's
    /// [`Allocation::request_bytes`]), then hands it to
    /// [`Image::finish_allocation`] (which it must, written or not: until
    /// then the cluster stays in flight). No data, table or refcount block
    /// is read or written under the metadata mutex (but as
    /// [`Image::loading_apart`] says).
    ///
    /// Fails with [`Busy`] if a cluster of the range is in flight.
    pub fn start_write(&self, io: &mut ImageIo, offset: u64, len: u64) -> io::Result<Vec<Piece>> {
        self.loading_apart(io, |io, may_load| self.begin_write(io, offset, len, may_load))
    }

    /// [`Image::start_write`] that reads no refcount block under the
    /// metadata mutex: an allocation that would scan one the cache lacks
    /// fails with [`NeedsLoad`](crate::NeedsLoad), having changed nothing; load it and try
    /// again.
    pub fn try_start_write(&self, io: &mut ImageIo, offset: u64, len: u64) -> io::Result<Vec<Piece>> {
        self.begin_write(io, offset, len, false)
    }

    fn begin_write(&self, io: &mut ImageIo, offset: u64, len: u64, may_load: bool) -> io::Result<Vec<Piece>> {
        self.check_writable()?;
        let mut meta = self.lock();
        self.check_idle(&meta, offset, len)?;
        self.prepare_change(&mut meta, io)?;
        meta.refcounts.may_load = may_load;
        let result = self.plan_write(&mut meta, io, offset, len);
        meta.refcounts.may_load = true;
        if let Ok(pieces) = &result {
            for piece in pieces {
                if let Piece::Allocate(a) = piece {
                    meta.allocating.insert(a.cluster);
                }
            }
        }
        self.note_dirty(&meta);
        result
    }

    fn plan_write(&self, meta: &mut Meta, io: &mut ImageIo, offset: u64, len: u64) -> io::Result<Vec<Piece>> {
        let mut found = Vec::new();
        self.for_each_cluster(offset, len, |image, cluster, within, n| {
            let (table, index, old) = image.entry_for_write(meta, io, cluster)?;
            found.push((cluster, within, n, table.offset, index, old));
            Ok(())
        })?;
        let mut pieces = Vec::with_capacity(found.len());
        for (cluster, within, n, table, index, old) in found {
            match self.plan_cluster(meta, io, (cluster, within, n), (table, index, old)) {
                Ok(Piece::InPlace { host, len, .. }) => {
                    pieces.push(Piece::InPlace { pos: cluster + within - offset, host, len })
                }
                Ok(piece) => pieces.push(piece),
                Err(e) => {
                    for piece in pieces {
                        if let Piece::Allocate(a) = piece {
                            self.give_back(meta, &a);
                        }
                    }
                    return Err(e);
                }
            }
        }
        Ok(pieces)
    }

    /// How bytes `within..within + n` of guest `cluster` (found at `index`
    /// of `table`, mapped by `old`) are written; an in-place piece's `pos`
    /// is left to the caller.
    fn plan_cluster(
        &self,
        meta: &mut Meta,
        io: &mut ImageIo,
        (cluster, within, n): (u64, u64, u64),
        (table, index, old): (u64, usize, L2Entry),
    ) -> io::Result<Piece> {
        let Some(host) = old.host.filter(|_| old.copied) else {
            return self.allocate(meta, io, (cluster, within, n), (table, index, old)).map(Piece::Allocate);
        };
        if self.write_hits_metadata(host, self.cluster_size()) {
            let what = format!("guest cluster {cluster:#x} maps onto metadata at {host:#x}");
            return Err(crate::CorruptMetadata(what).into());
        }
        let touched = self.touched(within, n);
        if old.alloc & touched == touched {
            return Ok(Piece::InPlace { pos: 0, host: host + within, len: n });
        }
        Ok(Piece::Allocate(self.allocate_subclusters((cluster, within, n), (table, index, old), host)))
    }

    /// Allocates the subclusters of an owned cluster (at `host`) that bytes
    /// `within..within + n` touch: each is written whole, with zeroes or
    /// the bytes below around the request's, but for an allocated one at
    /// either end, where only the request's bytes are written.
    fn allocate_subclusters(
        &self,
        (cluster, within, n): (u64, u64, u64),
        (table, index, old): (u64, usize, L2Entry),
        host: u64,
    ) -> Allocation {
        let scb = self.layout.subcluster_bits();
        let scs = 1u64 << scb;
        let (first, last) = (within >> scb, (within + n - 1) >> scb);
        let state = |sc: u64| old.subcluster(sc as u32, scb);
        let data = |sc| matches!(state(sc), Subcluster::Data(_));
        let start = if data(first) { within } else { first << scb };
        let end = if data(last) { within + n } else { (last + 1) << scb };
        let mut kept = Vec::new();
        // Only the subclusters at the ends can be partly the request's.
        for sc in [Some(first), (last != first).then_some(last)].into_iter().flatten() {
            let at = sc << scb;
            let partial = at < within || at + scs > within + n;
            if partial && state(sc) == Subcluster::Unallocated && self.has_backing() {
                kept.push(OldBytes { at, len: scs, source: Origin::Below(cluster + at) });
            }
        }
        let touched = self.touched(within, n);
        let new = L2Entry { alloc: old.alloc | touched, zero: old.zero & !touched, ..old };
        let contents = Some(AlignedBuf::zeroed(self.cluster_size() as usize));
        Allocation {
            cluster,
            table,
            index,
            old,
            new,
            host,
            fresh: false,
            span: start..end,
            contents,
            kept,
            within,
            len: n,
        }
    }

    /// Ends an allocation from [`Image::start_write`]: links it into its
    /// table if its contents were `written`, else gives its cluster back;
    /// either way the cluster is no longer in flight. `io` is the image
    /// file, for reloading the table if it left the cache.
    pub fn finish_allocation(&self, io: &mut dyn SyncIo, allocation: Allocation, written: bool) -> io::Result<()> {
        let mut meta = self.lock();
        let result = if written { self.link(&mut meta, io, &allocation) } else { Ok(()) };
        if !written || result.is_err() {
            self.give_back(&mut meta, &allocation);
        }
        meta.allocating.remove(&allocation.cluster);
        self.finished.fetch_add(1, Ordering::Release);
        for waker in meta.waiters.drain(..) {
            waker.wake();
        }
        self.note_dirty(&meta);
        result
    }

    /// How many allocations have finished so far: read it before a request
    /// that may fail with [`Busy`], and pass it to [`Image::wake_after`].
    pub fn allocations_finished(&self) -> u64 {
        self.finished.load(Ordering::Acquire)
    }

    /// Wakes `waker` once an allocation finishes after `seen` of them had
    /// (at once if one already has): for a request that failed with
    /// [`Busy`].
    pub fn wake_after(&self, seen: u64, waker: &Waker) {
        let mut meta = self.lock();
        if self.finished.load(Ordering::Acquire) != seen {
            drop(meta);
            waker.wake_by_ref();
        } else if !meta.waiters.iter().any(|w| w.will_wake(waker)) {
            meta.waiters.push(waker.clone());
        }
    }

    /// Fails with [`Busy`] if an allocation of a cluster of the range is in
    /// flight.
    pub(super) fn check_idle(&self, meta: &Meta, offset: u64, len: u64) -> io::Result<()> {
        if meta.allocating.is_empty() {
            return Ok(());
        }
        let cs = self.cluster_size();
        let busy = (offset & !(cs - 1)..offset + len).step_by(cs as usize).any(|c| meta.allocating.contains(&c));
        if busy { Err(io::Error::other(Busy)) } else { Ok(()) }
    }

    /// A host cluster for guest `cluster` (found at `index` of `table`,
    /// mapped by `old`) that bytes `within..within + n` are to be written
    /// into, and what its contents keep of the old ones.
    pub(super) fn allocate(
        &self,
        meta: &mut Meta,
        io: &mut ImageIo,
        (cluster, within, n): (u64, u64, u64),
        (table, index, old): (u64, usize, L2Entry),
    ) -> io::Result<Allocation> {
        let aligned = within.is_multiple_of(ALIGN as u64) && n.is_multiple_of(ALIGN as u64);
        let keeps_old = !(aligned && !self.layout.data_file && self.zero_around(&old, within, n));
        let fresh_from = meta.fresh_from();
        let host = if self.layout.data_file { cluster } else { meta.alloc(io.meta, 1)? };
        // Reused file space may hold old bytes: then the zeroes are written too.
        let contents = (keeps_old || host < fresh_from).then(|| AlignedBuf::zeroed(self.cluster_size() as usize));
        let kept = if keeps_old { self.old_bytes(&old, cluster, (within, n)) } else { Vec::new() };
        let touched = self.touched(within, n);
        let (alloc, zero) = match old.compressed {
            Some(_) => (self.all_subclusters(), 0),
            None => (old.alloc | touched, old.zero & !touched),
        };
        let new = L2Entry { host: Some(host), copied: true, compressed: None, alloc, zero };
        let span = 0..self.cluster_size();
        Ok(Allocation { cluster, table, index, old, new, host, fresh: true, span, contents, kept, within, len: n })
    }

    /// Where the bytes of a cluster mapped by `e` are, but for zeroes and
    /// the subclusters wholly inside `skip` (about to be overwritten).
    pub(super) fn old_bytes(&self, e: &L2Entry, cluster: u64, skip: (u64, u64)) -> Vec<OldBytes> {
        if let Some((host, len)) = e.compressed {
            return vec![OldBytes { at: 0, len: self.cluster_size(), source: Origin::Compressed { host, len } }];
        }
        let scb = self.layout.subcluster_bits();
        let scs = 1u64 << scb;
        let mut parts: Vec<OldBytes> = Vec::new();
        for sc in 0..self.layout.subclusters() {
            let at = u64::from(sc) << scb;
            if at >= skip.0 && at + scs <= skip.0 + skip.1 {
                continue;
            }
            let source = match e.subcluster(sc, scb) {
                Subcluster::Data(host) => Origin::Data(host),
                Subcluster::Unallocated if self.has_backing() => Origin::Below(cluster + at),
                _ => continue,
            };
            match parts.last_mut() {
                Some(last) if last.at + last.len == at && last.source.advanced(last.len) == Some(source) => {
                    last.len += scs
                }
                _ => parts.push(OldBytes { at, len: scs, source }),
            }
        }
        parts
    }

    /// Reads an allocation's old bytes into its contents, synchronously.
    pub(super) fn read_old_bytes(&self, io: &mut ImageIo, a: &mut Allocation) -> io::Result<()> {
        let Some(contents) = &mut a.contents else { return Ok(()) };
        for part in &a.kept {
            let buf = &mut contents[part.at as usize..(part.at + part.len) as usize];
            match part.source {
                Origin::Data(host) => io.data().read_at(buf, host)?,
                Origin::Below(guest) => io.read_below(buf, guest)?,
                Origin::Compressed { host, len } => self.read_compressed(io.meta, host, len, buf)?,
            }
        }
        Ok(())
    }

    /// Whether a cluster mapped by `old` reads as zeroes outside bytes
    /// `within..within + n`.
    fn zero_around(&self, old: &L2Entry, within: u64, n: u64) -> bool {
        if old.host.is_some() || old.compressed.is_some() {
            return false;
        }
        if !self.has_backing() {
            return true;
        }
        // Over a backing file only subclusters flagged zero read as zeroes.
        let scb = self.layout.subcluster_bits();
        let scs = 1u64 << scb;
        (0..self.layout.subclusters()).all(|sc| {
            let start = u64::from(sc) * scs;
            let covered = start >= within && start + scs <= within + n;
            covered || old.subcluster(sc, scb) == Subcluster::Zero
        })
    }

    /// Points the table entry at the allocation's cluster (its contents
    /// written) and drops the references the old entry held.
    pub(super) fn link(&self, meta: &mut Meta, io: &mut dyn SyncIo, a: &Allocation) -> io::Result<()> {
        let slice = self.slice_of(a.index);
        let table: Arc<_> = self.load_l2(meta, io, a.table, slice..slice + 1)?;
        self.set_l2(meta, &table, a.index, &a.new)?;
        if a.fresh {
            self.release(meta, &a.old);
        }
        Ok(())
    }

    /// Returns an allocation's cluster (or compressed bytes) unused.
    pub(super) fn give_back(&self, meta: &mut Meta, a: &Allocation) {
        if a.fresh {
            self.unreference(meta, &a.new, false);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;
    use std::task::Wake;

    use super::*;
    use crate::mem::MemFile;
    use crate::{Mapping, Options};

    const KIB: u64 = 1024;
    const MIB: u64 = 1024 * KIB;

    /// A new 4 MiB image with 64 KiB clusters, made by qemu-img, in memory.
    fn fresh_image(name: &str) -> (Image, MemFile) {
        let mut file = MemFile::made_by_qemu_img(name, "4M");
        let len = file.bytes.len() as u64;
        let opts = Options { writable: true, ..Options::default() };
        (Image::open(&mut file, len, opts).unwrap(), file)
    }

    fn io(file: &mut MemFile) -> ImageIo<'_> {
        ImageIo { meta: file, data: None, backing: None }
    }

    #[derive(Default)]
    struct Count(AtomicUsize);

    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn map(image: &Image, file: &mut MemFile, offset: u64) -> Mapping {
        image.map(&mut Default::default(), file, offset, 512).unwrap().mapping
    }

    /// The allocations of a write that has no bytes in place.
    fn allocations(pieces: Vec<Piece>) -> Vec<Allocation> {
        let allocation = |piece| match piece {
            Piece::Allocate(a) => a,
            Piece::InPlace { .. } => panic!("a piece in place"),
        };
        pieces.into_iter().map(allocation).collect()
    }

    /// Writes an allocation's contents, or the request bytes `byte` fills.
    fn write_out(file: &mut MemFile, a: &mut Allocation, byte: u8) {
        assert!(a.kept.is_empty(), "nothing to read on a fresh image");
        a.put_request_bytes(&mut |_, buf| buf.fill(byte));
        match &a.contents {
            Some(contents) => file.write_at(contents, a.host).unwrap(),
            None => file.write_at(&vec![byte; a.request_bytes().2 as usize], a.request_bytes().1).unwrap(),
        }
    }

    fn read(image: &Image, file: &mut MemFile, offset: u64, len: usize) -> Vec<u8> {
        let Mapping::Data { host, .. } = image.map(&mut Default::default(), file, offset, len as u64).unwrap().mapping
        else {
            panic!("not data at {offset:#x}");
        };
        let mut buf = vec![0; len];
        file.read_at(&mut buf, host).unwrap();
        buf
    }

    #[test]
    fn a_cluster_in_flight_holds_back_changes_to_it_until_it_is_linked() {
        let (image, mut file) = fresh_image("inflight");
        let data = |_, buf: &mut [u8]| buf.fill(0xa5);
        // Not 4 KiB aligned: the whole cluster is written.
        let mut started = allocations(image.start_write(&mut io(&mut file), 8 * KIB + 512, 4 * KIB).unwrap());
        assert_eq!(started.len(), 1);
        let mut a = started.pop().unwrap();
        a.put_request_bytes(&mut { data });
        let contents = a.contents.as_ref().expect("a whole cluster");
        assert_eq!(&contents[8 * 1024 + 512..12 * 1024 + 512], &[0xa5; 4096][..], "the write's bytes");
        assert!(contents[..8704].iter().chain(&contents[12800..]).all(|&b| b == 0), "zeroes around");

        // Every change to the cluster waits; another cluster does not.
        let busy = |r: io::Result<()>| r.is_err_and(|e| Busy::is(&e));
        assert!(busy(image.start_write(&mut io(&mut file), 0, 4 * KIB).map(drop)));
        assert!(busy(image.write(&mut io(&mut file), 60 * KIB, 8 * KIB, &mut { data })), "straddling into it");
        assert!(busy(image.write_zeroes(&mut io(&mut file), 0, 4 * KIB, true, false)));
        assert!(busy(image.discard(&mut io(&mut file), 0, 64 * KIB)));
        let other = allocations(image.start_write(&mut io(&mut file), 64 * KIB, 4 * KIB).unwrap());

        // Reads see the old contents until the allocation is linked; the
        // waiting requests are woken then, and only then.
        assert_eq!(map(&image, &mut file, 8 * KIB), Mapping::Unallocated);
        let count = Arc::new(Count::default());
        let waker = Waker::from(count.clone());
        image.wake_after(image.allocations_finished(), &waker);
        assert_eq!(count.0.load(Ordering::SeqCst), 0);
        write_out(&mut file, &mut a, 0xa5);
        let host = a.host;
        image.finish_allocation(&mut file, a, true).unwrap();
        assert_eq!(count.0.load(Ordering::SeqCst), 1, "woken once the allocation finished");
        assert_eq!(map(&image, &mut file, 8 * KIB), Mapping::Data { host: host + 8 * KIB, in_place: true });
        image.write(&mut io(&mut file), 0, 4 * KIB, &mut { data }).unwrap();

        // A late registration for what already finished wakes at once.
        let seen = image.allocations_finished() - 1;
        image.wake_after(seen, &waker);
        assert_eq!(count.0.load(Ordering::SeqCst), 2);
        for a in other {
            image.finish_allocation(&mut file, a, false).unwrap();
        }
    }

    /// An aligned write into a cluster that read as zeroes, allocated past
    /// all the file ever held, writes only its own bytes; the rest of the
    /// cluster reads as zeroes from the file.
    #[test]
    fn a_fresh_cluster_gets_only_the_request_bytes() {
        let (image, mut file) = fresh_image("fresh");
        let a = allocations(image.start_write(&mut io(&mut file), 128 * KIB + 8 * KIB, 4 * KIB).unwrap());
        let mut a = a.into_iter().next().unwrap();
        assert!(a.contents.is_none(), "no contents to write");
        assert_eq!(a.request_bytes(), (136 * KIB, a.host + 8 * KIB, 4 * KIB));
        write_out(&mut file, &mut a, 0x3c);
        image.finish_allocation(&mut file, a, true).unwrap();
        let got = read(&image, &mut file, 128 * KIB, 64 * 1024);
        assert!(
            got[..8192].iter().chain(&got[12288..]).all(|&b| b == 0) && got[8192..12288].iter().all(|&b| b == 0x3c)
        );
    }

    /// A free cluster inside the file (freed by QEMU, reused after reopening)
    /// may hold old bytes: the whole cluster is written, zeroes included.
    #[test]
    fn reused_file_space_gets_its_zeroes_written() {
        let path = std::env::temp_dir().join(format!("vsd-qcow2-reused-{}.qcow2", std::process::id()));
        let qemu =
            |args: &[&str]| assert!(std::process::Command::new(args[0]).args(&args[1..]).status().unwrap().success());
        let image_path = path.to_str().unwrap();
        qemu(&["qemu-img", "create", "-q", "-f", "qcow2", image_path, "4M"]);
        qemu(&[
            "qemu-io",
            "-c",
            "write -q -P 0xee 0 64k",
            "-c",
            "write -q -P 0xdd 64k 64k",
            "-c",
            "discard -q 0 64k",
            image_path,
        ]);
        let mut file = MemFile::new(std::fs::read(&path).unwrap(), 64 << 20);
        std::fs::remove_file(&path).unwrap();
        let len = file.bytes.len() as u64;
        let image = Image::open(&mut file, len, Options { writable: true, ..Options::default() }).unwrap();
        let data = |_, buf: &mut [u8]| buf.fill(0x3c);
        let mut a = allocations(image.start_write(&mut io(&mut file), MIB, 4 * KIB).unwrap()).remove(0);
        assert!(a.host + 64 * KIB <= len, "the freed cluster is reused");
        a.put_request_bytes(&mut { data });
        let contents = a.contents.as_ref().expect("the whole cluster, zeroes included");
        assert!(contents[4096..].iter().all(|&b| b == 0) && contents[..4096].iter().all(|&b| b == 0x3c));
        write_out(&mut file, &mut a, 0x3c);
        image.finish_allocation(&mut file, a, true).unwrap();
        let got = read(&image, &mut file, MIB, 64 * 1024);
        assert!(got[4096..].iter().all(|&b| b == 0), "no old bytes show through");
    }

    /// In an overlay with subclusters, a write keeps the backing file's
    /// bytes around it: `kept` names them (the subclusters it covers
    /// left out, adjacent ones in one read), and reading them in, then
    /// the request's bytes, gives the cluster's new contents.
    #[test]
    fn a_copy_up_keeps_the_backing_bytes_around_the_write() {
        let dir = std::env::temp_dir();
        let base = dir.join(format!("vsd-qcow2-kept-base-{}.raw", std::process::id()));
        let backing: Vec<u8> = (0..4 * MIB).map(|i| (i / 512) as u8).collect();
        std::fs::write(&base, &backing).unwrap();
        let args = ["-F", "raw", "-o", "extended_l2=on,cluster_size=64k", "-b", base.to_str().unwrap()];
        let mut file = MemFile::made_by_qemu_img_with("kept", &args, "4M");
        std::fs::remove_file(&base).unwrap();
        let len = file.bytes.len() as u64;
        let image = Image::open(&mut file, len, Options { writable: true, ..Options::default() }).unwrap();

        // 4 KiB at 72 KiB: subclusters 4 and 5 (of 2 KiB) of cluster 1 are
        // the write's; 0-3 and 6-31 come from below.
        let mut a = allocations(image.start_write(&mut io(&mut file), 72 * KIB, 4 * KIB).unwrap()).remove(0);
        let below = |at: u64, len: u64| OldBytes { at, len, source: Origin::Below(64 * KIB + at) };
        assert_eq!(a.kept, [below(0, 8 * KIB), below(12 * KIB, 52 * KIB)]);
        let mut backing_io = MemFile::new(backing.clone(), 4 * MIB);
        let mut io = ImageIo { meta: &mut file, data: None, backing: Some(&mut backing_io) };
        image.read_old_bytes(&mut io, &mut a).unwrap();
        a.put_request_bytes(&mut |_, buf| buf.fill(0xee));
        let contents = a.contents.as_ref().expect("a cluster with old bytes");
        let mut expected = backing[64 * KIB as usize..128 * KIB as usize].to_vec();
        expected[8 * KIB as usize..12 * KIB as usize].fill(0xee);
        assert!(contents[..] == expected[..]);
        image.finish_allocation(&mut file, a, false).unwrap();
    }

    /// In a cluster the image owns, with subclusters, a write allocates
    /// the subclusters it touches: an allocated one at either end gets
    /// only the request's bytes, an unallocated one is written whole, with
    /// zeroes around them.
    #[test]
    fn a_write_allocates_the_subclusters_it_touches_in_an_owned_cluster() {
        let mut file = MemFile::made_by_qemu_img_with("subclusters", &["-o", "extended_l2=on,cluster_size=64k"], "4M");
        let len = file.bytes.len() as u64;
        let image = Image::open(&mut file, len, Options { writable: true, ..Options::default() }).unwrap();
        // Subclusters of 2 KiB: 4 and 5 get data.
        image.write(&mut io(&mut file), 8 * KIB, 4 * KIB, &mut |_, buf| buf.fill(0xaa)).unwrap();

        // 9-13 KiB: the end of allocated subcluster 4, all of 5, the start
        // of unallocated subcluster 6.
        let mut pieces = image.start_write(&mut io(&mut file), 9 * KIB, 4 * KIB).unwrap();
        let Some(Piece::Allocate(mut a)) = pieces.pop() else { panic!("subclusters to allocate") };
        assert!(pieces.is_empty() && a.kept.is_empty());
        a.put_request_bytes(&mut |_, buf| buf.fill(0xbb));
        let host = a.host;
        let (bytes, at) = a.to_write().unwrap();
        assert_eq!((at, bytes.len() as u64), (host + 9 * KIB, 5 * KIB), "from the request's first byte to sc 6's end");
        let bytes = bytes.to_vec();
        file.write_at(&bytes, at).unwrap();
        image.finish_allocation(&mut file, a, true).unwrap();

        let got = read(&image, &mut file, 8 * KIB, 6 * 1024);
        assert!(got[..1024].iter().all(|&b| b == 0xaa), "subcluster 4 keeps its first KiB");
        assert!(got[1024..5 * 1024].iter().all(|&b| b == 0xbb));
        assert!(got[5 * 1024..].iter().all(|&b| b == 0), "the rest of subcluster 6 reads as zeroes");
        assert_eq!(map(&image, &mut file, 14 * KIB), Mapping::Unallocated, "subcluster 7 is untouched");
        // Wholly in allocated subclusters: in place.
        let pieces = image.start_write(&mut io(&mut file), 10 * KIB, 2 * KIB).unwrap();
        assert!(matches!(pieces[..], [Piece::InPlace { pos: 0, len: 2048, .. }]));
    }

    #[test]
    fn an_allocation_whose_write_failed_leaves_the_cluster_unallocated_and_free() {
        let (image, mut file) = fresh_image("failed");
        let data = |_, buf: &mut [u8]| buf.fill(0x5a);
        let a = allocations(image.start_write(&mut io(&mut file), 0, 64 * KIB).unwrap()).remove(0);
        image.finish_allocation(&mut file, a, false).unwrap();
        assert_eq!(map(&image, &mut file, 0), Mapping::Unallocated);
        // A cluster allocated after it puts it inside the file, where
        // qemu-img check looks for leaks.
        image.write(&mut io(&mut file), 64 * KIB, 64 * KIB, &mut { data }).unwrap();
        image.close(&mut io(&mut file)).unwrap();
        // QEMU finds no leak: the cluster's reference was dropped.
        let path = std::env::temp_dir().join(format!("vsd-qcow2-failed-check-{}.qcow2", std::process::id()));
        std::fs::write(&path, &file.bytes).unwrap();
        let out = std::process::Command::new("qemu-img").arg("check").arg(&path).output().expect("qemu-img runs");
        std::fs::remove_file(&path).unwrap();
        let report = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success() && report.contains("No errors were found"), "qemu-img check: {report}");
    }

    /// A cluster freed by a discard is handed out again, but only once no
    /// request that started before the free is in flight: such a request
    /// may have mapped the cluster, and its late write would land in the
    /// new owner's data.
    #[test]
    fn a_freed_cluster_is_reused_once_no_request_from_before_its_free_is_in_flight() {
        let (image, mut file) = fresh_image("reuse");
        let data = |_, buf: &mut [u8]| buf.fill(0x5a);
        let host_of = |file: &mut MemFile, offset| match map(&image, file, offset) {
            Mapping::Data { host, .. } => host,
            other => panic!("{other:?} at {offset:#x}"),
        };
        let write = |file: &mut MemFile, offset| image.write(&mut io(file), offset, 64 * KIB, &mut { data }).unwrap();
        let free = |file: &mut MemFile, offset| {
            image.discard(&mut io(file), offset, 64 * KIB).unwrap();
            image.flush(&mut io(file)).unwrap();
        };
        for offset in [0, 64 * KIB, 128 * KIB] {
            write(&mut file, offset);
        }
        let (first, second) = (host_of(&mut file, 0), host_of(&mut file, 64 * KIB));
        free(&mut file, 0);
        let mut queue = image.pin(4);
        queue.enter(0);
        free(&mut file, 64 * KIB);
        write(&mut file, 256 * KIB);
        assert_eq!(host_of(&mut file, 256 * KIB), first, "nothing from before its free is in flight: reused");
        write(&mut file, 320 * KIB);
        assert_ne!(host_of(&mut file, 320 * KIB), second, "reused under a request from before its free");
        queue.leave(0);
        queue.settle();
        write(&mut file, 384 * KIB);
        assert_eq!(host_of(&mut file, 384 * KIB), second, "reused once that request is done");
        image.flush(&mut io(&mut file)).unwrap();
        let path = std::env::temp_dir().join(format!("vsd-qcow2-reuse-{}.qcow2", std::process::id()));
        std::fs::write(&path, &file.bytes).unwrap();
        let out = std::process::Command::new("qemu-img").args(["check", "-f", "qcow2"]).arg(&path).output().unwrap();
        std::fs::remove_file(&path).unwrap();
        let report = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success() && report.contains("No errors were found"), "qemu-img check: {report}");
    }
}
