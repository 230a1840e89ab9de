//! The L2 table cache: tables of atomics that readers consult under a
//! read lock held only for the lookup, and that the metadata mutex's holder
//! updates in place. Tables are loaded a slice at a time (4 KiB by default,
//! QEMU's `l2-cache-entry-size`): a random read over a disk far larger
//! than the cache reads 4 KiB of table per miss, not a whole cluster.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};

use crate::buf::AlignedBuf;
use crate::entry::{COMPRESSED, EntryError, L2Entry, Layout, OFFSET_MASK};

/// One L2 table as in memory: raw entries (and bitmaps, for extended L2)
/// in the file's byte order (big-endian), as QEMU caches them: a slice
/// comes in with one copy, and a lookup pays one byte swap.
pub(super) struct L2Table {
    /// Where the table is in the image file.
    pub(super) offset: u64,
    /// The table's words, slice by slice, each set once when loaded.
    slices: Box<[Slice]>,
    /// log2 of the words per slice.
    slice_bits: u32,
    /// Slices loaded so far.
    loaded: AtomicUsize,
    /// Entries known not to point into the image's metadata, one bit each:
    /// an entry is checked the first time a request uses it, not when its
    /// slice is loaded. Cleared whenever a cluster becomes metadata.
    verified: Box<[AtomicU64]>,
    /// The metadata map's version `verified` holds for.
    verified_at: AtomicU64,
    stamp: AtomicU64,
}

/// `verified_at` of a table never verified.
const UNVERIFIED: u64 = u64::MAX;

impl L2Table {
    /// A table of `len` bytes at `offset`, in slices of `slice` bytes,
    /// none loaded.
    pub(super) fn unloaded(offset: u64, len: usize, slice: usize) -> Self {
        let slice_words = slice.min(len) / 8;
        let words = len / 8;
        Self {
            offset,
            slices: (0..words / slice_words).map(|_| Slice(AtomicPtr::new(std::ptr::null_mut()))).collect(),
            slice_bits: slice_words.trailing_zeros(),
            loaded: AtomicUsize::new(0),
            verified: (0..words.div_ceil(64)).map(|_| AtomicU64::new(0)).collect(),
            verified_at: AtomicU64::new(UNVERIFIED),
            stamp: AtomicU64::new(0),
        }
    }

    /// A table as read whole from disk: every slice loaded.
    pub(super) fn parse(offset: u64, raw: &[u8], slice: usize) -> Self {
        let table = Self::unloaded(offset, raw.len(), slice);
        let (words, _) = raw.as_chunks::<8>();
        for (slice, chunk) in words.chunks(table.slice_words()).enumerate() {
            table.fill(slice, chunk.iter().map(|w| u64::from_ne_bytes(*w)).collect());
        }
        table
    }

    /// A table of unallocated entries at `offset`.
    pub(super) fn empty(offset: u64, len: usize, slice: usize) -> Self {
        Self::parse(offset, &vec![0; len], slice)
    }

    /// A copy of this table to be written at `offset` (copy-on-write of a
    /// table shared with a snapshot); None unless every slice is loaded.
    pub(super) fn copy_to(&self, offset: u64) -> Option<Self> {
        let table = Self::unloaded(offset, self.len(), self.slice_words() * 8);
        for i in 0..self.slices.len() {
            table.fill(i, self.slice(i)?.iter().map(|w| w.load(Ordering::Relaxed)).collect());
        }
        table.verified_at.store(self.verified_at.load(Ordering::Acquire), Ordering::Release);
        table
            .verified
            .iter()
            .zip(&self.verified)
            .for_each(|(to, from)| to.store(from.load(Ordering::Relaxed), Ordering::Relaxed));
        Some(table)
    }

    /// Words per slice.
    pub(super) fn slice_words(&self) -> usize {
        1 << self.slice_bits
    }

    /// The slice holding entry `index`.
    pub(super) fn slice_of(&self, layout: &Layout, index: usize) -> usize {
        (index * stride(layout)) >> self.slice_bits
    }

    /// Whether slice `slice` is loaded.
    pub(super) fn is_loaded(&self, slice: usize) -> bool {
        !self.slices[slice].0.load(Ordering::Acquire).is_null()
    }

    /// Slices loaded so far.
    pub(super) fn loaded(&self) -> usize {
        self.loaded.load(Ordering::Acquire)
    }

