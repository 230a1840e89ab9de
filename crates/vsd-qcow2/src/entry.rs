//! L1 and L2 table entries: decoding with every reserved bit checked, and
//! one view of standard and extended (subcluster) L2 entries.
//!
//! A standard entry is treated as an extended entry with a single
//! subcluster, so mapping and allocation have one code path: bit 0 of
//! `alloc` means "data", bit 0 of `zero` means "reads as zeroes".

/// The cluster is referenced exactly once: it may be written in place.
pub const COPIED: u64 = 1 << 63;
/// The cluster is compressed (L2 only).
pub const COMPRESSED: u64 = 1 << 62;
/// The cluster reads as zeroes (standard L2 entries, version 3).
pub const ZERO: u64 = 1;
/// Bits 9-55: a host offset.
pub const OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;
const L1_RESERVED: u64 = 0x7f00_0000_0000_01ff;
const L2_RESERVED: u64 = 0x3f00_0000_0000_01fe;

/// Why an entry cannot be used.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EntryError {
    /// Reserved bits are set.
    #[error("reserved bits set in table entry {0:#018x}")]
    Reserved(u64),
    /// A host offset that is not cluster aligned.
    #[error("table entry {0:#018x} points to an unaligned host offset")]
    Unaligned(u64),
    /// Subclusters both allocated and zero, or allocated without a cluster.
    #[error("invalid subcluster bitmap {bitmap:#018x} for entry {entry:#018x}")]
    Bitmap {
        /// The L2 entry.
        entry: u64,
        /// The bitmap word.
        bitmap: u64,
    },
    /// The entry's data cluster is one of the image's metadata clusters.
    #[error("table entry {0:#018x} points into the image's metadata")]
    Metadata(u64),
}

/// Decodes an L1 entry: the L2 table's offset (None if unallocated) and
/// whether it may be modified in place.
pub fn l1(entry: u64, cluster_size: u64) -> Result<Option<(u64, bool)>, EntryError> {
    if entry & L1_RESERVED != 0 {
        return Err(EntryError::Reserved(entry));
    }
    let offset = entry & OFFSET_MASK;
    if !offset.is_multiple_of(cluster_size) {
        return Err(EntryError::Unaligned(entry));
    }
    Ok((offset != 0).then_some((offset, entry & COPIED != 0)))
}

/// A decoded L2 entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct L2Entry {
    /// The host cluster, for data and zero-allocated clusters.
    pub host: Option<u64>,
    /// Whether the host cluster may be written in place.
    pub copied: bool,
    /// Compressed data: (host byte offset, bytes to read).
    pub compressed: Option<(u64, u64)>,
    /// Subclusters holding data at `host + i * subcluster_size`.
    pub alloc: u32,
    /// Subclusters that read as zeroes.
    pub zero: u32,
}

/// What one subcluster reads as.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Subcluster {
    /// Data at this host offset.
    Data(u64),
    /// Zeroes.
    Zero,
    /// Not allocated here: the backing file's bytes, or zeroes.
    Unallocated,
    /// Part of a compressed cluster.
    Compressed,
}

/// The image facts entry decoding depends on.
#[derive(Clone, Copy, Debug)]
pub struct Layout {
    /// log2 of the cluster size.
    pub cluster_bits: u32,
    /// Entries carry subcluster bitmaps.
    pub extended: bool,
    /// Host offsets name the external data file, where 0 is valid.
    pub data_file: bool,
}

impl Layout {
    /// Subclusters per cluster: 32 with extended L2 entries, else 1.
    pub fn subclusters(&self) -> u32 {
        if self.extended { 32 } else { 1 }
    }

    /// log2 of the subcluster size.
    pub fn subcluster_bits(&self) -> u32 {
        if self.extended { self.cluster_bits - 5 } else { self.cluster_bits }
    }

    /// The host cluster, and whether it may be written in place, of a
    /// standard entry that plainly maps data: not compressed, not zero, no
    /// reserved bit, aligned, at a non-zero offset. That is what nearly
    /// every lookup finds, decoded here without building an [`L2Entry`]
    /// (a third of the mapping's cost); `None` leaves the entry to
    /// [`Layout::decode`].
    #[inline]
    pub fn plain_data(&self, entry: u64) -> Option<(u64, bool)> {
        let offset = entry & OFFSET_MASK;
        let special = entry & (COMPRESSED | ZERO | L2_RESERVED) != 0 || offset & ((1 << self.cluster_bits) - 1) != 0;
        (!self.extended && !special && offset != 0).then_some((offset, entry & COPIED != 0))
    }

