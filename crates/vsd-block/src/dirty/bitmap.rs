//! One named bitmap: its state, its bits, and the guard of a user that
//! holds it busy.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use super::{BitmapError, BitmapOptions, DirtySet};

/// One named bitmap.
pub struct Bitmap {
    pub(super) name: String,
    pub(super) granularity: u64,
    /// log2 of the granularity.
    pub(super) shift: u32,
    pub(super) persistent: bool,
    pub(super) state: Mutex<BitmapState>,
}

pub(super) struct BitmapState {
    pub(super) enabled: bool,
    /// A job or export uses it: it cannot be changed or removed.
    pub(super) busy: bool,
    pub(super) inconsistent: bool,
    pub(super) words: Arc<Words>,
}

/// What `query-named-block-nodes` shows of a bitmap.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BitmapInfo {
    /// Its name.
    pub name: String,
    /// Dirty bytes (whole granules).
    pub count: u64,
    /// Bytes per bit.
    pub granularity: u64,
    /// Whether it records writes.
    pub recording: bool,
    /// Whether something uses it.
    pub busy: bool,
    /// Whether it is kept in the image.
    pub persistent: bool,
    /// Whether a crash left its contents unknown.
    pub inconsistent: bool,
}

impl Bitmap {
    pub(super) fn new(name: String, size: u64, options: BitmapOptions) -> Self {
        let shift = options.granularity.trailing_zeros();
        let state = BitmapState {
            enabled: options.enabled,
            busy: false,
            inconsistent: false,
            words: Arc::new(Words::new(size, shift)),
        };
        Self { name, granularity: options.granularity, shift, persistent: options.persistent, state: Mutex::new(state) }
    }

    pub(super) fn state(&self) -> MutexGuard<'_, BitmapState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(super) fn words(&self) -> Arc<Words> {
        self.state().words.clone()
    }

    /// Its name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Bytes per bit.
    pub fn granularity(&self) -> u64 {
        self.granularity
    }

    /// What QMP shows of it.
    pub fn info(&self) -> BitmapInfo {
        let state = self.state();
        BitmapInfo {
            name: self.name.clone(),
            count: state.words.count() << self.shift,
            granularity: self.granularity,
            recording: state.enabled,
            busy: state.busy,
            persistent: self.persistent,
            inconsistent: state.inconsistent,
        }
    }

    /// Refuses a bitmap that is busy or inconsistent (QEMU's default check).
    pub fn usable(&self) -> Result<(), BitmapError> {
        let state = self.state();
        if state.busy {
            Err(BitmapError::Busy(self.name.clone()))
        } else if state.inconsistent {
            Err(BitmapError::Inconsistent(self.name.clone()))
        } else {
            Ok(())
        }
    }

    /// Marks every bit clean.
    pub fn clear(&self) -> Result<(), BitmapError> {
        self.usable()?;
        self.words().clear();
        Ok(())
    }

    /// Sets in this bitmap every byte dirty in `source` (of any granularity).
    pub fn merge(&self, source: &Bitmap) -> Result<(), BitmapError> {
        self.usable()?;
        source.usable()?;
        self.check_merge(source)?;
        let (target, from) = (self.words(), source.words());
        let mut at = 0;
        while let Some((offset, len)) = from.next_dirty(at, source.shift) {
            target.set(offset, len, self.shift);
            at = offset + len;
        }
        Ok(())
    }

    /// A copy of its bits, to put back with [`Bitmap::put_back`].
    pub fn copy_bits(&self) -> Vec<u64> {
        self.words().words.iter().map(|w| w.load(Ordering::SeqCst)).collect()
    }

    /// Sets its bits to `bits` (from [`Bitmap::copy_bits`]): an undone
    /// change. A write recorded since the copy is lost from this bitmap.
    pub fn put_back(&self, bits: &[u64]) {
        for (word, bits) in self.words().words.iter().zip(bits) {
            word.store(*bits, Ordering::SeqCst);
        }
    }

    /// Marks dirty again the bits of `bits` (from [`Bitmap::copy_bits`]):
    /// an undone clear, which loses no write recorded since.
    pub fn add_back(&self, bits: &[u64]) {
        for (word, bits) in self.words().words.iter().zip(bits) {
            word.fetch_or(*bits, Ordering::SeqCst);
        }
    }

    /// Refuses to merge `source` into this bitmap if their sizes differ.
    pub fn check_merge(&self, source: &Bitmap) -> Result<(), BitmapError> {
        let (target, merged) = (self.words().size, source.words().size);
        if target == merged { Ok(()) } else { Err(BitmapError::Sizes { target, merged }) }
    }

    /// Whether the bytes from `offset` are dirty, and for how many of them
    /// (1 to `len`; the range lies inside the node): NBD's block status.
    pub fn status(&self, offset: u64, len: u64) -> (bool, u64) {
        self.words().status(offset, len, self.shift)
    }

    /// Takes the bitmap for an export or a job until the guard drops.
    pub fn take(self: &Arc<Self>) -> Result<BusyGuard, BitmapError> {
        self.usable()?;
        self.hold()
    }

    /// Takes the bitmap whatever its bits are (even inconsistent): to
    /// remove it ([`DirtyBitmaps::remove_held`]).
    pub fn hold(self: &Arc<Self>) -> Result<BusyGuard, BitmapError> {
        let mut state = self.state();
        if state.busy {
            return Err(BitmapError::Busy(self.name.clone()));
        }
        state.busy = true;
        Ok(BusyGuard(self.clone()))
    }
}

