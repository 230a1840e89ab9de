//! Refcount block entries of any width from 1 to 64 bits. Entries narrower
//! than a byte are packed from the least significant bit, wider ones are
//! big-endian (qcow2 spec, "Host cluster management").

/// The width of refcount entries: `refcount_order` 0 to 6.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Width {
    order: u32,
}

impl Width {
    /// Entries of `1 << order` bits.
    pub fn new(order: u32) -> Self {
        assert!(order <= 6, "refcount_order is checked when the header is parsed");
        Self { order }
    }

    /// Bits per entry.
    pub fn bits(self) -> u32 {
        1 << self.order
    }

    /// The largest refcount an entry holds.
    pub fn max(self) -> u64 {
        u64::MAX >> (64 - self.bits())
    }

    /// Entries in a refcount block of `block_len` bytes.
    pub fn entries(self, block_len: u64) -> u64 {
        block_len * 8 / u64::from(self.bits())
    }

    /// The byte range of `block` that holds entry `index`.
    pub fn byte_range(self, index: u64) -> std::ops::Range<usize> {
        let first = (index * u64::from(self.bits()) / 8) as usize;
        first..first + (self.bits() as usize).div_ceil(8)
    }

    /// Entry `index` of `block`.
    pub fn get(self, block: &[u8], index: u64) -> u64 {
        let bits = self.bits();
        let bytes = &block[self.byte_range(index)];
        if bits < 8 {
            let shift = (index * u64::from(bits) % 8) as u32;
            u64::from(bytes[0] >> shift) & self.max()
        } else {
            bytes.iter().fold(0, |acc, &b| acc << 8 | u64::from(b))
        }
    }

    /// Sets entry `index` of `block`; `value` must not exceed [`Width::max`].
    pub fn set(self, block: &mut [u8], index: u64, value: u64) {
        debug_assert!(value <= self.max());
        let bits = self.bits();
        let range = self.byte_range(index);
        let bytes = &mut block[range];
        if bits < 8 {
            let shift = (index * u64::from(bits) % 8) as u32;
            let mask = (self.max() as u8) << shift;
            bytes[0] = (bytes[0] & !mask) | ((value as u8) << shift);
        } else {
            let be = value.to_be_bytes();
            bytes.copy_from_slice(&be[8 - bytes.len()..]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_width_round_trips_without_touching_neighbours() {
        for order in 0..=6 {
            let w = Width::new(order);
            let mut block = vec![0u8; 64];
            let n = w.entries(64);
            for i in 0..n {
                w.set(&mut block, i, (i * 7 + 1) & w.max());
            }
            for i in 0..n {
                assert_eq!(w.get(&block, i), (i * 7 + 1) & w.max(), "order {order} entry {i}");
            }
        }
    }

    #[test]
    fn narrow_entries_pack_from_the_low_bit_and_wide_ones_are_big_endian() {
        let mut block = [0u8; 8];
        Width::new(0).set(&mut block, 1, 1);
        assert_eq!(block[0], 0b10);
        let mut block = [0u8; 8];
        Width::new(2).set(&mut block, 1, 0xa);
        assert_eq!(block[0], 0xa0);
        let mut block = [0u8; 8];
        Width::new(4).set(&mut block, 1, 0x0102);
        assert_eq!(&block[2..4], &[1, 2]);
        assert_eq!(Width::new(6).max(), u64::MAX);
        assert_eq!(Width::new(4).entries(65536), 32768);
    }
}
