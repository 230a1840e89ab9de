//! The L2 table cache: tables of atomics that readers consult under a
//! read lock held only for the lookup, and that the metadata mutex's holder
//! updates in place.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use crate::buf::AlignedBuf;
use crate::entry::{COMPRESSED, EntryError, L2Entry, Layout, OFFSET_MASK};

/// One L2 table as in memory: raw entries (and bitmaps, for extended L2)
/// in the file's byte order (big-endian), as QEMU caches them: a table
/// comes in with one copy, for nearly every request when the cache is
/// small, and a lookup pays one byte swap.
pub(super) struct L2Table {
    /// Where the table is in the image file.
    pub(super) offset: u64,
    words: Box<[AtomicU64]>,
    /// Entries known not to point into the image's metadata, one bit each:
    /// an entry is checked the first time a request uses it, not when the
    /// table is loaded (a table loaded for one request is often evicted
    /// before a second entry of it is used). Cleared whenever a cluster
    /// becomes metadata.
    verified: Box<[AtomicU64]>,
    /// The metadata map's version `verified` holds for.
    verified_at: AtomicU64,
    stamp: AtomicU64,
}

/// `verified_at` of a table never verified.
const UNVERIFIED: u64 = u64::MAX;

impl L2Table {
    /// A table as read from disk.
    pub(super) fn parse(offset: u64, raw: &[u8]) -> Self {
        let (entries, _) = raw.as_chunks::<8>();
        Self::from_disk(offset, entries.iter().map(|w| u64::from_ne_bytes(*w)).collect())
    }

    /// A table whose words were read from disk into `words`, kept as they
    /// are.
    pub(super) fn from_disk(offset: u64, words: Box<[u64]>) -> Self {
        Self::with_words(offset, atomic(words))
    }

    /// A table of unallocated entries at `offset`.
    pub(super) fn empty(offset: u64, cluster_size: u64) -> Self {
        Self::with_words(offset, (0..cluster_size / 8).map(|_| AtomicU64::new(0)).collect())
    }

    /// A copy of this table to be written at `offset` (copy-on-write of a
    /// table shared with a snapshot).
    pub(super) fn copy_to(&self, offset: u64) -> Self {
        let table =
            Self::with_words(offset, self.words.iter().map(|w| AtomicU64::new(w.load(Ordering::Relaxed))).collect());
        table.verified_at.store(self.verified_at.load(Ordering::Acquire), Ordering::Release);
        table
            .verified
            .iter()
            .zip(&self.verified)
            .for_each(|(to, from)| to.store(from.load(Ordering::Relaxed), Ordering::Relaxed));
        table
    }

    fn with_words(offset: u64, words: Box<[AtomicU64]>) -> Self {
        let verified = (0..words.len().div_ceil(64)).map(|_| AtomicU64::new(0)).collect();
        Self { offset, words, verified, verified_at: AtomicU64::new(UNVERIFIED), stamp: AtomicU64::new(0) }
    }

    /// Word `i` in host byte order.
    #[inline]
    fn word(&self, i: usize, order: Ordering) -> u64 {
        u64::from_be(self.words[i].load(order))
    }