    /// Sets slice `slice` to `words` as read from disk (file byte order),
    /// unless it is loaded already; whether it was set. Through
    /// [`L2Cache::fill`] for a table that may be cached.
    pub(super) fn fill(&self, slice: usize, words: Box<[u64]>) -> bool {
        assert_eq!(words.len(), self.slice_words(), "a slice is a slice's worth of words");
        let words = Box::into_raw(atomic(words)).cast::<AtomicU64>();
        let null = std::ptr::null_mut();
        if self.slices[slice].0.compare_exchange(null, words, Ordering::AcqRel, Ordering::Acquire).is_err() {
            // SAFETY: `words` came from Box::into_raw of a slice this long
            // just above, and went nowhere else.
            drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(words, self.slice_words())) });
            return false;
        }
        self.loaded.fetch_add(1, Ordering::AcqRel);
        true
    }

    /// Slice `slice`'s words, if loaded.
    fn slice(&self, slice: usize) -> Option<&[AtomicU64]> {
        let words = self.slices[slice].0.load(Ordering::Acquire);
        // SAFETY: a non-null slice pointer names a slice's worth of words,
        // set once by `fill` and freed only when the table drops.
        (!words.is_null()).then(|| unsafe { std::slice::from_raw_parts(words, self.slice_words()) })
    }

    /// The atomic holding word `i`, if its slice is loaded.
    #[inline(always)]
    fn atom(&self, i: usize) -> Option<&AtomicU64> {
        let words = self.slices[i >> self.slice_bits].0.load(Ordering::Acquire);
        // SAFETY: as in `slice`; the index is masked to within the slice.
        (!words.is_null()).then(|| unsafe { &*words.add(i & ((1 << self.slice_bits) - 1)) })
    }

    /// Word `i` in host byte order, if its slice is loaded.
    #[inline(always)]
    fn word(&self, i: usize, order: Ordering) -> Option<u64> {
        Some(u64::from_be(self.atom(i)?.load(order)))
    }

    /// Sets word `i` from host byte order; false if its slice is not loaded.
    #[inline]
    fn set_word(&self, i: usize, value: u64) -> bool {
        self.atom(i).map(|w| w.store(value.to_be(), Ordering::Release)).is_some()
    }

    /// Whether the verified entries hold for `version` of the metadata map.
    #[inline]
    pub(super) fn checked(&self, version: u64) -> bool {
        self.verified_at.load(Ordering::Acquire) == version
    }

    /// Forgets every verification unless they hold for `version`. Called
    /// under the metadata map's read lock, so that no verification against
    /// an older version can land after the reset.
    pub(super) fn revalidate(&self, version: u64) {
        if !self.checked(version) {
            self.verified.iter().for_each(|w| w.store(0, Ordering::Relaxed));
            self.verified_at.store(version, Ordering::Release);
        }
    }

    /// Whether entry `index` is known not to point into metadata.
    #[inline(always)]
    pub(super) fn is_verified(&self, index: usize) -> bool {
        self.verified[index / 64].load(Ordering::Acquire) & (1 << (index % 64)) != 0
    }

    /// Checks entry `index` against the metadata: whether the data it
    /// points at (if any) lies outside every metadata cluster, which it
    /// then remembers. `is_metadata(host)` says whether a data cluster
    /// offset is a metadata cluster (None: data lives in an external file,
    /// where nothing can overlap). Called under the metadata map's read
    /// lock, after [`L2Table::revalidate`]; false too if the entry's slice
    /// is not loaded.
    pub(super) fn verify(&self, layout: &Layout, index: usize, is_metadata: Option<&dyn Fn(u64) -> bool>) -> bool {
        let Some(e) = self.word(index * stride(layout), Ordering::Acquire) else { return false };
        if let Some(is_metadata) = is_metadata {
            let cluster_size = 1u64 << layout.cluster_bits;
            let (start, len) = if e & COMPRESSED != 0 {
                layout.decode(e, 0).ok().and_then(|d| d.compressed).unwrap_or((0, 0))
            } else {
                (e & OFFSET_MASK, cluster_size)
            };
            let mut clusters = (start / cluster_size..(start + len).div_ceil(cluster_size)).filter(|_| start != 0);
            if clusters.any(|c| is_metadata(c * cluster_size)) {
                return false;
            }
        }
        self.verified[index / 64].fetch_or(1 << (index % 64), Ordering::Release);
        true
    }

    /// Decodes entry `index`, verified or not; None if its slice is not
    /// loaded.
    pub(super) fn decode(&self, layout: &Layout, index: usize) -> Option<Result<L2Entry, EntryError>> {
        let at = index * stride(layout);
        let entry = self.word(at, Ordering::Acquire)?;
        let bitmap = if layout.extended { self.word(at + 1, Ordering::Acquire)? } else { 0 };
        Some(layout.decode(entry, bitmap))
    }

    /// The raw entry word `index` (for errors); 0 if not loaded.
    pub(super) fn raw_entry(&self, layout: &Layout, index: usize) -> u64 {
        self.word(index * stride(layout), Ordering::Relaxed).unwrap_or(0)
    }

    /// Entry `index` if it plainly maps data ([`Layout::plain_data`]) and
    /// is verified not to point into metadata (so its slice is loaded).
    #[inline(always)]
    pub(super) fn plain_data(&self, layout: &Layout, index: usize) -> Option<(u64, bool)> {
        if layout.extended || !self.is_verified(index) {
            return None;
        }
        layout.plain_data(self.word(index, Ordering::Acquire)?)
    }

    /// Replaces entry `index` in memory; returns the byte range of the
    /// table that changed, or None if its slice is not loaded. New entries
    /// come from the allocator, which never hands out metadata clusters,
    /// so the entry's verification stands.
    pub(super) fn set(&self, layout: &Layout, index: usize, e: &L2Entry) -> Option<std::ops::Range<usize>> {
        let (entry, bitmap) = layout.encode(e);
        if layout.extended {
            // The bitmap first: a reader that sees the new entry word also
            // sees the bitmap that goes with it.
            (self.set_word(index * 2 + 1, bitmap) && self.set_word(index * 2, entry))
                .then_some(index * 16..index * 16 + 16)
        } else {
            self.set_word(index, entry).then_some(index * 8..index * 8 + 8)
        }
    }

    /// The on-disk bytes of `range` (aligned to 512-byte sectors by the
    /// caller); None if part of it is not loaded.
    pub(super) fn bytes(&self, range: std::ops::Range<usize>) -> Option<AlignedBuf> {
        let mut out = AlignedBuf::zeroed(range.len());
        for (chunk, i) in out.chunks_exact_mut(8).zip(range.start / 8..) {
            chunk.copy_from_slice(&self.word(i, Ordering::Relaxed)?.to_be_bytes());
        }
        Some(out)
    }

    /// Its size in bytes.
    pub(super) fn len(&self) -> usize {
        self.slices.len() << (self.slice_bits + 3)
    }
}