/// A bitmap in use: it cannot be changed or removed while this lives.
pub struct BusyGuard(Arc<Bitmap>);

impl BusyGuard {
    /// The bitmap.
    pub fn bitmap(&self) -> &Arc<Bitmap> {
        &self.0
    }

    /// Takes every dirty bit out of the bitmap, which goes on recording
    /// from clean: what was dirty until now, for a backup to copy.
    pub fn split(&self) -> DirtySet {
        let words = self.0.words();
        let bits = words.words.iter().map(|w| w.swap(0, Ordering::SeqCst)).collect();
        DirtySet { bits, shift: self.0.shift, size: words.size }
    }

    /// Marks dirty again what `set` holds (of any granularity): what a
    /// backup did not copy.
    pub fn restore(&self, set: &DirtySet) {
        let words = self.0.words();
        let mut index = 0;
        while let Some(dirty) = set.next_dirty(index) {
            words.set(dirty << set.shift, 1 << set.shift, self.0.shift);
            index = dirty + 1;
        }
    }
}

impl Drop for BusyGuard {
    fn drop(&mut self) {
        self.0.state().busy = false;
    }
}

/// The bits of a bitmap for a node of `size` bytes.
pub(super) struct Words {
    pub(super) size: u64,
    pub(super) bits: u64,
    pub(super) words: Box<[AtomicU64]>,
}

impl Words {
    pub(super) fn new(size: u64, shift: u32) -> Self {
        let bits = size.div_ceil(1 << shift);
        let words = (0..bits.div_ceil(64)).map(|_| AtomicU64::new(0)).collect();
        Self { size, bits, words }
    }

    /// Marks bytes `offset..offset + len` dirty (those inside the node).
    #[inline]
    pub(super) fn set(&self, offset: u64, len: u64, shift: u32) {
        if len == 0 || offset >= self.size {
            return;
        }
        let first = offset >> shift;
        let last = ((offset + len - 1) >> shift).min(self.bits - 1);
        for index in first / 64..=last / 64 {
            let low = if index == first / 64 { first % 64 } else { 0 };
            let high = if index == last / 64 { last % 64 } else { 63 };
            let mask = (u64::MAX >> (63 - high)) & (u64::MAX << low);
            let word = &self.words[index as usize];
            // Already dirty (the common case for a busy region): no write
            // to a line other queues may be reading.
            if word.load(Ordering::Relaxed) & mask != mask {
                word.fetch_or(mask, Ordering::SeqCst);
            }
        }
    }

    fn clear(&self) {
        self.words.iter().for_each(|w| w.store(0, Ordering::SeqCst));
    }

    pub(super) fn count(&self) -> u64 {
        self.words.iter().map(|w| u64::from(w.load(Ordering::Relaxed).count_ones())).sum()
    }

    fn bit(&self, index: u64) -> bool {
        self.words[(index / 64) as usize].load(Ordering::Relaxed) & (1 << (index % 64)) != 0
    }

    /// The first dirty run at or after byte `from`, in bytes, clamped to the node.
    pub(super) fn next_dirty(&self, from: u64, shift: u32) -> Option<(u64, u64)> {
        if from >= self.size {
            return None;
        }
        let mut bit = from >> shift;
        while bit < self.bits && !self.bit(bit) {
            bit += 1;
        }
        if bit >= self.bits {
            return None;
        }
        let start = bit;
        while bit < self.bits && self.bit(bit) {
            bit += 1;
        }
        let offset = (start << shift).max(from);
        Some((offset, (bit << shift).min(self.size) - offset))
    }

    fn status(&self, offset: u64, len: u64, shift: u32) -> (bool, u64) {
        if offset >= self.size {
            return (false, len); // the node grew and the bitmap not yet
        }
        let end = offset + len;
        let dirty = self.bit(offset >> shift);
        let mut bit = (offset >> shift) + 1;
        while bit << shift < end && self.bit(bit) == dirty {
            bit += 1;
        }
        (dirty, (bit << shift).min(end) - offset)
    }

    pub(super) fn or_from(&self, other: &Words) {
        for (to, from) in self.words.iter().zip(other.words.iter()) {
            to.fetch_or(from.load(Ordering::SeqCst), Ordering::SeqCst);
        }
        // Bits past this size came from a larger node.
        if let Some(last) = self.words.last().filter(|_| !self.bits.is_multiple_of(64)) {
            last.fetch_and(u64::MAX >> (64 - self.bits % 64), Ordering::SeqCst);
        }
    }
}
