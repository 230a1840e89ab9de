//! An open image: the header, the active L1 table, the L2 cache, and the
//! metadata state that allocation changes.

mod allocate;
mod bitmaps;
mod cache;
mod compressed;
mod open;
mod overlap;
mod rebuild;
mod refcounts;
mod resize;
mod reuse;
mod snapshots;
mod stream;
mod write;
mod writeback;

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::io;
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::Waker;

use cache::{L2Cache, L2Table};
use overlap::MetadataMap;
pub use refcounts::NeedsLoad;
use refcounts::Refcounts;
pub use reuse::EpochPin;
use reuse::{Epochs, Quarantine};

use crate::SyncIo;
use crate::buf::AlignedBuf;
use crate::entry::{self, EntryError, L2Entry, Layout, Subcluster};
use crate::header::{BitmapsExtension, Compression, Header};

pub use allocate::{Allocation, Busy, OldBytes, Origin, Piece};
pub use snapshots::SnapshotInfo;
use snapshots::SnapshotTable;

/// How the image is used, from the `--blockdev` options.
#[derive(Clone, Debug, Default)]
pub struct Options {
    /// Requests that change the image are allowed.
    pub writable: bool,
    /// Bytes of L2 tables to cache; by default enough for the whole disk,
    /// up to 32 MiB (256 GiB of disk with 64 KiB clusters).
    pub l2_cache_bytes: Option<u64>,
    /// Bytes of an L2 table loaded and cached at once (QEMU's
    /// `l2-cache-entry-size`): a power of two from 512 to the cluster
    /// size; by default 4 KiB. Below 4 KiB (the unit changed tables are
    /// written back in) tables are loaded 4 KiB at a time.
    pub l2_cache_entry_bytes: Option<u64>,
    /// Bytes of refcount blocks to cache; by default a quarter of the L2
    /// cache, at least 4 clusters (QEMU's default).
    pub refcount_cache_bytes: Option<u64>,
    /// Guest discards mark clusters zero but keep them allocated.
    pub discard_no_unref: bool,
    /// Clusters freed by discards are discarded in the file too.
    pub pass_discard: bool,
    /// Whether unallocated clusters read from a backing file rather than as
    /// zeroes; None: as the header says.
    pub has_backing: Option<bool>,
    /// Lazy refcounts: the dirty bit covers refcounts, so a flush needs no
    /// ordering between them and the tables; None: as the header's
    /// compatible feature bit says.
    pub lazy_refcounts: Option<bool>,
    /// The caller keeps the image's persistent bitmaps up to date (loads
    /// them, marks them in use, stores them back): opening writable keeps
    /// autoclear bit 0, as QEMU does, instead of clearing it and so making
    /// the bitmaps stale.
    pub keep_bitmaps: bool,
}

/// What a range of the guest disk reads as.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mapping {
    /// Data at this offset of the data file; `in_place` if writes may go
    /// there directly.
    Data {
        /// Host byte offset of the range's first byte.
        host: u64,
        /// The cluster is referenced once and holds data for the whole range.
        in_place: bool,
    },
    /// Zeroes.
    Zero,
    /// Not allocated in this image: the backing file's bytes, or zeroes.
    Unallocated,
    /// Inside a compressed cluster stored at `host`, `len` bytes long.
    Compressed {
        /// Host byte offset of the compressed data.
        host: u64,
        /// Bytes to read from there.
        len: u64,
    },
    /// The metadata for this range is corrupt: fail the request.
    Invalid,
}

/// A run of guest bytes with one mapping.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extent {
    /// What the run reads as.
    pub mapping: Mapping,
    /// Its length in bytes.
    pub len: u64,
}

/// Tables one queue looked up recently, by L1 index modulo the slot count.
const MEMO_SLOTS: usize = 16;

/// One queue's memo of the L2 tables it used last. While the cache's
/// generation is unchanged (no table entered or left it), a memoised table
/// is still the cached one, so the lookup takes no lock and hashes nothing.
#[derive(Default)]
pub struct MapMemo {
    slots: [Option<(u64, u64, Arc<L2Table>)>; MEMO_SLOTS],
}

/// The files an operation may touch. Reads of the backing file past its
/// end must return zeroes.
pub struct ImageIo<'a> {
    /// The image file itself: metadata, and data without a data file.
    pub meta: &'a mut dyn SyncIo,
    /// The external data file, if the image has one.
    pub data: Option<&'a mut dyn SyncIo>,
    /// The backing file, if any.
    pub backing: Option<&'a mut dyn SyncIo>,
}

impl ImageIo<'_> {
    fn data(&mut self) -> &mut dyn SyncIo {
        match self.data.as_deref_mut() {
            Some(data) => data,
            None => &mut *self.meta,
        }
    }

    /// Reads guest bytes the image does not allocate: the backing file's,
    /// or zeroes.
    fn read_below(&mut self, buf: &mut [u8], guest_offset: u64) -> io::Result<()> {
        match self.backing.as_deref_mut() {
            Some(backing) => backing.read_at(buf, guest_offset),
            None => {
                buf.fill(0);
                Ok(())
            }
        }
    }
}

/// An open qcow2 image, shared by every queue that serves it.
pub struct Image {
    header: Header,
    layout: Layout,
    opts: Options,
    /// log2 of the entries per L2 table (computed once: the hot path
    /// would otherwise divide on every request).
    l2_bits: u32,
    /// Unallocated clusters read from below rather than as zeroes (changes
    /// when [`Image::set_backing_file`] names a backing file or none).
    has_backing: AtomicBool,
    /// The virtual disk size: the header's, until the image grows.
    size: AtomicU64,
    /// The active L1 table, as long as the clusters it occupies allow:
    /// entries past the header's `l1_size` are zero, so the disk can grow
    /// into them without moving the table.
    l1: Box<[AtomicU64]>,
    l2: L2Cache,
    /// Bytes of an L2 table slice, as loaded and cached.
    slice_bytes: usize,
    /// Clusters holding metadata: L2 entries pointing there are refused,
    /// and data writes never land there.
    metadata: Arc<MetadataMap>,
    meta: Mutex<Meta>,
    /// What keeps freed clusters from reuse while requests may use them.
    epochs: Arc<Epochs>,
    /// Held by whoever writes metadata chunks (see `writeback`), before
    /// `meta`.
    writeback: Mutex<()>,
    /// Some metadata change is not on disk yet: a flush must write it.
    dirty: AtomicBool,
    /// Lazy refcounts are in use.
    lazy: bool,
    /// Allocations finished so far (see [`Image::wake_after`]).
    finished: AtomicU64,
    /// Advanced (under the metadata mutex) whenever L2 tables are written
    /// to the file or move: a table read without the mutex
    /// ([`TableLoad`]) is current only if this did not change meanwhile.
    tables_written: AtomicU64,
}