    /// Decodes an L2 entry and, for extended entries, its bitmap.
    pub fn decode(&self, entry: u64, bitmap: u64) -> Result<L2Entry, EntryError> {
        let copied = entry & COPIED != 0;
        if entry & COMPRESSED != 0 {
            if self.extended && bitmap != 0 {
                return Err(EntryError::Bitmap { entry, bitmap });
            }
            return Ok(L2Entry {
                host: None,
                copied: false,
                compressed: Some(self.compressed_extent(entry)),
                alloc: 0,
                zero: 0,
            });
        }
        if entry & L2_RESERVED != 0 || (self.extended && entry & ZERO != 0) {
            return Err(EntryError::Reserved(entry));
        }
        let offset = entry & OFFSET_MASK;
        if offset & ((1 << self.cluster_bits) - 1) != 0 {
            return Err(EntryError::Unaligned(entry));
        }
        // Offset 0 names a cluster only in an external data file, and only
        // with COPIED set; otherwise it means "no cluster", as in QEMU.
        let host = (offset != 0 || (self.data_file && copied)).then_some(offset);
        let (alloc, zero) = if self.extended {
            let (alloc, zero) = (bitmap as u32, (bitmap >> 32) as u32);
            if alloc & zero != 0 || (alloc != 0 && host.is_none()) {
                return Err(EntryError::Bitmap { entry, bitmap });
            }
            (alloc, zero)
        } else if entry & ZERO != 0 {
            (0, 1)
        } else {
            (u32::from(host.is_some()), 0)
        };
        Ok(L2Entry { host, copied: copied && host.is_some(), compressed: None, alloc, zero })
    }

    /// The host byte range holding a compressed cluster: its offset, and
    /// the bytes from there to the end of the last 512-byte sector used.
    fn compressed_extent(&self, entry: u64) -> (u64, u64) {
        let offset_bits = 62 - (self.cluster_bits - 8);
        let offset = entry & ((1 << offset_bits) - 1);
        let sectors = ((entry & !(COPIED | COMPRESSED)) >> offset_bits) + 1;
        (offset, sectors * 512 - (offset & 511))
    }

    /// Encodes an entry: (L2 entry, bitmap word). A compressed cluster
    /// counts the 512-byte sectors its bytes reach into after the first,
    /// and has no bitmap.
    pub fn encode(&self, e: &L2Entry) -> (u64, u64) {
        if let Some((offset, len)) = e.compressed {
            let sectors = (offset + len.max(1) - 1) / 512 - offset / 512;
            return (COMPRESSED | sectors << (62 - (self.cluster_bits - 8)) | offset, 0);
        }
        let host = e.host.map_or(0, |h| h | if e.copied { COPIED } else { 0 });
        if self.extended {
            (host, u64::from(e.alloc) | u64::from(e.zero) << 32)
        } else if e.alloc == 0 && e.zero != 0 {
            (host | ZERO, 0)
        } else {
            (host, 0)
        }
    }
}

impl L2Entry {
    /// An entry with no cluster and no zero flags.
    pub const UNALLOCATED: L2Entry = L2Entry { host: None, copied: false, compressed: None, alloc: 0, zero: 0 };

