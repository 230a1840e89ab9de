//! Dirty bits apart from any bitmap: what a backup has to copy.

/// Dirty bits taken out of a bitmap ([`BusyGuard::split`]), or made for a
/// whole node ([`DirtySet::all`]).
#[derive(Clone, Debug)]
pub struct DirtySet {
    pub(super) bits: Vec<u64>,
    pub(super) shift: u32,
    pub(super) size: u64,
}

impl DirtySet {
    /// Every byte of a node of `size` bytes dirty, at `granularity` (a
    /// power of two).
    pub fn all(size: u64, granularity: u64) -> Self {
        let mut set = Self::clean_set(size, granularity);
        let count = size.div_ceil(granularity);
        set.bits.fill(u64::MAX);
        if let Some(last) = set.bits.last_mut().filter(|_| !count.is_multiple_of(64)) {
            *last = u64::MAX >> (64 - count % 64);
        }
        set
    }

    /// No byte dirty.
    pub fn clean_set(size: u64, granularity: u64) -> Self {
        let bits = vec![0; size.div_ceil(granularity).div_ceil(64) as usize];
        Self { bits, shift: granularity.trailing_zeros(), size }
    }

    /// The same bytes at a coarser `granularity`: a granule is dirty if any
    /// byte of it was.
    pub fn coarsen(&self, granularity: u64) -> Self {
        let mut out = Self::clean_set(self.size, granularity.max(self.granularity()));
        let mut index = 0;
        while let Some(dirty) = self.next_dirty(index) {
            out.mark((dirty << self.shift) >> out.shift);
            index = dirty + 1;
        }
        out
    }

    fn mark(&mut self, index: u64) {
        if let Some(word) = self.bits.get_mut((index / 64) as usize) {
            *word |= 1 << (index % 64);
        }
    }

    /// Bytes per bit.
    pub fn granularity(&self) -> u64 {
        1 << self.shift
    }

    /// Dirty bytes, in whole granules.
    pub fn count(&self) -> u64 {
        self.bits.iter().map(|w| u64::from(w.count_ones())).sum::<u64>() << self.shift
    }

    /// Whether granule `index` is dirty.
    pub fn is_dirty(&self, index: u64) -> bool {
        self.bits.get((index / 64) as usize).is_some_and(|w| w & (1 << (index % 64)) != 0)
    }

    /// Marks granule `index` clean.
    pub fn clean(&mut self, index: u64) {
        if let Some(word) = self.bits.get_mut((index / 64) as usize) {
            *word &= !(1 << (index % 64));
        }
    }

    /// The first dirty granule at or after `index`.
    pub fn next_dirty(&self, index: u64) -> Option<u64> {
        let mut word = (index / 64) as usize;
        let mut bits = *self.bits.get(word)? & (u64::MAX << (index % 64));
        loop {
            if bits != 0 {
                return Some(word as u64 * 64 + u64::from(bits.trailing_zeros()));
            }
            word += 1;
            bits = *self.bits.get(word)?;
        }
    }

    /// The size of the node the set covers.
    pub fn size(&self) -> u64 {
        self.size
    }
}