/// A slice of an L2 table or a refcount block the cache lacks, read
/// without blocking: the caller reads [`TableLoad::buffer`] from
/// [`TableLoad::at`] in the image file however it likes (asynchronously,
/// beside other requests), then hands it to [`Image::finish_load`]. A
/// slice's read lands in the memory the cached table keeps: no copy, no
/// zeroing.
pub struct TableLoad {
    missing: MissingTable,
    at: u64,
    epoch: u64,
    words: Box<[MaybeUninit<u64>]>,
    /// A refcount block's memory, made when one is loaded (rarely: one
    /// covers gigabytes).
    block: Option<AlignedBuf>,
}

impl TableLoad {
    /// A load of table slices and refcount blocks of `image`.
    pub fn new(image: &Image) -> Self {
        let words = Box::new_uninit_slice(image.slice_bytes / 8);
        Self { missing: MissingTable::slice(0, 0), at: 0, epoch: 0, words, block: None }
    }

    /// Whether it loads what `missing` names.
    pub fn loads(&self, missing: MissingTable) -> bool {
        self.missing == missing
    }

    /// Where the slice is in the image file.
    pub fn at(&self) -> u64 {
        self.at
    }

    /// Where to read it to, and how many bytes. The memory is
    /// uninitialised until the read fills it.
    pub fn buffer(&mut self) -> (*mut u8, usize) {
        match (self.missing.what, &mut self.block) {
            (Missing::RefcountBlock(_), Some(block)) => (block.as_mut_ptr(), block.len()),
            _ => (self.words.as_mut_ptr().cast(), self.words.len() * 8),
        }
    }
}

/// A table the cache lacks is needed: a slice of the L2 table at `offset`
/// of the image file, or the refcount block there. Load it
/// ([`Image::start_load`]) and try again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MissingTable {
    offset: u64,
    what: Missing,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Missing {
    L2Slice(usize),
    /// By its index in the refcount table.
    RefcountBlock(u64),
}

impl MissingTable {
    fn slice(offset: u64, slice: usize) -> Self {
        Self { offset, what: Missing::L2Slice(slice) }
    }

    pub(super) fn refcount_block(offset: u64, index: u64) -> Self {
        Self { offset, what: Missing::RefcountBlock(index) }
    }
}

/// Everything allocation changes, behind the metadata mutex.
struct Meta {
    refcounts: Refcounts,
    /// L2 table chunks changed in memory only: table offset -> (table,
    /// chunk offsets). Dirty tables are found here even once evicted.
    dirty_l2: BTreeMap<u64, (Arc<L2Table>, BTreeSet<usize>)>,
    /// L1 table chunks changed in memory only.
    dirty_l1: BTreeSet<usize>,
    /// References to drop after the next table writes: (cluster, discard).
    decrements: Vec<(u64, bool)>,
    /// Clusters holding metadata (shared with [`Image`]).
    metadata: Arc<MetadataMap>,
    /// The start of the header as on disk, rewritten when fields change.
    header_chunk: AlignedBuf,
    /// The dirty bit is set on disk (lazy refcounts, until a clean close).
    dirty_bit: bool,
    /// Guest clusters (byte offsets) with an allocation in flight.
    allocating: HashSet<u64>,
    /// Requests waiting for an allocation to finish, woken when one does.
    waiters: Vec<Waker>,
    /// The image's epochs, to tag freed clusters with (see `reuse`).
    epochs: Arc<Epochs>,
    /// Freed clusters not to hand out yet.
    quarantine: Quarantine,
    /// The bitmap directory the header names, if the bitmaps are consistent.
    bitmaps: Option<BitmapsExtension>,
    /// Where the next compressed cluster's bytes go: the first free byte
    /// of a host cluster that compressed clusters fill in part (0: none).
    packed: u64,
    /// The internal snapshots, as the header's table has them.
    snapshots: SnapshotTable,
}

impl Image {
    /// The header as parsed at open: its backing file fields are not
    /// updated by [`Image::set_backing_file`].
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// The virtual disk size.
    #[inline]
    pub fn size(&self) -> u64 {
        self.size.load(Ordering::Acquire)
    }

    /// Bytes per cluster.
    #[inline]
    pub fn cluster_size(&self) -> u64 {
        self.header.cluster_size()
    }

    /// How compressed clusters are encoded.
    pub fn compression(&self) -> Compression {
        self.header.compression
    }

    /// Whether requests may change the image.
    pub fn writable(&self) -> bool {
        self.opts.writable
    }

    fn l2_bits(&self) -> u32 {
        self.l2_bits
    }

    /// Whether unallocated clusters read from below rather than as zeroes.
    fn has_backing(&self) -> bool {
        self.has_backing.load(Ordering::Relaxed)
    }

    /// What a queue of `depth` requests tells the image about its requests
    /// in flight: each [`EpochPin::enter`]s before its first lookup and
    /// [`EpochPin::leave`]s once done, and the queue [`EpochPin::settle`]s
    /// after each reap, so that a cluster freed meanwhile is not handed out
    /// again under a request that may have mapped it.
    pub fn pin(&self, depth: u16) -> EpochPin {
        self.epochs.pin(depth)
    }