    /// Sets word `i` from host byte order.
    #[inline]
    fn set_word(&self, i: usize, value: u64) {
        self.words[i].store(value.to_be(), Ordering::Release);
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
    #[inline]
    pub(super) fn is_verified(&self, index: usize) -> bool {
        self.verified[index / 64].load(Ordering::Acquire) & (1 << (index % 64)) != 0
    }

    /// Checks entry `index` against the metadata: whether the data it
    /// points at (if any) lies outside every metadata cluster, which it
    /// then remembers. `is_metadata(host)` says whether a data cluster
    /// offset is a metadata cluster (None: data lives in an external file,
    /// where nothing can overlap). Called under the metadata map's read
    /// lock, after [`L2Table::revalidate`].
    pub(super) fn verify(&self, layout: &Layout, index: usize, is_metadata: Option<&dyn Fn(u64) -> bool>) -> bool {
        if let Some(is_metadata) = is_metadata {
            let stride = if layout.extended { 2 } else { 1 };
            let cluster_size = 1u64 << layout.cluster_bits;
            let e = self.word(index * stride, Ordering::Acquire);
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

    /// Decodes entry `index`, verified or not.
    pub(super) fn decode(&self, layout: &Layout, index: usize) -> Result<L2Entry, EntryError> {
        let stride = if layout.extended { 2 } else { 1 };
        let entry = self.word(index * stride, Ordering::Acquire);
        let bitmap = if layout.extended { self.word(index * stride + 1, Ordering::Acquire) } else { 0 };
        layout.decode(entry, bitmap)
    }

    /// The raw entry word `index` (for errors).
    pub(super) fn raw_entry(&self, layout: &Layout, index: usize) -> u64 {
        self.word(index * if layout.extended { 2 } else { 1 }, Ordering::Relaxed)
    }

    /// Entry `index` if it plainly maps data ([`Layout::plain_data`]) and
    /// is verified not to point into metadata.
    #[inline]
    pub(super) fn plain_data(&self, layout: &Layout, index: usize) -> Option<(u64, bool)> {
        if layout.extended || !self.is_verified(index) {
            return None;
        }
        layout.plain_data(self.word(index, Ordering::Acquire))
    }

    /// Replaces entry `index` in memory; returns the byte range of the
    /// table that changed. New entries come from the allocator, which never
    /// hands out metadata clusters, so the entry's verification stands.
    pub(super) fn set(&self, layout: &Layout, index: usize, e: &L2Entry) -> std::ops::Range<usize> {
        let (entry, bitmap) = layout.encode(e);
        if layout.extended {
            // The bitmap first: a reader that sees the new entry word also
            // sees the bitmap that goes with it.
            self.set_word(index * 2 + 1, bitmap);
            self.set_word(index * 2, entry);
            index * 16..index * 16 + 16
        } else {
            self.set_word(index, entry);
            index * 8..index * 8 + 8
        }
    }

    /// The on-disk bytes of `range` (aligned to 512-byte sectors by the
    /// caller).
    pub(super) fn bytes(&self, range: std::ops::Range<usize>) -> AlignedBuf {
        let mut out = AlignedBuf::zeroed(range.len());
        for (chunk, word) in out.chunks_exact_mut(8).zip(&self.words[range.start / 8..range.end / 8]) {
            chunk.copy_from_slice(&word.load(Ordering::Relaxed).to_ne_bytes());
        }
        out
    }

    /// Its size in bytes.
    pub(super) fn len(&self) -> usize {
        self.words.len() * 8
    }
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

/// Cached L2 tables by offset, with approximate LRU eviction.
pub(super) struct L2Cache {
    tables: RwLock<TableMap>,
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
    /// A cache of at most `capacity` tables (at least 2).
    pub(super) fn new(capacity: usize) -> Self {
        Self {
            tables: RwLock::default(),
            capacity: capacity.max(2),
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
        let table = tables.get(&offset)?;
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
        tables.get(&offset).cloned()
    }

    /// Adds a table, evicting the least recently used one if full.
    pub(super) fn insert(&self, table: Arc<L2Table>) {
        let now = self.clock.fetch_add(1, Ordering::Relaxed) + 1;
        table.stamp.store(now, Ordering::Relaxed);
        let mut tables = self.tables.write().unwrap_or_else(|e| e.into_inner());
        self.generation.fetch_add(1, Ordering::Release);
        tables.insert(table.offset, table);
        if tables.len() > self.capacity {
            let oldest = tables.iter().min_by_key(|(_, t)| t.stamp.load(Ordering::Relaxed)).map(|(&off, _)| off);
            if let Some(off) = oldest {
                tables.remove(&off);
            }
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
        tables.retain(|_, t| t.stamp.load(Ordering::Relaxed) >= last);
    }

    /// Forgets the table at `offset` (it moved).
    pub(super) fn remove(&self, offset: u64) {
        let mut tables = self.tables.write().unwrap_or_else(|e| e.into_inner());
        self.generation.fetch_add(1, Ordering::Release);
        tables.remove(&offset);
    }
}
