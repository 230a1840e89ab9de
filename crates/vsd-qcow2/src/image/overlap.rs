//! Which clusters of the image file hold metadata, readable without the
//! metadata mutex: data writes are checked against it (QEMU's overlap
//! check), so a corrupt table entry can never send guest data over a
//! table, and the allocator never hands such a cluster out.
//!
//! The check is made once per L2 entry while its table is cached, the
//! first time a request uses it, not once per write: a table remembers the
//! map's version its entries were checked against, and only a cluster
//! turned into metadata since (a new version) makes them checked again.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{RwLock, RwLockReadGuard};

/// A bitmap of metadata clusters, growing with the image.
#[derive(Default)]
pub(super) struct MetadataMap {
    bits: RwLock<Vec<u64>>,
    /// How many clusters became metadata so far (changed under `bits`'
    /// write lock).
    version: AtomicU64,
}

impl MetadataMap {
    pub(super) fn new(clusters: impl IntoIterator<Item = u64>) -> Self {
        let map = Self::default();
        clusters.into_iter().for_each(|c| map.insert(c));
        map
    }

    pub(super) fn insert(&self, cluster: u64) {
        let mut bits = self.bits.write().unwrap_or_else(|e| e.into_inner());
        let word = (cluster / 64) as usize;
        if word >= bits.len() {
            bits.resize(word + 1, 0);
        }
        bits[word] |= 1 << (cluster % 64);
        self.version.fetch_add(1, Ordering::Release);
    }

    /// Changes whenever a cluster becomes metadata; removals leave it, as
    /// they cannot make a checked entry overlap.
    #[inline]
    pub(super) fn version(&self) -> u64 {
        self.version.load(Ordering::Acquire)
    }

    pub(super) fn remove(&self, cluster: u64) {
        let mut bits = self.bits.write().unwrap_or_else(|e| e.into_inner());
        if let Some(word) = bits.get_mut((cluster / 64) as usize) {
            *word &= !(1 << (cluster % 64));
        }
    }

    pub(super) fn contains(&self, cluster: u64) -> bool {
        holds(&self.read(), cluster)
    }

    /// Whether any cluster of the byte range `[offset, offset + len)` holds
    /// metadata.
    pub(super) fn overlaps(&self, offset: u64, len: u64, cluster_bits: u32) -> bool {
        let bits = self.read();
        let last = (offset + len.max(1) - 1) >> cluster_bits;
        ((offset >> cluster_bits)..=last).any(|c| holds(&bits, c))
    }

    /// Runs `f` with a test of whether a cluster holds metadata and the
    /// version the test answers for, locking once for all its tests (a
    /// table's worth of entries).
    pub(super) fn with_test<R>(&self, f: impl FnOnce(&dyn Fn(u64) -> bool, u64) -> R) -> R {
        let bits = self.read();
        f(&|cluster| holds(&bits, cluster), self.version.load(Ordering::Relaxed))
    }

    fn read(&self) -> RwLockReadGuard<'_, Vec<u64>> {
        self.bits.read().unwrap_or_else(|e| e.into_inner())
    }
}

fn holds(bits: &[u64], cluster: u64) -> bool {
    bits.get((cluster / 64) as usize).is_some_and(|w| w & (1 << (cluster % 64)) != 0)
}