    fn lock(&self) -> MutexGuard<'_, Meta> {
        // A panic under the lock aborts the process (panic=abort), so a
        // poisoned lock cannot be observed in release builds.
        self.meta.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The mapping of the guest bytes from `offset`, for at most `len`
    /// bytes; the returned extent is never empty. `memo` is the calling
    /// queue's own. An L2 table the cache lacks is read through `io`, under
    /// the metadata mutex: [`Image::map_cached`] does not wait for it.
    pub fn map(&self, memo: &mut MapMemo, io: &mut dyn SyncIo, offset: u64, len: u64) -> io::Result<Extent> {
        match self.map_cached(memo, offset, len) {
            Ok(extent) => Ok(extent),
            Err(MissingTable { offset: table, what }) => {
                let Missing::L2Slice(slice) = what else {
                    return Err(io::Error::from_raw_os_error(libc::EIO));
                };
                let table = self.load_l2(&mut self.lock(), io, table, slice..slice + 1)?;
                self.check_l2(&table);
                self.walk(&table, offset, self.table_end(offset, len))
                    .ok_or_else(|| io::Error::from_raw_os_error(libc::EIO))
            }
        }
    }

    /// [`Image::map`] without I/O: the L2 table it needs if the cache
    /// lacks it.
    #[inline(always)]
    pub fn map_cached(&self, memo: &mut MapMemo, offset: u64, len: u64) -> Result<Extent, MissingTable> {
        // Nearly every request ends here, inlined into the caller: no L1
        // entry decoded, no walk, no extent returned through memory.
        if let Some(table) = self.memoised(memo, self.l1_index(offset))
            && let Some(extent) = self.plain(table, offset, len)
        {
            self.l2.touch(table);
            return Ok(extent);
        }
        self.map_through_l1(memo, offset, len)
    }

    /// Where the range from `offset` for `len` bytes ends within the span
    /// of one L2 table.
    fn table_end(&self, offset: u64, len: u64) -> u64 {
        let span_bits = self.header.cluster_bits + self.l2_bits();
        offset + len.min((((offset >> span_bits) + 1) << span_bits) - offset)
    }

    /// [`Image::map_cached`] for any range: the L1 entry decoded, the table
    /// looked up in the cache, and walked.
    fn map_through_l1(&self, memo: &mut MapMemo, offset: u64, len: u64) -> Result<Extent, MissingTable> {
        let l1_index = self.l1_index(offset);
        let limit = self.table_end(offset, len);
        let l2_offset = match entry::l1(self.l1[l1_index].load(Ordering::Acquire), self.cluster_size()) {
            Ok(Some((l2_offset, _))) => l2_offset,
            Ok(None) => return Ok(Extent { mapping: Mapping::Unallocated, len: limit - offset }),
            Err(e) => return Ok(self.invalid(e, offset, limit)),
        };
        let missing = || MissingTable::slice(l2_offset, self.slice_of(self.l2_index(offset)));
        if let Some(table) = self.memoised(memo, l1_index) {
            self.l2.touch(table);
            return self.walk(table, offset, limit).ok_or_else(missing);
        }
        let Some((table, generation)) = self.l2.lookup(l2_offset) else {
            return Err(missing());
        };
        memo.slots[l1_index % MEMO_SLOTS] = Some((l2_offset, generation, table.clone()));
        self.check_l2(&table);
        self.walk(&table, offset, limit).ok_or_else(missing)
    }

    /// The slice of its table that holds L2 entry `index`.
    fn slice_of(&self, index: usize) -> usize {
        index * if self.layout.extended { 16 } else { 8 } / self.slice_bytes
    }

    /// The first table slice the cache lacks among those a change to a
    /// guest range needs, and how many of them were found cached before it
    /// (a request's progress through them): the slices mapping the range,
    /// and all of a table shared with a snapshot, which the change copies.
    /// A request that changes metadata loads them ahead
    /// ([`Image::start_load`]) rather than under the metadata mutex.
    /// Ranges without a table need none.
    pub fn missing_table(&self, offset: u64, len: u64) -> Option<(u64, MissingTable)> {
        let cs = self.cluster_size();
        let entry_bytes = if self.layout.extended { 16 } else { 8 };
        let slice_span = (self.slice_bytes / entry_bytes) as u64 * cs;
        let table_span = cs << self.l2_bits;
        let end = offset.saturating_add(len.max(1));
        let (mut at, mut cached) = (offset, 0);
        while at < end {
            let entry = self.l1.get(self.l1_index(at))?.load(Ordering::Acquire);
            let Ok(Some((l2_offset, copied))) = entry::l1(entry, cs) else {
                // No table here (or a bad entry, which the metadata path reports).
                at = (at / table_span + 1) * table_span;
                continue;
            };
            let (slices, next) = match copied {
                true => {
                    let slice = self.slice_of(self.l2_index(at));
                    (slice..slice + 1, (at / slice_span + 1) * slice_span)
                }
                false => (self.all_slices(), (at / table_span + 1) * table_span),
            };
            let table = self.l2.get(l2_offset);
            for slice in slices {
                if !table.as_ref().is_some_and(|t| t.is_loaded(slice)) {
                    return Some((cached, MissingTable::slice(l2_offset, slice)));
                }
                cached += 1;
            }
            at = next;
        }
        None
    }

    /// Prepares `load` for the table `missing` names; the caller then
    /// reads it into [`TableLoad::buffer`].
    pub fn start_load(&self, load: &mut TableLoad, missing: MissingTable) {
        load.missing = missing;
        match missing.what {
            Missing::L2Slice(slice) => {
                load.at = missing.offset + (slice * self.slice_bytes) as u64;
                load.epoch = self.tables_written.load(Ordering::Acquire);
            }
            Missing::RefcountBlock(_) => {
                load.at = missing.offset;
                load.epoch = self.lock().refcounts.written();
                let cs = self.cluster_size() as usize;
                load.block =
                    Some(load.block.take().filter(|b| b.len() == cs).unwrap_or_else(|| AlignedBuf::zeroed(cs)));
            }
        }
    }