impl Drop for L2Table {
    fn drop(&mut self) {
        for slice in &self.slices {
            let words = slice.0.load(Ordering::Acquire);
            if !words.is_null() {
                // SAFETY: set by `fill` from Box::into_raw of a slice this
                // long; nothing uses it once the table is dropped.
                drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(words, self.slice_words())) });
            }
        }
    }
}

/// One slice of a table: null until loaded, then a slice's worth of words
/// (from a boxed slice) that stays until the table drops. A bare pointer,
/// not a `OnceLock<Box<[_]>>`: every lookup goes through it, and it saves
/// the lock's state check and the length's bounds check.
struct Slice(AtomicPtr<AtomicU64>);

/// Words per entry.
fn stride(layout: &Layout) -> usize {
    if layout.extended { 2 } else { 1 }
}

/// `words` as atomics, in the same allocation.
fn atomic(words: Box<[u64]>) -> Box<[AtomicU64]> {
    const _: () = assert!(std::mem::align_of::<AtomicU64>() == std::mem::align_of::<u64>());
    // SAFETY: AtomicU64 has the same size and bit validity as u64, and here
    // (asserted above) the same alignment, so the allocation holds a valid
    // [AtomicU64] of the same length and layout, which the new box owns.
    unsafe { Box::from_raw(Box::into_raw(words) as *mut [AtomicU64]) }
}

/// Hashes a table's offset as itself: offsets are distinct multiples of
/// the cluster size, and SipHash showed up in every lookup's profile.
#[derive(Default)]
pub(super) struct OffsetHasher(u64);

impl Hasher for OffsetHasher {
    fn finish(&self) -> u64 {
        // Fibonacci hashing spreads the low zero bits over the whole word.
        self.0.wrapping_mul(0x9e37_79b9_7f4a_7c15)
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8) | u64::from(b);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

type TableMap = HashMap<u64, Arc<L2Table>, BuildHasherDefault<OffsetHasher>>;

/// The cached tables, and the slices they hold between them.
#[derive(Default)]
struct Tables {
    map: TableMap,
    slices: usize,
}

/// Cached L2 tables by offset, with approximate LRU eviction, bounded by
/// the slices they hold.
pub(super) struct L2Cache {
    tables: RwLock<Tables>,
    /// Slices the cache may hold.
    capacity: usize,
    /// Advanced on every insertion and cleaning pass; lookups stamp tables
    /// with it, so the hit path writes no shared counter.
    clock: AtomicU64,
    /// The clock at the last cleaning pass.
    cleaned: AtomicU64,
    /// Changes whenever a table enters or leaves the cache: a queue's memo
    /// of tables is valid while it stays the same.
    generation: AtomicU64,
}

impl L2Cache {
    /// A cache of at most `capacity` slices (at least `floor`).
    pub(super) fn new(capacity: usize, floor: usize) -> Self {
        Self {
            tables: RwLock::default(),
            capacity: capacity.max(floor),
            clock: AtomicU64::new(1),
            cleaned: AtomicU64::new(0),
            generation: AtomicU64::new(0),
        }
    }