    /// What subcluster `i` reads as.
    pub fn subcluster(&self, i: u32, subcluster_bits: u32) -> Subcluster {
        let bit = 1 << i;
        if self.compressed.is_some() {
            Subcluster::Compressed
        } else if self.alloc & bit != 0 {
            Subcluster::Data(self.host.unwrap_or(0) + (u64::from(i) << subcluster_bits))
        } else if self.zero & bit != 0 {
            Subcluster::Zero
        } else {
            Subcluster::Unallocated
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const STD: Layout = Layout { cluster_bits: 16, extended: false, data_file: false };
    const EXT: Layout = Layout { cluster_bits: 16, extended: true, data_file: false };

    /// The fast decoder agrees with the full one wherever it answers, and
    /// answers for every plainly allocated standard entry.
    #[test]
    fn plain_data_agrees_with_decode() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let crafted = [0, 0x50000, 0x50000 | COPIED, 0x50000 | ZERO, 0x50200, COPIED, 0x50000 | COMPRESSED, 1 << 57];
        let random = (0..100_000).map(|i| {
            let r = next();
            // Mostly aligned offsets with random flags, some raw noise.
            if i % 4 == 0 { r } else { (r & (COPIED | ZERO | (1 << 1))) | ((r >> 8) & OFFSET_MASK & !0xffff) }
        });
        let mut plain = 0;
        for entry in crafted.into_iter().chain(random) {
            let full = STD.decode(entry, 0);
            let is_plain = matches!(&full, Ok(e) if e.compressed.is_none() && e.alloc == 1 && e.zero == 0 && e.host.is_some_and(|h| h != 0));
            match STD.plain_data(entry) {
                Some((host, copied)) => {
                    plain += 1;
                    let e = full.unwrap();
                    assert_eq!((e.host, e.copied, e.alloc, e.zero), (Some(host), copied, 1, 0), "{entry:#x}");
                    assert_eq!(e.subcluster(0, 16), Subcluster::Data(host));
                }
                None => assert!(!is_plain, "{entry:#x} is plain data, the fast path said no"),
            }
            assert_eq!(EXT.plain_data(entry), None, "extended entries take the full path");
        }
        assert!(plain > 10_000, "the sample has plain entries: {plain}");
    }

    #[test]
    fn standard_entries() {
        assert_eq!(STD.decode(0, 0).unwrap(), L2Entry::UNALLOCATED);
        let data = STD.decode(0x50000 | COPIED, 0).unwrap();
        assert_eq!((data.host, data.copied, data.alloc), (Some(0x50000), true, 1));
        assert_eq!(data.subcluster(0, 16), Subcluster::Data(0x50000));
        let zero = STD.decode(ZERO, 0).unwrap();
        assert_eq!(zero.subcluster(0, 16), Subcluster::Zero);
        let zero_alloc = STD.decode(0x70000 | ZERO | COPIED, 0).unwrap();
        assert_eq!((zero_alloc.host, zero_alloc.subcluster(0, 16)), (Some(0x70000), Subcluster::Zero));
        assert_eq!(STD.encode(&zero_alloc), (0x70000 | ZERO | COPIED, 0));
        assert_eq!(STD.encode(&data), (0x50000 | COPIED, 0));
    }

    #[test]
    fn bad_standard_entries() {
        assert_eq!(STD.decode(0x50000 | 2, 0), Err(EntryError::Reserved(0x50002)));
        assert_eq!(STD.decode(0x50200, 0), Err(EntryError::Unaligned(0x50200)));
        assert_eq!(STD.decode(COPIED, 0), Ok(L2Entry::UNALLOCATED));
        let data_file = Layout { data_file: true, ..STD };
        assert_eq!(data_file.decode(COPIED, 0).unwrap().host, Some(0));
    }

    #[test]
    fn compressed_extent_follows_the_spec() {
        // 64 KiB clusters: offset in bits 0..53, additional sectors above.
        let entry = COMPRESSED | (3 << 54) | 0x12345;
        let e = STD.decode(entry, 0).unwrap();
        assert_eq!(e.compressed, Some((0x12345, 4 * 512 - 0x145)));
        assert_eq!(STD.encode(&e), (entry, 0));
        // 0x1f0 bytes from 0x12345 end in the next sector: one more.
        let written = L2Entry { compressed: Some((0x12345, 0x1f0)), ..L2Entry::UNALLOCATED };
        assert_eq!(EXT.encode(&written), (COMPRESSED | (1 << 54) | 0x12345, 0));
    }

    #[test]
    fn extended_entries() {
        let e = EXT.decode(0x50000 | COPIED, 0b101 | (0b10 << 32)).unwrap();
        assert_eq!(e.subcluster(0, 11), Subcluster::Data(0x50000));
        assert_eq!(e.subcluster(1, 11), Subcluster::Zero);
        assert_eq!(e.subcluster(2, 11), Subcluster::Data(0x50000 + 2 * 2048));
        assert_eq!(e.subcluster(3, 11), Subcluster::Unallocated);
        assert_eq!(EXT.encode(&e), (0x50000 | COPIED, 0b101 | (0b10 << 32)));
        assert!(EXT.decode(0x50000, 1 | (1 << 32)).is_err(), "allocated and zero");
        assert!(EXT.decode(0, 1).is_err(), "allocated without a cluster");
        assert!(EXT.decode(COMPRESSED | 0x1000, 1).is_err(), "compressed with a bitmap");
    }

    #[test]
    fn l1_entries() {
        assert_eq!(l1(0, 65536), Ok(None));
        assert_eq!(l1(0x30000 | COPIED, 65536), Ok(Some((0x30000, true))));
        assert!(l1(0x30000 | 1, 65536).is_err());
        assert!(l1(0x30200, 65536).is_err());
    }
}