    /// Puts the slice `load` read into the cache, unless the cache or the
    /// in-memory changes have it already, or tables were written while it
    /// was read (then what it read may be stale: map again, which loads it
    /// again). Whether the slice is cached now. The metadata mutex is taken
    /// for no I/O.
    ///
    /// # Safety
    /// A read has filled the whole of [`TableLoad::buffer`] since
    /// [`Image::start_load`].
    pub unsafe fn finish_load(&self, load: &mut TableLoad) -> bool {
        let MissingTable { offset, what } = load.missing;
        let slice = match what {
            Missing::L2Slice(slice) => slice,
            Missing::RefcountBlock(index) => {
                let Some(block) = load.block.take() else { return false };
                return self.lock().refcounts.insert_block(index, block, load.epoch);
            }
        };
        let meta = self.lock();
        let table = self.cached_table(&meta, offset);
        if table.is_loaded(slice) {
            return true;
        }
        if load.epoch != self.tables_written.load(Ordering::Acquire) {
            return false;
        }
        let fresh = Box::new_uninit_slice(load.words.len());
        let words = std::mem::replace(&mut load.words, fresh);
        // SAFETY: the caller's guarantee: a read initialised every byte.
        self.l2.fill(&table, slice, unsafe { words.assume_init() });
        true
    }

    /// Reads the table `missing` names from the image file in blocking
    /// steps, without the metadata mutex, and caches it (unless it went
    /// stale meanwhile: then the caller finds it missing again).
    pub(super) fn load(&self, io: &mut ImageIo, missing: MissingTable) -> io::Result<()> {
        let mut load = TableLoad::new(self);
        self.start_load(&mut load, missing);
        let (buf, len) = load.buffer();
        // SAFETY: `buf` names `len` bytes `load` owns, used here only;
        // zeroed first, a slice's memory is initialised before it is seen
        // as bytes.
        let buf = unsafe {
            buf.write_bytes(0, len);
            std::slice::from_raw_parts_mut(buf, len)
        };
        io.meta.read_at(buf, load.at())?;
        // SAFETY: the read filled the whole buffer.
        unsafe { self.finish_load(&mut load) };
        Ok(())
    }

    /// Runs `change(io, may_load)`, which takes the metadata mutex, first
    /// with `may_load` false: a table slice or refcount block it needs and
    /// the cache lacks then fails it with [`NeedsLoad`], and is read here
    /// without the mutex before it runs again. After a few such rounds
    /// (other writers may evict what this one loads) it runs with
    /// `may_load`, loading under the mutex.
    pub(super) fn loading_apart<T>(
        &self,
        io: &mut ImageIo,
        mut change: impl FnMut(&mut ImageIo, bool) -> io::Result<T>,
    ) -> io::Result<T> {
        const ROUNDS: usize = 4;
        for _ in 0..ROUNDS {
            match change(io, false) {
                Err(e) => match NeedsLoad::of(&e) {
                    Some(missing) => self.load(io, missing)?,
                    None => return Err(e),
                },
                done => return done,
            }
        }
        change(io, true)
    }

    /// Marks the tables in the file as changed (under the metadata mutex,
    /// once the change is written): loads in flight are stale.
    fn tables_written(&self) {
        self.tables_written.fetch_add(1, Ordering::AcqRel);
    }