    /// The cache's current generation.
    #[inline]
    pub(super) fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// The table at `offset`, if cached, and the generation it is cached in.
    pub(super) fn lookup(&self, offset: u64) -> Option<(Arc<L2Table>, u64)> {
        let tables = self.tables.read().unwrap_or_else(|e| e.into_inner());
        let table = tables.map.get(&offset)?;
        self.touch(table);
        Some((table.clone(), self.generation()))
    }

    /// Marks a table as recently used.
    #[inline]
    pub(super) fn touch(&self, table: &L2Table) {
        let now = self.clock.load(Ordering::Relaxed);
        if table.stamp.load(Ordering::Relaxed) != now {
            table.stamp.store(now, Ordering::Relaxed);
        }
    }

    /// The table at `offset`, if cached.
    pub(super) fn get(&self, offset: u64) -> Option<Arc<L2Table>> {
        let tables = self.tables.read().unwrap_or_else(|e| e.into_inner());
        tables.map.get(&offset).cloned()
    }

    /// Adds a table, evicting the least recently used ones if full.
    pub(super) fn insert(&self, table: Arc<L2Table>) {
        let now = self.clock.fetch_add(1, Ordering::Relaxed) + 1;
        table.stamp.store(now, Ordering::Relaxed);
        let mut tables = self.tables.write().unwrap_or_else(|e| e.into_inner());
        self.generation.fetch_add(1, Ordering::Release);
        tables.slices += table.loaded();
        if let Some(old) = tables.map.insert(table.offset, table.clone()) {
            tables.slices -= old.loaded();
        }
        self.evict(&mut tables, table.offset);
    }

    /// Loads slice `slice` of `table` with `words` (file byte order),
    /// unless loaded already, counting it if the table is cached (and
    /// evicting others if that makes the cache full).
    pub(super) fn fill(&self, table: &Arc<L2Table>, slice: usize, words: Box<[u64]>) {
        let mut tables = self.tables.write().unwrap_or_else(|e| e.into_inner());
        if table.fill(slice, words) && tables.map.get(&table.offset).is_some_and(|t| Arc::ptr_eq(t, table)) {
            tables.slices += 1;
            self.evict(&mut tables, table.offset);
        }
    }

    /// Evicts the least recently used tables but `keep` while the cache
    /// holds more slices than it may.
    fn evict(&self, tables: &mut Tables, keep: u64) {
        while tables.slices > self.capacity {
            let oldest = tables
                .map
                .iter()
                .filter(|&(&off, _)| off != keep)
                .min_by_key(|(_, t)| t.stamp.load(Ordering::Relaxed))
                .map(|(&off, _)| off);
            let Some(table) = oldest.and_then(|off| tables.map.remove(&off)) else { return };
            tables.slices -= table.loaded();
            self.generation.fetch_add(1, Ordering::Release);
        }
    }

    /// Drops the tables no lookup touched since the previous pass (QEMU's
    /// cache-clean-interval). Tables with unwritten changes stay reachable
    /// through the metadata state.
    pub(super) fn drop_unused(&self) {
        let mut tables = self.tables.write().unwrap_or_else(|e| e.into_inner());
        self.generation.fetch_add(1, Ordering::Release);
        let now = self.clock.fetch_add(1, Ordering::Relaxed) + 1;
        let last = self.cleaned.swap(now, Ordering::Relaxed);
        let Tables { map, slices } = &mut *tables;
        map.retain(|_, t| {
            let keep = t.stamp.load(Ordering::Relaxed) >= last;
            if !keep {
                *slices -= t.loaded();
            }
            keep
        });
    }

    /// Forgets the table at `offset` (it moved).
    pub(super) fn remove(&self, offset: u64) {
        let mut tables = self.tables.write().unwrap_or_else(|e| e.into_inner());
        self.generation.fetch_add(1, Ordering::Release);
        if let Some(table) = tables.map.remove(&offset) {
            tables.slices -= table.loaded();
        }
    }
}
