//! A job's own record of the writes to a node (QEMU's mirror bitmap):
//! marked when a write *completes*, so that a range the job cleaned and
//! then read is dirty again if a write to it landed after the read began.
//! Named bitmaps are marked at submission, which is enough for what they
//! serve (a backup's point in time holds writes back with its hook).

use std::sync::atomic::Ordering;
use std::sync::{Arc, PoisonError};

use super::DirtyBitmaps;
use super::bitmap::Words;

/// Ranges of a node written since the tracker's owner last took them.
pub struct Tracker {
    /// The bitmaps whose writers mark it, unless it is marked apart.
    bitmaps: Option<Arc<DirtyBitmaps>>,
    pub(super) words: Arc<Words>,
    shift: u32,
}

impl Tracker {
    pub(super) fn new(bitmaps: Arc<DirtyBitmaps>, size: u64, granularity: u64) -> Self {
        let shift = granularity.trailing_zeros();
        let words = Arc::new(Words::new(size, shift));
        bitmaps.trackers.lock().unwrap_or_else(PoisonError::into_inner).push((words.clone(), shift));
        bitmaps.changed();
        Self { bitmaps: Some(bitmaps), words, shift }
    }

    /// A tracker no writer marks, only its owner (a write-blocking
    /// mirror's, whose filter writes the target itself).
    pub fn apart(size: u64, granularity: u64) -> Self {
        let shift = granularity.trailing_zeros();
        Self { bitmaps: None, words: Arc::new(Words::new(size, shift)), shift }
    }

    /// No writer marks it from their next write on, only its owner (a
    /// mirror switched to write-blocking). Call it with no write in flight.
    pub fn set_apart(&self) {
        let Some(bitmaps) = &self.bitmaps else { return };
        bitmaps.trackers.lock().unwrap_or_else(PoisonError::into_inner).retain(|(w, _)| !Arc::ptr_eq(w, &self.words));
        bitmaps.changed();
    }

    /// Bytes per bit.
    pub fn granularity(&self) -> u64 {
        1 << self.shift
    }

    /// Marks bytes `offset..offset + len` dirty.
    pub fn mark(&self, offset: u64, len: u64) {
        self.words.set(offset, len, self.shift);
    }

    /// Takes the first dirty run at or after byte `from`, at most `max`
    /// bytes (rounded up to whole granules): it is clean from now on.
    pub fn take(&self, from: u64, max: u64) -> Option<(u64, u64)> {
        let (offset, len) = self.words.next_dirty(from, self.shift)?;
        let granule = self.granularity();
        let len = len.min(max.next_multiple_of(granule).max(granule));
        let (first, last) = (offset >> self.shift, (offset + len - 1) >> self.shift);
        for bit in first..=last {
            self.words.words[(bit / 64) as usize].fetch_and(!(1 << (bit % 64)), Ordering::SeqCst);
        }
        Some((offset, len))
    }

    /// Bytes dirty now, in whole granules (at most the node's size).
    pub fn dirty_bytes(&self) -> u64 {
        (self.words.count() << self.shift).min(self.words.size)
    }
}

impl Drop for Tracker {
    fn drop(&mut self) {
        self.set_apart();
    }
}