    /// The memo's table for L1 entry `l1_index`, if the entry still names
    /// it, the cache still holds it and no cluster became metadata since it
    /// was checked: then no lock is taken and nothing hashed.
    #[inline]
    fn memoised<'m>(&self, memo: &'m MapMemo, l1_index: usize) -> Option<&'m L2Table> {
        let (table_offset, generation, table) = memo.slots[l1_index % MEMO_SLOTS].as_ref()?;
        // The memoised offset came from a valid entry: an entry equal to it
        // but for the COPIED flag is valid too, and names the same table.
        let l1_entry = self.l1.get(l1_index)?.load(Ordering::Acquire);
        (l1_entry & !entry::COPIED == *table_offset
            && *generation == self.l2.generation()
            && table.checked(self.metadata.version()))
        .then_some(&**table)
    }

    /// The mapping of a range within one cluster that plainly holds data
    /// ([`L2Table::plain_data`]), the common case, without the general
    /// walk; `None` for any other range.
    #[inline(always)]
    fn plain(&self, table: &L2Table, offset: u64, len: u64) -> Option<Extent> {
        let cb = self.header.cluster_bits;
        let within = offset & ((1 << cb) - 1);
        if len > (1 << cb) - within {
            return None;
        }
        let (host, in_place) = table.plain_data(&self.layout, self.l2_index(offset))?;
        Some(Extent { mapping: Mapping::Data { host: host + within, in_place }, len })
    }

    /// Walks `table` from `offset` to `limit` (both within it), merging
    /// subclusters that map the same way, as far as its loaded slices go;
    /// None if the slice of `offset` is not loaded.
    fn walk(&self, table: &L2Table, offset: u64, limit: u64) -> Option<Extent> {
        if let Some(extent) = self.plain(table, offset, limit - offset) {
            return Some(extent);
        }
        let cb = self.header.cluster_bits;
        let scb = self.layout.subcluster_bits();
        let mut first: Option<Mapping> = None;
        let mut pos = offset;
        while pos < limit {
            let index = self.l2_index(pos);
            let e = match self.entry(table, index) {
                None if first.is_none() => return None,
                Some(Ok(e)) => e,
                Some(Err(e)) if first.is_none() => {
                    return Some(self.invalid(e, offset, (pos | (self.cluster_size() - 1)) + 1));
                }
                _ => break,
            };
            let sc = ((pos >> scb) & u64::from(self.layout.subclusters() - 1)) as u32;
            let (mapping, next) = match e.subcluster(sc, scb) {
                Subcluster::Compressed => {
                    let (host, len) = e.compressed.expect("compressed subclusters come from compressed entries");
                    (Mapping::Compressed { host, len }, ((pos >> cb) + 1) << cb)
                }
                state => {
                    let within = pos & ((1 << scb) - 1);
                    let mapping = match state {
                        Subcluster::Data(host) => Mapping::Data { host: host + within, in_place: e.copied },
                        Subcluster::Zero => Mapping::Zero,
                        _ => Mapping::Unallocated,
                    };
                    (mapping, ((pos >> scb) + 1) << scb)
                }
            };
            match first {
                None => first = Some(mapping),
                Some(f) if continues(f, mapping, pos - offset) => {}
                Some(_) => break,
            }
            pos = next;
            if matches!(mapping, Mapping::Compressed { .. }) {
                break;
            }
        }
        Some(Extent { mapping: first.expect("the loop runs at least once"), len: pos.min(limit) - offset })
    }

    /// The index in the L1 table of the entry mapping guest `offset`.
    #[inline]
    fn l1_index(&self, offset: u64) -> usize {
        (offset >> (self.header.cluster_bits + self.l2_bits)) as usize
    }

    /// The index in its L2 table of the entry mapping guest `offset`.
    #[inline]
    fn l2_index(&self, offset: u64) -> usize {
        ((offset >> self.header.cluster_bits) & ((1 << self.l2_bits) - 1)) as usize
    }

    fn invalid(&self, e: impl std::fmt::Display, offset: u64, end: u64) -> Extent {
        log::error!("qcow2: guest offset {offset:#x}: {e}");
        Extent { mapping: Mapping::Invalid, len: end - offset }
    }

    /// Reads and decompresses the compressed cluster at `host` into `out`
    /// (one whole cluster).
    pub fn read_compressed(&self, io: &mut dyn SyncIo, host: u64, len: u64, out: &mut [u8]) -> io::Result<()> {
        let start = host & !511;
        let end = (host + len).next_multiple_of(512);
        let mut raw = AlignedBuf::zeroed((end - start) as usize);
        io.read_at(&mut raw, start)?;
        let input = &raw[(host - start) as usize..(host - start + len) as usize];
        if crate::compress::decompress_cluster(self.compression(), input, out) {
            Ok(())
        } else {
            log::error!("qcow2: compressed cluster at {host:#x} does not decompress");
            Err(io::Error::from_raw_os_error(libc::EIO))
        }
    }

    /// Whether a data write to `[host, host + len)` of the image file would
    /// land on metadata (a corrupt entry): such writes must fail.
    fn write_hits_metadata(&self, host: u64, len: u64) -> bool {
        !self.layout.data_file && self.metadata.overlaps(host, len, self.header.cluster_bits)
    }

    /// Flags the image corrupt in its header, as QEMU does when it finds
    /// metadata it cannot trust: QEMU and vsd then refuse to write it until
    /// `qemu-img check -r` repairs it. Nothing else is written.
    pub fn mark_corrupt(&self, io: &mut dyn SyncIo) -> io::Result<()> {
        self.lock().set_incompatible_bit(io, crate::header::incompatible::CORRUPT, true)
    }

    /// Flushes, then clears the dirty bit of lazy refcounts: the image is
    /// consistent on disk as QEMU expects after a clean close.
    pub fn close(&self, io: &mut ImageIo) -> io::Result<()> {
        self.flush(io)?;
        let mut meta = self.lock();
        // Clean only if nothing changed since the flush (no one should).
        if meta.dirty_bit && !self.metadata_dirty() {
            meta.set_dirty_bit(io.meta, false)?;
        }
        Ok(())
    }

    /// Before the first metadata change with lazy refcounts: the dirty bit
    /// must be durable before refcounts may fall behind.
    fn prepare_change(&self, meta: &mut Meta, io: &mut ImageIo) -> io::Result<()> {
        if self.lazy && !meta.dirty_bit { meta.set_dirty_bit(io.meta, true) } else { Ok(()) }
    }

    /// Drops cached tables and refcount blocks unused since the previous
    /// call; the driver calls it every `cache-clean-interval`.
    pub fn drop_unused_caches(&self) {
        self.l2.drop_unused();
        self.lock().refcounts.drop_clean();
    }

    /// Whether metadata changed since the last flush: then a flush must go
    /// through [`Image::flush`] rather than straight to the files.
    #[inline]
    pub fn metadata_dirty(&self) -> bool {
        self.dirty.load(Ordering::Acquire)
    }

    fn note_dirty(&self, meta: &Meta) {
        let dirty = meta.refcounts.is_dirty() || !meta.dirty_l2.is_empty() || !meta.dirty_l1.is_empty();
        self.dirty.store(dirty || !meta.decrements.is_empty(), Ordering::Release);
    }

    /// The L2 table at `l2_offset` with its `slices` loaded, into the
    /// cache if needed. Loads happen under the metadata mutex so that a
    /// table being changed is never reloaded from stale disk contents.
    fn load_l2(
        &self,
        meta: &mut Meta,
        io: &mut dyn SyncIo,
        l2_offset: u64,
        slices: std::ops::Range<usize>,
    ) -> io::Result<Arc<L2Table>> {
        let table = self.cached_table(meta, l2_offset);
        let bytes = self.slice_bytes;
        for slice in slices.filter(|&slice| !table.is_loaded(slice)) {
            if !meta.refcounts.may_load {
                return Err(io::Error::other(NeedsLoad(MissingTable::slice(l2_offset, slice))));
            }
            let mut raw = AlignedBuf::zeroed(bytes);
            io.read_at(&mut raw, l2_offset + (slice * bytes) as u64)?;
            let (words, _) = raw.as_chunks::<8>();
            self.l2.fill(&table, slice, words.iter().map(|w| u64::from_ne_bytes(*w)).collect());
        }
        Ok(table)
    }

    /// The table at `offset` in the cache, put there if needed: the one
    /// with unwritten changes, else one with no slice loaded yet. Called
    /// under the metadata mutex (`meta`).
    fn cached_table(&self, meta: &Meta, offset: u64) -> Arc<L2Table> {
        if let Some(table) = self.l2.get(offset) {
            return table;
        }
        let table = match meta.dirty_l2.get(&offset) {
            Some((table, _)) => table.clone(),
            None => Arc::new(L2Table::unloaded(offset, self.cluster_size() as usize, self.slice_bytes)),
        };
        self.l2.insert(table.clone());
        table
    }

    /// The range of every slice of a table.
    fn all_slices(&self) -> std::ops::Range<usize> {
        0..self.cluster_size() as usize / self.slice_bytes
    }

    /// Forgets `table`'s verified entries if a cluster became metadata
    /// since they were verified: guest data is then never read from or
    /// written over metadata through it.
    fn check_l2(&self, table: &L2Table) {
        if !table.checked(self.metadata.version()) {
            self.metadata.with_test(|_, version| table.revalidate(version));
        }
    }

    /// Entry `index` of `table`, verified not to point into metadata; None
    /// if its slice is not loaded.
    fn entry(&self, table: &L2Table, index: usize) -> Option<Result<L2Entry, EntryError>> {
        if !(table.checked(self.metadata.version()) && table.is_verified(index)) {
            let cb = self.header.cluster_bits;
            let verified = self.metadata.with_test(|is_metadata, version| {
                table.revalidate(version);
                let test = |host| is_metadata(host >> cb);
                table.verify(&self.layout, index, (!self.layout.data_file).then_some(&test))
            });
            if !verified {
                let slice = table.slice_of(&self.layout, index);
                return table.is_loaded(slice).then(|| Err(EntryError::Metadata(table.raw_entry(&self.layout, index))));
            }
        }
        table.decode(&self.layout, index)
    }
}

impl Meta {
    /// A header field of `N` bytes at `at`, as on disk.
    fn header_field<const N: usize>(&self, at: u64) -> [u8; N] {
        let at = at as usize;
        self.header_chunk[at..at + N].try_into().unwrap_or([0; N])
    }

    /// Where the active L1 table is (it moves when the disk grows past its
    /// clusters).
    fn l1_offset(&self) -> u64 {
        u64::from_be_bytes(self.header_field(crate::header::field::L1_TABLE_OFFSET))
    }

    /// The active L1 table's entries on disk.
    fn l1_size(&self) -> u64 {
        u64::from(u32::from_be_bytes(self.header_field(crate::header::field::L1_SIZE)))
    }

    fn set_dirty_bit(&mut self, io: &mut dyn SyncIo, on: bool) -> io::Result<()> {
        self.set_incompatible_bit(io, crate::header::incompatible::DIRTY, on)?;
        self.dirty_bit = on;
        Ok(())
    }

    /// Sets or clears one `incompatible_features` bit, durably.
    fn set_incompatible_bit(&mut self, io: &mut dyn SyncIo, bit: u64, on: bool) -> io::Result<()> {
        let at = crate::header::field::INCOMPATIBLE as usize;
        let mut bits = u64::from_be_bytes(self.header_chunk[at..at + 8].try_into().unwrap_or_default());
        bits = if on { bits | bit } else { bits & !bit };
        self.header_chunk[at..at + 8].copy_from_slice(&bits.to_be_bytes());
        io.write_at(&self.header_chunk, 0)?;
        io.flush()
    }
}

/// A changed L2 entry outside the loaded slices of its table: changes load
/// their slice first, so this is a bug, reported as an I/O error rather
/// than written as zeroes.
fn unloaded_slice() -> io::Error {
    log::error!("qcow2: an L2 table slice to write back is not in memory");
    io::Error::from_raw_os_error(libc::EIO)
}

/// Whether `next`, found `delta` bytes after the start of `first`, extends it.
fn continues(first: Mapping, next: Mapping, delta: u64) -> bool {
    match (first, next) {
        (Mapping::Data { host: a, in_place: x }, Mapping::Data { host: b, in_place: y }) => b == a + delta && x == y,
        (Mapping::Zero, Mapping::Zero) | (Mapping::Unallocated, Mapping::Unallocated) => true,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mem::MemFile;

    const MIB: u64 = 1 << 20;

    /// A 1 GiB image (64 KiB clusters: one L2 table of 16 slices) with
    /// data at 0 and at 32 MiB (its second slice), made by qemu-img and
    /// vsd, opened anew with nothing cached.
    fn cold_image(name: &str) -> (Image, MemFile) {
        let mut file = MemFile::made_by_qemu_img(name, "1G");
        let opts = Options { writable: true, ..Options::default() };
        let len = file.bytes.len() as u64;
        let image = Image::open(&mut file, len, opts.clone()).unwrap();
        let mut io = ImageIo { meta: &mut file, data: None, backing: None };
        for at in [0, 32 * MIB] {
            image.write(&mut io, at, 4096, &mut |_, buf| buf.fill(0x5a)).unwrap();
        }
        image.close(&mut io).unwrap();
        let len = file.bytes.len() as u64;
        (Image::open(&mut file, len, opts).unwrap(), file)
    }

    /// An image file that counts the reads made with the image's metadata
    /// mutex held (the tests use one thread: a held mutex is this one's).
    pub(super) struct Watched<'a> {
        pub(super) file: &'a mut MemFile,
        pub(super) image: &'a Image,
        pub(super) reads: usize,
        pub(super) under_mutex: usize,
    }

    impl SyncIo for Watched<'_> {
        fn read_at(&mut self, buf: &mut [u8], offset: u64) -> io::Result<()> {
            self.reads += 1;
            self.under_mutex += usize::from(self.image.meta.try_lock().is_err());
            self.file.read_at(buf, offset)
        }
        fn write_at(&mut self, buf: &[u8], offset: u64) -> io::Result<()> {
            self.file.write_at(buf, offset)
        }
        fn flush(&mut self) -> io::Result<()> {
            self.file.flush()
        }
        fn discard(&mut self, offset: u64, len: u64) -> io::Result<()> {
            self.file.discard(offset, len)
        }
    }

    /// The blocking changes of metadata (a write, write-zeroes, discard)
    /// read the table slices and the refcount block they lack without the
    /// metadata mutex, and make their change once they have them.
    #[test]
    fn blocking_changes_read_what_they_lack_without_the_metadata_mutex() {
        let (image, mut file) = cold_image("blocking-loads");
        let mut watched = Watched { file: &mut file, image: &image, reads: 0, under_mutex: 0 };
        let mut io = ImageIo { meta: &mut watched, data: None, backing: None };
        // A new cluster in an uncached slice, from the uncached refcount block.
        image.write(&mut io, 64 * MIB, 4096, &mut |_, buf| buf.fill(0x77)).unwrap();
        image.write_zeroes(&mut io, 128 * MIB, 64 << 10, false, false).unwrap();
        image.discard(&mut io, 0, 64 << 10).unwrap();
        // Past the only L2 table: a new one is allocated.
        image.write_zeroes(&mut io, 600 * MIB, 64 << 10, false, false).unwrap();
        assert!(watched.reads >= 4, "slices and the refcount block were read: {}", watched.reads);
        assert_eq!(watched.under_mutex, 0, "of {} reads", watched.reads);
        let mut memo = MapMemo::default();
        let mut map = |at| image.map(&mut memo, &mut file.clone(), at, 4096).unwrap().mapping;
        assert!(matches!(map(64 * MIB), Mapping::Data { in_place: true, .. }));
        for at in [0, 128 * MIB, 600 * MIB] {
            assert!(matches!(map(at), Mapping::Zero), "{at:#x}: {:?}", map(at));
        }
    }

    /// Reads what `load` asks for from `file`, as a queue's child request would.
    fn read_into(file: &MemFile, load: &mut TableLoad) {
        let at = load.at() as usize;
        let (buf, len) = load.buffer();
        // SAFETY: `buf` names `len` bytes owned by `load`, apart from `file`.
        unsafe { std::ptr::copy_nonoverlapping(file.bytes[at..at + len].as_ptr(), buf, len) };
    }

    #[test]
    fn a_missing_slice_is_read_once_and_the_next_slice_still_misses() {
        let (image, file) = cold_image("slice-miss");
        let mut memo = MapMemo::default();
        let missing = image.map_cached(&mut memo, 0, 4096).unwrap_err();
        let mut load = TableLoad::new(&image);
        image.start_load(&mut load, missing);
        assert!(load.loads(missing));
        assert_eq!(load.buffer().1, 4096, "one 4 KiB slice");
        read_into(&file, &mut load);
        // SAFETY: read_into filled the whole buffer.
        assert!(unsafe { image.finish_load(&mut load) });
        let first = image.map_cached(&mut memo, 0, 4096).unwrap();
        assert!(matches!(first.mapping, Mapping::Data { in_place: true, .. }), "{first:?}");
        let second = image.map_cached(&mut memo, 32 * MIB, 4096).unwrap_err();
        assert_ne!(second, missing, "another slice of the same table");
        // The blocking path loads it and maps it like the other.
        let extent = image.map(&mut memo, &mut file.clone(), 32 * MIB, 4096).unwrap();
        assert!(matches!(extent.mapping, Mapping::Data { in_place: true, .. }), "{extent:?}");
        assert!(image.map_cached(&mut memo, 32 * MIB, 4096).is_ok());
    }

    /// Loads the slice `missing` names, as a queue does.
    fn load(image: &Image, file: &MemFile, missing: MissingTable) {
        let mut load = TableLoad::new(image);
        image.start_load(&mut load, missing);
        read_into(file, &mut load);
        // SAFETY: read_into filled the whole buffer.
        assert!(unsafe { image.finish_load(&mut load) });
    }

    /// Over a range of several slices, each missing one is named in turn,
    /// with how many were cached before it; ranges without a table need
    /// none.
    #[test]
    fn every_missing_slice_of_a_range_is_named_in_turn() {
        let (image, file) = cold_image("slices-in-turn");
        let range = (0, 100 * MIB);
        let (cached, first) = image.missing_table(range.0, range.1).unwrap();
        assert_eq!((cached, first.what), (0, Missing::L2Slice(0)));
        load(&image, &file, first);
        let (cached, second) = image.missing_table(range.0, range.1).unwrap();
        assert_eq!(
            (cached, second.offset, second.what),
            (1, first.offset, Missing::L2Slice(1)),
            "not only the range's ends"
        );
        load(&image, &file, second);
        assert_eq!(
            image.missing_table(range.0, range.1).map(|(cached, m)| (cached, m.what)),
            Some((2, Missing::L2Slice(2)))
        );
        assert_eq!(image.missing_table(512 * MIB, 256 * MIB), None, "no table maps 512 MiB on");
    }

    /// A 1 GiB image made by QEMU: `before` written (qemu-io commands), an
    /// internal snapshot taken, then `after` written.
    fn with_snapshot(name: &str, before: &[&str], after: &[&str]) -> MemFile {
        let path = std::env::temp_dir().join(format!("vsd-qcow2-{name}-{}.qcow2", std::process::id()));
        let image = path.to_str().unwrap();
        let run = |args: &[&str]| {
            assert!(std::process::Command::new(args[0]).args(&args[1..]).status().unwrap().success(), "{args:?}");
        };
        run(&["qemu-img", "create", "-q", "-f", "qcow2", image, "1G"]);
        before.iter().for_each(|c| run(&["qemu-io", "-c", c, image]));
        run(&["qemu-img", "snapshot", "-c", "s1", image]);
        after.iter().for_each(|c| run(&["qemu-io", "-c", c, image]));
        let file = MemFile::new(std::fs::read(&path).unwrap(), 64 << 20);
        std::fs::remove_file(&path).unwrap();
        file
    }

    /// A change to a table shared with a snapshot copies all of it: every
    /// slice is needed, whatever the range.
    #[test]
    fn a_change_to_a_table_shared_with_a_snapshot_needs_all_its_slices() {
        let file = with_snapshot("shared-table", &["write -q 0 4k"], &[]);
        let image = Image::open(&mut file.clone(), file.bytes.len() as u64, Options::default()).unwrap();
        let slices = image.all_slices().len() as u64;
        for expected in 0..slices {
            let (cached, missing) = image.missing_table(0, 4096).unwrap();
            assert_eq!((cached, missing.what), (expected, Missing::L2Slice(expected as usize)));
            load(&image, &file, missing);
        }
        assert_eq!(image.missing_table(0, 4096), None);
    }

    /// With `discard-no-unref`, the discard passed down to the file skips
    /// a cluster a snapshot shares (its bytes are the snapshot's too) and
    /// drops one the image owns alone; an unmapping zeroing keeps its
    /// cluster too, as QEMU does, and a later write lands in it again.
    #[test]
    fn a_kept_cluster_is_discarded_in_the_file_only_if_no_snapshot_shares_it() {
        struct Discards {
            file: MemFile,
            discarded: Vec<(u64, u64)>,
        }
        impl SyncIo for Discards {
            fn read_at(&mut self, buf: &mut [u8], offset: u64) -> io::Result<()> {
                self.file.read_at(buf, offset)
            }
            fn write_at(&mut self, buf: &[u8], offset: u64) -> io::Result<()> {
                self.file.write_at(buf, offset)
            }
            fn flush(&mut self) -> io::Result<()> {
                Ok(())
            }
            fn discard(&mut self, offset: u64, len: u64) -> io::Result<()> {
                self.discarded.push((offset, len));
                Ok(())
            }
        }
        let file = with_snapshot("no-unref", &["write -q 0 64k"], &["write -q 64k 128k"]);
        let opts = Options { writable: true, discard_no_unref: true, pass_discard: true, ..Options::default() };
        let len = file.bytes.len() as u64;
        let mut recorder = Discards { file, discarded: Vec::new() };
        let image = Image::open(&mut recorder, len, opts).unwrap();
        let host = |file: &MemFile, at| match image.map(&mut MapMemo::default(), &mut file.clone(), at, 4096) {
            Ok(Extent { mapping: Mapping::Data { host, in_place }, .. }) => (host, in_place),
            other => panic!("{at:#x}: {other:?}"),
        };
        let ((shared, shared_in_place), (owned, owned_in_place)) =
            (host(&recorder.file, 0), host(&recorder.file, 64 << 10));
        assert!(!shared_in_place && owned_in_place, "cluster 0 is the snapshot's too, cluster 1 the image's alone");
        let (zeroed, _) = host(&recorder.file, 128 << 10);
        let mut io = ImageIo { meta: &mut recorder, data: None, backing: None };
        image.discard(&mut io, 0, 128 << 10).unwrap();
        image.write_zeroes(&mut io, 128 << 10, 64 << 10, true, false).unwrap();
        image.write(&mut io, 128 << 10, 4096, &mut |_, buf| buf.fill(1)).unwrap();
        assert_eq!(recorder.discarded, [(owned, 64 << 10), (zeroed, 64 << 10)], "not {shared:#x}");
        assert_eq!(host(&recorder.file, 128 << 10), (zeroed, true), "the zeroed cluster was kept and written again");
    }

    #[test]
    fn a_slice_read_while_tables_were_written_is_read_again() {
        let (image, mut file) = cold_image("slice-stale");
        let mut memo = MapMemo::default();
        let missing = image.map_cached(&mut memo, 0, 4096).unwrap_err();
        let mut load = TableLoad::new(&image);
        image.start_load(&mut load, missing);
        read_into(&file, &mut load);
        // Another queue allocates in another slice of the table and flushes
        // it before this read is handed in: what was read may be stale.
        let mut io = ImageIo { meta: &mut file, data: None, backing: None };
        image.write(&mut io, 33 * MIB, 4096, &mut |_, buf| buf.fill(0xa5)).unwrap();
        image.flush(&mut io).unwrap();
        // SAFETY: read_into filled the whole buffer.
        assert!(!unsafe { image.finish_load(&mut load) }, "a read older than a table write is dropped");
        assert_eq!(image.map_cached(&mut memo, 0, 4096).unwrap_err(), missing);
        image.start_load(&mut load, missing);
        read_into(&file, &mut load);
        // SAFETY: as above.
        assert!(unsafe { image.finish_load(&mut load) });
        for at in [0, 33 * MIB] {
            let extent = image.map_cached(&mut memo, at, 4096).unwrap();
            assert!(matches!(extent.mapping, Mapping::Data { in_place: true, .. }), "{at:#x}: {extent:?}");
        }
    }

    /// An allocation that would scan a refcount block the cache lacks
    /// names it, having changed nothing, and goes through once it is loaded
    /// like a slice; the blocking path reads it itself.
    #[test]
    fn an_allocation_names_the_refcount_block_it_lacks() {
        let (image, file) = cold_image("block-miss");
        let mut io_file = file.clone();
        fn io(file: &mut MemFile) -> ImageIo<'_> {
            ImageIo { meta: file, data: None, backing: None }
        }
        let (_, slice) = image.missing_table(64 * MIB, 4096).unwrap();
        load(&image, &file, slice);
        let Err(e) = image.try_start_write(&mut io(&mut io_file), 64 * MIB, 4096) else {
            panic!("the refcount block was cached after the open");
        };
        let block = NeedsLoad::of(&e).expect("the refcount block is named");
        assert!(matches!(block.what, Missing::RefcountBlock(0)), "{block:?}");
        let Err(again) = image.try_start_write(&mut io(&mut io_file), 64 * MIB, 4096) else {
            panic!("the block was loaded by the failed attempt");
        };
        assert_eq!(NeedsLoad::of(&again), Some(block), "nothing changed, nothing held in flight");
        load(&image, &file, block);
        let pieces = image.try_start_write(&mut io(&mut io_file), 64 * MIB, 4096).unwrap();
        assert!(matches!(pieces[..], [Piece::Allocate(_)]));
        for piece in pieces {
            if let Piece::Allocate(a) = piece {
                image.finish_allocation(&mut io_file, a, false).unwrap();
            }
        }
    }
}
